import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { DSecClient } from '@dsec/sdk';
import { makeBusyboxRootfs } from '@dsec/images';
import { main } from '@dsec/cli/main';
import type { EvalResult } from '../../src/index.js';
import {
  makeShellTaskSet,
  startScriptedModel,
  type ShellTaskSet,
} from '../../src/testing/index.js';

const REPO = resolve(fileURLToPath(new URL('../../../..', import.meta.url)));

let node: SingleNode;
let work: string;
let set: ShellTaskSet;
let slowSet: ShellTaskSet;
let client: DSecClient;

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(['--state-dir', join(work, 'state'), ...args], {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: node.url, DSEC_API_KEY: node.adminKey },
  });
  return run;
}

function results(path: string): EvalResult[] {
  return readFileSync(path, 'utf8')
    .split('\n')
    .filter((l) => l.trim() !== '')
    .map((l) => JSON.parse(l) as EvalResult);
}

function byId(rs: EvalResult[]): Record<string, EvalResult> {
  return Object.fromEntries(rs.map((r) => [r.instance_id, r]));
}

/** The CLI from source in a child process: the driver a test can kill. */
function driver(args: string[]): {
  child: ChildProcess;
  exit: Promise<number | null>;
  output: () => string;
} {
  const child = spawn(
    process.execPath,
    [
      '--conditions=dsec-source',
      '--import',
      'tsx',
      'packages/cli/src/run.ts',
      '--state-dir',
      join(work, 'state'),
      ...args,
    ],
    {
      cwd: REPO,
      env: { ...process.env, DSEC_URL: node.url, DSEC_API_KEY: node.adminKey },
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  let output = '';
  child.stdout.on('data', (c: Buffer) => (output += c.toString()));
  child.stderr.on('data', (c: Buffer) => (output += c.toString()));
  const exit = new Promise<number | null>((res) =>
    child.on('exit', (code, signal) => res(code ?? (signal ? -1 : null))),
  );
  return { child, exit, output: () => output };
}

/** Waits until some task has a finished step in the journal but no result yet: the driver is mid-batch. */
async function midBatch(out: string, exited: Promise<unknown>): Promise<void> {
  let gone = false;
  void exited.then(() => (gone = true));
  for (;;) {
    if (gone) throw new Error('the driver ended before it could be interrupted');
    const journal = existsSync(`${out}.journal`) ? readFileSync(`${out}.journal`, 'utf8') : '';
    const done = new Set(
      journal
        .split('\n')
        .filter((l) => l.includes('"t":"done"'))
        .map((l) => (JSON.parse(l) as { id: string }).id),
    );
    // Grading steps per task: a finished task journaled all of them. A task still short of
    // that count has its slow last step (the test run) ahead or running, so the signal lands
    // inside a task rather than between a task's last step and its result.
    const gradingSteps = new Map<string, number>();
    for (const l of journal.split('\n')) {
      if (!l.includes('"t":"step"')) continue;
      const { id, rid } = JSON.parse(l) as { id: string; rid: string };
      gradingSteps.set(id, (gradingSteps.get(id) ?? 0) + (/:g\d+/.test(rid) ? 1 : 0));
    }
    const all = Math.max(0, ...[...done].map((id) => gradingSteps.get(id) ?? 0));
    const midTask = [...gradingSteps].some(([id, n]) => !done.has(id) && n < all);
    if (done.size >= 1 && midTask) return;
    await sleep(20);
  }
}

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-eval-it-'));
  await chmod(work, 0o711);
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'eval-node' });
  const rootfs = join(work, 'rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  set = await makeShellTaskSet(join(work, 'tasks'), { image: 'busybox' });
  slowSet = await makeShellTaskSet(join(work, 'slow'), { image: 'busybox', testDelaySeconds: 1 });
  client = new DSecClient({ url: node.url, apiKey: node.adminKey });
});

after(async () => {
  client?.close();
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

test('prepare builds one workspace layer per repository and commit, then finds them all present', async () => {
  const first = await dsec(['--json', 'eval', 'prepare', set.tasksFile]);
  assert.equal(first.code, 0, first.stderr);
  const report = JSON.parse(first.stdout) as {
    built: string[];
    present: string[];
    tasks: { workspace: string }[];
  };
  assert.equal(report.built.length, 3, JSON.stringify(report));
  assert.deepEqual(report.present, ['busybox']);
  assert.equal(new Set(report.tasks.map((t) => t.workspace)).size, 3);
  const again = JSON.parse(
    (await dsec(['--json', 'eval', 'prepare', set.tasksFile])).stdout,
  ) as typeof report;
  assert.deepEqual(again.built, []);
  assert.equal(again.present.length, 4);
});

test('gold scores every task 1 and none every task 0, through logged steps with no duplicates', async () => {
  const goldOut = join(work, 'gold.jsonl');
  const gold = await dsec([
    '--json',
    'eval',
    'run',
    set.tasksFile,
    '--agent',
    'gold',
    '--concurrency',
    '3',
    '--label',
    'job=it-gold',
    '--out',
    goldOut,
  ]);
  assert.equal(gold.code, 0, gold.stderr);
  assert.deepEqual(JSON.parse(gold.stdout).tasks, 3);
  const summary = JSON.parse(gold.stdout) as { tasks: number; solved: number; errors: number };
  assert.deepEqual([summary.tasks, summary.solved, summary.errors], [3, 3, 0]);
  const rs = byId(results(goldOut));
  for (const r of Object.values(rs)) {
    assert.equal(r.reward, 1, JSON.stringify(r));
    assert.equal(r.error, undefined);
    assert.equal(r.duplicateExecutions, 0);
    assert.equal(r.replayedSteps, 0);
    // Gold: a read and a write of the one file. Taking its patch: the agent's processes killed, its
    // workdir listed and the changed file read; grading, in a fresh sandbox: its workdir listed, the base file read,
    // the patch applied, the test file written, then the test run.
    assert.equal(r.toolCalls, 2);
    assert.equal(r.executedSteps, 2 + 3 + 5);
    assert.ok(r.sandboxId);
    assert.equal(r.grading, 'patch');
    assert.ok(r.gradingSandboxId && r.gradingSandboxId !== r.sandboxId);
    assert.equal(r.agentPatch?.files, 1);
    assert.deepEqual(r.agentPatch?.leftOut, []);
    assert.match(r.agentPatch?.diff ?? '', /^diff --git a\/lib\/\w+\.sh b\/lib\/\w+\.sh$/m);
    assert.ok(r.durations.totalMs >= r.durations.agentMs + r.durations.gradingMs);
  }
  assert.deepEqual(rs['shcalc__add-1']!.tests, {
    add_basic: 'passed',
    add_zero: 'passed',
    sub_basic: 'passed',
  });
  // Every sandbox, the agents' and the grading ones, was stopped after grading.
  const live = await client.listSandboxes({ labels: { job: 'it-gold' } });
  assert.ok(
    live.every((s) => s.state === 'stopped'),
    JSON.stringify(live.map((s) => s.state)),
  );
  for (const r of Object.values(rs)) {
    for (const id of [r.sandboxId!, r.gradingSandboxId!]) {
      const state = await client
        .sandbox(id)
        .refresh()
        .then((i) => i.state)
        .catch((err: { code?: string }) => err.code);
      assert.ok(state === 'stopped' || state === 'sandbox_not_found', `${id}: ${state}`);
    }
  }

  const noneOut = join(work, 'none.jsonl');
  const none = await dsec([
    '--json',
    'eval',
    'run',
    set.tasksFile,
    '--agent',
    'none',
    '--out',
    noneOut,
    '--no-prepare',
  ]);
  assert.equal(none.code, 0, none.stderr);
  assert.deepEqual(JSON.parse(none.stdout).solved, 0);
  for (const r of results(noneOut)) {
    assert.equal(r.reward, 0);
    assert.equal(r.error, undefined);
    assert.equal(r.toolCalls, 0);
    assert.equal(r.agentPatch?.files, 0);
    assert.equal(r.agentPatch?.diff, '');
    assert.ok(r.failing && r.failing.length >= 1);
  }
  assert.equal(byId(results(noneOut))['shcalc__add-1']!.tests.add_basic, 'failed');
});

test('the http agent solves every task through a scripted model on loopback, and reports tokens', async () => {
  const { readFile: read } = await import('node:fs/promises');
  const problems = Object.fromEntries(
    (await read(set.tasksFile, 'utf8'))
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as { instance_id: string; problem_statement: string })
      .map((t) => [t.instance_id, t.problem_statement]),
  );
  const model = await startScriptedModel(set.tasks, problems);
  try {
    const out = join(work, 'http.jsonl');
    const run = await dsec([
      '--json',
      'eval',
      'run',
      set.tasksFile,
      '--agent',
      'http',
      '--endpoint',
      model.url,
      '--model',
      'scripted',
      '--out',
      out,
    ]);
    assert.equal(run.code, 0, run.stderr);
    for (const r of results(out)) {
      assert.equal(r.reward, 1, JSON.stringify(r));
      assert.equal(r.agentFinished, true);
      assert.equal(r.toolCalls, 3);
      assert.deepEqual(r.tokens, { prompt: 400, completion: 40, total: 440 });
      assert.equal(r.duplicateExecutions, 0);
    }
    assert.equal(model.requests, 12);
  } finally {
    await model.close();
  }
});

test('kill -9 mid-batch, then --resume: same rewards, same steps, nothing run twice', async () => {
  const args = (out: string) => [
    'eval',
    'run',
    slowSet.tasksFile,
    '--agent',
    'gold',
    '--concurrency',
    '2',
    '--label',
    'job=it-kill',
    '--out',
    out,
  ];
  const straightOut = join(work, 'straight.jsonl');
  const straight = await dsec(['--json', ...args(straightOut)]);
  assert.equal(straight.code, 0, straight.stderr);

  const out = join(work, 'killed.jsonl');
  const first = driver(['--json', ...args(out)]);
  await midBatch(out, first.exit);
  first.child.kill('SIGKILL');
  await first.exit;
  const before = results(out).length;
  assert.ok(before < 3, `the kill came after the batch ended (${before} results)`);

  const second = driver(['--json', ...args(out), '--resume']);
  assert.equal(await second.exit, 0, second.output());
  const resumed = byId(results(out));
  const reference = byId(results(straightOut));
  assert.deepEqual(Object.keys(resumed).sort(), Object.keys(reference).sort());
  let replayed = 0;
  for (const [id, r] of Object.entries(resumed)) {
    assert.equal(r.reward, reference[id]!.reward, id);
    assert.equal(r.reward, 1, JSON.stringify(r));
    assert.equal(r.duplicateExecutions, 0, id);
    assert.equal(r.executedSteps, reference[id]!.executedSteps, id);
    assert.equal(r.attempt, 1);
    replayed += r.replayedSteps;
  }
  assert.ok(replayed > 0, 'the resumed driver answered no step from the command log');
  const live = await client.listSandboxes({ labels: { job: 'it-kill' } });
  assert.ok(live.every((s) => s.state === 'stopped'));
});

test('SIGTERM pauses the job and exits 143; --resume resumes it and finishes', async () => {
  const out = join(work, 'term.jsonl');
  const args = [
    'eval',
    'run',
    slowSet.tasksFile,
    '--agent',
    'gold',
    '--concurrency',
    '2',
    '--label',
    'job=it-term',
    '--out',
    out,
  ];
  const first = driver(['--json', ...args]);
  await midBatch(out, first.exit);
  first.child.kill('SIGTERM');
  assert.equal(await first.exit, 143, first.output());
  const paused = (await client.listSandboxes({ labels: { job: 'it-term' } })).filter(
    (s) => s.state !== 'stopped',
  );
  assert.ok(paused.length >= 1, 'no sandbox of the job was left for the resume');
  assert.ok(
    paused.every((s) => s.state === 'paused'),
    JSON.stringify(paused.map((s) => s.state)),
  );
  assert.match(await readFile(`${out}.journal`, 'utf8'), /"t":"paused"/);

  const second = driver(['--json', ...args, '--resume']);
  assert.equal(await second.exit, 0, second.output());
  const summary = JSON.parse(second.output().slice(second.output().indexOf('{'))) as {
    tasks: number;
    solved: number;
  };
  assert.deepEqual(
    [summary.tasks, summary.solved],
    [3, 3],
    JSON.stringify(results(out).map((r) => [r.instance_id, r.reward, r.error])),
  );
  for (const r of results(out)) assert.equal(r.duplicateExecutions, 0);
});
