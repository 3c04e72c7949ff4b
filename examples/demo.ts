/**
 * The demo workload: what an RL rollout does with DSec, in miniature. A batch
 * of sandboxes is created at once; each one receives a small "task", runs a
 * few stateful commands (the agent's tool calls), is scored by a grading
 * command, and is thrown away.
 *
 *   DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key) \
 *     node --conditions=dsec-source --import tsx examples/demo.ts
 */
import { DSecClient } from '@dsec/sdk';

const BATCH = Number(process.env.DEMO_BATCH ?? 8);

async function rollout(
  client: DSecClient,
  task: number,
): Promise<{ task: number; reward: number; ms: number }> {
  const started = Date.now();
  const sandbox = await client.runContainer(
    {
      image: 'busybox',
      memoryLimitMb: 256,
      cpuCoresLimit: 1,
      ttlRunningStopSeconds: 300,
      networkRules: {},
      initUser: 'root',
    },
    { timeoutMs: 60_000 },
  );
  try {
    // The "agent" writes a solution in several tool calls; state persists between them.
    await sandbox.runShell(`mkdir -p /work && cd /work && seq 1 ${task + 10} > input.txt`);
    await sandbox.runShell(`cd /work && awk '{ s += $1 } END { print s }' input.txt > answer.txt`);
    // The grader checks the answer against the closed form n(n+1)/2.
    const n = task + 10;
    const graded = await sandbox.runShell(
      `test "$(cat /work/answer.txt)" = "${(n * (n + 1)) / 2}"`,
    );
    return { task, reward: graded.exitCode === 0 ? 1 : 0, ms: Date.now() - started };
  } finally {
    await sandbox.stop();
  }
}

const client = new DSecClient();
await client.open();
const t0 = Date.now();
const results = await Promise.all(Array.from({ length: BATCH }, (_, i) => rollout(client, i)));
for (const r of results)
  console.log(`task ${String(r.task).padStart(2)}  reward ${r.reward}  ${r.ms} ms`);
const solved = results.filter((r) => r.reward === 1).length;
console.log(
  `${solved}/${BATCH} tasks solved in ${Date.now() - t0} ms (${BATCH} sandboxes, 3 commands each)`,
);
client.close();
if (solved !== BATCH) process.exitCode = 1;
