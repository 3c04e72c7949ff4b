import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { baseImageRefs } from './onbuild.js';
import { parseDockerfile } from './parse.js';

test('base images: global ARGs expanded (a --build-arg over the default), stages and scratch skipped', () => {
  const parsed = parseDockerfile(
    [
      'ARG BASE=debian:bookworm',
      'ARG TAG',
      'FROM ${BASE} AS build',
      'FROM build',
      'FROM scratch',
      'FROM registry.test/x:${TAG:-v1}',
      'FROM $BASE',
    ].join('\n'),
  );
  assert.deepEqual(baseImageRefs(parsed, {}), ['debian:bookworm', 'registry.test/x:v1']);
  assert.deepEqual(baseImageRefs(parsed, { BASE: 'evil.test/e', TAG: 'v2' }), [
    'evil.test/e',
    'registry.test/x:v2',
  ]);
});

test('a FROM whose variable cannot be resolved is refused: its image could not be checked', () => {
  assert.throws(
    () => baseImageRefs(parseDockerfile('FROM ${NOWHERE}\n'), {}),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'from_variable',
  );
});
