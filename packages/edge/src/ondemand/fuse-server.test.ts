import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import fc from 'fast-check';
import { DsecError } from '@dsec/core';
import { ChunkCache, type RangeSource } from './chunk-cache.js';
import {
  ATTR_OUT_BYTES,
  ENTRY_OUT_BYTES,
  Errno,
  IN_HEADER_BYTES,
  INIT_OUT_BYTES,
  KSTATFS_BYTES,
  MAX_PAGES,
  NO_REPLY_OPCODES,
  OPEN_OUT_BYTES,
  OUT_HEADER_BYTES,
  Opcode,
  decodeOutHeader,
  encodeInHeader,
  encodeInitIn,
  encodeReadIn,
} from './fuse-protocol.js';
import { BlobFuseServer } from './fuse-server.js';

// Issue 24 point 10(b): the blob daemon's FUSE server against arbitrary and mutated frames.
// `respond` is the whole path from a frame read off /dev/fuse to the bytes written back.

const PAGE = 4096;
const MAX_READ = MAX_PAGES * PAGE;
const HEX = 'cd'.repeat(32);
const BLOB_INO = 3n;
const STATS_INO = 2n;

class MemorySource implements RangeSource {
  constructor(readonly data: Buffer) {}
  async statBlob(digest: string) {
    if (digest !== `sha256:${HEX}`) throw new DsecError('image_not_found', digest);
    return { sizeBytes: this.data.length };
  }
  async readBlobRange(digest: string, offset: number, length: number) {
    if (digest !== `sha256:${HEX}`) throw new DsecError('image_not_found', digest);
    return this.data.subarray(offset, offset + length);
  }
}

async function server(t: { after: (fn: () => Promise<void>) => void }) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-fuse-server-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const source = new MemorySource(randomBytes(3 * MAX_READ + 1234));
  const cache = await ChunkCache.open({
    dir,
    source,
    budgetBytes: 64 << 20,
    chunkBytes: 64 << 10,
    log: () => {},
  });
  // What the server asks of the cache: the allocation a frame makes it do.
  const asked: number[] = [];
  const read = cache.read.bind(cache);
  cache.read = (digest, size, offset, length, ...rest) => {
    asked.push(length);
    return read(digest, size, offset, length, ...rest);
  };
  const logs: string[] = [];
  // fd -1: respond() never writes; only the read loop and reply() touch the device.
  const s = new BlobFuseServer({
    fd: -1,
    source,
    cache,
    pageBytes: PAGE,
    log: (l) => logs.push(l),
  });
  const frame = (opcode: number, nodeid: bigint, body: Buffer, unique = 7n) =>
    Buffer.concat([
      encodeInHeader({
        len: IN_HEADER_BYTES + body.length,
        opcode,
        unique,
        nodeid,
        uid: 0,
        gid: 0,
        pid: 1,
        totalExtlen: 0,
      }),
      body,
    ]);
  // The kernel's first requests: INIT, then LOOKUP of the blob (inode 3).
  const init = encodeInitIn({ major: 7, minor: 38, maxReadahead: 1 << 20, flags: 0xffffffff });
  assert.equal(await errnoOf(s, frame(Opcode.INIT, 0n, init)), 0);
  assert.equal(await errnoOf(s, frame(Opcode.LOOKUP, 1n, Buffer.from(`${HEX}\0`))), 0);
  return { s, source, asked, logs, frame };
}

async function errnoOf(s: BlobFuseServer, f: Buffer): Promise<number | undefined> {
  const parts = await s.respond(f);
  return parts === undefined ? undefined : 0 - decodeOutHeader(Buffer.concat(parts)).error || 0;
}

/** The largest payload a well-behaved server may answer this frame with. */
function payloadBound(frame: Buffer): number {
  const opcode = frame.readUInt32LE(4);
  if (opcode === Opcode.READ || opcode === Opcode.READDIR) {
    // Only a body long enough to carry a size can make the server read that many bytes.
    return frame.length >= IN_HEADER_BYTES + 24
      ? Math.min(frame.readUInt32LE(IN_HEADER_BYTES + 16), MAX_READ)
      : 0;
  }
  return Math.max(ENTRY_OUT_BYTES, ATTR_OUT_BYTES, INIT_OUT_BYTES, KSTATFS_BYTES, OPEN_OUT_BYTES);
}

const KNOWN_ERRNOS = new Set<number>(Object.values(Errno));

/** Checks one reply against the frame it answers; returns its errno. */
function checkReply(
  frame: Buffer,
  parts: Buffer[] | undefined,
  asked: number[],
): number | undefined {
  assert.ok(
    asked.every((n) => n <= MAX_READ),
    `the cache was asked for ${Math.max(...asked)} bytes`,
  );
  asked.length = 0;
  if (parts === undefined) return undefined;
  const reply = Buffer.concat(parts);
  assert.ok(reply.length >= OUT_HEADER_BYTES);
  const out = decodeOutHeader(reply);
  assert.equal(out.len, reply.length, 'the header says how long the reply is');
  assert.equal(out.unique, frame.readBigUInt64LE(8), 'the reply answers this request');
  assert.ok(
    out.error <= 0 && (out.error === 0 || KNOWN_ERRNOS.has(-out.error)),
    `errno ${out.error}`,
  );
  if (out.error !== 0) assert.equal(reply.length, OUT_HEADER_BYTES, 'an error carries no payload');
  assert.ok(
    reply.length - OUT_HEADER_BYTES <= payloadBound(frame),
    `opcode ${frame.readUInt32LE(4)}: ${reply.length - OUT_HEADER_BYTES} bytes of payload`,
  );
  return out.error === 0 ? 0 : -out.error;
}

const OPCODES = Object.values(Opcode);

test('arbitrary frames: respond never rejects and every reply is well-formed and bounded', async (t) => {
  const { s, asked, logs } = await server(t);
  await fc.assert(
    fc.asyncProperty(
      fc.uint8Array({ maxLength: 120, size: 'max' }),
      fc.oneof(fc.constantFrom(...OPCODES), fc.nat({ max: 0xffffffff })),
      fc.constantFrom(1n, STATS_INO, BLOB_INO, 99n),
      fc.boolean(),
      async (bytes, opcode, nodeid, consistent) => {
        const f = Buffer.from(bytes);
        if (f.length >= 8) f.writeUInt32LE(opcode, 4);
        if (f.length >= 24) f.writeBigUInt64LE(nodeid, 16);
        if (consistent && f.length >= 40) {
          f.writeUInt32LE(f.length, 0);
          f.writeUInt16LE(0, 36);
        }
        checkReply(f, await s.respond(f), asked);
      },
    ),
    { numRuns: 3000 },
  );
  assert.deepEqual(logs, [], 'malformed frames are counted, not logged one by one');
  assert.ok(s.counterValues().malformed > 0);
});

/** Well-formed requests of every kind the server answers, for the mutations below. */
const request = fc.oneof(
  fc.constant({ opcode: Opcode.LOOKUP, nodeid: 1n, body: Buffer.from(`${HEX}\0`) }),
  fc.constant({ opcode: Opcode.LOOKUP, nodeid: 1n, body: Buffer.from('.stats\0') }),
  fc.constant({ opcode: Opcode.GETATTR, nodeid: BLOB_INO, body: Buffer.alloc(16) }),
  fc.constant({ opcode: Opcode.OPEN, nodeid: BLOB_INO, body: Buffer.alloc(8) }),
  fc.constant({ opcode: Opcode.OPENDIR, nodeid: 1n, body: Buffer.alloc(8) }),
  fc.constant({ opcode: Opcode.STATFS, nodeid: 1n, body: Buffer.alloc(0) }),
  fc.constant({ opcode: Opcode.RELEASE, nodeid: BLOB_INO, body: Buffer.alloc(24) }),
  fc.constant({ opcode: Opcode.FORGET, nodeid: BLOB_INO, body: Buffer.alloc(8) }),
  fc.record({
    opcode: fc.constant(Opcode.INIT),
    nodeid: fc.constant(0n),
    body: fc
      .record({
        major: fc.nat({ max: 9 }),
        minor: fc.nat({ max: 50 }),
        maxReadahead: fc.nat({ max: 0xffffffff }),
        flags: fc.nat({ max: 0xffffffff }),
      })
      .map((i) => encodeInitIn(i)),
  }),
  fc.record({
    opcode: fc.constantFrom(Opcode.READ, Opcode.READDIR),
    nodeid: fc.constantFrom(1n, STATS_INO, BLOB_INO),
    body: fc
      .record({
        fh: fc.bigInt({ min: 0n, max: 3n }),
        offset: fc.oneof(
          fc.bigInt({ min: 0n, max: BigInt(4 * MAX_READ) }),
          fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
        ),
        size: fc.oneof(fc.nat({ max: MAX_READ }), fc.nat({ max: 0xffffffff })),
      })
      .map((r) => encodeReadIn(r)),
  }),
);

const mutation = fc.oneof(
  fc.record({ kind: fc.constant('none' as const) }),
  fc.record({ kind: fc.constant('cut' as const), at: fc.nat({ max: 120 }) }),
  fc.record({
    kind: fc.constant('extend' as const),
    extra: fc.uint8Array({ maxLength: 64, size: 'max' }),
  }),
  fc.record({
    kind: fc.constant('flip' as const),
    at: fc.nat({ max: 120 }),
    value: fc.nat({ max: 255 }),
  }),
  fc.record({ kind: fc.constant('len' as const), len: fc.nat({ max: 0xffffffff }) }),
  fc.record({ kind: fc.constant('ext' as const), words: fc.nat({ max: 0xffff }) }),
);

test('mutated frames: well-formed replies within bounds; unmutated ones answered right', async (t) => {
  const { s, source, asked, frame } = await server(t);
  await fc.assert(
    fc.asyncProperty(request, mutation, async (r, m) => {
      let f = frame(r.opcode, r.nodeid, r.body);
      if (m.kind === 'cut') f = f.subarray(0, m.at);
      if (m.kind === 'extend') f = Buffer.concat([f, m.extra]);
      if (m.kind === 'flip' && m.at < f.length) f[m.at] = m.value;
      if (m.kind === 'len') f.writeUInt32LE(m.len, 0);
      if (m.kind === 'ext') f.writeUInt16LE(m.words, 36);
      const parts = await s.respond(f);
      const errno = checkReply(f, parts, asked);
      if (f.length < IN_HEADER_BYTES) assert.equal(parts, undefined);
      // A frame whose own length field disagrees with its size is never acted on.
      if (f.length >= IN_HEADER_BYTES && f.readUInt32LE(0) !== f.length) {
        if (!NO_REPLY_OPCODES.has(f.readUInt32LE(4))) assert.equal(errno, Errno.EINVAL);
      }
      if (m.kind !== 'none') return;
      if (NO_REPLY_OPCODES.has(r.opcode)) return assert.equal(parts, undefined);
      if (r.opcode === Opcode.READ && r.nodeid === BLOB_INO) {
        const offset = r.body.readBigUInt64LE(8);
        const size = r.body.readUInt32LE(16);
        if (size > MAX_READ) return assert.equal(errno, Errno.EINVAL);
        assert.equal(errno, 0);
        const start = offset > BigInt(source.data.length) ? source.data.length : Number(offset);
        const want = source.data.subarray(start, start + size);
        assert.ok(Buffer.concat(parts!).subarray(OUT_HEADER_BYTES).equals(want), 'the blob bytes');
      }
    }),
    { numRuns: 3000 },
  );
  // The mutations left enough frames whole for the blob to be read, and broke others.
  const c = s.counterValues();
  assert.ok(c.reads > 0 && c.malformed > 0, JSON.stringify(c));
});

test('a READ larger than the kernel may send is refused before any allocation', async (t) => {
  const { s, asked, frame } = await server(t);
  for (const size of [MAX_READ + 1, 64 << 20, 0xffffffff]) {
    const f = frame(Opcode.READ, BLOB_INO, encodeReadIn({ fh: 0n, offset: 0n, size }));
    assert.equal(checkReply(f, await s.respond(f), asked), Errno.EINVAL, `${size}`);
  }
  const ok = frame(Opcode.READ, BLOB_INO, encodeReadIn({ fh: 0n, offset: 0n, size: MAX_READ }));
  const parts = await s.respond(ok);
  assert.equal(checkReply(ok, parts, asked), 0);
  assert.equal(Buffer.concat(parts!).length, OUT_HEADER_BYTES + MAX_READ);
});

test('open .stats handles are capped; RELEASE frees one', async (t) => {
  const { s, frame } = await server(t);
  const open = () => frame(Opcode.OPEN, STATS_INO, Buffer.alloc(8));
  const handles: bigint[] = [];
  for (;;) {
    const parts = await s.respond(open());
    const reply = Buffer.concat(parts!);
    if (decodeOutHeader(reply).error !== 0) {
      assert.equal(-decodeOutHeader(reply).error, Errno.EMFILE);
      break;
    }
    handles.push(reply.readBigUInt64LE(OUT_HEADER_BYTES));
    assert.ok(handles.length <= 1000, 'no cap');
  }
  const release = Buffer.alloc(24);
  release.writeBigUInt64LE(handles[0]!, 0);
  assert.equal(await errnoOf(s, frame(Opcode.RELEASE, STATS_INO, release)), 0);
  assert.equal(await errnoOf(s, open()), 0);
});

test('extensions after the arguments are not read as arguments', async (t) => {
  const { s } = await server(t);
  // A LOOKUP of the blob followed by 8 bytes of extension: the name is still found.
  const body = Buffer.from(`${HEX}\0`);
  const ext = Buffer.alloc(8, 0xee);
  const f = Buffer.concat([
    encodeInHeader({
      len: IN_HEADER_BYTES + body.length + ext.length,
      opcode: Opcode.LOOKUP,
      unique: 9n,
      nodeid: 1n,
      uid: 0,
      gid: 0,
      pid: 1,
      totalExtlen: 1,
    }),
    body,
    ext,
  ]);
  const reply = Buffer.concat((await s.respond(f))!);
  assert.equal(decodeOutHeader(reply).error, 0);
  assert.equal(reply.readBigUInt64LE(OUT_HEADER_BYTES), BLOB_INO);
});
