import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  ATTR_OUT_BYTES,
  ENTRY_OUT_BYTES,
  FOPEN_KEEP_CACHE,
  FUSE_ASYNC_READ,
  FUSE_MAX_PAGES,
  INIT_OUT_BYTES,
  KSTATFS_BYTES,
  OPEN_OUT_BYTES,
  OUT_HEADER_BYTES,
  S_IFREG,
  decodeDirents,
  decodeInHeader,
  decodeInitIn,
  decodeInitOut,
  decodeName,
  decodeOutHeader,
  decodeReadIn,
  decodeStatfsOut,
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
    assert.equal(decodeName(Buffer.from('abc')), 'abc');
  });
});
