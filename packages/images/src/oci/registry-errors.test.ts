import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DsecError } from '@dsec/core';
import { classifySkopeoError } from './registry.js';

function skopeoFailure(text: string): DsecError {
  return new DsecError('internal', `skopeo exited with 1: ${text}`, { details: { exitCode: 1 } });
}

test('an unreachable registry is unavailable even when its port contains 404', () => {
  const err = classifySkopeoError(
    skopeoFailure(
      'time="2026-12-01T01:21:13Z" level=fatal msg="Error parsing image name \\"docker://127.0.0.1:40461/test/a:v1\\": pinging container registry 127.0.0.1:40461: Get \\"http://127.0.0.1:40461/v2/\\": dial tcp 127.0.0.1:40461: connect: connection refused"',
    ),
    'docker://127.0.0.1:40461/test/a:v1',
  ) as DsecError;
  assert.equal(err.code, 'unavailable');
  assert.equal(err.details?.['reason'], 'registry_unreachable');
});

test('a missing tag is image_not_found', () => {
  for (const text of [
    'manifest unknown: manifest unknown',
    'reading manifest v9: 404 (Not Found)',
  ]) {
    const err = classifySkopeoError(skopeoFailure(text), 'docker://r/x:v9') as DsecError;
    assert.equal(err.code, 'image_not_found', text);
  }
});
