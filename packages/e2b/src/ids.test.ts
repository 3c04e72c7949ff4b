import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import { base32Decode, base32Encode, toDsecSandboxId, toE2bSandboxId } from './ids.js';

test('base32 round-trips any bytes and rejects strings no encoding produces', () => {
  fc.assert(
    fc.property(fc.uint8Array({ maxLength: 200 }), (a) => {
      const b = Buffer.from(a);
      const text = base32Encode(b);
      assert.match(text, /^[a-z2-7]*$/);
      assert.deepEqual(base32Decode(text), b);
    }),
  );
  assert.equal(base32Encode(Buffer.from('foobar')), 'mzxw6ytboi');
  assert.equal(base32Decode('mzxw6ytboj'), undefined); // stray low bits
  assert.equal(base32Decode('mya'), undefined); // a whole leftover character
  assert.deepEqual(base32Decode('my'), Buffer.from('f'));
  assert.equal(base32Decode('MZXW'), undefined); // upper case is not ours
});

test('sandbox IDs convert both ways, survive lower-casing, and malformed ones are not found', () => {
  const codec = new SandboxIdCodec('0123456789abcdef0123');
  for (let i = 0; i < 50; i++) {
    const id = codec.mint('node-1');
    const e2b = toE2bSandboxId(id);
    assert.match(e2b, /^sb[a-z2-7]+$/);
    assert.equal(e2b.toLowerCase(), e2b);
    assert.equal(toDsecSandboxId(e2b), id);
    assert.equal(toDsecSandboxId(id), id);
    assert.deepEqual(codec.decode(toDsecSandboxId(e2b)), { edgeId: 'node-1' });
  }
  for (const bad of ['', 'sb', 'sbABC', 'x-1', 'sb0', 'sbmzxw6ytboj']) {
    assert.throws(
      () => toDsecSandboxId(bad),
      (e) => isDsecError(e, 'sandbox_not_found'),
    );
  }
});
