import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { applyFilePatch, parsePatch } from './diff.js';

const GIT_PATCH = `diff --git a/pkg/calc.py b/pkg/calc.py
index 3b18e51..a2c4f1e 100644
--- a/pkg/calc.py
+++ b/pkg/calc.py
@@ -1,4 +1,4 @@
 def add(a, b):
-    return a - b
+    return a + b
 
 def sub(a, b):
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100755
index 0000000..e69de29
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1,2 @@
+def test_x():
+    assert True
diff --git a/old.txt b/old.txt
deleted file mode 100644
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
`;

test('parsePatch reads git diffs: modified, created (with mode) and deleted files', () => {
  const files = parsePatch(GIT_PATCH);
  assert.equal(files.length, 3);
  assert.deepEqual(
    files.map((f) => [f.oldPath, f.newPath, f.newMode]),
    [
      ['pkg/calc.py', 'pkg/calc.py', undefined],
      [undefined, 'tests/test_new.py', 0o755],
      ['old.txt', undefined, undefined],
    ],
  );
  const [calc, created, deleted] = files;
  assert.equal(
    applyFilePatch('def add(a, b):\n    return a - b\n\ndef sub(a, b):\n    return a - b\n', calc!),
    'def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n',
  );
  assert.equal(applyFilePatch(undefined, created!), 'def test_x():\n    assert True\n');
  assert.equal(applyFilePatch('bye\n', deleted!), undefined);
});

test('a hunk is found where earlier edits moved it, and a mismatch is conflict', () => {
  const patch = parsePatch(`--- a/f
+++ b/f
@@ -3,3 +3,3 @@
 c
-d
+D
 e
`)[0]!;
  // Two lines inserted above: the hunk now starts at line 5.
  assert.equal(applyFilePatch('x\ny\na\nb\nc\nd\ne\n', patch), 'x\ny\na\nb\nc\nD\ne\n');
  assert.throws(
    () => applyFilePatch('a\nb\nc\nX\ne\n', patch),
    (err: unknown) => isDsecError(err) && err.code === 'conflict',
  );
  // The patch changes a file that is not there.
  assert.throws(
    () => applyFilePatch(undefined, patch),
    (err: unknown) => isDsecError(err) && err.code === 'conflict',
  );
});

test('"No newline at end of file" on either side is honoured', () => {
  const add = parsePatch(`--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
\\ No newline at end of file
+b
`)[0]!;
  assert.equal(applyFilePatch('a\nb', add), 'a\nb\n');
  const drop = parsePatch(`--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
+c
\\ No newline at end of file
`)[0]!;
  assert.equal(applyFilePatch('a\nb\n', drop), 'a\nc');
});

test('malformed and binary patches are invalid_argument', () => {
  const invalid = (err: unknown) => isDsecError(err) && err.code === 'invalid_argument';
  assert.throws(() => parsePatch('@@ -1 +1 @@\n-a\n+b\n'), invalid);
  assert.throws(() => parsePatch('--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n'), invalid);
  assert.throws(
    () =>
      parsePatch('diff --git a/x.png b/x.png\nindex 1..2 100644\nGIT binary patch\nliteral 5\n'),
    invalid,
  );
  assert.deepEqual(parsePatch(''), []);
});

/** A small seeded PRNG so failures reproduce. */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), a | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

test('applying `git diff --no-index` output reproduces the new file (200 random edits)', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-eval-diff-'));
  try {
    const rand = rng(7);
    const word = () =>
      ['alpha', 'beta', 'gamma', '', '    x = 1', 'return y', '}'][Math.floor(rand() * 7)]!;
    for (let round = 0; round < 200; round++) {
      const before = Array.from({ length: Math.floor(rand() * 60) }, word);
      const after = [...before];
      for (let e = Math.floor(rand() * 6); e >= 0; e--) {
        const at = Math.floor(rand() * (after.length + 1));
        const r = rand();
        if (r < 0.4) after.splice(at, 1);
        else if (r < 0.8) after.splice(at, 0, `new ${round} ${e}`);
        else if (at < after.length) after[at] = `changed ${e}`;
      }
      const endA = rand() < 0.8 ? '\n' : '';
      const endB = rand() < 0.8 ? '\n' : '';
      const a = before.length ? before.join('\n') + endA : '';
      const b = after.length ? after.join('\n') + endB : '';
      writeFileSync(join(dir, 'a'), a);
      writeFileSync(join(dir, 'b'), b);
      let diff = '';
      try {
        execFileSync('git', ['diff', '--no-index', '--no-color', '-U2', 'a', 'b'], { cwd: dir });
      } catch (err) {
        diff = String((err as { stdout: Buffer }).stdout); // exit 1: they differ
      }
      if (diff === '') {
        assert.equal(a, b);
        continue;
      }
      const [patch] = parsePatch(diff);
      assert.ok(patch, `round ${round}: no file in the diff`);
      const source = patch.oldPath === undefined ? undefined : a;
      const result = applyFilePatch(source, patch) ?? '';
      assert.equal(result, b, `round ${round}:\n${diff}`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
