import { spawn } from 'node:child_process';
import { chmod, mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { monitorEventLoopDelay, type IntervalHistogram } from 'node:perf_hooks';
import { startSingleNode } from '@dsec/cluster';
import { toDsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { buildContainerConfig } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { describeMachine } from './create.js';
import {
  detachMountsUnder,
  leftoversAcrossClose,
  removeCgroupParent,
  type HostLeftovers,
} from './host-leftovers.js';
import { mountPeerRoot, PEER_HOST_ID, PEER_ID_COUNT } from './peer-root.js';
import { summarize } from './stats.js';

export interface BurstBenchOptions {
  /** Creates per system (default 1000). */
  count: number;
  /** Creates in flight at once, for both systems (default 1000). */
  concurrency: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface BurstSystemResult {
  createsPerSecond: number;
  failures: number;
  /** Failures by error code (`capacity_exhausted`, `internal`, …). */
  failuresByCode: Record<string, number>;
  /** The first few failure messages, for diagnosis. */
  failureSamples: string[];
  p50Ms: number;
  p99Ms: number;
  /** From the first create sent to the last one answered. */
  wallMs: number;
}

export interface BurstBenchReport {
  benchmark: 'burst';
  count: number;
  concurrency: number;
  results: {
    dsec: BurstSystemResult & {
      /** Removing all of them again, at the same concurrency. */
      removals: { perSecond: number; failures: number; failureSamples: string[]; p99Ms: number };
      /** What was left on the host after every sandbox was removed (all zero when clean). */
      left: HostLeftovers;
      /** Stalls of the node's event loop during the creates and during the removals. */
      eventLoopDelay: { creates: LoopDelay; removals: LoopDelay };
    };
    runc: BurstSystemResult;
  };
  /** dsec ÷ runc; above 1 means DSec creates faster. */
  ratios: { createsPerSecond: number | null };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * What each sandbox requests: the idle sandbox of the density target
 * (`--cpus 1 --memory-mb 512`). A tiny CPU ceiling would measure something
 * else: the runtime's init runs under the sandbox's CPU quota, and at
 * 0.01 cores every start waits out several 100 ms CFS periods.
 */
const SPEC = { image: 'busybox', cpuCoresLimit: 1, memoryLimitMb: 512 } as const;

/**
 * `count` creates with `concurrency` in flight: DSec sandboxes with the
 * default network policy (an isolated network namespace behind a veth,
 * nftables and the platform resolver) through the SDK against an in-process
 * single node, then the same number of bare `runc run -d` containers of the
 * same rootfs (same EROFS layer, idmapped overlay, namespaces and limits,
 * with an empty network namespace) at the same concurrency. Everything made
 * is removed afterwards; what the node left on the host is counted first.
 */
export async function benchBurst(options: BurstBenchOptions): Promise<BurstBenchReport> {
  const { count, concurrency } = options;
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-burst-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-burst-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => detachMountsUnder(work).then(() => rm(work, { recursive: true, force: true })),
    () => removeCgroupParent(cgroupParent),
  ];
  let done = 0;
  const tick = () => options.onProgress?.(++done, 3 * count);
  try {
    const stateDir = join(work, 'state');
    const node = await startSingleNode({
      stateDir,
      port: 0,
      cgroupParent,
      network: { mode: 'isolated' },
      capacity: { sandboxes: Math.max(count, 1000) },
    });
    let nodeOpen = true;
    cleanups.unshift(async () => nodeOpen && node.close({ stopSandboxes: true }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    const layer = await node.buildLayer({
      name: 'busybox',
      kind: 'base',
      from: { dir: rootfsDir },
    });
    const client = new DSecClient({
      url: node.url,
      apiKey: node.adminKey,
      maxSockets: concurrency,
    });
    cleanups.unshift(async () => client.close());

    // DSec: the burst of creates, then removing them all. The node runs in
    // this process, so its event loop's stalls are measured too (a stalled
    // loop is what makes an HTTP server time out the requests it holds).
    const createLoop = monitorEventLoopDelay({ resolution: 10 });
    createLoop.enable();
    const sandboxes: Sandbox[] = [];
    const dsec = await burst(count, concurrency, options.signal, async () => {
      try {
        sandboxes.push(await client.runContainer({ ...SPEC }));
      } finally {
        tick();
      }
    });
    createLoop.disable();
    const removeLoop = monitorEventLoopDelay({ resolution: 10 });
    removeLoop.enable();
    const removals = await burst(sandboxes.length, concurrency, options.signal, async (i) => {
      try {
        await sandboxes[i]!.stop({ timeoutMs: 600_000 });
      } finally {
        tick();
      }
    });
    removeLoop.disable();
    const left = await leftoversAcrossClose(
      node,
      {
        workDir: work,
        edgeStateDir: join(stateDir, 'edge'),
        cgroupParent,
        sandboxIds: sandboxes.map((sb) => sb.id),
      },
      async () => {
        client.close();
        nodeOpen = false;
        await node.close({ stopSandboxes: true });
      },
    );

    // Bare runc at the same concurrency.
    const peer = await preparePeer(work, await node.store.blobPath(layer.digest), cgroupParent);
    cleanups.unshift(peer.cleanup);
    const runc = await burst(count, concurrency, options.signal, async (i) => {
      try {
        await peer.run(i);
      } finally {
        tick();
      }
    });

    const dsecResult = toResult(dsec);
    const runcResult = toResult(runc);
    return {
      benchmark: 'burst',
      count,
      concurrency,
      results: {
        dsec: {
          ...dsecResult,
          removals: {
            perSecond: rate(removals.latenciesMs.length, removals.wallMs),
            failures: removals.failures.length,
            failureSamples: removals.samples,
            p99Ms: summarize(removals.latenciesMs).p99Ms,
          },
          left,
          eventLoopDelay: { creates: delays(createLoop), removals: delays(removeLoop) },
        },
        runc: runcResult,
      },
      ratios: {
        createsPerSecond: runcResult.createsPerSecond
          ? Math.round((dsecResult.createsPerSecond / runcResult.createsPerSecond) * 1000) / 1000
          : null,
      },
      method:
        'dsec: SDK runContainer (busybox, default network policy) against an in-process single node; ' +
        'runc: `runc run -d` of the same EROFS layer and idmapped overlay with the same namespaces and limits; ' +
        'rates count successful creates over the wall time of the whole burst',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

interface BurstRun {
  latenciesMs: number[];
  /** Error codes. */
  failures: string[];
  samples: string[];
  wallMs: number;
}

/** Runs `task(0..count-1)` with at most `concurrency` in flight; every outcome is recorded. */
export async function burst(
  count: number,
  concurrency: number,
  signal: AbortSignal | undefined,
  task: (i: number) => Promise<void>,
): Promise<BurstRun> {
  const run: BurstRun = { latenciesMs: [], failures: [], samples: [], wallMs: 0 };
  let next = 0;
  const t0 = performance.now();
  const worker = async () => {
    while (next < count) {
      if (signal?.aborted) throw new Error('benchmark aborted');
      const i = next++;
      const start = performance.now();
      try {
        await task(i);
        run.latenciesMs.push(performance.now() - start);
      } catch (err) {
        const e = toDsecError(err);
        run.failures.push(e.code);
        if (run.samples.length < 5) run.samples.push(`${e.code}: ${e.message}`);
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, count) }, worker));
  run.wallMs = performance.now() - t0;
  return run;
}

interface LoopDelay {
  p99Ms: number;
  maxMs: number;
}

function delays(h: IntervalHistogram): LoopDelay {
  return { p99Ms: Math.round(h.percentile(99) / 1e5) / 10, maxMs: Math.round(h.max / 1e5) / 10 };
}

function rate(n: number, ms: number): number {
  return ms > 0 ? Math.round((n / (ms / 1000)) * 100) / 100 : 0;
}

function toResult(run: BurstRun): BurstSystemResult {
  const s = summarize(run.latenciesMs);
  const failuresByCode: Record<string, number> = {};
  for (const code of run.failures) failuresByCode[code] = (failuresByCode[code] ?? 0) + 1;
  return {
    createsPerSecond: rate(run.latenciesMs.length, run.wallMs),
    failures: run.failures.length,
    failuresByCode,
    failureSamples: run.samples,
    p50Ms: s.p50Ms,
    p99Ms: s.p99Ms,
    wallMs: Math.round(run.wallMs),
  };
}

const PEER_SPEC: SandboxSpec = {
  backend: 'container',
  image: 'busybox',
  toolkits: [],
  memoryLimitMb: SPEC.memoryLimitMb,
  cpuCoresLimit: SPEC.cpuCoresLimit,
  pidsLimit: 1024,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

/**
 * Bare runc containers over the same layer and idmapped overlay as the DSec
 * sandboxes, one bundle (config) per container because each needs its own
 * cgroup; they share the read-only-mounted root.
 */
async function preparePeer(work: string, image: string, cgroupParent: string) {
  const dir = join(work, 'peer');
  const rootfs = join(dir, 'rootfs');
  const runtimeRoot = join(dir, 'runtime');
  await mkdir(runtimeRoot, { recursive: true });
  const root = await mountPeerRoot(dir, rootfs, image);
  const started: string[] = [];
  const runcLog = join(dir, 'runc.log');
  const runc = (args: string[]) =>
    new Promise<void>((resolve, reject) => {
      // runc's log, not its stderr: a detached container keeps the stdio it inherits open.
      // The peers share one uid range, and the kernel caps keys per uid (kernel.keys.maxkeys):
      // without a session keyring of its own each (DSec gives every sandbox its own range).
      const extra = args[0] === 'run' ? ['--no-new-keyring'] : [];
      const child = spawn(
        'runc',
        ['--root', runtimeRoot, '--log', runcLog, args[0]!, ...extra, ...args.slice(1)],
        {
          stdio: 'ignore',
        },
      );
      child.once('error', reject);
      child.once('exit', (code, sig) => {
        if (code === 0) return resolve();
        void readFile(runcLog, 'utf8')
          .catch(() => '')
          .then((log) => {
            const last = log.trim().split('\n').at(-1) ?? '';
            reject(new Error(`runc ${args[0]}: exit ${sig ?? code} ${last}`));
          });
      });
    });
  return {
    async run(i: number): Promise<void> {
      const id = `burst-${process.pid}-${i}`;
      const bundle = join(dir, 'bundles', String(i));
      await mkdir(bundle, { recursive: true });
      const config = buildContainerConfig({
        spec: PEER_SPEC,
        hostname: 'burst',
        rootfs,
        initBinary: '/bin/true',
        cgroupsPath: `/${cgroupParent}/peer-${i}`,
        hostIdBase: PEER_HOST_ID,
        idCount: PEER_ID_COUNT,
      }) as { process: { args: string[] }; mounts: { destination: string }[] };
      // The peer idles like a sandbox's init does, without DSec's init or exec channel.
      config.process.args = ['/bin/sleep', '3600'];
      config.mounts = config.mounts.filter((m) => m.destination !== '/dev/.dsec-init');
      await writeFile(join(bundle, 'config.json'), JSON.stringify(config));
      started.push(id);
      await runc(['run', '-d', '--bundle', bundle, id]);
    },
    cleanup: async () => {
      const ids = [...started];
      await burst(ids.length, 64, undefined, (i) => runc(['delete', '-f', ids[i]!]));
      await root.unmount();
    },
  };
}
