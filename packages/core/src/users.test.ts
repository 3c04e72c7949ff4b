import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from './errors.js';
import { checkSandboxUser, isSandboxUser, SANDBOX_ID_COUNT } from './users.js';

test('a sandbox runs as a uid of its own range or a user name', () => {
  for (const ok of [
    '0',
    '1000',
    '65534',
    String(SANDBOX_ID_COUNT - 1),
    'root',
    'user',
    '_apt',
    'www-data',
    'a1',
  ])
    assert.equal(isSandboxUser(ok), true, ok);
  for (const bad of [
    '',
    '9999999999',
    String(SANDBOX_ID_COUNT),
    '100000',
    '4294967295',
    '-1',
    '1e3',
    '0x10',
    ' 0',
    'Root',
    '1abc',
    '-user',
    'us er',
    'user\0',
    'u'.repeat(33),
    '../etc',
  ])
    assert.equal(isSandboxUser(bad), false, JSON.stringify(bad));
});

test('checkSandboxUser names the field it refuses', () => {
  assert.equal(checkSandboxUser('user', 'initUser'), 'user');
  assert.throws(
    () => checkSandboxUser('9999999999', 'initUser'),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === 'initUser',
  );
});
