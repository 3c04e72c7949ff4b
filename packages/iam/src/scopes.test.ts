import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { checkScopes, mayRunImage, maySnapshot, scopesCover, unrunnableImages } from './scopes.js';
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
