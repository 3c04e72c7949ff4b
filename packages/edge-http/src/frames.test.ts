import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { randomBytes } from 'node:crypto';
import { FrameMac } from './auth.js';
import { FrameMacError, FrameReader, frame as macFrame } from './frames.js';

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

/** One direction of a stream: frames written and read under the same per-exchange key. */
let key = randomBytes(32);
let sender = new FrameMac(key);
function frame(type: number, payload: Buffer): Buffer {
  return macFrame(sender, type, payload);
}
function reader(maxFrameBytes: number, onFrame: (type: number, payload: Buffer) => void) {
  return new FrameReader(maxFrameBytes, new FrameMac(key), onFrame);
}
/** A new stream: the next `frame`s start over from sequence 0 under a new key. */
function newStream(): void {
  key = randomBytes(32);
  sender = new FrameMac(key);
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
        newStream();
        const stream = Buffer.concat(frames.map(([t, p]) => frame(t, Buffer.from(p))));
        const got: [number, string][] = [];
        const r = reader(1 << 20, (t, p) => got.push([t, p.toString('hex')]));
        let at = 0;
        for (let i = 0; at < stream.length; i++) {
          const n = cuts[i % cuts.length]!;
          r.push(stream.subarray(at, at + n));
          at += n;
        }
        assert.deepEqual(
          got,
          frames.map(([t, p]) => [t, Buffer.from(p).toString('hex')]),
        );
        assert.equal(r.pending, 0);
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
  for (const pieceBytes of [64 << 10, 4 << 10, 100]) {
    newStream();
    const whole = frame(2, payload);
    let got: Buffer | undefined;
    const r = reader(256 << 20, (_t, p) => (got = Buffer.from(p)));
    const pieces = chunks(whole, pieceBytes);
    const copied = copiedBytes(() => {
      for (const c of pieces) r.push(c);
    });
    assert.ok(got?.equals(payload), `the frame arrives whole (${pieceBytes}-byte pieces)`);
    assert.ok(
      copied <= 2 * whole.length,
      `${copied} bytes copied for a ${whole.length}-byte frame in ${pieceBytes}-byte pieces`,
    );
  }
});

test('many small frames in one piece, and headers split across pieces, copy little', () => {
  newStream();
  const many = Buffer.concat(Array.from({ length: 10_000 }, (_, i) => frame(0, Buffer.from([i]))));
  let n = 0;
  const r = reader(1 << 20, () => n++);
  // Pieces of 3 bytes: every header straddles two of them.
  const copied = copiedBytes(() => {
    for (const c of chunks(many, 3)) r.push(c);
  });
  assert.equal(n, 10_000);
  assert.ok(copied <= 4 * many.length, `${copied} bytes copied for ${many.length}`);
});

test('a frame over the limit is refused from its header, before its bytes are gathered', () => {
  newStream();
  const r = reader(1024, () => assert.fail('no frame'));
  const head = frame(0, Buffer.alloc(0));
  head.writeUInt32BE(1025, 1);
  assert.throws(
    () => {
      r.push(head.subarray(0, 2));
      r.push(head.subarray(2));
    },
    (e: unknown) => isDsecError(e, 'invalid_argument'),
  );
});

test('a changed byte fails the MAC however the frame is split, and the reader stays failed', () => {
  for (const pieceBytes of [1, 7, 64 << 10]) {
    newStream();
    const good = frame(0, Buffer.from('first'));
    const bad = frame(0, Buffer.from('second'));
    bad[7] = bad[7]! ^ 1;
    const got: string[] = [];
    const r = reader(1 << 20, (_t, p) => got.push(p.toString()));
    assert.throws(() => {
      for (const c of chunks(Buffer.concat([good, bad]), pieceBytes)) r.push(c);
    }, FrameMacError);
    assert.deepEqual(got, ['first']);
    assert.throws(() => r.push(frame(0, Buffer.from('third'))), FrameMacError);
  }
});
