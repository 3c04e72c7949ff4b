import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startSingleNode } from '@dsec/cluster';
import { toDsecError } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { describeMachine } from './create.js';
import {
  detachMountsUnder,
  leftoversAcrossClose,
  removeCgroupParent,
  type HostLeftovers,
} from './host-leftovers.js';
import { summarize } from './stats.js';

export interface ChurnBenchOptions {
  /** How long to churn (default 60). */
  seconds: number;
  /** Create → exec → destroy loops running at once (default 8). */
  concurrency: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface ChurnBenchReport {
  benchmark: 'churn';
  seconds: number;
  concurrency: number;
  results: {
    dsec: {
      /** Completed cycles per second. */
      perSecond: number;
      cycles: number;
      failures: number;
      failuresByCode: Record<string, number>;
      p50Ms: number;
      p99Ms: number;
      /** What was left on the host once the loops stopped (all must be zero). */
      left: HostLeftovers;
    };
  };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * Create → exec `true` → destroy, in `concurrency` loops at full speed for
 * `seconds`, through the SDK against an in-process single node with the
 * default network policy. Then counts what the node left on the host: mounts,
 * cgroups, veths, nftables elements, processes and per-sandbox directories.
 * A failed cycle still removes its sandbox (as a client would).
 */
export async function benchChurn(options: ChurnBenchOptions): Promise<ChurnBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-churn-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-churn-${process.pid}`;
  const cleanups: (() => Promise<unknown>)[] = [
    () => detachMountsUnder(work).then(() => rm(work, { recursive: true, force: true })),
    () => removeCgroupParent(cgroupParent),
  ];
  try {
    const stateDir = join(work, 'state');
    const node = await startSingleNode({
      stateDir,
      port: 0,
      cgroupParent,
      network: { mode: 'isolated' },
    });
    let nodeOpen = true;
    cleanups.unshift(async () => nodeOpen && node.close({ stopSandboxes: true }));
    const rootfsDir = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfsDir);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfsDir } });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());

    const ids: string[] = [];
    const latencies: number[] = [];
    const failures: string[] = [];
    const t0 = performance.now();
    const deadline = t0 + options.seconds * 1000;
    let reported = 0;
    const loop = async () => {
      while (performance.now() < deadline && !options.signal?.aborted) {
        const start = performance.now();
        let id: string | undefined;
        try {
          const sb = await client.runContainer({
            image: 'busybox',
            cpuCoresLimit: 1,
            memoryLimitMb: 512,
          });
          id = sb.id;
          ids.push(sb.id);
          const r = await sb.exec(['true']);
          if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`);
          await sb.stop();
          latencies.push(performance.now() - start);
        } catch (err) {
          failures.push(toDsecError(err).code);
          if (id)
            await client
              .sandbox(id)
              .stop()
              .catch(() => undefined);
        }
        const second = Math.min(options.seconds, Math.floor((performance.now() - t0) / 1000));
        if (second > reported) options.onProgress?.((reported = second), options.seconds);
      }
    };
    await Promise.all(Array.from({ length: options.concurrency }, loop));
    const wallMs = performance.now() - t0;
    if (options.signal?.aborted) throw new Error('benchmark aborted');

    const left = await leftoversAcrossClose(
      node,
      { workDir: work, edgeStateDir: join(stateDir, 'edge'), cgroupParent, sandboxIds: ids },
      async () => {
        client.close();
        nodeOpen = false;
        await node.close();
      },
    );

    const failuresByCode: Record<string, number> = {};
    for (const code of failures) failuresByCode[code] = (failuresByCode[code] ?? 0) + 1;
    const s = summarize(latencies);
    return {
      benchmark: 'churn',
      seconds: options.seconds,
      concurrency: options.concurrency,
      results: {
        dsec: {
          perSecond: Math.round((latencies.length / (wallMs / 1000)) * 100) / 100,
          cycles: latencies.length,
          failures: failures.length,
          failuresByCode,
          p50Ms: s.p50Ms,
          p99Ms: s.p99Ms,
          left,
        },
      },
      method:
        'SDK runContainer (busybox, default network policy) → exec `true` → stop, in parallel loops; ' +
        'leftovers counted with the node running and again after it closed (the larger count is reported)',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}
