import { spawn } from 'node:child_process';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { randomId, type SandboxSpec } from '@dsec/core';
import { buildContainerConfig, openContainerEdge } from '@dsec/edge';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { describeMachine } from './create.js';
import { removeCgroupParent } from './host-leftovers.js';
import { mountPeerRoot, PEER_HOST_ID, PEER_ID_COUNT } from './peer-root.js';
import { summarize, type LatencySummary } from './stats.js';

export interface PauseBenchOptions {
  /** Measured pause → resume + exec cycles per system. Default 10. */
  iterations: number;
  /** Unmeasured cycles first. Default 1. */
  warmup: number;
  /** Touched memory the sandbox's process holds, in MiB. Default 256. */
  holdMib: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface PauseSystemResult {
  /** Memory charged to the sandbox's cgroup while it runs (median over cycles). */
  runningBytes: number;
  /** The same right after the pause returned (median). */
  pausedBytes: number;
  /** pausedBytes ÷ runningBytes. */
  pausedRatio: number;
  /** Host `MemAvailable` 3 s after the pause minus before it (median; other work on the host moves it). */
  hostAvailableGainBytes: number;
  /** How long the pause call took. */
  pause: LatencySummary;
  /** From a paused sandbox to the end of its first command (`true`): resume + exec. */
  resumeExec: LatencySummary;
  resumeExecP50Ms: number;
  /**
   * From the start of that first command until the process's memory is all
   * resident again (it scans it once a second; swapped-out pages are read
   * back from the swap file). Includes up to a second of the process sleeping.
   */
  workingSetBack: LatencySummary;
}

export interface PauseBenchReport {
  benchmark: 'pause';
  cycle: string;
  iterations: number;
  holdMib: number;
  results: { dsec: PauseSystemResult; runc: PauseSystemResult };
  targets: {
    pausedRatio: number;
    resumeExecP50Ms: number;
    met: boolean;
  };
  method: string;
  machine: Record<string, unknown>;
}

const MEMORY_LIMIT_MB = 512;
const HOST_SETTLE_MS = 3000;

/**
 * A sandbox's process touches `holdMib` MiB once a second (an awk string it
 * scans), so its memory is resident whenever it runs. One cycle: wait until
 * it is resident again, read the cgroup's charge, pause, read it again, then
 * time the first command on the paused sandbox (DSec resumes it
 * transparently; the peer runs `runc resume` then `runc exec`).
 *
 * DSec: the edge's `pauseSandbox` (freezer, memory reclaimed into the edge's
 * swap file) through the Edge API in process. Peer: a bare `runc` container
 * from the same EROFS layer and idmapped overlay, `runc pause` (freezer
 * only: its memory stays resident, the peer's answer to "paused").
 */
export async function benchPause(options: PauseBenchOptions): Promise<PauseBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-pause-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-pause-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => rm(work, { recursive: true, force: true }),
    () => removeCgroupParent(cgroupParent),
  ];
  const total = options.warmup + options.iterations;
  const hold = holdScript(options.holdMib);
  const holdBytes = options.holdMib * 2 ** 20;
  try {
    const store = new DirImageStore(join(work, 'images'));
    const rootfs = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfs);
    const layer = await buildLayer(store, {
      name: 'busybox',
      kind: 'base',
      from: { dir: rootfs },
    });
    const edge = await openContainerEdge({
      edgeId: 'bench',
      stateDir: join(work, 'edge'),
      store,
      cgroupParent,
      network: { mode: 'none' },
      pauseSwapChunkBytes: 2 * holdBytes,
    });
    cleanups.unshift(async () => {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
    });
    const spec: SandboxSpec = {
      backend: 'container',
      image: 'busybox',
      toolkits: [],
      memoryLimitMb: MEMORY_LIMIT_MB,
      cpuCoresLimit: 1,
      pidsLimit: 256,
      ttlSeconds: 3600,
      networkRules: {},
      initUser: 'root',
      env: {},
      labels: {},
    };
    const id = (await edge.createSandbox({ id: randomId('sb'), projectId: 'bench', spec })).id;
    await edge.runCommand(id, { shell: `setsid ${hold} </dev/null >/dev/null 2>&1 &` });

    const peer = await startPeer(work, await store.blobPath(layer.digest), hold);
    cleanups.unshift(peer.stop);

    const dsec: Samples = newSamples();
    const runc: Samples = newSamples();
    for (let i = 0; i < total; i++) {
      if (options.signal?.aborted) throw new Error('benchmark aborted');
      const measured = i >= options.warmup;
      // Alternate which goes first, so neither always runs on a host the other just loaded.
      const order = i % 2 === 0 ? ['dsec', 'runc'] : ['runc', 'dsec'];
      for (const name of order) {
        if (name === 'dsec') {
          await cycle(
            measured ? dsec : undefined,
            holdBytes,
            async () => (await edge.getSandbox(id)).memoryBytes ?? 0,
            () => edge.pauseSandbox(id),
            async () => {
              const r = await edge.runCommand(id, { argv: ['true'] });
              if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`);
            },
          );
        } else {
          await cycle(
            measured ? runc : undefined,
            holdBytes,
            peer.memoryBytes,
            () => peer.runc(['pause', peer.name]),
            async () => {
              await peer.runc(['resume', peer.name]);
              await peer.runc(['exec', peer.name, 'true']);
            },
          );
        }
      }
      options.onProgress?.(i + 1, total);
    }
    const results = { dsec: summarizeSystem(dsec), runc: summarizeSystem(runc) };
    const targets = { pausedRatio: 0.05, resumeExecP50Ms: 150 };
    return {
      benchmark: 'pause',
      cycle: 'touched memory resident → pause → first `true` on the paused sandbox',
      iterations: options.iterations,
      holdMib: options.holdMib,
      results,
      targets: {
        ...targets,
        met:
          results.dsec.pausedRatio <= targets.pausedRatio &&
          results.dsec.resumeExecP50Ms <= targets.resumeExecP50Ms,
      },
      method:
        'memory: the cgroup charge (memory.usage_in_bytes) before the pause and after it returned; ' +
        'host: MemAvailable 3 s after the pause returned minus before it; ' +
        'resumeExec: wall time from a paused sandbox to the end of `true` in it',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

interface Samples {
  running: number[];
  paused: number[];
  hostGain: number[];
  pauseMs: number[];
  resumeExecMs: number[];
  workingSetBackMs: number[];
}

const newSamples = (): Samples => ({
  running: [],
  paused: [],
  hostGain: [],
  pauseMs: [],
  resumeExecMs: [],
  workingSetBackMs: [],
});

async function cycle(
  into: Samples | undefined,
  holdBytes: number,
  charged: () => Promise<number>,
  pause: () => Promise<unknown>,
  resumeExec: () => Promise<void>,
): Promise<void> {
  // Resident again: the process scans its memory once a second, swapping it back in.
  const deadline = Date.now() + 60_000;
  while ((await charged()) < holdBytes && Date.now() < deadline) await sleep(100);
  await sleep(1100); // a full scan after the last page came back
  const running = await charged();
  const availableBefore = await memAvailableBytes();
  const t0 = performance.now();
  await pause();
  const pauseMs = performance.now() - t0;
  const paused = await charged();
  // Freed pages reach MemAvailable over a few seconds here (on this VM the
  // kernel first reports them to the hypervisor, which takes them back).
  await sleep(HOST_SETTLE_MS);
  const hostGain = (await memAvailableBytes()) - availableBefore;
  const t1 = performance.now();
  await resumeExec();
  const resumeExecMs = performance.now() - t1;
  // The process scans its memory at least once a second: until it is all back.
  while ((await charged()) < holdBytes && performance.now() - t1 < 60_000) await sleep(20);
  const workingSetBackMs = performance.now() - t1;
  if (!into) return;
  into.workingSetBackMs.push(workingSetBackMs);
  into.running.push(running);
  into.paused.push(paused);
  into.hostGain.push(hostGain);
  into.pauseMs.push(pauseMs);
  into.resumeExecMs.push(resumeExecMs);
}

function summarizeSystem(s: Samples): PauseSystemResult {
  const runningBytes = median(s.running);
  const pausedBytes = median(s.paused);
  const resumeExec = summarize(s.resumeExecMs);
  return {
    runningBytes,
    pausedBytes,
    pausedRatio: Math.round((pausedBytes / runningBytes) * 10_000) / 10_000,
    hostAvailableGainBytes: median(s.hostGain),
    pause: summarize(s.pauseMs),
    resumeExec,
    resumeExecP50Ms: resumeExec.p50Ms,
    workingSetBack: summarize(s.workingSetBackMs),
  };
}

/** A process holding `mib` MiB in an awk string it scans (touches) once a second. */
function holdScript(mib: number): string {
  return `awk 'BEGIN { s = sprintf("%${mib * 2 ** 20}s", ""); while (1) { n += index(s, "x"); system("sleep 1") } }'`;
}

/**
 * The peer: `runc run -d` of the same layer (idmapped overlay, namespaces,
 * memory limit) running the same process, in a cgroup of its own.
 */
async function startPeer(work: string, image: string, hold: string) {
  const dir = join(work, 'peer');
  const bundle = join(dir, 'bundle');
  const rootfs = join(bundle, 'rootfs');
  const root = await mountPeerRoot(dir, rootfs, image);
  const name = `bench-pause-${process.pid}`;
  const cgroupsPath = `/dsec-bench/pause-${process.pid}`;
  const config = buildContainerConfig({
    spec: {
      backend: 'container',
      image: 'busybox',
      toolkits: [],
      memoryLimitMb: MEMORY_LIMIT_MB,
      cpuCoresLimit: 1,
      pidsLimit: 256,
      ttlSeconds: 3600,
      networkRules: {},
      initUser: 'root',
      env: {},
      labels: {},
    },
    hostname: 'bench',
    rootfs,
    initBinary: '/bin/true',
    cgroupsPath,
    hostIdBase: PEER_HOST_ID,
    idCount: PEER_ID_COUNT,
  }) as { process: { args: string[] }; mounts: { destination: string }[] };
  config.process.args = ['/bin/sh', '-c', hold];
  config.mounts = config.mounts.filter((m) => m.destination !== '/dev/.dsec-init');
  await writeFile(join(bundle, 'config.json'), JSON.stringify(config));
  const runtimeRoot = join(dir, 'runtime');
  const runc = (args: string[]) => run('runc', ['--root', runtimeRoot, ...args]);
  await runc(['run', '-d', '--bundle', bundle, name]);
  return {
    name,
    runc,
    memoryBytes: async () =>
      Number(
        await readFile(
          join('/sys/fs/cgroup/memory', cgroupsPath, 'memory.usage_in_bytes'),
          'utf8',
        ).catch(() => '0'),
      ),
    stop: async () => {
      await runc(['resume', name]).catch(() => undefined);
      await runc(['delete', '--force', name]).catch(() => undefined);
      await root.unmount();
      await removeCgroupParent(cgroupsPath.slice(1));
    },
  };
}

/** Runs a tool with no stdio (a detached container would keep pipes open). */
function run(cmd: string, args: string[]): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { stdio: 'ignore' });
    child.once('error', reject);
    child.once('exit', (code) =>
      code === 0 ? resolve() : reject(new Error(`${cmd} ${args.join(' ')}: exit ${code}`)),
    );
  });
}

async function memAvailableBytes(): Promise<number> {
  const meminfo = await readFile('/proc/meminfo', 'utf8');
  return Number(/^MemAvailable:\s+(\d+) kB$/m.exec(meminfo)?.[1] ?? 0) * 1024;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor((s.length - 1) / 2)] ?? 0;
}
