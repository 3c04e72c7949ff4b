/**
 * The client side of `dsec bench exec`'s load run, in its own process as a
 * trainer's client would be: `echo` through the SDK, `concurrency` commands
 * in flight at once spread over the given sandboxes. Reads its job as JSON
 * from argv[2]; prints the result as one JSON line on stdout.
 */
import { DSecClient } from '@dsec/sdk';
import { summarize } from './stats.js';

export interface ExecLoadJob {
  url: string;
  apiKey: string;
  sandboxIds: string[];
  execs: number;
  concurrency: number;
}

async function run(job: ExecLoadJob) {
  const client = new DSecClient({ url: job.url, apiKey: job.apiKey });
  await client.open();
  const sandboxes = job.sandboxIds.map((id) => client.sandbox(id));
  for (const sb of sandboxes) await sb.exec(['echo', 'warm']);
  const latencies: number[] = [];
  let failures = 0;
  let firstError: string | undefined;
  let next = 0;
  const t0 = process.hrtime.bigint();
  await Promise.all(
    Array.from({ length: job.concurrency }, async (_, worker) => {
      while (next < job.execs) {
        const i = next++;
        const sb = sandboxes[(worker + i) % sandboxes.length]!;
        const started = process.hrtime.bigint();
        try {
          const r = await sb.exec(['echo', String(i)]);
          if (r.exitCode !== 0 || r.stdout !== `${i}\n`) throw new Error(`echo ${i}: ${r.outcome}`);
          latencies.push(Number(process.hrtime.bigint() - started) / 1e6);
        } catch (err) {
          failures++;
          firstError ??= String(err);
        }
      }
    }),
  );
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
