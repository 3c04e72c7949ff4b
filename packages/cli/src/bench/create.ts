import { execFile, spawnSync } from 'node:child_process';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { startSingleNode } from '@dsec/cluster';
import { buildContainerConfig } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import type { SandboxSpec } from '@dsec/core';
import { removeCgroupParent } from './host-leftovers.js';
import { mountPeerRoot, PEER_HOST_ID, PEER_ID_COUNT } from './peer-root.js';
import { interleave, ratio, type LatencySummary } from './stats.js';

const execFileAsync = promisify(execFile);

export interface CreateBenchOptions {
  iterations: number;
  warmup: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface CreateBenchReport {
  benchmark: 'create';
  cycle: string;
  iterations: number;
  results: Record<string, LatencySummary>;
  ratios: {
    runc: number | null;
    podman: number | null;
    'runc (dsec-net)': number | null;
    /** dsec-net ÷ dsec: what the default network policy adds to a create. */
    'dsec (dsec-net)': number | null;
  };
  machine: Record<string, unknown>;
}

const SPEC: SandboxSpec = {
  backend: 'container',
  image: 'busybox',
  toolkits: [],
  memoryLimitMb: 256,
  cpuCoresLimit: 1,
  pidsLimit: 1024,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

/**
 * create → first exec of `true` → destroy, through the full path (SDK →
 * apiserver → edge → runc → chronus), interleaved with the same cycle by bare
 * `runc run` on the same EROFS layer, idmapped overlay and namespaces, and by
 * `podman run --rm` when podman is installed.
 *
 * `dsec` runs sandboxes in a fresh network namespace with loopback only, as
 * the runc and podman peers do; `dsec-net` is a second node whose sandboxes
 * are wired to the node by a veth behind nftables and the DNS allowlist
 * resolver (issue 5), so the cost of that network shows separately.
 */
export async function benchCreate(options: CreateBenchOptions): Promise<CreateBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-create-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      network: { mode: 'none' },
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const netNode = await startSingleNode({
      stateDir: join(work, 'state-net'),
      port: 0,
      network: { mode: 'isolated' },
    });
    cleanups.unshift(() => netNode.close({ stopSandboxes: true }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    const layer = await node.buildLayer({
      name: 'busybox',
      kind: 'base',
      from: { dir: rootfsDir },
    });
    await netNode.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfsDir } });

    const peer = await preparePeerBundle(work, await node.store.blobPath(layer.digest));
    cleanups.unshift(peer.cleanup);
    const hasPodman = spawnSync('podman', ['--version']).status === 0;

    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    cleanups.unshift(async () => client.close());
    const netClient = new DSecClient({ url: netNode.url, apiKey: netNode.adminKey });
    await netClient.open();
    cleanups.unshift(async () => netClient.close());
    const cycle = async (c: DSecClient) => {
      const sb = await c.runContainer({ image: 'busybox', memoryLimitMb: 256, cpuCoresLimit: 1 });
      const r = await sb.exec(['true']);
      if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`);
      await sb.stop();
    };

    const systems: Record<string, (i: number) => Promise<void>> = {
      dsec: () => cycle(client),
      'dsec-net': () => cycle(netClient),
      runc: async (i) => {
        await execFileAsync('runc', [
          '--root',
          peer.runtimeRoot,
          'run',
          '--bundle',
          peer.bundle,
          `bench-${process.pid}-${i}`,
        ]);
      },
    };
    if (hasPodman) {
      systems.podman = async () => {
        // Root here lacks CAP_SYS_RESOURCE: podman's default rlimits (above the hard limits) would fail.
        await execFileAsync('podman', [
          'run',
          '--rm',
          '--runtime',
          'runc',
          '--network',
          'none',
          '--ulimit',
          'nofile=1024:1024',
          '--ulimit',
          'nproc=1024:1024',
          '--rootfs',
          rootfsDir,
          '/bin/true',
        ]);
      };
    }

    const results = await interleave(systems, options);
    return {
      benchmark: 'create',
      cycle: 'create → exec `true` → destroy',
      iterations: options.iterations,
      results,
      ratios: {
        runc: ratio(results.dsec!, results.runc),
        podman: ratio(results.dsec!, results.podman),
        'runc (dsec-net)': ratio(results['dsec-net']!, results.runc),
        'dsec (dsec-net)': ratio(results['dsec-net']!, results.dsec),
      },
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/** A bundle for bare `runc run`: same layer, same idmapped overlay, same namespaces and limits. */
async function preparePeerBundle(work: string, image: string) {
  const dir = join(work, 'peer');
  const bundle = join(dir, 'bundle');
  const rootfs = join(bundle, 'rootfs');
  const root = await mountPeerRoot(dir, rootfs, image);
  const cgroupPath = `dsec-bench/${process.pid}`;
  const config = buildContainerConfig({
    spec: SPEC,
    hostname: 'bench',
    rootfs,
    initBinary: '/bin/true',
    cgroupsPath: `/${cgroupPath}`,
    hostIdBase: PEER_HOST_ID,
    idCount: PEER_ID_COUNT,
  }) as { process: { args: string[] }; mounts: { destination: string }[] };
  // The peer runs `true` directly: no init, no exec channel.
  config.process.args = ['/bin/true'];
  config.mounts = config.mounts.filter((m) => m.destination !== '/dev/.dsec-init');
  await writeFile(join(bundle, 'config.json'), JSON.stringify(config));
  const runtimeRoot = join(dir, 'runtime');
  const cleanup = async () => {
    await root.unmount();
    await removeCgroupParent(cgroupPath);
  };
  return { bundle, runtimeRoot, cleanup };
}

export async function describeMachine(): Promise<Record<string, unknown>> {
  const os = await import('node:os');
  const version = async (cmd: string, args: string[]) =>
    (await execFileAsync(cmd, args).then(
      (r) => r.stdout.split('\n')[0]?.trim(),
      () => undefined,
    )) ?? null;
  return {
    cpu: os.cpus()[0]?.model ?? 'unknown',
    cores: os.cpus().length,
    memoryGiB: Math.round(os.totalmem() / 2 ** 30),
    kernel: os.release(),
    node: process.version,
    runc: await version('runc', ['--version']),
    crun: await version('crun', ['--version']),
    podman: await version('podman', ['--version']),
  };
}
