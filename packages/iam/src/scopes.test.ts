import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import {
  checkScopes,
  MAX_PATTERN_WILDCARDS,
  mayRevokeScopes,
  mayRunImage,
  maySnapshot,
  SCOPES,
  scopeSpec,
  scopesCover,
  ungrantableScopes,
  unrunnableImages,
} from './scopes.js';
import type { Principal } from './types.js';

const key = (scopes?: string[]): Principal => ({
  keyId: 'key-1',
  projectId: 'prj-1',
  role: 'member',
  scopes,
});

test('an unscoped key may snapshot and run anything', () => {
  assert.ok(maySnapshot(key()));
  assert.ok(mayRunImage(key(), 'anything:v9'));
});

test('a builder snapshots without running what it builds; a runtime the reverse', () => {
  const builder = key(['sandboxes:snapshot', 'images:run:base*']);
  const runtime = key(['images:run:task-*']);
  assert.ok(maySnapshot(builder));
  assert.ok(!maySnapshot(runtime));
  assert.ok(mayRunImage(builder, 'base'));
  assert.ok(mayRunImage(builder, 'base-py:3.12'));
  assert.ok(!mayRunImage(builder, 'task-7'));
  assert.ok(mayRunImage(runtime, 'task-7'));
  assert.ok(mayRunImage(runtime, 'task-7:v2'));
  assert.ok(!mayRunImage(runtime, 'base'));
  assert.deepEqual(unrunnableImages(runtime, ['task-1', 'base', 'tk:1', 'task-2']), [
    'base',
    'tk:1',
  ]);
  // An empty scope list is a key with none of the scoped rights.
  assert.ok(!maySnapshot(key([])));
  assert.ok(!mayRunImage(key([]), 'base'));
});

test('run patterns: a version pins it; dots and dashes are literal; malformed refs never run', () => {
  const k = key(['images:run:py3.12:v1', 'images:run:a-b']);
  assert.ok(mayRunImage(k, 'py3.12:v1'));
  assert.ok(!mayRunImage(k, 'py3.12:v2'));
  assert.ok(!mayRunImage(k, 'py3x12:v1'), 'a dot matches only a dot');
  assert.ok(mayRunImage(k, 'a-b:latest'));
  assert.ok(!mayRunImage(k, 'a-bc'));
  assert.ok(!mayRunImage(key(['images:run:*']), 'Not A Ref'));
});

test('checkScopes accepts the known forms, drops duplicates, names the bad entry', () => {
  assert.deepEqual(checkScopes(['images:run:*', 'sandboxes:snapshot', 'images:run:*']), [
    'images:run:*',
    'sandboxes:snapshot',
  ]);
  for (const [scopes, field] of [
    [['sandboxes:snapshot', 'sandboxes:delete'], 'scopes.1'],
    [['images:run:'], 'scopes.0'],
    [['images:run:UPPER'], 'scopes.0'],
    [['images:run:a b'], 'scopes.0'],
    [[7], 'scopes.0'],
    [Array.from({ length: 33 }, (_, i) => `images:run:t${i}`), 'scopes'],
  ] as const) {
    assert.throws(
      () => checkScopes(scopes),
      (e) => isDsecError(e, 'invalid_argument') && e.field === field,
      JSON.stringify(scopes),
    );
  }
});

test('scopesCover: held scopes and narrower run patterns only; never unscoped from scoped', () => {
  assert.ok(scopesCover(undefined, undefined));
  assert.ok(scopesCover(undefined, ['sandboxes:snapshot']));
  assert.ok(!scopesCover([], undefined));
  assert.ok(scopesCover(['images:run:task-*'], ['images:run:task-a*']));
  assert.ok(scopesCover(['images:run:task-*'], ['images:run:task-1:v2']));
  assert.ok(scopesCover(['images:run:*'], ['images:run:anything*']));
  assert.ok(!scopesCover(['images:run:task-*'], ['images:run:*']));
  assert.ok(!scopesCover(['images:run:task-*:v1'], ['images:run:task-1']), 'any version is wider');
  assert.ok(!scopesCover(['images:run:task-*'], ['sandboxes:snapshot']));
  assert.ok(scopesCover(['sandboxes:snapshot'], ['sandboxes:snapshot']));
  assert.ok(scopesCover(['sandboxes:snapshot'], []));
});

// Issue 24: run patterns were compiled to backtracking RegExps; this pair took hours.
const REDOS = 'images:run:a*a*a*a*a*a*a*a*b';
const LONG_NAME = 'a'.repeat(120);

test('a pattern with many stars against a long name answers at once (no backtracking)', () => {
  const k = key([REDOS]);
  assert.equal(mayRunImage(k, LONG_NAME), false);
  assert.equal(mayRunImage(k, `${LONG_NAME}:${'a'.repeat(120)}`), false);
  assert.equal(mayRunImage(k, `${'a'.repeat(119)}b`), true);
  assert.deepEqual(unrunnableImages(k, [LONG_NAME, `${LONG_NAME}b`]), [LONG_NAME]);
});

test('scopesCover against a held pattern with many stars answers at once', () => {
  assert.equal(scopesCover([REDOS], [`images:run:${LONG_NAME}`]), false);
  assert.equal(scopesCover([REDOS], [`images:run:${LONG_NAME}*`]), false);
  assert.equal(scopesCover([REDOS], [`images:run:${LONG_NAME}b`]), true);
});

test('checkScopes caps wildcards per run pattern and names the entry', () => {
  const at = `images:run:${'a*'.repeat(MAX_PATTERN_WILDCARDS)}`;
  assert.deepEqual(checkScopes([at]), [at]);
  for (const over of [
    `${at}b*`,
    `images:run:${'*'.repeat(MAX_PATTERN_WILDCARDS + 1)}`,
    `images:run:a*:${'*'.repeat(MAX_PATTERN_WILDCARDS)}`,
  ]) {
    assert.throws(
      () => checkScopes(['sandboxes:snapshot', over]),
      (e) =>
        isDsecError(e, 'invalid_argument') &&
        e.field === 'scopes.1' &&
        e.details?.['max'] === MAX_PATTERN_WILDCARDS,
      over,
    );
  }
  // A long bad entry is not echoed whole.
  assert.throws(
    () => checkScopes([`x${'y'.repeat(290)}`]),
    (e) => isDsecError(e, 'invalid_argument') && e.message.length < 200,
  );
});

test('every scope has a kind: the run and snapshot scopes restrict, metrics:read adds', () => {
  assert.equal(scopeSpec('sandboxes:snapshot')?.kind, 'restrictive');
  assert.equal(scopeSpec('images:run:task-*')?.kind, 'restrictive');
  assert.equal(scopeSpec('metrics:read')?.kind, 'additive');
  assert.equal(scopeSpec('metrics:write'), undefined);
  // Every form checkScopes accepts is in the table (a new scope must say which kind it is).
  for (const scope of ['sandboxes:snapshot', 'metrics:read', 'images:run:*']) {
    assert.deepEqual(checkScopes([scope]), [scope]);
    assert.ok(SCOPES.includes(scopeSpec(scope)!));
  }
});

test('an unscoped key holds every restrictive right and no additive one', () => {
  assert.ok(scopesCover(undefined, ['sandboxes:snapshot', 'images:run:*']));
  assert.ok(!scopesCover(undefined, ['metrics:read']));
  assert.ok(!scopesCover(undefined, ['images:run:*', 'metrics:read']));
  assert.ok(scopesCover(['metrics:read'], ['metrics:read']));
  assert.ok(!scopesCover(['images:run:*'], ['metrics:read']));
});

test('ungrantableScopes: additive scopes only from a holder or a root admin', () => {
  const wanted = ['metrics:read', 'images:run:task-*', 'sandboxes:snapshot'];
  // An unscoped root-project member (or any non-root admin) lacks metrics:read.
  assert.deepEqual(ungrantableScopes({ rootAdmin: false }, wanted), ['metrics:read']);
  assert.deepEqual(ungrantableScopes({ rootAdmin: true }, wanted), []);
  // A scoped root admin reads metrics by role: it may grant it; its run patterns still bound it.
  assert.deepEqual(ungrantableScopes({ rootAdmin: true, scopes: ['images:run:task-*'] }, wanted), [
    'sandboxes:snapshot',
  ]);
  assert.deepEqual(
    ungrantableScopes({ rootAdmin: false, scopes: ['metrics:read'] }, ['metrics:read']),
    [],
  );
  assert.deepEqual(
    ungrantableScopes({ rootAdmin: false, scopes: ['images:run:*'] }, ['metrics:read']),
    ['metrics:read'],
  );
});

test('mayRevokeScopes: a scoped key revokes only keys it could have granted, or itself', () => {
  const unscoped = { rootAdmin: false };
  const runtime = { rootAdmin: false, scopes: ['images:run:task-*'] };
  assert.ok(mayRevokeScopes(unscoped, undefined));
  assert.ok(mayRevokeScopes(unscoped, ['metrics:read']));
  assert.ok(!mayRevokeScopes(runtime, undefined));
  assert.ok(!mayRevokeScopes(runtime, ['images:run:*']));
  assert.ok(mayRevokeScopes(runtime, ['images:run:task-1']));
  // An additive scope it lacks makes the key wider than it: the monitoring key stays.
  assert.ok(!mayRevokeScopes(runtime, ['metrics:read']));
  assert.ok(!mayRevokeScopes(runtime, ['metrics:read', 'images:run:task-1']));
  assert.ok(mayRevokeScopes({ ...runtime, scopes: ['metrics:read'] }, ['metrics:read']));
  // A root admin holds metrics:read by role, scoped or not.
  assert.ok(
    mayRevokeScopes({ ...runtime, rootAdmin: true }, ['metrics:read', 'images:run:task-1']),
  );
});

// Run patterns over few characters, with and without a version, against every reference
// made of those characters and one more (`c`, which no pattern uses).
const namePattern = fc
  .array(fc.constantFrom('a', 'b', '*'), { minLength: 1, maxLength: 4 })
  .map((cs) => cs.join(''));
const versionPattern = fc
  .array(fc.constantFrom('v', '1', '*'), { minLength: 1, maxLength: 2 })
  .map((cs) => cs.join(''));
const runScope = fc
  .tuple(namePattern, fc.option(versionPattern, { nil: undefined }))
  .map(([n, v]) => `images:run:${n}${v === undefined ? '' : `:${v}`}`);
function words(alphabet: string, maxLength: number): string[] {
  let layer = [''];
  const out: string[] = [];
  for (let n = 1; n <= maxLength; n++) {
    layer = layer.flatMap((s) => [...alphabet].map((c) => s + c));
    out.push(...layer);
  }
  return out;
}
const REFS = words('abc', 4).flatMap((n) => [n, ...words('v1c', 2).map((v) => `${n}:${v}`)]);

test('scopesCover agrees with what the keys may run, over every small reference', () => {
  fc.assert(
    fc.property(fc.array(runScope, { minLength: 1, maxLength: 2 }), runScope, (held, wanted) => {
      const covers = scopesCover(held, [wanted]);
      const included = REFS.every(
        (r) => !mayRunImage(key([wanted]), r) || mayRunImage(key(held), r),
      );
      assert.equal(covers, included, `${held.join(' ')} ⊇ ${wanted}`);
    }),
    { numRuns: 1500 },
  );
});
