import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { CHUNK_TABLE_CHUNK_BYTES, encodeChunkTable, parseChunkTable } from './chunk-table.js';
import { isDsecError } from './errors.js';

const sha = (b: Buffer) => createHash('sha256').update(b).digest();

test('a chunk table round-trips and has the documented layout', () => {
  assert.equal(CHUNK_TABLE_CHUNK_BYTES, 256 << 10);
  const digests = [sha(Buffer.from('a')), sha(Buffer.from('b')), sha(randomBytes(10))];
  const bytes = encodeChunkTable(CHUNK_TABLE_CHUNK_BYTES, digests);
  assert.equal(bytes.length, 16 + 3 * 32);
  assert.equal(bytes.subarray(0, 8).toString('ascii'), 'DSECCHK1');
  assert.equal(bytes.readUInt32LE(8), 256 << 10);
  assert.equal(bytes.readUInt32LE(12), 0);
  assert.ok(bytes.subarray(16 + 32, 16 + 64).equals(digests[1]!));
  const parsed = parseChunkTable(bytes);
  assert.equal(parsed.chunkBytes, 256 << 10);
  assert.equal(parsed.digests.length, 3);
  parsed.digests.forEach((d, i) => assert.ok(d.equals(digests[i]!)));

  const empty = parseChunkTable(encodeChunkTable(65536, []));
  assert.deepEqual(empty, { chunkBytes: 65536, digests: [] });
});

test('bad tables are rejected with invalid_argument', () => {
  const good = encodeChunkTable(1 << 20, [sha(Buffer.from('x'))]);
  const zeroSize = Buffer.from(good);
  zeroSize.writeUInt32LE(0, 8);
  const reserved = Buffer.from(good);
  reserved.writeUInt32LE(1, 12);
  const badMagic = Buffer.from(good);
  badMagic[7] = 0x32; // DSECCHK2
  for (const [name, bad] of [
    ['empty', Buffer.alloc(0)],
    ['short header', good.subarray(0, 15)],
    ['bad magic', badMagic],
    ['zero chunk size', zeroSize],
    ['reserved word', reserved],
    ['truncated digest', good.subarray(0, good.length - 1)],
    ['extra byte', Buffer.concat([good, Buffer.alloc(1)])],
  ] as const)
    assert.throws(
      () => parseChunkTable(bad),
      (e) => isDsecError(e, 'invalid_argument'),
      name,
    );
  assert.throws(
    () => encodeChunkTable(1 << 20, [Buffer.alloc(31)]),
    (e) => isDsecError(e, 'invalid_argument'),
  );
  assert.throws(
    () => encodeChunkTable(0, []),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});
