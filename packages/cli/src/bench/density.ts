import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { startSingleNode } from '@dsec/cluster';
import { isDsecError, toDsecError } from '@dsec/core';
import { detectCgroupDriver, type AdmissionConfig } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { describeMachine } from './create.js';
import { removeCgroupParent } from './host-leftovers.js';

export interface DensityBenchOptions {
  /** Stop after this many sandboxes even if admission would take more. */
  max?: number | undefined;
  /** Creates in flight at once (default 4). */
  concurrency: number;
  cpus: number;
  memoryMb: number;
  /** Admission knobs of the benchmark's node (default: the edge's defaults). */
  admission?: AdmissionConfig | undefined;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface DensityBenchReport {
  benchmark: 'density';
  sandboxSpec: { cpus: number; memoryMb: number };
  concurrency: number;
  results: {
    dsec: {
      /** Idle sandboxes running when creation stopped. */
      sandboxes: number;
      /** The resource admission refused on (`sandboxes`, `memory`, `cpu`, `pids`, `disk`), or `max`. */
      stoppedBy: string;
      /** The refusal's measure, value and limit, when admission stopped it. */
      refusal: Record<string, unknown> | null;
      /**
       * Host memory per idle sandbox that the platform keeps for it: the rise
       * of MemTotal − MemAvailable over the creates, minus the rise of the
       * sandboxes' cgroup charge, plus the PSS of the platform's per-sandbox
       * command daemons (they sit in the sandbox's cgroups, so part of their
       * memory is in the charge: counted again here, to err on our side),
       * divided by the sandboxes.
       */
      platformBytesPerSandbox: number;
      /**
       * PSS of the platform's processes per sandbox: those that carry the
       * node's state dir in their command line, plus the per-sandbox command
       * daemons (`dsec-chronus`) in the sandboxes' cgroups.
       */
      processPssBytesPerSandbox: number;
      /** Memory charged to the sandboxes' cgroups, per sandbox. */
      chargedBytesPerSandbox: number;
      /** Rise of the host's thread count (what the pids check counts), per sandbox. */
      threadsPerSandbox: number;
      createsPerSecond: number;
      /** Creates that failed with something other than a clean refusal. */
      createFailures: number;
      failuresByCode: Record<string, number>;
      /** Sandboxes that did not answer `true` through the SDK at the end. */
      execFailures: number;
      /** Sandboxes whose removal failed, and why. */
      removeFailures: number;
      removeFailuresByCode: Record<string, number>;
    };
  };
  method: string;
  machine: Record<string, unknown>;
}

const MAX_CREATE_FAILURES = 20;
/**
 * Consecutive placement refusals while the edge would still admit, waited out
 * before giving up: placement holds each placement against the room the edge
 * last reported until its next status (every second).
 */
const MAX_PLACEMENT_WAITS = 40;

/**
 * Idle sandboxes (`--cpus 1 --memory-mb 512` by default) through the SDK
 * against an in-process single node with the default network policy, until
 * admission refuses one (or `max`). Then: what each costs the host outside
 * its own cgroup, whether every one still answers an exec, and removal of
 * them all.
 */
export async function benchDensity(options: DensityBenchOptions): Promise<DensityBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-density-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-density-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => rm(work, { recursive: true, force: true }),
    () => removeCgroupParent(cgroupParent),
  ];
  try {
    const stateDir = join(work, 'state');
    const node = await startSingleNode({
      stateDir,
      port: 0,
      cgroupParent,
      ...(options.admission ? { admission: options.admission } : {}),
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfsDir } });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());
    const spec = { image: 'busybox', cpuCoresLimit: options.cpus, memoryLimitMb: options.memoryMb };

    // One create and removal first: layer mounts, caches and the node's own
    // warm-up are not a per-sandbox cost.
    await (await client.runContainer(spec)).stop();
    await sleep(1000);
    const before = await measure(cgroupParent, stateDir);

    const ids: string[] = [];
    const failures: string[] = [];
    let refusal: Record<string, unknown> | undefined;
    let stoppedBy: string | undefined;
    const max = options.max ?? Number.POSITIVE_INFINITY;
    let started = 0;
    let placementWaits = 0;
    const t0 = performance.now();
    const worker = async () => {
      while (!stoppedBy && started < max) {
        if (options.signal?.aborted) throw new Error('benchmark aborted');
        started++;
        try {
          const sb = await client.runContainer(spec);
          placementWaits = 0;
          ids.push(sb.id);
          options.onProgress?.(ids.length, options.max ?? 0);
        } catch (err) {
          started--;
          if (isDsecError(err, 'capacity_exhausted')) {
            // The edge's refusal names the resource. Placement's does not: its view
            // (refreshed every second, plus its in-flight placements) said full, so
            // ask the edge's admission; while it would still admit, wait for a
            // fresher view and go on.
            let named = err.details?.resource !== undefined ? err.details : undefined;
            if (!named) {
              const admission = node.edge.options.admission;
              await admission.refresh();
              named = admission.check(spec) as Record<string, unknown> | undefined;
              if (!named && ++placementWaits <= MAX_PLACEMENT_WAITS) {
                await sleep(250);
                continue;
              }
            }
            refusal ??= named ?? { placementWaits };
            stoppedBy ??= String(named?.resource ?? 'placement');
            break;
          }
          failures.push(toDsecError(err).code);
          if (failures.length > MAX_CREATE_FAILURES) {
            stoppedBy = 'failures';
            break;
          }
        }
      }
    };
    await Promise.all(Array.from({ length: options.concurrency }, worker));
    const createSeconds = (performance.now() - t0) / 1000;
    stoppedBy ??= 'max';

    await sleep(2000); // let the last creates' transient allocations settle
    const after = await measure(cgroupParent, stateDir);
    const n = Math.max(1, ids.length);
    const charged = after.chargedBytes - before.chargedBytes;
    const daemons = after.daemonPssBytes - before.daemonPssBytes;
    const platformBytesPerSandbox = Math.round(
      (after.usedBytes - before.usedBytes - charged + daemons) / n,
    );

    // Every sandbox still answers.
    let execFailures = 0;
    await forEachLimit(ids, options.concurrency * 4, async (id) => {
      const r = await client
        .sandbox(id)
        .exec(['true'])
        .catch(() => undefined);
      if (r?.exitCode !== 0) execFailures++;
    });

    const removeFailures: string[] = [];
    await forEachLimit(ids, options.concurrency * 2, async (id) => {
      await client
        .sandbox(id)
        .stop()
        .catch((err: unknown) => removeFailures.push(toDsecError(err).code));
    });

    return {
      benchmark: 'density',
      sandboxSpec: { cpus: options.cpus, memoryMb: options.memoryMb },
      concurrency: options.concurrency,
      results: {
        dsec: {
          sandboxes: ids.length,
          stoppedBy,
          refusal: refusal ?? null,
          platformBytesPerSandbox,
          processPssBytesPerSandbox: Math.round((after.pssBytes - before.pssBytes + daemons) / n),
          chargedBytesPerSandbox: Math.round(charged / n),
          threadsPerSandbox: Math.round(((after.threads - before.threads) / n) * 10) / 10,
          createsPerSecond: Math.round((ids.length / createSeconds) * 10) / 10,
          createFailures: failures.length,
          failuresByCode: countCodes(failures),
          execFailures,
          removeFailures: removeFailures.length,
          removeFailuresByCode: countCodes(removeFailures),
        },
      },
      method:
        'platformBytesPerSandbox = (Δ(MemTotal − MemAvailable) − Δ(working set charged to the sandboxes’ parent cgroup: usage less inactive file cache)) ÷ sandboxes, ' +
        'measured 2 s after the last create against a baseline taken after one warm-up create and removal; ' +
        'processPssBytesPerSandbox sums PSS (smaps_rollup) of the host processes naming the state dir. Other load on the host adds noise.',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

/** Host memory in use, the sandboxes' cgroup charge, and PSS of the node's per-sandbox processes. */
async function measure(
  cgroupParent: string,
  stateDir: string,
): Promise<{
  usedBytes: number;
  chargedBytes: number;
  pssBytes: number;
  daemonPssBytes: number;
  threads: number;
}> {
  const meminfo = await readFile('/proc/meminfo', 'utf8');
  const kb = (key: string) => Number(new RegExp(`^${key}:\\s+(\\d+)`, 'm').exec(meminfo)?.[1]);
  const usedBytes = (kb('MemTotal') - kb('MemAvailable')) * 1024;
  // The cgroup's working set (charge less inactive file cache), as admission counts it: a
  // parent keeps the page cache its removed children charged.
  const chargedBytes = (await detectCgroupDriver().memoryWorkingSetBytes(`/${cgroupParent}`)) ?? 0;
  let pssBytes = 0;
  let daemonPssBytes = 0;
  const pss = async (pid: string) => {
    const rollup = await readFile(`/proc/${pid}/smaps_rollup`, 'utf8').catch(() => '');
    return Number(/^Pss:\s+(\d+)/m.exec(rollup)?.[1] ?? 0) * 1024;
  };
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    const cmdline = await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '');
    if (cmdline.includes(stateDir)) pssBytes += await pss(entry);
    else if (cmdline.startsWith('dsec-chronus\0') || cmdline.startsWith('dsec-chronus ')) {
      const cgroup = await readFile(`/proc/${entry}/cgroup`, 'utf8').catch(() => '');
      if (cgroup.includes(`/${cgroupParent}/`)) daemonPssBytes += await pss(entry);
    }
  }
  const threads = Number((await readFile('/proc/loadavg', 'utf8')).split(/\s+/)[3]?.split('/')[1]);
  return { usedBytes, chargedBytes, pssBytes, daemonPssBytes, threads };
}

function countCodes(codes: string[]): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const code of codes) counts[code] = (counts[code] ?? 0) + 1;
  return counts;
}

async function forEachLimit<T>(
  items: T[],
  limit: number,
  fn: (item: T) => Promise<void>,
): Promise<void> {
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.max(1, Math.min(limit, items.length)) }, async () => {
      while (next < items.length) await fn(items[next++]!);
    }),
  );
}
