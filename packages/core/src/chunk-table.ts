/**
 * Chunk tables: the per-chunk sha256 digests of a data blob, stored as an
 * ordinary blob of their own so a reader fetching the data blob piecemeal
 * can verify each chunk as it arrives.
 *
 * Layout: the 8 ASCII bytes `DSECCHK1`, the chunk size as a u32 little
 * endian, a u32 zero, then one raw 32-byte sha256 per chunk of the data blob
 * in order (the last chunk may be shorter than the chunk size). A blob of
 * `size` bytes has `ceil(size / chunkBytes)` entries (none when empty).
 */
import { DsecError } from './errors.js';

/**
 * The chunk size tables are written with: 256 KiB, the paper's, and the blob
 * daemon's default. A reader cuts a blob read with a table at the table's
 * chunk size, so tables written earlier with 1 MiB chunks stay readable.
 */
export const CHUNK_TABLE_CHUNK_BYTES = 256 << 10;

const MAGIC = Buffer.from('DSECCHK1', 'ascii');
const HEADER_BYTES = 16;
const DIGEST_BYTES = 32;

export interface ChunkTable {
  chunkBytes: number;
  /** Raw 32-byte sha256 of each chunk, in order. */
  digests: Buffer[];
}

/** The table bytes for chunks of `chunkSize` bytes with these raw sha256 digests. */
export function encodeChunkTable(chunkSize: number, digests: Buffer[]): Buffer {
  if (!Number.isInteger(chunkSize) || chunkSize < 1 || chunkSize > 0xffff_ffff)
    throw new DsecError('invalid_argument', 'chunk size must be an integer in [1, 2^32)', {
      field: 'chunkSize',
    });
  const out = Buffer.alloc(HEADER_BYTES + digests.length * DIGEST_BYTES);
  MAGIC.copy(out, 0);
  out.writeUInt32LE(chunkSize, 8);
  out.writeUInt32LE(0, 12);
  digests.forEach((d, i) => {
    if (d.length !== DIGEST_BYTES)
      throw new DsecError('invalid_argument', `chunk digest ${i} is not 32 bytes`, {
        field: `digests.${i}`,
      });
    d.copy(out, HEADER_BYTES + i * DIGEST_BYTES);
  });
  return out;
}

/**
 * The chunk size and digests of a table. Throws `invalid_argument` on a bad
 * magic, a zero chunk size, a non-zero reserved word or a truncated body.
 * The digests are views into `bytes`.
 */
export function parseChunkTable(bytes: Buffer): ChunkTable {
  if (bytes.length < HEADER_BYTES || !bytes.subarray(0, 8).equals(MAGIC))
    throw new DsecError('invalid_argument', 'not a chunk table (bad magic)');
  const chunkBytes = bytes.readUInt32LE(8);
  if (chunkBytes === 0) throw new DsecError('invalid_argument', 'chunk table: zero chunk size');
  if (bytes.readUInt32LE(12) !== 0)
    throw new DsecError('invalid_argument', 'chunk table: reserved header word is not zero');
  const body = bytes.length - HEADER_BYTES;
  if (body % DIGEST_BYTES !== 0)
    throw new DsecError(
      'invalid_argument',
      `chunk table: body of ${body} bytes is not a whole number of digests`,
    );
  const digests: Buffer[] = [];
  for (let at = HEADER_BYTES; at < bytes.length; at += DIGEST_BYTES)
    digests.push(bytes.subarray(at, at + DIGEST_BYTES));
  return { chunkBytes, digests };
}
