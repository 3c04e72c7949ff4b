/**
 * SECURITY.md K39 / D24 (issue 24, point 8): an agent cannot change how it is
 * graded. Real sandboxes with real pytest, node and npm (the host's Debian
 * packages, see makeToolchainRootfs) and busybox; every attack is an agent
 * acting through the same tool calls a model makes. Each attack, left in the
 * agent's sandbox when the grader ran the tests there, turned the unfixed task
 * into reward 1; here each must score 0, while the gold fix scores 1.
 */
import assert from 'node:assert/strict';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import {
  GoldAgent,
  NoneAgent,
  RepoCache,
  loadTasks,
  prepareTasks,
  runEval,
  type Agent,
  type EvalResult,
  type EvalTask,
  type PreparedTask,
} from '../../src/index.js';
import {
  IN_PLACE_ATTACKS,
  STEERING_ATTACKS,
  ScriptedAgent,
  makeIntegrityTaskSet,
  makeToolchainRootfs,
  type IntegrityTaskSet,
} from '../../src/testing/index.js';

const root = process.getuid?.() === 0;
const hostHasToolchain = await import('node:child_process').then(
  ({ spawnSync }) =>
    spawnSync('dpkg', ['-s', 'python3-pytest', 'nodejs'], { stdio: 'ignore' }).status === 0,
);
const skip = !root
  ? 'needs root'
  : !hostHasToolchain
    ? 'needs the host packages python3-pytest and nodejs'
    : false;

describe('grading integrity (K39)', { skip, timeout: 1_800_000 }, () => {
  let work = '';
  let node: SingleNode;
  let client: DSecClient;
  let set: IntegrityTaskSet;
  let tasks: EvalTask[];
  let tasksFile = '';
  let repos: RepoCache;
  let prepared: Map<string, PreparedTask>;
  let runs = 0;

  before(async () => {
    work = await mkdtemp(join(tmpdir(), 'dsec-grading-it-'));
    await chmod(work, 0o711);
    node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'grading' });
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await makeBusyboxRootfs(join(work, 'busybox'));
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(work, 'busybox') } });
    await makeToolchainRootfs(join(work, 'toolchain'));
    await node.buildLayer({
      name: 'toolchain',
      kind: 'base',
      from: { dir: join(work, 'toolchain') },
      compress: false,
    });
    await rm(join(work, 'toolchain'), { recursive: true, force: true });
    set = await makeIntegrityTaskSet(join(work, 'tasks'), {
      toolchainImage: 'toolchain',
      shellImage: 'busybox',
    });
    const loaded = await loadTasks(set.tasksFile);
    tasks = loaded.tasks;
    tasksFile = loaded.file;
    repos = new RepoCache(join(work, 'cache'));
    const report = await prepareTasks(tasks, { store: node.store, repos });
    prepared = new Map(report.tasks.map((p) => [p.instance_id, p]));
  });

  after(async () => {
    client?.close();
    await node?.close({ stopSandboxes: true });
    if (work) await rm(work, { recursive: true, force: true });
  });

  async function run(
    agent: Agent,
    ids: string[],
    extra: { keepSandboxes?: boolean } = {},
  ): Promise<Record<string, EvalResult>> {
    const out = join(work, `run-${++runs}.jsonl`);
    const summary = await runEval({
      client,
      tasks: tasks.filter((t) => ids.includes(t.instance_id)),
      tasksFile,
      prepared,
      agent,
      outPath: out,
      concurrency: 4,
      labels: { job: `grading-it-${runs}` },
      original: (task, path) => repos.fileAtBase(task, path),
      repos,
      sandbox: { memoryLimitMb: 512 },
      ...extra,
    } as Parameters<typeof runEval>[0]);
    return Object.fromEntries(summary.results.map((r) => [r.instance_id, r]));
  }

  it('gold scores every task 1 and none every task 0 (patch-graded and in place)', async () => {
    const gold = await run(new GoldAgent(), set.ids);
    for (const id of set.ids) {
      assert.equal(gold[id]?.reward, 1, `gold ${id}: ${JSON.stringify(gold[id])}`);
    }
    const none = await run(new NoneAgent(), set.ids);
    for (const id of set.ids) {
      assert.equal(none[id]?.reward, 0, `none ${id}: ${JSON.stringify(none[id])}`);
      assert.equal(none[id]?.error, undefined);
    }
  });

  it('every steering attack scores 0 on the unfixed task', async () => {
    const outcomes: string[] = [];
    // DSEC_TEST_ATTACKS=a,b runs only those (to look at one closely).
    const only = process.env['DSEC_TEST_ATTACKS']?.split(',');
    const pending = [...STEERING_ATTACKS, ...IN_PLACE_ATTACKS].filter(
      (a) => !only || only.includes(a.name),
    );
    const worker = async () => {
      for (let a = pending.shift(); a; a = pending.shift()) {
        const r = (await run(new ScriptedAgent(a.name, a.steps), [a.instance]))[a.instance];
        outcomes.push(
          `${a.name} (${a.instance}): reward ${r?.reward}${r?.error ? ` error ${r.error.code}: ${r.error.message}` : ''}`,
        );
      }
    };
    await Promise.all([worker(), worker()]);
    const report = outcomes.sort().join('\n');
    console.log(report);
    const steered = outcomes.filter((o) => !/: reward 0$/.test(o));
    assert.deepEqual(steered, [], `attacks that did not score 0:\n${report}`);
  });
});
