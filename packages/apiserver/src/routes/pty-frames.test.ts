import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { ptyFrame, PtyFrameReader } from './ports.js';

// The public terminal stream's frame reader: what a client sends, cut however the client likes.

test('any split of a terminal stream yields its frames, whole and in order', () => {
  fc.assert(
    fc.property(
      fc.array(fc.tuple(fc.integer({ min: 0, max: 255 }), fc.uint8Array({ maxLength: 300 })), {
        maxLength: 12,
      }),
      fc.array(fc.integer({ min: 1, max: 97 }), { minLength: 1, maxLength: 40 }),
      (frames, cuts) => {
        const stream = Buffer.concat(frames.map(([t, p]) => ptyFrame(t, Buffer.from(p))));
        const got: [number, string][] = [];
        const reader = new PtyFrameReader((t, p) => got.push([t, p.toString('hex')]));
        for (let at = 0, i = 0; at < stream.length; i++) {
          const n = cuts[i % cuts.length]!;
          reader.push(stream.subarray(at, at + n));
          at += n;
        }
        assert.deepEqual(
          got,
          frames.map(([t, p]) => [t, Buffer.from(p).toString('hex')]),
        );
      },
    ),
    { numRuns: 2000 },
  );
});

test('a 1 MiB frame in 16-byte pieces is copied a bounded number of times; over 1 MiB is refused', () => {
  const whole = ptyFrame(0, Buffer.alloc(1 << 20, 0x61));
  let n = 0;
  const reader = new PtyFrameReader(() => n++);
  const concat = Buffer.concat;
  let copied = 0;
  Buffer.concat = (list: readonly Uint8Array[], totalLength?: number) => {
    const out = concat(list, totalLength);
    copied += out.length;
    return out;
  };
  try {
    for (let at = 0; at < whole.length; at += 16) reader.push(whole.subarray(at, at + 16));
  } finally {
    Buffer.concat = concat;
  }
  assert.equal(n, 1);
  // Before: 32 GiB (each piece joined all gathered so far).
  assert.ok(copied <= 2 * whole.length, `${copied} bytes copied for ${whole.length}`);
  const big = ptyFrame(0, Buffer.alloc(0));
  big.writeUInt32BE((1 << 20) + 1, 1);
  assert.throws(
    () => new PtyFrameReader(() => undefined).push(big),
    (e: unknown) => isDsecError(e, 'invalid_argument'),
  );
});
