import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import {
  ATTR_OUT_BYTES,
  ENTRY_OUT_BYTES,
  FOPEN_KEEP_CACHE,
  FUSE_ASYNC_READ,
  FUSE_MAX_PAGES,
  FuseProtocolError,
  IN_HEADER_BYTES,
  INIT_OUT_BYTES,
  KSTATFS_BYTES,
  OPEN_OUT_BYTES,
  OUT_HEADER_BYTES,
  S_IFREG,
  decodeDirents,
  decodeFh,
  decodeInHeader,
  decodeInitIn,
  decodeInitOut,
  decodeName,
  decodeOpenFlags,
  decodeOutHeader,
  decodeReadIn,
  decodeRequest,
  decodeStatfsOut,
  direntBytes,
  encodeAttrOut,
  encodeDirents,
  encodeEntryOut,
  encodeInHeader,
  encodeInitIn,
  encodeInitOut,
  encodeOpenOut,
  encodeReadIn,
  encodeReply,
  encodeReplyHeader,
  encodeStatfsOut,
  negotiateInit,
  readAttr,
  type InHeader,
} from './fuse-protocol.js';

// Offsets below are those of /usr/include/linux/fuse.h (checked with offsetof).
describe('fuse protocol', () => {
  test('in header round-trips at the UAPI offsets', () => {
    const h = {
      len: 56,
      opcode: 1,
      unique: 0x1122334455667788n,
      nodeid: 1n,
      uid: 1000,
      gid: 1001,
      pid: 42,
      totalExtlen: 0,
    };
    const buf = encodeInHeader(h);
    assert.equal(buf.length, 40);
    assert.equal(buf.readBigUInt64LE(8), h.unique);
    assert.equal(buf.readUInt32LE(32), 42);
    assert.deepEqual(decodeInHeader(buf), h);
  });

  test('replies carry length, negative errno and unique', () => {
    const err = encodeReply(7n, 2);
    assert.deepEqual(decodeOutHeader(err), { len: OUT_HEADER_BYTES, error: -2, unique: 7n });
    const ok = encodeReply(9n, 0, Buffer.from('abc'));
    assert.deepEqual(decodeOutHeader(ok), { len: 19, error: 0, unique: 9n });
    assert.equal(ok.toString('utf8', 16), 'abc');
    assert.deepEqual(decodeOutHeader(encodeReplyHeader(5n, 4096)), {
      len: 4112,
      error: 0,
      unique: 5n,
    });
  });

  test('INIT: 7.min(kernel,31), only offered flags, readahead capped by the offer', () => {
    const offer = decodeInitIn(
      encodeInitIn({ major: 7, minor: 38, maxReadahead: 131072, flags: 0xffffffff }),
    );
    assert.equal(offer.flags, 0xffffffff);
    const out = negotiateInit(offer, { maxReadaheadBytes: 1 << 20 });
    assert.equal(out.minor, 31);
    assert.equal(out.maxReadahead, 131072);
    assert.equal(out.flags, FUSE_ASYNC_READ | FUSE_MAX_PAGES);
    const older = negotiateInit(
      { major: 7, minor: 27, maxReadahead: 1 << 20, flags: FUSE_ASYNC_READ },
      { maxReadaheadBytes: 65536 },
    );
    assert.equal(older.minor, 27);
    assert.equal(older.maxReadahead, 65536);
    assert.equal(older.flags, FUSE_ASYNC_READ);
    const buf = encodeInitOut(out);
    assert.equal(buf.length, INIT_OUT_BYTES);
    assert.equal(buf.readUInt16LE(16), 16); // max_background
    assert.equal(buf.readUInt16LE(18), 12); // congestion_threshold
    assert.equal(buf.readUInt32LE(20), 4096); // max_write
    assert.equal(buf.readUInt32LE(24), 1); // time_gran
    assert.equal(buf.readUInt16LE(28), 256); // max_pages
    assert.deepEqual(decodeInitOut(buf), out);
  });

  test('entry_out and attr_out embed fuse_attr at 40 and 16', () => {
    const attr = { ino: 3n, size: 5000, mode: S_IFREG | 0o444, nlink: 1, mtimeSec: 1700000000 };
    const entry = encodeEntryOut(attr, { entrySec: 86400, attrSec: 60 });
    assert.equal(entry.length, ENTRY_OUT_BYTES);
    assert.equal(entry.readBigUInt64LE(0), 3n); // nodeid
    assert.equal(entry.readBigUInt64LE(16), 86400n); // entry_valid
    assert.equal(entry.readBigUInt64LE(24), 60n); // attr_valid
    assert.equal(entry.readUInt32LE(40 + 60), S_IFREG | 0o444); // attr.mode
    assert.equal(entry.readBigUInt64LE(40 + 16), 10n); // attr.blocks (512 B)
    assert.deepEqual(readAttr(entry, 40), { ...attr, uid: 0, gid: 0, blksize: 4096 });
    const out = encodeAttrOut(attr, 30);
    assert.equal(out.length, ATTR_OUT_BYTES);
    assert.equal(out.readBigUInt64LE(0), 30n);
    assert.equal(readAttr(out, 16).size, 5000);
  });

  test('open_out and read_in', () => {
    const open = encodeOpenOut(12n, FOPEN_KEEP_CACHE);
    assert.equal(open.length, OPEN_OUT_BYTES);
    assert.equal(open.readUInt32LE(8), FOPEN_KEEP_CACHE);
    const r = { fh: 4n, offset: 1n << 40n, size: 131072 };
    const buf = encodeReadIn(r);
    assert.equal(buf.length, 40);
    assert.deepEqual(decodeReadIn(buf), r);
  });

  test('dirents are 8-byte aligned and stop at the size limit', () => {
    const entries = ['.', '..', '.stats', 'a'.repeat(64)].map((name, i) => ({
      ino: BigInt(i + 1),
      off: BigInt(i + 1),
      type: 8,
      name,
    }));
    const all = encodeDirents(entries, 4096);
    assert.equal(all.count, 4);
    assert.equal(all.buf.length, 32 + 32 + 32 + 88);
    assert.deepEqual(decodeDirents(all.buf), entries);
    const some = encodeDirents(entries, 100);
    assert.equal(some.count, 3);
    assert.deepEqual(decodeDirents(some.buf), entries.slice(0, 3));
  });

  test('statfs is 80 bytes with bsize at 40 and frsize at 48', () => {
    const s = {
      blocks: 100,
      bfree: 50,
      bavail: 50,
      files: 3,
      ffree: 0,
      bsize: 4096,
      namelen: 255,
      frsize: 4096,
    };
    const buf = encodeStatfsOut(s);
    assert.equal(buf.length, KSTATFS_BYTES);
    assert.equal(buf.readUInt32LE(48), 4096);
    assert.deepEqual(decodeStatfsOut(buf), s);
  });

  test('names end at the NUL', () => {
    assert.equal(decodeName(Buffer.from('abc\0')), 'abc');
  });
});

// Issue 24 point 10(b): every decoder over arbitrary and mutated bytes either answers or throws
// FuseProtocolError; nothing reads past a buffer's end (Node's own RangeError would say so, and
// toString/subarray would silently cut a name short, which the dirent checks catch).
describe('fuse protocol: untrusted bytes', () => {
  const bytes = (maxLength = 160) =>
    fc.uint8Array({ maxLength, size: 'max' }).map((a) => Buffer.from(a));
  const decoders: [string, (b: Buffer) => unknown][] = [
    ['decodeInHeader', decodeInHeader],
    ['decodeRequest', decodeRequest],
    ['decodeOutHeader', decodeOutHeader],
    ['decodeInitIn', decodeInitIn],
    ['decodeInitOut', decodeInitOut],
    ['decodeReadIn', decodeReadIn],
    ['decodeOpenFlags', decodeOpenFlags],
    ['decodeFh', decodeFh],
    ['decodeName', decodeName],
    ['decodeDirents', decodeDirents],
    ['decodeStatfsOut', decodeStatfsOut],
    ['readAttr@0', (b) => readAttr(b, 0)],
    ['readAttr@40', (b) => readAttr(b, 40)],
  ];
  const onlyOwnErrors = (name: string, f: (b: Buffer) => unknown, b: Buffer) => {
    try {
      f(b);
    } catch (err) {
      assert.ok(err instanceof FuseProtocolError, `${name}(${b.toString('hex')}): ${String(err)}`);
    }
  };

  test('arbitrary bytes: every decoder answers or throws FuseProtocolError', () => {
    for (const [name, f] of decoders) {
      for (let n = 0; n <= 96; n++) onlyOwnErrors(name, f, Buffer.alloc(n, 0xff));
      fc.assert(
        fc.property(bytes(), (b) => onlyOwnErrors(name, f, b)),
        { numRuns: 500 },
      );
    }
  });

  const header = fc.record({
    opcode: fc.integer({ min: 0, max: 60 }),
    unique: fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
    nodeid: fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
    uid: fc.nat({ max: 0xffffffff }),
    gid: fc.nat({ max: 0xffffffff }),
    pid: fc.nat({ max: 0xffffffff }),
  });
  const frameOf = (h: Omit<InHeader, 'len' | 'totalExtlen'>, body: Buffer, ext: Buffer) =>
    Buffer.concat([
      encodeInHeader({
        ...h,
        len: IN_HEADER_BYTES + body.length + ext.length,
        totalExtlen: ext.length / 8,
      }),
      body,
      ext,
    ]);

  test('requests: a well-formed frame splits back into its header and body', () => {
    fc.assert(
      fc.property(header, bytes(), fc.nat({ max: 4 }), (h, body, extWords) => {
        const ext = Buffer.alloc(extWords * 8, 0xee);
        const got = decodeRequest(frameOf(h, body, ext));
        assert.deepEqual(
          { ...got.header },
          {
            ...h,
            len: IN_HEADER_BYTES + body.length + ext.length,
            totalExtlen: extWords,
          },
        );
        assert.ok(
          got.body.equals(body),
          'extensions follow the arguments and are not part of them',
        );
      }),
    );
  });

  test('requests: a frame whose lengths disagree is refused, never read past', () => {
    fc.assert(
      fc.property(
        header,
        bytes(),
        fc.oneof(
          fc.record({ kind: fc.constant('len' as const), len: fc.nat({ max: 0xffffffff }) }),
          fc.record({ kind: fc.constant('ext' as const), ext: fc.nat({ max: 0xffff }) }),
          fc.record({ kind: fc.constant('cut' as const), keep: fc.nat({ max: 200 }) }),
        ),
        (h, body, m) => {
          let frame = frameOf(h, body, Buffer.alloc(0));
          if (m.kind === 'len') frame.writeUInt32LE(m.len, 0);
          if (m.kind === 'ext') frame.writeUInt16LE(m.ext, 36);
          if (m.kind === 'cut') frame = frame.subarray(0, m.keep);
          const len = frame.length >= 4 ? frame.readUInt32LE(0) : -1;
          const ext = frame.length >= 38 ? frame.readUInt16LE(36) * 8 : 0;
          const valid =
            frame.length >= IN_HEADER_BYTES && len === frame.length && len - ext >= IN_HEADER_BYTES;
          try {
            const r = decodeRequest(frame);
            assert.ok(valid, 'accepted a frame whose lengths disagree');
            assert.ok(r.body.length <= frame.length - IN_HEADER_BYTES);
          } catch (err) {
            assert.ok(err instanceof FuseProtocolError, String(err));
            assert.ok(!valid, `refused a good frame: ${String(err)}`);
          }
        },
      ),
      { numRuns: 2000 },
    );
  });

  const name = fc.oneof(
    fc.string({ minLength: 1, maxLength: 80, unit: 'grapheme' }),
    fc.uint8Array({ minLength: 1, maxLength: 40 }).map((a) => Buffer.from(a).toString('latin1')),
  );
  const dirent = fc
    .record({
      ino: fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
      off: fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }),
      type: fc.nat({ max: 15 }),
      name,
    })
    .map((e) => ({ ...e })); // plain objects, as the decoder makes

  test('dirents: round-trip any names, and a cut or lying reply is refused', () => {
    fc.assert(
      fc.property(
        fc.array(dirent, { maxLength: 12, size: 'max' }),
        fc.nat({ max: 8192 }),
        (entries, max) => {
          const { buf, count } = encodeDirents(entries, max);
          assert.ok(buf.length <= max);
          assert.deepEqual(decodeDirents(buf), entries.slice(0, count));
        },
      ),
      { numRuns: 500 },
    );
    fc.assert(
      fc.property(
        fc.array(dirent, { minLength: 1, maxLength: 6, size: 'max' }),
        fc.nat(),
        fc.nat({ max: 0xffffffff }),
        (entries, pick, namelen) => {
          const { buf } = encodeDirents(entries, 1 << 20);
          // Cut anywhere inside the last entry's header or name: refused.
          const lastAt = buf.length - direntBytes(entries.at(-1)!.name);
          const nameEnd = lastAt + 24 + Buffer.byteLength(entries.at(-1)!.name);
          const cut = lastAt + 1 + (pick % (nameEnd - lastAt));
          if (cut < nameEnd)
            assert.throws(() => decodeDirents(buf.subarray(0, cut)), FuseProtocolError);
          // A namelen that runs past the end: refused; one that fits: parsed within bounds.
          const lied = Buffer.from(buf);
          lied.writeUInt32LE(namelen, lastAt + 16);
          if (lastAt + 24 + namelen > lied.length)
            assert.throws(() => decodeDirents(lied), FuseProtocolError);
          else onlyOwnErrors('decodeDirents', decodeDirents, lied);
        },
      ),
      { numRuns: 500 },
    );
  });

  test('a name that is not UTF-8 does not shift the dirents after it', () => {
    const entries = [
      { ino: 5n, off: 1n, type: 8, name: 'x' },
      { ino: 6n, off: 2n, type: 8, name: 'after' },
    ];
    const { buf } = encodeDirents(entries, 4096);
    buf[24] = 0xff; // the first name's only byte: invalid UTF-8, decoded as 3 bytes of U+FFFD
    const got = decodeDirents(buf);
    assert.equal(got.length, 2);
    assert.deepEqual(got[1], entries[1]);
  });

  test('names must carry their NUL; a short open or release body is malformed', () => {
    assert.throws(() => decodeName(Buffer.from('abc')), FuseProtocolError);
    assert.equal(decodeName(Buffer.from('abc\0junk')), 'abc');
    assert.throws(() => decodeOpenFlags(Buffer.alloc(3)), FuseProtocolError);
    assert.throws(() => decodeFh(Buffer.alloc(7)), FuseProtocolError);
    assert.throws(() => decodeReadIn(Buffer.alloc(23)), FuseProtocolError);
    assert.throws(() => readAttr(Buffer.alloc(200), -1), FuseProtocolError);
  });
});
