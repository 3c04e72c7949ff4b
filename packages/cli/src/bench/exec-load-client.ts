/**
 * The client side of `dsec bench exec`'s load run, in its own process as a
 * trainer's client would be: `echo` through the SDK, `concurrency` commands
 * in flight at once spread over the given sandboxes, after `warmup` unmeasured
 * ones. Reads its job as JSON
 * from argv[2]; prints the result as one JSON line on stdout.
 */
import { DSecClient } from '@dsec/sdk';
import { summarize } from './stats.js';

export interface ExecLoadJob {
  url: string;
  apiKey: string;
  sandboxIds: string[];
  execs: number;
  /** Unmeasured execs first, at the same concurrency. */
  warmup: number;
  concurrency: number;
}

async function run(job: ExecLoadJob) {
  const client = new DSecClient({ url: job.url, apiKey: job.apiKey });
  await client.open();
  const sandboxes = job.sandboxIds.map((id) => client.sandbox(id));
  const latencies: number[] = [];
  let failures = 0;
  let firstError: string | undefined;
  /** `n` echos, `concurrency` in flight; a failure counts whether measured or not. */
  const phase = async (n: number, measured: boolean) => {
    let next = 0;
    await Promise.all(
      Array.from({ length: job.concurrency }, async (_, worker) => {
        while (next < n) {
          const i = next++;
          const sb = sandboxes[(worker + i) % sandboxes.length]!;
          const started = process.hrtime.bigint();
          try {
            const r = await sb.exec(['echo', String(i)]);
            if (r.exitCode !== 0 || r.stdout !== `${i}\n`)
              throw new Error(`echo ${i}: ${r.outcome}`);
            if (measured) latencies.push(Number(process.hrtime.bigint() - started) / 1e6);
          } catch (err) {
            failures++;
            firstError ??= String(err);
          }
        }
      }),
    );
  };
  // Unmeasured: the client's and the server's hot paths compiled, as in a long-running trainer.
  await phase(Math.max(job.warmup, sandboxes.length), false);
  const t0 = process.hrtime.bigint();
  await phase(job.execs, true);
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  client.close();
  return {
    ...summarize(latencies),
    execsPerSecond: Math.round(latencies.length / seconds),
    failures,
    ...(firstError !== undefined ? { firstError } : {}),
  };
}

const job = JSON.parse(process.argv[2] ?? '{}') as ExecLoadJob;
process.stdout.write(JSON.stringify(await run(job)) + '\n');
