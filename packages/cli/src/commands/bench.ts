import type { Command } from 'commander';
import { benchCreate } from '../bench/create.js';
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
}
