import type { Command } from 'commander';
import { benchCreate } from '../bench/create.js';
import { benchExec } from '../bench/exec.js';
import { benchLayers } from '../bench/layers.js';
import { benchOndemand } from '../bench/ondemand.js';
import type { LatencySummary } from '../bench/stats.js';
import { contextOf, type CliContext } from '../context.js';
import { createProgress } from '../progress.js';

/**
 * `dsec bench NAME`: side-by-side benchmarks against a peer, in one run,
 * interleaved. Prints a table, or with `--json` one object with `results`
 * and `ratios` (ours ÷ peer; below 1 means DSec is better).
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
        const report = await runBench(
          ctx,
          'exec',
          Number(opts.iterations) + Number(opts.warmup),
          (onProgress) =>
            benchExec({
              iterations: Number(opts.iterations),
              warmup: Number(opts.warmup),
              streamBytes: Number(opts.streamMib) * 1024 * 1024,
              onProgress,
              signal: ctx.signal,
            }),
        );
        if (!report) return;
        printLatencies(ctx, report);
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
      const report = await runBench(
        ctx,
        'create',
        Number(opts.iterations) + Number(opts.warmup),
        (onProgress) =>
          benchCreate({
            iterations: Number(opts.iterations),
            warmup: Number(opts.warmup),
            onProgress,
            signal: ctx.signal,
          }),
      );
      if (report) printLatencies(ctx, report);
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
        const report = await runBench(ctx, 'layers', 2 * count, (onProgress) =>
          benchLayers({
            count,
            workspaceMb: Number(opts.workspaceMb),
            concurrency: Number(opts.concurrency),
            onProgress,
            signal: ctx.signal,
          }),
        );
        if (!report) return;
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
      const report = await runBench(ctx, 'ondemand', 6, (onProgress) =>
        benchOndemand({
          imageMb: Number(opts.imageMb),
          bandwidthMiBps: Number(opts.bandwidthMibps),
          onProgress,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        }),
      );
      if (!report) return;
      for (const [name, s] of Object.entries(report.results)) {
        ctx.out(
          `${name.padEnd(6)} ${(s.bytesTransferred / 2 ** 20).toFixed(1).padStart(8)} MiB from the store   first exec ${(s.timeToFirstExecMs / 1000).toFixed(2)} s   task done ${(s.timeToTaskDoneMs / 1000).toFixed(2)} s`,
        );
      }
      ctx.out(`ratios (dsec ÷ eager): ${JSON.stringify(report.ratios)}`);
    });
}

/**
 * Runs one benchmark with a progress bar. With `--json` it prints the report
 * and returns undefined; otherwise it returns the report for the caller's table.
 */
async function runBench<R>(
  ctx: CliContext,
  name: string,
  total: number,
  run: (onProgress: (done: number) => void) => Promise<R>,
): Promise<R | undefined> {
  const progress = createProgress({ label: `bench ${name}`, total, enabled: !ctx.json });
  const report = await run((done) => progress.update(done));
  progress.done();
  if (!ctx.json) return report;
  ctx.out(JSON.stringify(report, null, 2));
  return undefined;
}

function printLatencies(
  ctx: CliContext,
  report: {
    cycle: string;
    iterations: number;
    results: Record<string, LatencySummary>;
    ratios: unknown;
  },
): void {
  ctx.out(`${report.cycle}, ${report.iterations} iterations`);
  const width = Math.max(...Object.keys(report.results).map((n) => n.length)) + 2;
  for (const [name, s] of Object.entries(report.results)) {
    ctx.out(
      `${name.padEnd(width)} p50 ${s.p50Ms.toFixed(2).padStart(8)} ms   p99 ${s.p99Ms.toFixed(2).padStart(8)} ms`,
    );
  }
  ctx.out(`ratios (dsec ÷ peer, p50): ${JSON.stringify(report.ratios)}`);
}
