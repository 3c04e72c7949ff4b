import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { DsecError } from '@dsec/core';
import { ChunkCache, isValidChunkBytes, MAX_CHUNK_BYTES, type RangeSource } from './chunk-cache.js';

const CHUNK = 64 << 10;
const HEX = 'ab'.repeat(32);
const DIGEST = `sha256:${HEX}`;

/** The raw sha256 of each chunk of `data`. */
function tableOf(data: Buffer): Buffer[] {
  const out: Buffer[] = [];
  for (let at = 0; at < data.length; at += CHUNK)
    out.push(
      createHash('sha256')
        .update(data.subarray(at, at + CHUNK))
        .digest(),
    );
  return out;
}

/** A source holding one blob that counts its range reads and fails on demand. */
class FakeSource implements RangeSource {
  calls: { offset: number; length: number }[] = [];
  failing = false;
  delayMs = 0;
  /** Chunk indexes whose bytes come back altered. */
  corrupt = new Set<number>();
  constructor(readonly data: Buffer) {}
  async statBlob(digest: string) {
    if (digest !== DIGEST) throw new DsecError('image_not_found', digest);
    return { sizeBytes: this.data.length };
  }
  async readBlobRange(digest: string, offset: number, length: number) {
    if (digest !== DIGEST) throw new DsecError('image_not_found', digest);
    this.calls.push({ offset, length });
    if (this.delayMs) await new Promise((r) => setTimeout(r, this.delayMs));
    if (this.failing) throw new Error('store down');
    const bytes = this.data.subarray(offset, offset + length);
    if (!this.corrupt.has(Math.floor(offset / CHUNK))) return bytes;
    const altered = Buffer.from(bytes);
    altered[7] = altered[7]! ^ 0xff;
    return altered;
  }
}

async function setup(
  t: { after: (fn: () => Promise<void>) => void },
  blobBytes = 10 * CHUNK + 100,
) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-chunk-cache-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  return { dir, source: new FakeSource(randomBytes(blobBytes)) };
}

test('isValidChunkBytes: powers of two from 64 KiB to the cap, nothing a 32-bit test lets through', () => {
  for (const ok of [65536, 262144, 1 << 20, MAX_CHUNK_BYTES])
    assert.equal(isValidChunkBytes(ok), true, String(ok));
  for (const bad of [
    0,
    4096,
    65535,
    65537,
    3 * 65536,
    2 * MAX_CHUNK_BYTES,
    2 ** 32,
    2 ** 32 + 65536,
    2 ** 40,
    -65536,
    65536.5,
    NaN,
    Infinity,
  ])
    assert.equal(isValidChunkBytes(bad), false, String(bad));
});

describe('ChunkCache', () => {
  test('assembles ranges across chunks and fetches each chunk once', async (t) => {
    const { dir, source } = await setup(t);
    const cache = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    const size = source.data.length;
    for (const [off, len] of [
      [0, 10],
      [CHUNK - 5, 10],
      [3 * CHUNK + 7, 2 * CHUNK + 1],
      [size - 50, 1000],
      [size, 10],
    ] as const) {
      const got = await cache.read(DIGEST, size, off, len);
      assert.ok(got.equals(source.data.subarray(off, Math.min(off + len, size))), `${off}+${len}`);
    }
    assert.deepEqual(
      source.calls.map((c) => c.offset / CHUNK),
      [0, 1, 3, 4, 5, 10],
    );
    assert.equal(source.calls.at(-1)!.length, 100); // the short last chunk
    const s = cache.stats();
    assert.equal(s.fetches, 6);
    assert.equal(s.cachedChunks, 6);
    assert.equal(s.cachedBytes, 5 * CHUNK + 100);
    assert.equal(s.bytesFetched, 5 * CHUNK + 100);
    assert.equal(s.hits, 1); // the second chunk-0 read came from disk
    await cache.read(DIGEST, size, 0, size);
    assert.equal(cache.stats().fetches, 11);
  });

  test('concurrent readers of a missing chunk share one fetch', async (t) => {
    const { dir, source } = await setup(t);
    source.delayMs = 20;
    const cache = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    const reads = Array.from({ length: 8 }, (_, i) =>
      cache.read(DIGEST, source.data.length, i * 100, 100),
    );
    const got = await Promise.all(reads);
    got.forEach((b, i) => assert.ok(b.equals(source.data.subarray(i * 100, i * 100 + 100))));
    assert.equal(source.calls.length, 1);
  });

  test('bounds concurrent fetches', async (t) => {
    const { dir, source } = await setup(t);
    let active = 0;
    let peak = 0;
    const inner = source.readBlobRange.bind(source);
    source.readBlobRange = async (d, o, l) => {
      peak = Math.max(peak, ++active);
      await new Promise((r) => setTimeout(r, 5));
      active--;
      return inner(d, o, l);
    };
    const cache = await ChunkCache.open({
      dir,
      source,
      budgetBytes: 1 << 30,
      chunkBytes: CHUNK,
      maxConcurrentFetches: 2,
    });
    const size = source.data.length;
    assert.ok((await cache.read(DIGEST, size, 0, size)).equals(source.data));
    assert.equal(peak, 2);
  });

  test('evicts least recently used chunks beyond the budget', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const cache = await ChunkCache.open({ dir, source, budgetBytes: 3 * CHUNK, chunkBytes: CHUNK });
    await cache.read(DIGEST, size, 0, 1); // chunk 0
    await cache.read(DIGEST, size, CHUNK, 1); // chunk 1
    await cache.read(DIGEST, size, 2 * CHUNK, 1); // chunk 2
    await cache.read(DIGEST, size, 0, 1); // touch chunk 0: chunk 1 is now the oldest
    await cache.read(DIGEST, size, 3 * CHUNK, 1); // chunk 3 evicts chunk 1
    const s = cache.stats();
    assert.equal(s.evictions, 1);
    assert.equal(s.cachedChunks, 3);
    assert.ok(s.cachedBytes <= s.budgetBytes);
    const files = (await readdir(dir)).map((f) => Number(f.split('.')[2])).sort();
    assert.deepEqual(files, [0, 2, 3]);
    source.calls = [];
    await cache.read(DIGEST, size, 0, 1);
    assert.equal(source.calls.length, 0);
    await cache.read(DIGEST, size, CHUNK, 1);
    assert.equal(source.calls.length, 1);
    // A whole read through a small budget stays correct.
    assert.ok((await cache.read(DIGEST, size, 0, size)).equals(source.data));
  });

  test('a restarted cache reuses its chunks and discards temp files', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const first = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    await first.read(DIGEST, size, 0, 3 * CHUNK);
    await writeFile(join(dir, `${HEX}.${CHUNK}.7.tmp.1.0`), 'partial');
    // Chunks of other valid sizes may stay (reads with tables of that size); this one no cache can hold.
    await writeFile(join(dir, `${HEX}.100000.0`), 'not a chunk size');
    source.calls = [];
    const second = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    assert.equal(second.stats().cachedChunks, 3);
    assert.equal(second.stats().cachedBytes, 3 * CHUNK);
    assert.ok(
      (await second.read(DIGEST, size, 10, 3 * CHUNK - 20)).equals(
        source.data.subarray(10, 3 * CHUNK - 10),
      ),
    );
    assert.equal(source.calls.length, 0);
    assert.equal((await readdir(dir)).length, 3);
    // A smaller budget at restart trims the oldest chunks.
    const third = await ChunkCache.open({ dir, source, budgetBytes: CHUNK, chunkBytes: CHUNK });
    assert.equal(third.stats().cachedChunks, 1);
    assert.equal((await readdir(dir)).length, 1);
  });

  test('a failed fetch fails that read only, is logged once, and is retried later', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const lines: string[] = [];
    const cache = await ChunkCache.open({
      dir,
      source,
      budgetBytes: 1 << 30,
      chunkBytes: CHUNK,
      log: (l) => lines.push(l),
    });
    source.failing = true;
    source.delayMs = 5;
    const reads = [cache.read(DIGEST, size, 0, 10), cache.read(DIGEST, size, 20, 10)];
    for (const r of reads)
      await assert.rejects(
        r,
        (err: unknown) => err instanceof DsecError && err.code === 'unavailable',
      );
    assert.equal(lines.length, 1);
    assert.match(lines[0]!, /store down/);
    assert.equal(cache.stats().cachedChunks, 0);
    source.failing = false;
    assert.ok((await cache.read(DIGEST, size, 0, 10)).equals(source.data.subarray(0, 10)));
  });

  test('a chunk removed behind its back is refetched', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const cache = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    await cache.read(DIGEST, size, 0, 10);
    await rm(join(dir, `${HEX}.${CHUNK}.0`));
    assert.ok((await cache.read(DIGEST, size, 0, 10)).equals(source.data.subarray(0, 10)));
    assert.equal(source.calls.length, 2);
  });

  test('rejects bad chunk sizes', async (t) => {
    const { dir, source } = await setup(t);
    for (const chunkBytes of [1000, 32 << 10, (64 << 10) + 1])
      await assert.rejects(
        ChunkCache.open({ dir, source, budgetBytes: 1, chunkBytes }),
        (err: unknown) => err instanceof DsecError && err.code === 'invalid_argument',
      );
  });

  test('with a chunk table, good chunks pass and a corrupt one fails only its reads', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const table = tableOf(source.data);
    const lines: string[] = [];
    const cache = await ChunkCache.open({
      dir,
      source,
      budgetBytes: 1 << 30,
      chunkBytes: CHUNK,
      log: (l) => lines.push(l),
    });
    source.corrupt.add(4);
    for (const [off, len] of [
      [0, 10],
      [CHUNK - 5, 10],
      [3 * CHUNK + 7, CHUNK - 7],
      [5 * CHUNK, 2 * CHUNK],
      [size - 50, 100],
    ] as const)
      assert.ok(
        (await cache.read(DIGEST, size, off, len, table)).equals(
          source.data.subarray(off, Math.min(off + len, size)),
        ),
        `${off}+${len}`,
      );
    for (const [off, len] of [
      [4 * CHUNK, 1],
      [4 * CHUNK - 10, 20],
      [3 * CHUNK, 3 * CHUNK],
    ] as const)
      await assert.rejects(
        cache.read(DIGEST, size, off, len, table),
        (err: unknown) =>
          err instanceof DsecError &&
          err.code === 'internal' &&
          err.message === `chunk 4 of ${DIGEST} does not match its digest`,
        `${off}+${len}`,
      );
    const s = cache.stats();
    assert.equal(s.corruptChunks, 3); // each read refetched (and rejected) chunk 4
    assert.equal(s.verifiedChunks, 6); // chunks 0, 1, 3, 5, 6 and 10
    assert.equal(lines.length, 3);
    assert.match(lines[0]!, /chunk 4 of sha256:ab.* does not match its digest/);
    const files = await readdir(dir);
    assert.ok(!files.some((f) => f.startsWith(`${HEX}.${CHUNK}.4`)), files.join());
    assert.ok(
      files.every((f) => f.endsWith('.v')),
      files.join(),
    );
    // Other chunks still read fine; a fixed source heals chunk 4.
    assert.ok(
      (await cache.read(DIGEST, size, 0, 3 * CHUNK, table)).equals(
        source.data.subarray(0, 3 * CHUNK),
      ),
    );
    source.corrupt.clear();
    assert.ok(
      (await cache.read(DIGEST, size, 4 * CHUNK, CHUNK, table)).equals(
        source.data.subarray(4 * CHUNK, 5 * CHUNK),
      ),
    );
    // A table of the wrong length is refused.
    await assert.rejects(
      cache.read(DIGEST, size, 0, 1, table.slice(1)),
      (err: unknown) => err instanceof DsecError && err.code === 'invalid_argument',
    );
  });

  test('a chunk cached unverified is checked once before a verified read uses it', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const table = tableOf(source.data);
    const lines: string[] = [];
    const cache = await ChunkCache.open({
      dir,
      source,
      budgetBytes: 1 << 30,
      chunkBytes: CHUNK,
      log: (l) => lines.push(l),
    });
    source.corrupt.add(1);
    await cache.read(DIGEST, size, 0, 2 * CHUNK); // unverified: chunk 1 cached altered
    assert.equal(source.calls.length, 2);
    source.calls = [];
    source.corrupt.clear();
    assert.ok(
      (await cache.read(DIGEST, size, 0, 2 * CHUNK, table)).equals(
        source.data.subarray(0, 2 * CHUNK),
      ),
    );
    assert.deepEqual(
      source.calls.map((c) => c.offset / CHUNK),
      [1],
    ); // chunk 0 passed from disk, chunk 1 was refetched
    assert.equal(lines.length, 1);
    assert.deepEqual((await readdir(dir)).sort(), [`${HEX}.${CHUNK}.0.v`, `${HEX}.${CHUNK}.1.v`]);
    // The verified status survives a restart.
    source.calls = [];
    const again = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    assert.equal(again.stats().cachedChunks, 2);
    assert.ok(
      (await again.read(DIGEST, size, 0, 2 * CHUNK, table)).equals(
        source.data.subarray(0, 2 * CHUNK),
      ),
    );
    assert.ok(
      (await again.read(DIGEST, size, 0, 2 * CHUNK)).equals(source.data.subarray(0, 2 * CHUNK)),
    );
    assert.equal(source.calls.length, 0);
  });

  test('a read with a table of another chunk size is cut and cached at the table’s size', async (t) => {
    const { dir, source } = await setup(t);
    const size = source.data.length;
    const cache = await ChunkCache.open({ dir, source, budgetBytes: 1 << 30, chunkBytes: CHUNK });
    const big = 4 * CHUNK;
    const table: Buffer[] = [];
    for (let at = 0; at < size; at += big)
      table.push(
        createHash('sha256')
          .update(source.data.subarray(at, at + big))
          .digest(),
      );
    assert.ok(
      (await cache.read(DIGEST, size, big + 10, 100, table, big)).equals(
        source.data.subarray(big + 10, big + 110),
      ),
    );
    assert.deepEqual(source.calls, [{ offset: big, length: big }]);
    assert.deepEqual(await readdir(dir), [`${HEX}.${big}.1.v`]);
    // Without the table the cache's own size applies; a size no cache can hold is refused.
    await cache.read(DIGEST, size, big + 10, 100);
    assert.deepEqual(source.calls[1], { offset: big, length: CHUNK });
    await assert.rejects(cache.read(DIGEST, size, 0, 1, table, 100_000), {
      code: 'invalid_argument',
    });
  });

  test('sequential reads fetch ahead, bounded by 1/16 of the run and the maximum; scattered reads do not', async (t) => {
    const { dir, source } = await setup(t, 96 * CHUNK);
    const size = source.data.length;
    const cache = await ChunkCache.open({
      dir,
      source,
      budgetBytes: 1 << 30,
      chunkBytes: CHUNK,
      readaheadMaxBytes: 3 * CHUNK,
    });
    const half = CHUNK / 2;
    // Read 80 chunks in half-chunk steps. Under 16 chunks the run fetches
    // nothing ahead; from then on at most 1/16 of it (3 chunks at most).
    for (let at = 0; at < 80 * CHUNK; at += half) {
      await cache.read(DIGEST, size, at, half);
      await cache.settled();
      const fetchedTo = Math.max(...source.calls.map((c) => c.offset / CHUNK)) + 1;
      const read = Math.ceil((at + half) / CHUNK);
      const window = Math.min(3, Math.floor((at + half) / 16 / CHUNK));
      assert.ok(
        fetchedTo - read <= window,
        `at ${at / CHUNK}: fetched to ${fetchedTo}, read ${read}`,
      );
      if (at + half < 16 * CHUNK) assert.equal(cache.stats().readaheadFetches, 0);
    }
    // Each chunk fetched once, and from 16 chunks on nearly all before their read.
    assert.equal(new Set(source.calls.map((c) => c.offset)).size, source.calls.length);
    const { readaheadFetches, readaheadHits } = cache.stats();
    assert.ok(readaheadFetches >= 60, JSON.stringify(cache.stats()));
    assert.ok(readaheadFetches - readaheadHits <= 3, JSON.stringify(cache.stats()));

    // Scattered single reads elsewhere: each fetches its own chunk and nothing more.
    source.calls = [];
    for (const i of [90, 84, 95, 87]) await cache.read(DIGEST, size, i * CHUNK + 100, 200);
    await cache.settled();
    assert.deepEqual(
      source.calls.map((c) => c.offset / CHUNK),
      [90, 84, 95, 87],
    );
  });
});
