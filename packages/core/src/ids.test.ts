import { test } from 'node:test';
import assert from 'node:assert/strict';
import { SandboxIdCodec } from './ids.js';
import { isDsecError } from './errors.js';

const codec = new SandboxIdCodec('0123456789abcdef0123456789abcdef');

test('an ID round-trips its edge and is URL-safe', () => {
  const id = codec.mint('node-1');
  assert.match(id, /^sb-[A-Za-z0-9_-]+$/);
  assert.equal(codec.decode(id).edgeId, 'node-1');
  assert.notEqual(codec.mint('node-1'), id);
});

test('a forged, edited or foreign ID does not decode', () => {
  const id = codec.mint('node-1');
  const other = new SandboxIdCodec('another-secret-of-enough-length');
  const flipped = id.slice(0, -2) + (id.at(-2) === 'A' ? 'B' : 'A') + id.at(-1);
  for (const bad of [flipped, other.mint('node-1'), 'sb-', 'x', '../../etc', id + 'A', '']) {
    assert.throws(
      () => codec.decode(bad),
      (e) => isDsecError(e, 'sandbox_not_found'),
      bad,
    );
  }
});
