/**
 * A SWE-bench dataset as published, end to end: a dataset file exactly in
 * SWE-bench's shape over a small real Python repository (pytest `addopts`
 * with `-v`, a parametrised test whose ID holds a space, a binary hunk in a
 * patch and in a test patch), instance images of SWE-bench's shape (the
 * repository at /testbed at its base commit, a conda-like
 * /opt/miniconda3/bin/activate that activates an environment `testbed`)
 * pushed to a local docker-registry and imported by `dsec eval run
 * --dataset swebench --image TEMPLATE`. Gold scores every instance 1, none
 * 0; an instance whose image does not exist and one the spec table lacks
 * error alone; `--retry-errors` reruns only those.
 */
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { chmod, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { DSecClient } from '@dsec/sdk';
import { main } from '@dsec/cli/main';
import { startLocalRegistry, type LocalRegistry } from '@dsec/images/testing/registry';
import type { EvalResult } from '../../src/index.js';
import { pushSwebenchImages } from '../../src/testing/index.js';

const skip =
  spawnSync('dpkg', ['-s', 'python3-pytest'], { stdio: 'ignore' }).status === 0
    ? false
    : 'needs the host package python3-pytest';

let node: SingleNode;
let registry: LocalRegistry;
let work: string;
let dataset: string;
let specs: string;
let template: string;
let env: Record<string, string>;

const GIT_ENV = {
  ...process.env,
  GIT_AUTHOR_NAME: 't',
  GIT_AUTHOR_EMAIL: 't@t',
  GIT_COMMITTER_NAME: 't',
  GIT_COMMITTER_EMAIL: 't@t',
  GIT_AUTHOR_DATE: '2020-01-01T00:00:00Z',
  GIT_COMMITTER_DATE: '2020-01-01T00:00:00Z',
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
};

function git(cwd: string, ...args: string[]): string {
  return execFileSync('git', args, { cwd, env: GIT_ENV, encoding: 'utf8' });
}

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(['--state-dir', join(work, 'state'), ...args], {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env,
  });
  return run;
}

function results(path: string): Record<string, EvalResult> {
  return Object.fromEntries(
    readFileSync(path, 'utf8')
      .split('\n')
      .filter((l) => l.trim() !== '')
      .map((l) => JSON.parse(l) as EvalResult)
      .map((r) => [r.instance_id, r]),
  );
}

const CALC_V1 = 'def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n';
const CALC_V2 = 'def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a + b\n';
const CALC_FIXED = 'def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n';
const SETUP_CFG = '[tool:pytest]\naddopts = -v\n';
const TESTS_BASE =
  'import pytest\n\nfrom calc import add, mul\n\n\n' +
  '@pytest.mark.parametrize("expr", ["1 + 1", "2*3"])\n' +
  'def test_expr(expr):\n    assert eval(expr) > 0\n\n\n' +
  'def test_mul():\n    assert mul(2, 0) == 0\n';
// SWE-bench cuts an ID at its first space, whatever -v makes of it.
const BASE1_FILES = {
  'setup.cfg': SETUP_CFG,
  // Puts the repository's root on sys.path for the `pytest` entry point (SWE-bench's images
  // install the repository instead: `pip install -e .`, which these have no pip for).
  'conftest.py': '',
  'calc.py': CALC_V1,
  'tests/test_calc.py': TESTS_BASE,
};
const BASE2_FILES = { ...BASE1_FILES, 'calc.py': CALC_V2 };

/**
 * The repository's history: base commits of the two instances, with the
 * dataset's `patch` (the fix) and `test_patch` (tests that fail before it)
 * taken from real commits by `git diff --binary`, binary hunks included.
 */
async function makeRepo(dir: string) {
  await mkdir(join(dir, 'tests'), { recursive: true });
  git(dir, 'init', '-q', '-b', 'main');
  await writeFile(join(dir, 'setup.cfg'), SETUP_CFG);
  await writeFile(join(dir, 'conftest.py'), '');
  await writeFile(join(dir, 'calc.py'), CALC_V1);
  await writeFile(join(dir, 'tests', 'test_calc.py'), TESTS_BASE);
  git(dir, 'add', '-A');
  git(dir, 'commit', '-qm', 'base 1');
  const base1 = git(dir, 'rev-parse', 'HEAD').trim();

  // Instance 1: add() subtracts. Its fix; its test.
  await writeFile(join(dir, 'calc.py'), CALC_V1.replace('a - b', 'a + b'));
  const patch1 = git(dir, 'diff', '--binary');
  git(dir, 'checkout', '-q', '--', '.');
  await writeFile(
    join(dir, 'tests', 'test_calc.py'),
    TESTS_BASE + '\n\ndef test_add():\n    assert add(2, 3) == 5\n',
  );
  const testPatch1 = git(dir, 'diff', '--binary');
  git(dir, 'checkout', '-q', '--', '.');

  // Instance 2, a later base: add() fixed, mul() adds. The fix ships a binary table; the test reads
  // it from a binary fixture the test patch adds.
  await writeFile(join(dir, 'calc.py'), CALC_V2);
  git(dir, 'commit', '-qam', 'base 2');
  const base2 = git(dir, 'rev-parse', 'HEAD').trim();
  await writeFile(join(dir, 'calc.py'), CALC_FIXED);
  await writeFile(join(dir, 'table.bin'), Buffer.from([0, 1, 2, 3, 255, 0, 7]));
  git(dir, 'add', '-A');
  const patch2 = git(dir, 'diff', '--cached', '--binary');
  git(dir, 'reset', '-q', '--hard');
  await writeFile(join(dir, 'tests', 'six.png'), Buffer.from([6, 0, 0, 0, 0]));
  await writeFile(
    join(dir, 'tests', 'test_calc.py'),
    TESTS_BASE +
      '\n\ndef test_mul_table():\n' +
      '    import pathlib\n' +
      '    six = pathlib.Path(__file__).with_name("six.png").read_bytes()[0]\n' +
      '    assert mul(2, 3) == six\n',
  );
  git(dir, 'add', '-A');
  const testPatch2 = git(dir, 'diff', '--cached', '--binary');
  git(dir, 'reset', '-q', '--hard');
  return { base1, base2, patch1, testPatch1, patch2, testPatch2 };
}

function instance(
  id: string,
  version: string,
  base: string,
  patch: string,
  testPatch: string,
  f2p: string[],
) {
  return {
    repo: 'dsec-test/calc',
    instance_id: id,
    base_commit: base,
    patch,
    test_patch: testPatch,
    problem_statement: `Fix ${id}.`,
    hints_text: '',
    created_at: '2020-01-01T00:00:00Z',
    version,
    FAIL_TO_PASS: JSON.stringify(f2p),
    // `test_expr[1 + 1]` as SWE-bench's parser keys it.
    PASS_TO_PASS: JSON.stringify(
      [
        'tests/test_calc.py::test_expr[1',
        'tests/test_calc.py::test_expr[2*3]',
        'tests/test_calc.py::test_mul',
      ].filter((t) => !(id.endsWith('-2') && t.endsWith('test_mul'))),
    ),
    environment_setup_commit: base,
  };
}

before(async () => {
  if (skip) return;
  work = await mkdtemp(join(tmpdir(), 'dsec-swebench-it-'));
  await chmod(work, 0o711);
  registry = await startLocalRegistry({ dir: join(work, 'registry') });
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'swebench-node' });
  env = {
    DSEC_URL: node.url,
    DSEC_API_KEY: node.adminKey,
    DSEC_INSECURE_REGISTRIES: registry.host,
  };

  // The dataset's patches, from real commits of a scratch repository (`git diff --binary`).
  const h = await makeRepo(join(work, 'repo'));
  // The images: the shared cached layers (Python, pytest, git, bash; the conda shim and its
  // testbed environment), and per instance the repository at /testbed, one commit of these files.
  const pushed = await pushSwebenchImages({
    registry: registry.host,
    dir: join(work, 'images'),
    instances: [
      { instanceId: 'dsec-test__calc-1', files: BASE1_FILES },
      { instanceId: 'dsec-test__calc-2', files: BASE2_FILES },
    ],
  });
  template = pushed.template;
  const base1 = pushed.images.get('dsec-test__calc-1')!.baseCommit;
  const base2 = pushed.images.get('dsec-test__calc-2')!.baseCommit;
  const rows = [
    instance('dsec-test__calc-1', '0.1', base1, h.patch1, h.testPatch1, [
      'tests/test_calc.py::test_add',
    ]),
    instance('dsec-test__calc-2', '0.1', base2, h.patch2, h.testPatch2, [
      'tests/test_calc.py::test_mul_table',
    ]),
    // No image was pushed for this one.
    instance('dsec-test__calc-3', '0.1', base1, h.patch1, h.testPatch1, [
      'tests/test_calc.py::test_add',
    ]),
    // The spec table has no version 0.9 of the repository.
    instance('dsec-test__calc-4', '0.9', base1, h.patch1, h.testPatch1, [
      'tests/test_calc.py::test_add',
    ]),
  ];
  dataset = join(work, 'dataset.json');
  await writeFile(dataset, JSON.stringify(rows, null, 2));
  specs = join(work, 'specs.json');
  await writeFile(
    specs,
    JSON.stringify({
      $schema_version: 1,
      repos: {
        'dsec-test/calc': {
          parser: 'pytest',
          directives: 'paths',
          versions: { '0.1': { test_cmd: 'pytest -rA -p no:cacheprovider' } },
        },
      },
    }),
  );
});

after(async () => {
  if (skip) return;
  await node?.close({ stopSandboxes: true });
  await registry?.close();
  await rm(work, { recursive: true, force: true });
});

test(
  'gold scores every instance 1, none 0; a missing image and a missing spec error alone; --retry-errors reruns them',
  { skip },
  async () => {
    const common = ['--dataset', 'swebench', '--image', template, '--specs', specs];
    const goldOut = join(work, 'gold.jsonl');
    const gold = await dsec([
      '--json',
      'eval',
      'run',
      dataset,
      ...common,
      '--agent',
      'gold',
      '--out',
      goldOut,
    ]);
    assert.equal(gold.code, 0, gold.stderr);
    const summary = JSON.parse(gold.stdout) as { tasks: number; solved: number; errors: number };
    assert.deepEqual(
      [summary.tasks, summary.solved, summary.errors],
      [4, 2, 2],
      readFileSync(goldOut, 'utf8'),
    );
    const rs = results(goldOut);
    for (const id of ['dsec-test__calc-1', 'dsec-test__calc-2']) {
      const r = rs[id]!;
      assert.equal(r.reward, 1, JSON.stringify(r));
      assert.equal(r.error, undefined);
      assert.deepEqual(r.failing, []);
      assert.equal(r.duplicateExecutions, 0);
    }
    // The IDs are SWE-bench's: the parametrised one cut at its space, verbose lines not read.
    assert.equal(rs['dsec-test__calc-1']!.tests['tests/test_calc.py::test_expr[1'], 'passed');
    assert.equal(rs['dsec-test__calc-1']!.tests['tests/test_calc.py::test_add'], 'passed');
    assert.ok(!Object.keys(rs['dsec-test__calc-1']!.tests).some((k) => k.includes(' ')));
    // The fix's binary file reached the grading sandbox.
    assert.equal(rs['dsec-test__calc-2']!.tests['tests/test_calc.py::test_mul_table'], 'passed');
    assert.equal(rs['dsec-test__calc-3']!.reward, null);
    assert.equal(
      rs['dsec-test__calc-3']!.error?.code,
      'image_not_found',
      JSON.stringify(rs['dsec-test__calc-3']),
    );
    assert.equal(rs['dsec-test__calc-4']!.error?.code, 'invalid_argument');
    assert.equal(rs['dsec-test__calc-4']!.error?.reason, 'no_spec');

    const noneOut = join(work, 'none.jsonl');
    const none = await dsec([
      '--json',
      'eval',
      'run',
      dataset,
      ...common,
      '--agent',
      'none',
      '--out',
      noneOut,
      '--keep-sandboxes',
    ]);
    assert.equal(none.code, 0, none.stderr);
    const nrs = results(noneOut);
    for (const id of ['dsec-test__calc-1', 'dsec-test__calc-2']) {
      assert.equal(nrs[id]!.reward, 0, JSON.stringify(nrs[id]));
      assert.equal(nrs[id]!.error, undefined);
    }
    assert.equal(nrs['dsec-test__calc-1']!.tests['tests/test_calc.py::test_add'], 'failed');
    assert.deepEqual(nrs['dsec-test__calc-1']!.failing, ['tests/test_calc.py::test_add']);

    // `eval grade` on an agent's sandbox (what dsec.eval's Python runner calls): an agent that fixed
    // calc.py by hand scores 1, graded in a fresh sandbox of the instance's image.
    const agentSandbox = nrs['dsec-test__calc-1']!.sandboxId!;
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    try {
      const fixed = await client
        .sandbox(agentSandbox)
        .runShell('cat > /testbed/calc.py', { stdin: CALC_FIXED });
      assert.equal(fixed.exitCode, 0, fixed.stderr);
    } finally {
      client.close();
    }
    const graded = await dsec([
      '--json',
      'eval',
      'grade',
      dataset,
      ...common,
      '--instance',
      'dsec-test__calc-1',
      '--sandbox',
      agentSandbox,
      '--run-id',
      'grade-check',
    ]);
    assert.equal(graded.code, 0, graded.stderr);
    const g = JSON.parse(graded.stdout) as {
      reward: number;
      failing: string[];
      agentPatch: { files: number };
    };
    assert.deepEqual([g.reward, g.failing, g.agentPatch.files], [1, [], 1], graded.stdout);

    // The missing image arrives (the same as instance 1's); --retry-errors runs only the errored two.
    await pushSwebenchImages({
      registry: registry.host,
      dir: join(work, 'images'),
      instances: [{ instanceId: 'dsec-test__calc-3', files: BASE1_FILES }],
    });
    const retry = await dsec([
      '--json',
      'eval',
      'run',
      dataset,
      ...common,
      '--agent',
      'gold',
      '--out',
      goldOut,
      '--retry-errors',
    ]);
    assert.equal(retry.code, 0, retry.stderr);
    const after = results(goldOut);
    assert.equal(after['dsec-test__calc-3']!.reward, 1, JSON.stringify(after['dsec-test__calc-3']));
    assert.equal(after['dsec-test__calc-3']!.attempt, 2);
    assert.equal(after['dsec-test__calc-4']!.error?.reason, 'no_spec');
    // The instances that had a result kept it: same sandbox, not run again.
    assert.equal(after['dsec-test__calc-1']!.sandboxId, rs['dsec-test__calc-1']!.sandboxId);
    assert.equal(after['dsec-test__calc-1']!.attempt, 1);

    // Without a registry: a local layer template names the layers imported above; nothing is pulled.
    await registry.close();
    const localOut = join(work, 'local.jsonl');
    const local = await dsec([
      '--json',
      'eval',
      'run',
      dataset,
      '--dataset',
      'swebench',
      '--image',
      'sweb.eval.x86_64.{id}:latest',
      '--specs',
      specs,
      '--agent',
      'gold',
      '--out',
      localOut,
    ]);
    assert.equal(local.code, 0, local.stderr);
    const ls = JSON.parse(local.stdout) as { tasks: number; solved: number; errors: number };
    assert.deepEqual([ls.tasks, ls.solved, ls.errors], [4, 3, 1], readFileSync(localOut, 'utf8'));
  },
);
