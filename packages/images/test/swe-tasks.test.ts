import assert from 'node:assert/strict';
import { execFile, execFileSync } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { promisify } from 'node:util';
import { parseEnvironmentRecipes } from '@dsec/images';
import { checkTaskOnHost } from '../../../examples/swe-tasks/check-tasks.js';
import {
  checkTask,
  parsePytestOutcomes,
  parseTapOutcomes,
  readTasks,
} from '../../../examples/swe-tasks/lib.js';

// The shipped task set (examples/swe-tasks), checked on the host without
// sandboxes; the integration test runs tasks inside real ones.
const DIR = join(import.meta.dirname, '../../../examples/swe-tasks');
const TASKS = join(DIR, 'tasks.jsonl');

function hostHasTools(): string | false {
  try {
    execFileSync('/usr/bin/python3', ['-c', 'import pytest'], { stdio: 'ignore' });
  } catch {
    return 'needs /usr/bin/python3 with pytest (python3-pytest)';
  }
  const major = Number(
    /^v(\d+)/.exec(execFileSync('node', ['--version'], { encoding: 'utf8' }))?.[1],
  );
  return major >= 18 ? false : 'needs node 18 or later';
}

void test('tasks.jsonl and the bundles are what make-repos.ts generates (commit hashes are deterministic)', async () => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ['--import', 'tsx', join(DIR, 'make-repos.ts'), '--check'],
    { cwd: join(DIR, '../..') },
  );
  assert.match(stdout, /nothing changed/);
});

void test('the task set: 6+ repositories in two languages, SWE-bench fields, environments that exist', async () => {
  const tasks = await readTasks(TASKS);
  const recipes = parseEnvironmentRecipes(
    JSON.parse(await readFile(join(DIR, 'environments.json'), 'utf8')),
  );
  const repos = new Set(tasks.map((t) => t.repo));
  assert.ok(repos.size >= 6, `${repos.size} repositories`);
  const toolkits = new Set(tasks.flatMap((t) => t.environment.toolkits));
  assert.deepEqual([...toolkits].sort(), ['node-test', 'python-test']);
  assert.equal(new Set(tasks.map((t) => t.instance_id)).size, tasks.length);
  for (const t of tasks) {
    assert.match(t.base_commit, /^[0-9a-f]{40}$/);
    assert.match(t.patch, /^diff --git a\//);
    assert.match(t.test_patch, /^diff --git a\//);
    assert.ok(t.FAIL_TO_PASS.length > 0 && t.PASS_TO_PASS.length > 0, t.instance_id);
    assert.equal(recipes[t.environment.image]?.kind, 'base', t.instance_id);
    for (const k of t.environment.toolkits) assert.equal(recipes[k]?.kind, 'toolkit', k);
    // The gold patch must not touch tests, nor the test patch the code.
    assert.doesNotMatch(t.patch, /^diff --git a\/tests?\//m, t.instance_id);
    assert.doesNotMatch(t.test_patch, /^diff --git a\/(?!tests?\/)/m, t.instance_id);
  }
});

void test('outcome parsers: pytest -rA summary lines and node:test TAP with nesting', () => {
  const pytest = [
    '=========================== short test summary info ============================',
    'PASSED tests/test_a.py::test_ok',
    'PASSED tests/test_a.py::test_param[MY KEY=1]',
    'PASSED tests/test_a.py::TestX::test_m',
    'FAILED tests/test_a.py::test_bad - AssertionError: assert 1 == 2',
    'ERROR tests/test_b.py - ImportError: nope',
    'XFAIL tests/test_a.py::test_x - reason',
  ].join('\n');
  assert.deepEqual(
    [...parsePytestOutcomes(pytest)],
    [
      ['tests/test_a.py::test_ok', 'passed'],
      ['tests/test_a.py::test_param[MY KEY=1]', 'passed'],
      ['tests/test_a.py::TestX::test_m', 'passed'],
      ['tests/test_a.py::test_bad', 'failed'],
      ['tests/test_b.py', 'error'],
      ['tests/test_a.py::test_x', 'xfail'],
    ],
  );
  const tap = [
    'TAP version 13',
    '# Subtest: top level',
    'ok 1 - top level',
    '  ---',
    '  duration_ms: 1.2',
    '  ...',
    '# Subtest: suite',
    '    # Subtest: inner \\# one',
    '    not ok 1 - inner \\# one',
    '    # Subtest: skipped one',
    '    ok 2 - skipped one # SKIP not today',
    '    1..2',
    'not ok 2 - suite',
    '1..2',
  ].join('\n');
  assert.deepEqual(
    [...parseTapOutcomes(tap)],
    [
      ['top level', 'passed'],
      ['suite > inner # one', 'failed'],
      ['suite > skipped one', 'skipped'],
      ['suite', 'failed'],
    ],
  );
});

const skip = hostHasTools();

void test(
  'every instance is valid on the host: FAIL_TO_PASS fails before the gold patch, all pass after',
  { skip },
  async () => {
    const tasks = await readTasks(TASKS);
    for (const task of tasks) {
      const r = await checkTaskOnHost(task);
      assert.deepEqual(r.problems, [], task.instance_id);
      assert.ok(
        task.FAIL_TO_PASS.every((id) => r.before[id] === 'failed'),
        task.instance_id,
      );
    }
  },
);

void test(
  'the check catches a broken instance: a test listed on the wrong side, a patch that does not apply',
  { skip },
  async () => {
    const [task] = await readTasks(TASKS);
    assert.ok(task);
    const swapped = {
      ...task,
      FAIL_TO_PASS: task.PASS_TO_PASS.slice(0, 1),
      PASS_TO_PASS: [...task.FAIL_TO_PASS, ...task.PASS_TO_PASS.slice(1)],
    };
    const r = await checkTaskOnHost(swapped);
    assert.equal(r.ok, false);
    assert.ok(r.problems.some((p) => p.startsWith('FAIL_TO_PASS passes before the fix')));
    assert.ok(r.problems.some((p) => p.startsWith('PASS_TO_PASS is failed before the fix')));

    const noApply = await checkTask(
      { ...task, test_patch: task.patch.replace(/^-.*$/m, '-this line is not in the file') },
      { run: () => Promise.resolve({ exitCode: 1, output: 'Hunk #1 FAILED' }) },
    );
    assert.deepEqual(noApply.problems, ['test_patch does not apply: Hunk #1 FAILED']);
  },
);
