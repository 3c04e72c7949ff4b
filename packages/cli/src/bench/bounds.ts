import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { cpus, tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';
import { startSingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { describeMachine } from './create.js';
import type { FloodJob, FloodResult } from './flood-client.js';
import { removeCgroupParent } from './host-leftovers.js';
import { summarize, type LatencySummary } from './stats.js';

export type FloodKind = FloodJob['kind'];
export const FLOOD_KINDS: readonly FloodKind[] = [
  'control',
  'bogus-keys',
  'idle',
  'unread',
  'junk',
];

export interface BoundsBenchOptions {
  /** Measured execs of the steady client per phase (quiet, then under the flood). Default 300. */
  execs: number;
  floods: readonly FloodKind[];
  /** Idle connections the `idle` flood holds, over three loopback addresses. Default 12 000. */
  idleConnections: number;
  /** The `idle` flood reopens a connection the server closed after this long; 0 never. Default 0. */
  idleReconnectMs: number;
  /** Unread command streams the `unread` flood holds with one key. Default 150. */
  unreadStreams: number;
  /** Requests in flight of the `bogus-keys` and `junk` floods. Default 64. */
  concurrency: number;
  /** Requests per second of the `bogus-keys` and `junk` floods; 0 for as fast as they go. Default 250. */
  ratePerSecond: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface FloodPhase {
  quiet: LatencySummary;
  flood: LatencySummary;
  /** Flood p99 over quiet p99 (the bound holds at ≤ 2). */
  p99Ratio: number;
  /** Execs of the steady client that failed during the flood (locked out). */
  failures: number;
  attacker: FloodResult;
  node: {
    /** The node's event-loop delay p99 (ms), quiet and during the flood: what its own work costs. */
    loopDelayP99Ms: { quiet: number; flood: number };
    /** CPU the node's process used (percent of one core), quiet and during the flood. */
    cpuPercent: { quiet: number; flood: number };
    rssMbBefore: number;
    rssMbPeak: number;
    /** Audit rows written during the flood (all kinds). */
    auditRows: number;
    /** Failed authentications IAM counted during the flood. */
    authFailures: number;
  };
}

export interface BoundsBenchReport {
  benchmark: 'bounds';
  cores: number;
  results: Partial<Record<FloodKind, FloodPhase>>;
  method: string;
  machine: Record<string, unknown>;
}

/**
 * Each bound of docs/security.md ("Bounded work per caller") under a flood
 * at it, beside a steady client: one `true` at a time through the SDK into
 * its own sandbox, with the admin key, each on a new connection, measured
 * quiet and then while the flood runs. The attacker is another process (flood-client.ts) on the same
 * machine; its own CPU is part of what the node shares, as a co-tenant's
 * would be, and the `control` flood (the bogus-keys flood against a server
 * of the attacker's own) shows how much that alone costs. The node is a
 * default `dsec up` (every bound at its default).
 */
export async function benchBounds(options: BoundsBenchOptions): Promise<BoundsBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-bounds-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-bounds-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => rm(work, { recursive: true, force: true }),
    () => removeCgroupParent(cgroupParent),
  ];
  try {
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      cgroupParent,
      network: { mode: 'none' },
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true, drainMs: 0 }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfsDir } });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());
    const steady = await client.runContainer({ image: 'busybox', memoryLimitMb: 128 });

    // The attacker of the unread flood is a tenant with a key and a sandbox of its own.
    const admin = await node.iam.authenticate(node.adminKey);
    const tenant = await node.iam.createProject(admin, { name: 'flood' });
    const tenantKey = (await node.iam.createKey(admin, { projectId: tenant.id })).key;
    const tenantClient = new DSecClient({ url: node.url, apiKey: tenantKey });
    cleanups.unshift(async () => tenantClient.close());
    // A quarter of a core: its `yes` commands may not starve the machine, only fill streams.
    const target = await tenantClient.runContainer({
      image: 'busybox',
      memoryLimitMb: 256,
      cpuCoresLimit: 0.25,
    });

    const port = Number(new URL(node.url).port);
    const total = options.floods.length * 2 * options.execs;
    let done = 0;
    const measure = async (): Promise<{
      samples: number[];
      failures: number;
      loopDelayP99Ms: number;
      cpuPercent: number;
    }> => {
      const samples: number[] = [];
      let failures = 0;
      const loop = monitorEventLoopDelay({ resolution: 10 });
      loop.enable();
      const cpu0 = process.cpuUsage();
      const phaseStart = performance.now();
      for (let i = 0; i < options.execs; i++) {
        if (options.signal?.aborted) throw new Error('benchmark aborted');
        // A new connection each time, as a client that arrives now: the connection caps
        // must let it in (a kept-alive socket would hide a lockout).
        const t0 = performance.now();
        const fresh = new DSecClient({ url: node.url, apiKey: node.adminKey });
        try {
          const r = await fresh.sandbox(steady.id).exec(['true']);
          if (r.exitCode !== 0) failures++;
          else samples.push(performance.now() - t0);
        } catch {
          failures++;
        } finally {
          fresh.close();
        }
        options.onProgress?.(++done, total);
      }
      loop.disable();
      const cpu = process.cpuUsage(cpu0);
      return {
        samples,
        failures,
        loopDelayP99Ms: Math.round(loop.percentile(99) / 1e4) / 100,
        cpuPercent:
          Math.round(((cpu.user + cpu.system) / 1000 / (performance.now() - phaseStart)) * 1000) /
          10,
      };
    };
    for (let i = 0; i < 30; i++) await steady.exec(['true']); // warm paths, unmeasured

    const results: Partial<Record<FloodKind, FloodPhase>> = {};
    for (const kind of options.floods) {
      const quiet = await measure();
      const job: FloodJob = {
        kind,
        port,
        concurrency: options.concurrency,
        ratePerSecond: options.ratePerSecond,
        connections: options.idleConnections,
        reconnectMs: options.idleReconnectMs,
        addresses: ['127.0.0.2', '127.0.0.3', '127.0.0.4'],
        streams: options.unreadStreams,
        key: tenantKey,
        sandboxId: target.id,
      };
      const rssBefore = process.memoryUsage().rss;
      const statsBefore = authFailures(node.iam);
      const auditBefore = await auditRows(node.iam);
      const attacker = startFlood(job);
      let rssPeak = rssBefore;
      const sampler = setInterval(() => {
        rssPeak = Math.max(rssPeak, process.memoryUsage().rss);
      }, 100);
      try {
        await attacker.ready;
        await sleep(2000); // the flood at full strength: connections held, streams cut once
        const flooded = await measure();
        const result = await attacker.stop();
        const statsAfter = authFailures(node.iam);
        const quietSummary = summarize(quiet.samples);
        const floodSummary = summarize(flooded.samples);
        results[kind] = {
          quiet: quietSummary,
          flood: floodSummary,
          p99Ratio: Math.round((floodSummary.p99Ms / quietSummary.p99Ms) * 100) / 100,
          failures: flooded.failures + quiet.failures,
          attacker: result,
          node: {
            loopDelayP99Ms: { quiet: quiet.loopDelayP99Ms, flood: flooded.loopDelayP99Ms },
            cpuPercent: { quiet: quiet.cpuPercent, flood: flooded.cpuPercent },
            rssMbBefore: Math.round(rssBefore / 2 ** 20),
            rssMbPeak: Math.round(rssPeak / 2 ** 20),
            auditRows: (await auditRows(node.iam)) - auditBefore,
            authFailures: statsAfter - statsBefore,
          },
        };
      } finally {
        clearInterval(sampler);
        await attacker.stop().catch(() => undefined);
      }
      await sleep(1500); // what the flood left (connections, streams) goes before the next quiet run
    }
    return {
      benchmark: 'bounds',
      cores: cpus().length,
      results,
      method:
        'steady client: `true` through the SDK, one at a time, each on a new connection, admin key, own sandbox; each flood runs in a child process ' +
        '(flood-client.ts) against a default single node; p99 of the steady client quiet, then during the flood',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/** Failed authentications IAM counted so far (0 for an IAM that counts none). */
function authFailures(iam: { authStats?: () => { failures: Record<string, number> } }): number {
  const failures = iam.authStats?.().failures ?? {};
  return Object.values(failures).reduce((a, b) => a + b, 0);
}

async function auditRows(iam: { listAudit(o: { limit: number }): Promise<unknown[]> }) {
  return (await iam.listAudit({ limit: 10_000_000 })).length;
}

/** Starts the attacker; `ready` once it flooded for the first time, `stop` ends it and reads its report. */
function startFlood(job: FloodJob): { ready: Promise<void>; stop(): Promise<FloodResult> } {
  const child = spawn(
    process.execPath,
    [...process.execArgv, floodClientEntry(), JSON.stringify(job)],
    {
      stdio: ['pipe', 'pipe', 'inherit'],
    },
  );
  const lines = createInterface({ input: child.stdout });
  let report: FloodResult | undefined;
  let markReady: () => void = () => undefined;
  const ready = new Promise<void>((resolve) => (markReady = resolve));
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  lines.on('line', (line) => {
    if (line === 'ready') markReady();
    else report = JSON.parse(line) as FloodResult;
  });
  void exited.then(markReady);
  let stopping: Promise<FloodResult> | undefined;
  return {
    ready,
    stop: () =>
      (stopping ??= (async () => {
        child.stdin.end();
        await exited;
        lines.close();
        if (!report) throw new Error(`the ${job.kind} flood reported nothing`);
        return report;
      })()),
  };
}

/** The flood client: bundled JS beside the CLI bundle, or the TS source (run through tsx). */
function floodClientEntry(): string {
  const bundled = fileURLToPath(new URL('./flood.js', import.meta.url));
  return existsSync(bundled)
    ? bundled
    : fileURLToPath(new URL('./flood-client.ts', import.meta.url));
}
