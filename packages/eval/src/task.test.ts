import { test } from 'node:test';
import assert from 'node:assert/strict';
import { normalizeTask } from './task.js';

const TEXT_PATCH = 'diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n';
const TEST_PATCH =
  'diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/test_a.py\n@@ -1 +1 @@\n-x\n+y\n';
const BINARY =
  'diff --git a/tests/data.bin b/tests/data.bin\nnew file mode 100644\nindex 0000000..1111111\nGIT binary patch\nliteral 3\nKc${NkU|;|M00aO5\n\nliteral 0\nHcmV?d00001\n\n';

function task(fields: Record<string, unknown>) {
  return normalizeTask(
    {
      instance_id: 'x__y-1',
      repo: 'x/y',
      base_commit: 'abc',
      repo_dir: '/r',
      environment: { image: 'base' },
      patch: TEXT_PATCH,
      test_patch: TEST_PATCH,
      ...fields,
    },
    'tasks.jsonl:1',
    '/',
  );
}

test('the default test command writes no bytecode (-B)', () => {
  assert.equal(task({}).test_command, 'python3 -B -m pytest -rA tests/test_a.py');
  assert.equal(task({ test_command: 'make test' }).test_command, 'make test');
});

test('a binary hunk in test_patch makes that task unrunnable, not the file', () => {
  const t = task({ test_patch: TEST_PATCH + BINARY });
  assert.equal(t.unrunnable?.code, 'invalid_argument');
  assert.equal(t.unrunnable?.reason, 'binary_patch');
  assert.match(t.unrunnable?.message ?? '', /^tasks\.jsonl:1: test_patch .*binary/);
});

test('a binary hunk in patch is fine: the gold agent applies it with git apply', () => {
  assert.equal(task({ patch: TEXT_PATCH + BINARY }).unrunnable, undefined);
});

test('a patch that is not a diff makes the task unrunnable (bad_patch)', () => {
  const t = task({
    patch: 'diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ bogus @@\n',
  });
  assert.equal(t.unrunnable?.reason, 'bad_patch');
});
