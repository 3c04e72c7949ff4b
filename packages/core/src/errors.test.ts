import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { DsecError, ERROR_CODES, toDsecError } from './errors.js';

test('docs/errors.md lists every error code with its status', () => {
  const doc = readFileSync(new URL('../../../docs/errors.md', import.meta.url), 'utf8');
  for (const [code, { status }] of Object.entries(ERROR_CODES)) {
    assert.match(
      doc,
      new RegExp(`\\| \`${code}\` \\| ${status} \\|`),
      `docs/errors.md is missing ${code}`,
    );
  }
});

test('an error survives the wire form', () => {
  const e = new DsecError('invalid_argument', 'bad', {
    field: 'memoryLimitMb',
    details: { min: 16 },
  });
  const back = DsecError.fromBody(JSON.parse(JSON.stringify(e.toJSON())), 400);
  assert.equal(back.code, 'invalid_argument');
  assert.equal(back.field, 'memoryLimitMb');
  assert.deepEqual(back.details, { min: 16 });
  assert.equal(back.status, 400);
});

test('unknown codes and foreign errors map to stable codes', () => {
  assert.equal(DsecError.fromBody({ error: { code: 'nope', message: 'x' } }).code, 'internal');
  assert.equal(DsecError.fromBody('garbage', 502).code, 'unavailable');
  assert.equal(toDsecError(new Error('boom')).code, 'internal');
});

test('a full disk is unavailable, whichever layer noticed it', () => {
  for (const code of ['ENOSPC', 'EDQUOT', 'SQLITE_FULL']) {
    const err = Object.assign(new Error('database or disk is full'), { code });
    const mapped = toDsecError(err);
    assert.equal(mapped.code, 'unavailable', code);
    assert.match(mapped.message, /out of disk space/);
    assert.deepEqual(mapped.details, { reason: 'disk_full' });
  }
});
