import type { Command } from 'commander';
import type { ApiFuzzReport } from '@dsec/apiserver/testing';
import { contextOf } from '../context.js';
import { parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';

/**
 * `dsec bench fuzz --seconds N`: the API fuzzer (`runApiFuzz` of
 * @dsec/apiserver/testing; CI runs it for a few seconds as a unit test) for
 * as long as asked, with a random seed unless one is given: requests from
 * the OpenAPI document against an in-process apiserver over a fake edge,
 * checked for no 5xx, no hang, DSec's error shape and codes, documented
 * statuses, 401 without a key, and nothing of one project reachable with
 * another's key. `--json` prints the report: `results.requests` and
 * `results.violations` (one per broken property and route: `route`,
 * `request`, `expected`, `got`). The exit code is 1 when it found any.
 */
export function registerFuzzBench(bench: Command): void {
  bench
    .command('fuzz')
    .description(
      'fuzz every route of the API from its OpenAPI document (in process); report broken properties',
    )
    .option('--seconds <n>', 'how long to fuzz', parseInteger, 60)
    .option('--seed <n>', 'fast-check seed (default random; the report names it)', parseInteger)
    .option(
      '--request-timeout-ms <n>',
      'a request without an answer by then hangs',
      parseInteger,
      10_000,
    )
    .action(
      async (
        opts: { seconds: number; seed?: number; requestTimeoutMs: number },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        // Loaded on use: the fuzzer and fast-check are for this command only.
        const { runApiFuzz } = await import('@dsec/apiserver/testing');
        const progress = createProgress({ label: 'bench fuzz', enabled: !ctx.json });
        const report: ApiFuzzReport & { machine?: Record<string, unknown> } = await runApiFuzz({
          seconds: opts.seconds,
          seed: opts.seed,
          requestTimeoutMs: opts.requestTimeoutMs,
          onProgress: (n) => progress.update(n),
          signal: ctx.signal,
        });
        progress.done();
        report.machine = await describeMachine();
        if (report.results.violations.length > 0) ctx.exitCode = 1;
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const r = report.results;
        ctx.out(
          `${r.requests} requests over ${r.routes} routes in ${(report.durationMs / 1000).toFixed(1)} s (seed ${report.seed})`,
        );
        ctx.out(`statuses: ${JSON.stringify(r.statuses)}`);
        if (r.violations.length === 0) ctx.out(`no property broken (${r.properties.join(', ')})`);
        for (const v of r.violations) {
          ctx.out(
            `${v.property} ${v.route} (${v.occurrences}×): expected ${v.expected}, got ${v.got}`,
          );
          ctx.out(`  ${v.request.method} ${v.request.url} [key ${v.request.key}]`);
        }
      },
    );
}
