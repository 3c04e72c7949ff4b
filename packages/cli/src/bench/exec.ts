import { execFile } from 'node:child_process';
import { chmod, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { startSingleNode } from '@dsec/cluster';
import { BackendSet, ContainerBackend } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { describeMachine } from './create.js';
import type { ExecLoadJob } from './exec-load-client.js';
import { startPeerRunner } from './peer-runner.js';
import { interleave, ratio, type LatencySummary } from './stats.js';

const execFileAsync = promisify(execFile);

export interface ExecBenchOptions {
  iterations: number;
  warmup: number;
  /** Consecutive calls of one system per turn (see `interleave`). */
  block: number;
  /** Bytes of stdout streamed for the throughput run. */
  streamBytes: number;
  /** `echo` commands run in the load phase, `loadConcurrency` at once over `loadSandboxes`. */
  loadExecs: number;
  /** Unmeasured `echo` commands before the load run's. */
  loadWarmup: number;
  loadConcurrency: number;
  loadSandboxes: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface ExecBenchReport {
  benchmark: 'exec';
  cycle: string;
  iterations: number;
  block: number;
  results: Record<string, LatencySummary> & { load: LoadResult };
  ratios: { 'runtime exec': number | null; nsenter: number | null };
  throughput: { bytes: number; seconds: number; mbPerSecond: number; ndjsonMbPerSecond: number };
  machine: Record<string, unknown>;
}

/** Latencies of the load run's successful commands, and its rate and failures. */
export interface LoadResult extends LatencySummary {
  execs: number;
  concurrency: number;
  sandboxes: number;
  execsPerSecond: number;
  failures: number;
  /** The first failure's message, if any. */
  firstError?: string;
}

/**
 * Round trip of `true` in a warm shell session through the full path (SDK →
 * apiserver → edge → chronus → the session's shell), interleaved with
 * `runc exec` and `nsenter` of `true` into the same sandbox; then stdout
 * throughput of one command streamed through the full path. Each system
 * runs in blocks of `block` calls (`interleave`).
 */
export async function benchExec(options: ExecBenchOptions): Promise<ExecBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-exec-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const stateDir = join(work, 'state');
    const node = await startSingleNode({ stateDir, port: 0 });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const rootfs = join(work, 'rootfs');
    await makeBusyboxRootfs(rootfs);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });

    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());
    const sb = await client.runContainer({
      image: 'busybox',
      memoryLimitMb: 512,
      cpuCoresLimit: 2,
    });
    const session = sb.session('bench');

    // The node's backend is a set (containers, microVMs) where several kinds run.
    const configured = node.edge.options.backend;
    const backend =
      configured instanceof BackendSet
        ? configured.backends.find((b) => b instanceof ContainerBackend)
        : configured;
    if (!(backend instanceof ContainerBackend))
      throw new Error('bench exec needs the container backend');
    const paths = backend.paths({ id: sb.id });
    const initPid = (await readFile(paths.pidFile, 'utf8')).trim();
    const runtime = backend.options.runtime as { binary?: string; root?: string; name: string };
    const runtimeBinary = runtime.binary ?? runtime.name;
    const runtimeRoot = runtime.root ?? join(stateDir, 'edge', 'runtime');

    // The peers run from a process of their own (see startPeerRunner).
    const peers = startPeerRunner();
    cleanups.unshift(async () => peers.close());
    const systems: Record<string, () => Promise<void | number>> = {
      dsec: async () => {
        const r = await session.run('true');
        if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`);
      },
      // The runtime the edge runs (crun where installed): its own exec path.
      'runtime exec': () =>
        peers.time([runtimeBinary, '--root', runtimeRoot, 'exec', paths.name, 'true']),
      nsenter: () =>
        peers.time(['nsenter', '-t', initPid, '-U', '-m', '-p', '-n', '-i', '-u', 'true']),
    };
    const results = await interleave(systems, options);

    // Bulk stdout through the full path: the raw-bytes stream (`commands.stream`),
    // and for comparison the framed NDJSON stream that also carries stderr.
    const mib = Math.max(1, Math.round(options.streamBytes / 2 ** 20));
    const produce = ['dd', 'if=/dev/zero', 'bs=1048576', `count=${mib}`];
    let bytes = 0;
    const t0 = process.hrtime.bigint();
    const r = await sb.commands.stream(produce, {
      timeoutMs: 600_000,
      maxOutputBytes: 0,
      onStdout: (chunk) => (bytes += chunk.length),
    });
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    if (bytes !== mib * 2 ** 20 || r.stdoutBytes !== bytes) {
      throw new Error(`streamed ${bytes} of ${mib * 2 ** 20} bytes (${r.outcome})`);
    }
    let framedBytes = 0;
    const t1 = process.hrtime.bigint();
    await sb.commands.run(produce, {
      timeoutMs: 600_000,
      maxOutputBytes: 0,
      onStdout: (text) => (framedBytes += Buffer.byteLength(text)),
    });
    const framedSeconds = Number(process.hrtime.bigint() - t1) / 1e9;
    await sb.stop();
    const load = await execLoad(client, node, options);
    return {
      benchmark: 'exec',
      cycle: '`true` in a warm session: SDK → apiserver → edge → sandbox',
      iterations: options.iterations,
      block: options.block,
      results: { ...results, load },
      ratios: {
        'runtime exec': ratio(results.dsec!, results['runtime exec']),
        nsenter: ratio(results.dsec!, results.nsenter),
      },
      throughput: {
        bytes,
        seconds: Math.round(seconds * 1000) / 1000,
        mbPerSecond: Math.round(bytes / 1e6 / seconds),
        ndjsonMbPerSecond: Math.round(framedBytes / 1e6 / framedSeconds),
      },
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/**
 * Throughput under load: `echo` as a one-off command (its own process in the
 * sandbox, result in the command log) through the SDK, `loadConcurrency` in
 * flight at once, spread over `loadSandboxes` sandboxes. The client runs in a
 * process of its own (exec-load-client.ts), as a trainer's would: in this one
 * it would take half the node's event loop.
 */
async function execLoad(
  client: DSecClient,
  node: { url: string; adminKey: string },
  options: ExecBenchOptions,
): Promise<LoadResult> {
  const sandboxes = await Promise.all(
    Array.from({ length: options.loadSandboxes }, () =>
      client.runContainer({ image: 'busybox', memoryLimitMb: 256, cpuCoresLimit: 1 }),
    ),
  );
  try {
    const job: ExecLoadJob = {
      url: node.url,
      apiKey: node.adminKey,
      sandboxIds: sandboxes.map((sb) => sb.id),
      execs: options.loadExecs,
      warmup: options.loadWarmup,
      concurrency: options.loadConcurrency,
    };
    const { stdout } = await execFileAsync(
      process.execPath,
      [...process.execArgv, loadClientEntry(), JSON.stringify(job)],
      { maxBuffer: 2 ** 20 },
    );
    const result = JSON.parse(stdout) as Omit<LoadResult, 'execs' | 'concurrency' | 'sandboxes'>;
    return {
      ...result,
      execs: options.loadExecs,
      concurrency: options.loadConcurrency,
      sandboxes: options.loadSandboxes,
    };
  } finally {
    await Promise.allSettled(sandboxes.map((sb) => sb.stop()));
  }
}

/** The load client: bundled JS beside the CLI bundle, or the TS source (run through tsx). */
function loadClientEntry(): string {
  const bundled = fileURLToPath(new URL('./exec-load.js', import.meta.url));
  return existsSync(bundled)
    ? bundled
    : fileURLToPath(new URL('./exec-load-client.ts', import.meta.url));
}
