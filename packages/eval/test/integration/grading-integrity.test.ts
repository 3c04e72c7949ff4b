/**
 * SECURITY.md K39 / D24 (issue 24, point 8): an agent cannot change how it is
 * graded. Real sandboxes with real pytest, node and npm (the host's Debian
 * packages, see makeToolchainRootfs) and busybox; every attack is an agent
 * acting through the same tool calls a model makes. When the grader ran the
 * tests in the agent's sandbox (12887b5), 22 of the 23 turned the unfixed
 * task into reward 1 (`profile-env` did not); here each must score 0, while
 * the gold fix scores 1. DSEC_TEST_ATTACKS=a,b runs only those attacks.
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
        let line = `${a.name} (${a.instance}): reward ${r?.reward}`;
        if (r?.error) line += ` error ${r.error.code}: ${r.error.message}`;
        const left = r?.agentPatch?.leftOut.find((l) => l.path === a.leftOut?.path);
        if (a.leftOut && left?.rule !== a.leftOut.rule) {
          line += ` but ${a.leftOut.path} was not left out by ${a.leftOut.rule}: ${JSON.stringify(r?.agentPatch?.leftOut)}`;
        }
        outcomes.push(line);
      }
    };
    await Promise.all([worker(), worker()]);
    const report = outcomes.sort().join('\n');
    console.log(report);
    const steered = outcomes.filter((o) => !/: reward 0$/.test(o));
    assert.deepEqual(steered, [], `attacks that did not score 0:\n${report}`);
  });

  it('the patch carries edits, new, deleted, binary, big and oddly named files, modes and symlinks, and says what it left out', async () => {
    const big = 'pyapp/big.bin';
    const agent = new ScriptedAgent('fidelity', () => [
      { edit: 'pyapp/calc.py', old: 'return a - b\n\n\ndef sub', new: 'return a + b\n\n\ndef sub' },
      { write: 'pyapp/new_module.py', content: 'VALUE = 1\n' },
      {
        shell:
          `printf '\\000\\001\\377\\376 binary\\n' > pyapp/data.bin && { head -c 1000000 /dev/zero; head -c 4096 /dev/urandom; head -c 1000000 /dev/zero; } > ${big} && ` +
          'rm pyapp/serve.py && chmod 755 pyapp/calc.py && ln -s calc.py pyapp/alias.py && ' +
          'ln -s /etc/passwd pyapp/escape && ln -s ../../etc pyapp/up && ' +
          "echo spaced > 'pyapp/with space.txt' && echo unicode > 'pyapp/ünï.txt' && " +
          'printf x > "pyapp/bad$(printf \'\\nname\')" && mkfifo pyapp/fifo && ' +
          'mkdir -p pyapp/__pycache__ node_modules/x .git/hooks && echo x > pyapp/__pycache__/calc.cpython-311.pyc && ' +
          'echo x > node_modules/x/index.js && echo "import os" > json.py && echo "# more" >> tests/test_sub.py && ' +
          'echo "#!/bin/sh" > .git/hooks/pre-commit && echo x > /usr/local/bin/tool && ' +
          'sha256sum ' +
          big +
          ' pyapp/data.bin > /tmp/sums',
      },
    ]);
    const r = (await run(agent, ['pyapp__add-1'], { keepSandboxes: true }))['pyapp__add-1']!;
    assert.equal(r.reward, 1, JSON.stringify(r));
    const patch = r.agentPatch!;
    const left = Object.fromEntries(patch.leftOut.map((l) => [l.path, l.rule]));
    assert.deepEqual(left, {
      'json.py': 'python-shadowing',
      'node_modules/x/index.js': 'node-modules',
      'pyapp/__pycache__/calc.cpython-311.pyc': 'python-bytecode',
      'pyapp/bad\nname': 'unsupported-name',
      'pyapp/escape': 'symlink-escape',
      'pyapp/fifo': 'not-regular',
      'pyapp/up': 'symlink-escape',
      'tests/test_sub.py': 'test-command-path',
    });
    assert.equal(patch.files, 8);
    assert.equal(patch.truncated, false);
    for (const needle of [
      'diff --git a/pyapp/calc.py b/pyapp/calc.py\nold mode 100644\nnew mode 100755',
      'diff --git a/pyapp/serve.py b/pyapp/serve.py\ndeleted file mode 100644',
      'diff --git a/pyapp/alias.py b/pyapp/alias.py\nnew file mode 120000',
      'diff --git a/pyapp/data.bin b/pyapp/data.bin\nnew file mode 100644',
      'GIT binary patch',
      'b/pyapp/\\303\\274n\\303\\257.txt"',
      'pyapp/with space.txt',
    ]) {
      assert.ok(
        patch.diff.includes(needle),
        `the diff has no ${JSON.stringify(needle)}:\n${patch.diff
          .split('\n')
          .filter((l) => /^(diff|old|new|deleted|rename)/.test(l))
          .join('\n')}`,
      );
    }
    // The grading sandbox holds the agent's bytes, and none of what was left out.
    const agentSums = (await client.sandbox(r.sandboxId!).commands.run('cat /tmp/sums')).stdout;
    const grader = client.sandbox(r.gradingSandboxId!);
    const inGrader = await grader.commands.run(
      `cd /testbed && sha256sum ${big} pyapp/data.bin && readlink pyapp/alias.py && stat -c %a pyapp/calc.py && ` +
        "cat 'pyapp/with space.txt' 'pyapp/ünï.txt' && ls -a . pyapp node_modules /usr/local/bin 2>&1; " +
        '[ -e .git/hooks/pre-commit ] && echo HOOK; tail -1 tests/test_sub.py',
    );
    const out = inGrader.stdout;
    assert.ok(out.startsWith(agentSums.replace(/\/tmp\/[^\n]*/g, '')), `${out}\n---\n${agentSums}`);
    assert.match(out, /^calc\.py\n755\nspaced\nunicode\n/m);
    for (const absent of [
      'conftest.py',
      'json.py',
      'serve.py',
      'escape',
      'fifo',
      '__pycache__',
      'tool',
      'HOOK',
      '# more',
    ]) {
      assert.ok(!out.includes(absent), `${absent} reached the grading sandbox:\n${out}`);
    }
    // The recorded diff is what `git apply` takes back: applied to the base commit it gives the agent's big file.
    const task = tasks.find((t) => t.instance_id === 'pyapp__add-1')!;
    const clone = join(work, 'apply-check');
    const { execFileSync } = await import('node:child_process');
    execFileSync('git', ['clone', '-q', task.repo_dir!, clone]);
    execFileSync('git', ['-C', clone, 'checkout', '-q', task.base_commit]);
    execFileSync('git', ['-C', clone, 'apply', '--binary', '-'], { input: patch.diff });
    const { createHash } = await import('node:crypto');
    const { readFile } = await import('node:fs/promises');
    const sum = createHash('sha256')
      .update(await readFile(join(clone, big)))
      .digest('hex');
    assert.ok(agentSums.includes(sum), `${sum} not in ${agentSums}`);
    await client.sandbox(r.sandboxId!).stop();
    await grader.stop();
  });

  it('a leftover that swaps repository files for FIFOs while the grader reads them neither stalls the grading nor loses the fix', async () => {
    // Four paths, two per process, each flipped between a regular file and a FIFO with no writer as
    // fast as the process can: often enough one is a file when the reader tests it and a FIFO when it
    // opens it, and the open then waits out the read's timeout.
    const swapper = `import os
import sys

k = int(sys.argv[1])
os.makedirs(".swap", exist_ok=True)
paths = ["pyapp/swap%d.txt" % (2 * k + i) for i in range(2)]
while True:
    for i, p in enumerate(paths):
        t = ".swap/%d-%d" % (k, i)
        os.mkfifo(t)
        os.rename(t, p)
        with open(t, "w") as f:
            f.write("x")
        os.rename(t, p)
`;
    const agent = new ScriptedAgent('fifo-swapper', () => [
      { edit: 'pyapp/calc.py', old: 'return a - b\n\n\ndef sub', new: 'return a + b\n\n\ndef sub' },
      { write: '/tmp/.swap.py', content: swapper },
      { shell: '(python3 /tmp/.swap.py 0 & python3 /tmp/.swap.py 1 &) >/dev/null 2>&1' },
      {
        // Set up as meant: the path is seen both as a FIFO and as a file.
        shell:
          'for i in $(seq 200); do [ -e pyapp/swap3.txt ] && break; usleep 50000; done; ' +
          'f=; r=; i=0; while [ $i -lt 200000 ]; do [ -p pyapp/swap0.txt ] && f=1; [ -f pyapp/swap0.txt ] && r=1; ' +
          '[ "$f$r" = 11 ] && exit 0; i=$((i + 1)); done; exit 1',
      },
    ]);
    const started = Date.now();
    const r = (await run(agent, ['pyapp__add-1']))['pyapp__add-1']!;
    const seconds = (Date.now() - started) / 1000;
    console.log(`fifo-swapper: reward ${r.reward} in ${seconds.toFixed(1)} s`);
    assert.equal(r.error, undefined, JSON.stringify(r.error));
    assert.equal(r.reward, 1, JSON.stringify(r));
    const lost = r.agentPatch?.leftOut.filter((l) => l.rule === 'changed-while-read') ?? [];
    assert.deepEqual(lost, [], JSON.stringify(r.agentPatch?.leftOut));
  });

  it('in place, every leftover of the agent is dead before the tests are written', async () => {
    const stubborn = IN_PLACE_ATTACKS.find((a) => a.name === 'inplace-stubborn-leftovers')!;
    const id = stubborn.instance;
    const r = (
      await run(new ScriptedAgent(stubborn.name, stubborn.steps), [id], { keepSandboxes: true })
    )[id]!;
    assert.equal(r.reward, 0, JSON.stringify(r));
    assert.equal(r.grading, 'in_place');
    assert.equal(r.gradingSandboxId, undefined);
    // Three respawning loops and the session shell, and the watchers running at that instant (a
    // loop may be between two runs of its watcher): what matters is that none is left, below.
    assert.ok((r.killedProcesses ?? 0) >= 4, JSON.stringify(r));
    const sb = client.sandbox(r.sandboxId!);
    const ps = await sb.commands.run('ps -o pid,user,args');
    const lines = ps.stdout.trim().split('\n').slice(1);
    // init, and this command's reaper, shell and ps.
    assert.ok(
      lines.every((l) => /dsec-init|dsec-reaper|memfd|ps -o/.test(l)),
      ps.stdout,
    );
    assert.ok(!ps.stdout.includes('.w.sh'), ps.stdout);
    await sb.stop();
  });
});
