import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { FrameReader, frame } from './frames.js';

/*
 * The frame reader runs on the apiserver over what an edge streams back (a
 * command's result frame carries both streams' kept output, up to 64 MiB
 * each, which the sandbox chooses) and on the edge over what a terminal
 * client types. Sockets hand it at most 64 KiB at a time, often much less.
 */

/** Bytes that went through `Buffer.concat` while `fn` ran (every copy the reader makes). */
function copiedBytes(fn: () => void): number {
  const concat = Buffer.concat;
  let bytes = 0;
  Buffer.concat = (list: readonly Uint8Array[], totalLength?: number) => {
    const out = concat(list, totalLength);
    bytes += out.length;
    return out;
  };
  try {
    fn();
  } finally {
    Buffer.concat = concat;
  }
  return bytes;
}

function chunks(buf: Buffer, size: number): Buffer[] {
  const out: Buffer[] = [];
  for (let at = 0; at < buf.length; at += size) out.push(buf.subarray(at, at + size));
  return out;
}

test('any split of a stream yields its frames, whole and in order', () => {
  fc.assert(
    fc.property(
      fc.array(fc.tuple(fc.integer({ min: 0, max: 255 }), fc.uint8Array({ maxLength: 300 })), {
        maxLength: 12,
      }),
      fc.array(fc.integer({ min: 1, max: 97 }), { minLength: 1, maxLength: 40 }),
      (frames, cuts) => {
        const stream = Buffer.concat(frames.map(([t, p]) => frame(t, Buffer.from(p))));
        const got: [number, string][] = [];
        const reader = new FrameReader(1 << 20, (t, p) => got.push([t, p.toString('hex')]));
        let at = 0;
        for (let i = 0; at < stream.length; i++) {
          const n = cuts[i % cuts.length]!;
          reader.push(stream.subarray(at, at + n));
          at += n;
        }
        assert.deepEqual(
          got,
          frames.map(([t, p]) => [t, Buffer.from(p).toString('hex')]),
        );
        assert.equal(reader.pending, 0);
      },
    ),
    { numRuns: 2000 },
  );
});

test('a large frame arriving in socket-sized pieces is copied a bounded number of times', () => {
  // Before: each piece copied everything gathered so far, (n²/2)·piece bytes for n pieces:
  // a 32 MiB result frame in 64 KiB pieces was 8 GiB of copying, 43 s of the apiserver's
  // event loop, for one command of one tenant.
  const payload = Buffer.alloc(8 << 20, 0x61);
  const whole = frame(2, payload);
  for (const pieceBytes of [64 << 10, 4 << 10, 100]) {
    let got: Buffer | undefined;
    const reader = new FrameReader(256 << 20, (_t, p) => (got = Buffer.from(p)));
    const pieces = chunks(whole, pieceBytes);
    const copied = copiedBytes(() => {
      for (const c of pieces) reader.push(c);
    });
    assert.ok(got?.equals(payload), `the frame arrives whole (${pieceBytes}-byte pieces)`);
    assert.ok(
      copied <= 2 * whole.length,
      `${copied} bytes copied for a ${whole.length}-byte frame in ${pieceBytes}-byte pieces`,
    );
  }
});

test('many small frames in one piece, and headers split across pieces, copy little', () => {
  const many = Buffer.concat(Array.from({ length: 10_000 }, (_, i) => frame(0, Buffer.from([i]))));
  let n = 0;
  const reader = new FrameReader(1 << 20, () => n++);
  // Pieces of 3 bytes: every header straddles two of them.
  const copied = copiedBytes(() => {
    for (const c of chunks(many, 3)) reader.push(c);
  });
  assert.equal(n, 10_000);
  assert.ok(copied <= 4 * many.length, `${copied} bytes copied for ${many.length}`);
});

test('a frame over the limit is refused from its header, before its bytes are gathered', () => {
  const reader = new FrameReader(1024, () => assert.fail('no frame'));
  const head = frame(0, Buffer.alloc(0));
  head.writeUInt32BE(1025, 1);
  assert.throws(
    () => {
      reader.push(head.subarray(0, 2));
      reader.push(head.subarray(2));
    },
    (e: unknown) => isDsecError(e, 'invalid_argument'),
  );
});
