import { execFile } from 'node:child_process';
import { readFile, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';
import { buildLayer } from '@dsec/images';
import { describeMachine } from './create.js';
import { startSnapshotBenchNode } from './fork.js';
import { summarize, type LatencySummary } from './stats.js';

const execFileAsync = promisify(execFile);

export interface SnapshotBenchOptions {
  iterations: number;
  writableMb: number;
  onProgress?: (done: number) => void;
  signal?: AbortSignal;
}

export interface SnapshotBenchReport {
  benchmark: 'snapshot';
  iterations: number;
  writableMb: number;
  results: {
    dsec: { freezeMs: LatencySummary; snapshotMs: LatencySummary; layerBytes: number };
    tar: { freezeMs: LatencySummary; snapshotMs: LatencySummary; layerBytes: number };
  };
  /** dsec ÷ tar medians: below 1 means DSec is faster. */
  ratios: { freezeMs: number; snapshotMs: number };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * `dsec bench snapshot`: a sandbox with `writableMb` MiB in its writable
 * layer, snapshotted `iterations` times by DSec (freeze, `mkfs.erofs` of the
 * upper directory, thaw, id shift, store) and by the obvious alternative:
 * freeze, `tar` the upper directory, thaw, then build a layer from the tar
 * (extract, `mkfs.erofs`, store), both uncompressed. The same freezer, the
 * same store, alternating so drift hits both.
 */
export async function benchSnapshot(options: SnapshotBenchOptions): Promise<SnapshotBenchReport> {
  const node = await startSnapshotBenchNode(options.writableMb);
  try {
    const freezer = node.freezerState;
    if (!freezer) throw new Error('the tar peer needs a cgroup v1 freezer');
    const dsec = { freeze: [] as number[], total: [] as number[], bytes: 0 };
    const tar = { freeze: [] as number[], total: [] as number[], bytes: 0 };
    for (let i = 0; i < options.iterations; i++) {
      const snap = await node.edge.snapshotSandbox(node.sourceId, { name: `bench-snap-${i}` });
      dsec.freeze.push(snap.freezeMs);
      dsec.total.push(snap.totalMs);
      dsec.bytes = snap.layer.sizeBytes;

      const archive = join(node.work, `upper-${i}.tar`);
      const t0 = performance.now();
      await freeze(freezer);
      const f0 = performance.now();
      try {
        await execFileAsync('tar', [
          '--create',
          `--file=${archive}`,
          '--xattrs',
          '--xattrs-include=*',
          '--numeric-owner',
          `--directory=${node.upperDir}`,
          '.',
        ]);
      } finally {
        await writeFile(freezer, 'THAWED');
      }
      const f1 = performance.now();
      const layer = await buildLayer(node.store, {
        name: `bench-tar-${i}`,
        kind: 'toolkit',
        from: { tar: archive },
        compress: false,
      });
      await rm(archive, { force: true });
      tar.freeze.push(f1 - f0);
      tar.total.push(performance.now() - t0);
      tar.bytes = layer.sizeBytes;
      options.onProgress?.(i + 1);
    }
    const results = {
      dsec: {
        freezeMs: summarize(dsec.freeze),
        snapshotMs: summarize(dsec.total),
        layerBytes: dsec.bytes,
      },
      tar: {
        freezeMs: summarize(tar.freeze),
        snapshotMs: summarize(tar.total),
        layerBytes: tar.bytes,
      },
    };
    const r = (a: number, b: number) => Math.round((a / b) * 100) / 100;
    return {
      benchmark: 'snapshot',
      iterations: options.iterations,
      writableMb: options.writableMb,
      results,
      ratios: {
        freezeMs: r(results.dsec.freezeMs.p50Ms, results.tar.freezeMs.p50Ms),
        snapshotMs: r(results.dsec.snapshotMs.p50Ms, results.tar.snapshotMs.p50Ms),
      },
      method:
        'one edge driven directly; source sandbox writable layer of 1 MiB random files; ' +
        'dsec: snapshotSandbox (freezer v1, mkfs.erofs uncompressed from the upper dir, thaw, uid shift, store with fsync); ' +
        'tar: freeze, tar --xattrs of the upper dir, thaw, buildLayer from the tar (extract, mkfs.erofs uncompressed, store)',
      machine: await describeMachine(),
    };
  } finally {
    await node.close();
  }
}

async function freeze(stateFile: string): Promise<void> {
  for (;;) {
    await writeFile(stateFile, 'FROZEN');
    if ((await readFile(stateFile, 'utf8')).trim() === 'FROZEN') return;
    await sleep(1);
  }
}
