import type { Command } from 'commander';
import { benchCreate } from '../bench/create.js';
import { benchExec } from '../bench/exec.js';
import { benchLayers } from '../bench/layers.js';
import { benchOndemand } from '../bench/ondemand.js';
import { contextOf } from '../context.js';
import { createProgress } from '../progress.js';

/**
 * `dsec bench NAME`: side-by-side benchmarks against a peer, in one run,
 * interleaved. Prints a table, or with `--json` one object with `results`
 * and `ratios` (ours ÷ peer on p50; below 1 means DSec is faster).
 */
export function register(program: Command): void {
  const bench = program
    .command('bench')
    .description('measure DSec against peers (runc, podman) side by side');
  bench
    .command('exec')
    .description(
      '`true` in a warm session through the full path vs `runc exec` and `nsenter` into the same sandbox; stdout throughput',
    )
    .option('--iterations <n>', 'measured round trips per system', '200')
    .option('--warmup <n>', 'unmeasured round trips first', '20')
    .option('--stream-mib <n>', 'MiB of stdout streamed for the throughput run', '512')
    .action(
      async (opts: { iterations: string; warmup: string; streamMib: string }, command: Command) => {
        const ctx = contextOf(command);
        const total = Number(opts.iterations) + Number(opts.warmup);
        const progress = createProgress({ label: 'bench exec', total, enabled: !ctx.json });
        const report = await benchExec({
          iterations: Number(opts.iterations),
          warmup: Number(opts.warmup),
          streamBytes: Number(opts.streamMib) * 1024 * 1024,
          onProgress: (done) => progress.update(done),
          signal: ctx.signal,
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        ctx.out(`${report.cycle}, ${report.iterations} iterations`);
        for (const [name, s] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(10)} p50 ${s.p50Ms.toFixed(3).padStart(8)} ms   p99 ${s.p99Ms.toFixed(3).padStart(8)} ms`,
          );
        }
        ctx.out(`ratios (dsec ÷ peer, p50): ${JSON.stringify(report.ratios)}`);
        ctx.out(
          `stdout throughput: ${report.throughput.mbPerSecond} MB/s raw, ${report.throughput.ndjsonMbPerSecond} MB/s framed (NDJSON)`,
        );
      },
    );
  bench
    .command('create')
    .description(
      'create → exec `true` → destroy through the full path vs bare `runc run` and `podman run --rm`',
    )
    .option('--iterations <n>', 'measured cycles per system', '30')
    .option('--warmup <n>', 'unmeasured cycles first', '3')
    .action(async (opts: { iterations: string; warmup: string }, command: Command) => {
      const ctx = contextOf(command);
      const total = Number(opts.iterations) + Number(opts.warmup);
      const progress = createProgress({ label: 'bench create', total, enabled: !ctx.json });
      const report = await benchCreate({
        iterations: Number(opts.iterations),
        warmup: Number(opts.warmup),
        onProgress: (done) => progress.update(done),
        signal: ctx.signal,
      });
      progress.done();
      if (ctx.json) {
        ctx.out(JSON.stringify(report, null, 2));
        return;
      }
      ctx.out(`${report.cycle}, ${report.iterations} iterations`);
      for (const [name, s] of Object.entries(report.results)) {
        ctx.out(
          `${name.padEnd(8)} p50 ${s.p50Ms.toFixed(1).padStart(7)} ms   p99 ${s.p99Ms.toFixed(1).padStart(7)} ms`,
        );
      }
      ctx.out(`ratios (dsec ÷ peer, p50): ${JSON.stringify(report.ratios)}`);
    });
  bench
    .command('layers')
    .description(
      'N sandboxes sharing a workspace + toolkit: EROFS layers vs per-sandbox tar.gz extraction',
    )
    .option('--count <n>', 'sandboxes per system', '64')
    .option('--workspace-mb <n>', 'size of the synthetic workspace', '40')
    .option('--concurrency <n>', 'sandboxes created at a time (both systems)', '8')
    .action(
      async (
        opts: { count: string; workspaceMb: string; concurrency: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const count = Number(opts.count);
        const progress = createProgress({
          label: 'bench layers',
          total: 2 * count,
          enabled: !ctx.json,
        });
        const report = await benchLayers({
          count,
          workspaceMb: Number(opts.workspaceMb),
          concurrency: Number(opts.concurrency),
          onProgress: (done) => progress.update(done),
          signal: ctx.signal,
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        for (const [name, s] of Object.entries(report.results)) {
          ctx.out(
            `${name.padEnd(6)} ${(s.bytesWritten / 2 ** 20).toFixed(1).padStart(9)} MiB written   ${(s.timeToReadyMs / 1000).toFixed(2).padStart(7)} s to ready`,
          );
        }
        ctx.out(`ratios (dsec ÷ tar): ${JSON.stringify(report.ratios)}`);
      },
    );
  bench
    .command('ondemand')
    .description('a task reading ~10 % of a large image: on-demand data blob vs eager full pull')
    .option('--image-mb <n>', 'size of the large image', '320')
    .option('--bandwidth-mibps <n>', 'store bandwidth', '100')
    .action(async (opts: { imageMb: string; bandwidthMibps: string }, command: Command) => {
      const ctx = contextOf(command);
      const progress = createProgress({ label: 'bench ondemand', total: 6, enabled: !ctx.json });
      const report = await benchOndemand({
        imageMb: Number(opts.imageMb),
        bandwidthMiBps: Number(opts.bandwidthMibps),
        onProgress: (done) => progress.update(done),
        ...(ctx.signal ? { signal: ctx.signal } : {}),
      });
      progress.done();
      if (ctx.json) {
        ctx.out(JSON.stringify(report, null, 2));
        return;
      }
      for (const [name, s] of Object.entries(report.results)) {
        ctx.out(
          `${name.padEnd(6)} ${(s.bytesTransferred / 2 ** 20).toFixed(1).padStart(8)} MiB from the store   first exec ${(s.timeToFirstExecMs / 1000).toFixed(2)} s   task done ${(s.timeToTaskDoneMs / 1000).toFixed(2)} s`,
        );
      }
      ctx.out(`ratios (dsec ÷ eager): ${JSON.stringify(report.ratios)}`);
    });
}
