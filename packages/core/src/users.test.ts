import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from './errors.js';
import { checkSandboxUser, isSandboxUser, namesSandboxIds, SANDBOX_ID_COUNT } from './users.js';

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
    'root:root',
    'alice:wheel',
    '1000:1000',
    'user:0',
    '0:staff',
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
    ':',
    'root:',
    ':root',
    'a:b:c',
    '0:100000',
    'root:Wheel',
    'root:../x',
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

test('namesSandboxIds: only a name other than root needs the image to define it', () => {
  for (const u of ['root', '0', '1000', 'root:root', '0:0', '1000:1000', 'root:0'])
    assert.equal(namesSandboxIds(u), false, u);
  for (const u of ['alice', 'root:wheel', '0:staff', 'alice:0'])
    assert.equal(namesSandboxIds(u), true, u);
});
