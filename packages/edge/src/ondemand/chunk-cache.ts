import { createHash } from 'node:crypto';
import { mkdir, open, readdir, rename, stat, unlink, utimes, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { ImageStore } from '@dsec/core';

/** What the chunk cache reads blobs from: the two ranged calls of an image store. */
export type RangeSource = Pick<ImageStore, 'statBlob' | 'readBlobRange'>;

export interface ChunkCacheOptions {
  /** Directory of the chunk files (created if missing; owned by this cache alone). */
  dir: string;
  source: RangeSource;
  /** Chunks are evicted, least recently used first, beyond this many bytes. */
  budgetBytes: number;
  /** Size of a chunk, the unit of fetching and eviction: a power of two ≥ 64 KiB. Default 1 MiB. */
  chunkBytes?: number;
  /** At most this many chunk fetches run at once. Default 8. */
  maxConcurrentFetches?: number;
  /** Where fetch failures are reported, one line each. Default: stderr. */
  log?: (line: string) => void;
}

export interface ChunkCacheStats {
  chunkBytes: number;
  budgetBytes: number;
  cachedBytes: number;
  cachedChunks: number;
  /** Chunk fetches from the source that succeeded, and their bytes. */
  fetches: number;
  bytesFetched: number;
  /** Chunk accesses served from disk, and those that had to fetch (or wait for a fetch). */
  hits: number;
  misses: number;
  evictions: number;
  /** Chunks fetched for a read with a chunk table whose sha256 matched it. */
  verifiedChunks: number;
  /** Chunks fetched for a read with a chunk table whose sha256 did not match (not cached). */
  corruptChunks: number;
}

export const DEFAULT_CHUNK_BYTES = 1 << 20;
const MIN_CHUNK_BYTES = 64 << 10;
/** Last-access times on disk are refreshed at most this often per chunk. */
const TOUCH_INTERVAL_MS = 60_000;
const HEX_DIGEST = /^sha256:([0-9a-f]{64})$/;

interface Entry {
  file: string;
  bytes: number;
  touchedMs: number;
  /** Checked against a chunk table when fetched (the file name ends in `.v`). */
  verified: boolean;
}

/**
 * A bounded on-disk cache of fixed-size chunks of immutable blobs, filled on
 * demand from a {@link RangeSource}.
 *
 * Chunk `i` of a blob holds bytes `[i*chunkBytes, (i+1)*chunkBytes)` (the last
 * one is shorter) in the file `<hex>.<chunkBytes>.<i>`, written to a temp
 * file and renamed into place, so a file under its final name is complete.
 * Concurrent reads of one missing chunk share a single fetch. Eviction
 * unlinks files; a reader that still has one open keeps reading it, and one
 * that lost the race refetches. At open the index is rebuilt from the
 * directory (modification time orders the LRU), so a restarted daemon keeps
 * its warm cache; temp files and chunks of another chunk size are removed.
 *
 * Verification: a read given a chunk table (the raw sha256 of each chunk)
 * hashes every chunk it fetches from the source and compares it with the
 * table before the chunk is stored or returned; a mismatch stores nothing,
 * logs one line and fails that read with `internal` (EIO to the kernel).
 * Verification happens at fetch time only: chunks on disk are trusted (the
 * cache directory is this daemon's alone, mode 0700). A verified chunk is
 * kept as `<hex>.<chunkBytes>.<i>.v`, so its status survives a restart; a
 * chunk fetched by a read without a table (an unverified name) is hashed
 * once from disk when a read with a table first touches it, and refetched
 * when it does not match. Reads with and without a table never share a fetch.
 */
export class ChunkCache {
  readonly chunkBytes: number;
  readonly budgetBytes: number;
  private readonly dir: string;
  private readonly source: RangeSource;
  private readonly log: (line: string) => void;
  /** Key → entry, least recently used first. */
  private readonly index = new Map<string, Entry>();
  private readonly inflight = new Map<string, Promise<Buffer>>();
  private readonly slots: Semaphore;
  private cachedBytes = 0;
  private tmpSeq = 0;
  private counters = {
    fetches: 0,
    bytesFetched: 0,
    hits: 0,
    misses: 0,
    evictions: 0,
    verifiedChunks: 0,
    corruptChunks: 0,
  };

  private constructor(options: ChunkCacheOptions, chunkBytes: number) {
    this.dir = options.dir;
    this.source = options.source;
    this.budgetBytes = options.budgetBytes;
    this.chunkBytes = chunkBytes;
    this.log = options.log ?? ((line) => process.stderr.write(`${line}\n`));
    this.slots = new Semaphore(options.maxConcurrentFetches ?? 8);
  }

  /**
   * Opens (creating) the cache directory and rebuilds the index from it.
   * Throws `invalid_argument` for a bad chunk size or budget.
   */
  static async open(options: ChunkCacheOptions): Promise<ChunkCache> {
    const chunkBytes = options.chunkBytes ?? DEFAULT_CHUNK_BYTES;
    if (
      !Number.isSafeInteger(chunkBytes) ||
      chunkBytes < MIN_CHUNK_BYTES ||
      (chunkBytes & (chunkBytes - 1)) !== 0
    )
      throw new DsecError('invalid_argument', 'chunk size must be a power of two ≥ 64 KiB', {
        field: 'chunkBytes',
      });
    if (!Number.isSafeInteger(options.budgetBytes) || options.budgetBytes < 0)
      throw new DsecError('invalid_argument', 'cache budget must be a byte count ≥ 0', {
        field: 'budgetBytes',
      });
    if ((options.maxConcurrentFetches ?? 8) < 1)
      throw new DsecError('invalid_argument', 'maxConcurrentFetches must be ≥ 1', {
        field: 'maxConcurrentFetches',
      });
    const cache = new ChunkCache(options, chunkBytes);
    await mkdir(options.dir, { recursive: true, mode: 0o700 });
    await cache.rebuildIndex();
    return cache;
  }

  stats(): ChunkCacheStats {
    return {
      chunkBytes: this.chunkBytes,
      budgetBytes: this.budgetBytes,
      cachedBytes: this.cachedBytes,
      cachedChunks: this.index.size,
      ...this.counters,
    };
  }

  /**
   * Bytes `[offset, offset+length)` of the blob `digest` (`sha256:<hex>`) of
   * `blobSize` bytes, clipped at its end. Rejects `unavailable` when a chunk
   * fetch failed (that read only; the next read tries again).
   *
   * With `table` (the raw sha256 of each chunk of this cache's chunk size,
   * `ceil(blobSize / chunkBytes)` of them) every chunk fetched is verified;
   * a chunk that does not match rejects `internal` (details `corruptChunk`).
   */
  async read(
    digest: string,
    blobSize: number,
    offset: number,
    length: number,
    table?: Buffer[],
  ): Promise<Buffer> {
    const hex = HEX_DIGEST.exec(digest)?.[1];
    if (!hex) throw new DsecError('invalid_argument', `malformed digest ${digest}`);
    const end = Math.min(offset + length, blobSize);
    if (offset < 0 || length < 0) throw new DsecError('invalid_argument', 'negative range');
    if (table && table.length !== Math.ceil(blobSize / this.chunkBytes))
      throw new DsecError(
        'invalid_argument',
        `chunk table of ${table.length} chunks does not fit ${blobSize} bytes in chunks of ${this.chunkBytes}`,
      );
    if (offset >= end) return Buffer.alloc(0);
    const first = Math.floor(offset / this.chunkBytes);
    const last = Math.floor((end - 1) / this.chunkBytes);
    const parts: Promise<Buffer>[] = [];
    for (let i = first; i <= last; i++) {
      const base = i * this.chunkBytes;
      const from = Math.max(offset, base) - base;
      const to = Math.min(end, base + this.chunkBytes) - base;
      parts.push(this.readChunk(hex, blobSize, i, from, to, table?.[i]));
    }
    const buffers = await Promise.all(parts);
    return buffers.length === 1 ? buffers[0]! : Buffer.concat(buffers);
  }

  private keyOf(hex: string, index: number): string {
    return `${hex}.${this.chunkBytes}.${index}`;
  }

  /** Bytes `[from, to)` of chunk `index`, checked against `sha256` when given. */
  private async readChunk(
    hex: string,
    blobSize: number,
    index: number,
    from: number,
    to: number,
    sha256?: Buffer,
  ): Promise<Buffer> {
    const key = this.keyOf(hex, index);
    const expected = Math.min(this.chunkBytes, blobSize - index * this.chunkBytes);
    let entry = this.index.get(key);
    if (entry && entry.bytes === expected && sha256 && !entry.verified)
      entry = await this.upgrade(key, entry, sha256);
    if (entry && entry.bytes === expected) {
      const data = await readRange(entry.file, from, to - from);
      if (data) {
        this.counters.hits++;
        this.index.delete(key); // most recently used goes last
        this.index.set(key, entry);
        const now = Date.now();
        if (now - entry.touchedMs > TOUCH_INTERVAL_MS) {
          entry.touchedMs = now;
          utimes(entry.file, now / 1000, now / 1000).catch(() => undefined);
        }
        return data;
      }
    }
    if (entry && this.index.get(key) === entry) await this.drop(key, entry); // vanished or wrong size
    this.counters.misses++;
    const chunk = await this.fetch(hex, index, key, expected, sha256);
    return chunk.subarray(from, to);
  }

  /**
   * A cached chunk fetched without a table, hashed from disk against
   * `sha256`: marked verified when it matches, dropped (undefined) when not.
   */
  private async upgrade(key: string, entry: Entry, sha256: Buffer): Promise<Entry | undefined> {
    const data = await readRange(entry.file, 0, entry.bytes);
    if (this.index.get(key) !== entry || entry.verified) {
      const current = this.index.get(key);
      return current?.verified ? current : undefined;
    }
    if (!data) {
      await this.drop(key, entry); // vanished or short: fetch it afresh
      return undefined;
    }
    if (!createHash('sha256').update(data).digest().equals(sha256)) {
      this.log(`blobd: cached ${key} (fetched unverified) does not match its digest; refetching`);
      await this.drop(key, entry);
      return undefined;
    }
    const file = `${entry.file}.v`;
    try {
      await rename(entry.file, file);
      entry.file = file;
    } catch {
      // still verified for this run; a restart hashes it again
    }
    entry.verified = true;
    return entry;
  }

  /** The whole chunk, fetched once however many readers (of one kind) wait for it. */
  private fetch(
    hex: string,
    index: number,
    key: string,
    expected: number,
    sha256?: Buffer,
  ): Promise<Buffer> {
    const flight = sha256 ? `${key}.v` : key;
    let pending = this.inflight.get(flight);
    if (pending) return pending;
    pending = this.fetchAndStore(hex, index, key, expected, sha256);
    this.inflight.set(flight, pending);
    const done = () => void this.inflight.delete(flight);
    pending.then(done, done);
    return pending;
  }

  private async fetchAndStore(
    hex: string,
    index: number,
    key: string,
    expected: number,
    sha256?: Buffer,
  ): Promise<Buffer> {
    const digest = `sha256:${hex}`;
    let data: Buffer;
    await this.slots.acquire();
    try {
      data = await this.source.readBlobRange(digest, index * this.chunkBytes, expected);
      if (data.length !== expected)
        throw new Error(`short read: ${data.length} of ${expected} bytes`);
    } catch (err) {
      const message = err instanceof Error ? err.message : String(err);
      this.log(`blobd: fetching ${digest} chunk ${index}: ${message}`);
      throw new DsecError('unavailable', `fetching ${digest} chunk ${index}: ${message}`, {
        cause: err,
      });
    } finally {
      this.slots.release();
    }
    this.counters.fetches++;
    this.counters.bytesFetched += data.length;
    if (sha256) {
      if (!createHash('sha256').update(data).digest().equals(sha256)) {
        this.counters.corruptChunks++;
        const message = `chunk ${index} of ${digest} does not match its digest`;
        this.log(`blobd: ${message}`);
        throw new DsecError('internal', message, { details: { corruptChunk: index } });
      }
      this.counters.verifiedChunks++;
    }
    const old = this.index.get(key);
    // An unverified fetch never replaces a verified chunk.
    if (old?.verified && !sha256) return data;
    const file = join(this.dir, sha256 ? `${key}.v` : key);
    const tmp = `${file}.tmp.${process.pid}.${this.tmpSeq++}`;
    try {
      await writeFile(tmp, data, { mode: 0o600 });
      await rename(tmp, file);
    } catch (err) {
      // A full or broken disk still serves this read from memory.
      this.log(`blobd: caching ${key}: ${err instanceof Error ? err.message : String(err)}`);
      await unlink(tmp).catch(() => undefined);
      return data;
    }
    const current = this.index.get(key);
    if (current?.verified && !sha256) {
      // A verified fetch of this chunk landed meanwhile: keep that one.
      await unlink(file).catch(() => undefined);
      return data;
    }
    if (current) {
      this.index.delete(key);
      this.cachedBytes -= current.bytes;
      if (current.file !== file) await unlink(current.file).catch(() => undefined);
    }
    this.index.set(key, { file, bytes: data.length, touchedMs: Date.now(), verified: !!sha256 });
    this.cachedBytes += data.length;
    await this.evict();
    return data;
  }

  private async evict(): Promise<void> {
    while (this.cachedBytes > this.budgetBytes) {
      const oldest = this.index.entries().next();
      if (oldest.done) break;
      const [key, entry] = oldest.value;
      this.counters.evictions++;
      await this.drop(key, entry);
    }
  }

  private async drop(key: string, entry: Entry): Promise<void> {
    if (this.index.get(key) !== entry) return;
    this.index.delete(key);
    this.cachedBytes -= entry.bytes;
    await unlink(entry.file).catch(() => undefined);
  }

  private async rebuildIndex(): Promise<void> {
    const pattern = /^([0-9a-f]{64})\.(\d+)\.(\d+)(\.v)?$/;
    const found = new Map<string, { entry: Entry; mtimeMs: number }>();
    for (const name of await readdir(this.dir)) {
      const file = join(this.dir, name);
      const m = pattern.exec(name);
      if (!m) {
        if (name.includes('.tmp.')) await unlink(file).catch(() => undefined);
        continue;
      }
      if (Number(m[2]) !== this.chunkBytes) {
        await unlink(file).catch(() => undefined);
        continue;
      }
      const st = await stat(file).catch(() => undefined);
      if (!st?.isFile()) continue;
      const key = m[4] ? name.slice(0, -2) : name;
      const verified = !!m[4];
      const twin = found.get(key);
      if (twin) {
        // Both kinds of one chunk (a crash between store and unlink): keep the verified one.
        const loser = verified ? twin.entry.file : file;
        await unlink(loser).catch(() => undefined);
        if (!verified) continue;
      }
      found.set(key, {
        entry: { file, bytes: st.size, touchedMs: st.mtimeMs, verified },
        mtimeMs: st.mtimeMs,
      });
    }
    const sorted = [...found].sort((a, b) => a[1].mtimeMs - b[1].mtimeMs);
    for (const [key, f] of sorted) {
      this.index.set(key, f.entry);
      this.cachedBytes += f.entry.bytes;
    }
    await this.evict();
    this.counters.evictions = 0; // shrinking to a smaller budget at start is not churn
  }
}

/** `length` bytes at `position` of `file`, or undefined when it is gone or too short. */
async function readRange(
  file: string,
  position: number,
  length: number,
): Promise<Buffer | undefined> {
  let handle;
  try {
    handle = await open(file, 'r');
  } catch {
    return undefined;
  }
  try {
    const buf = Buffer.allocUnsafe(length);
    let done = 0;
    while (done < length) {
      const { bytesRead } = await handle.read(buf, done, length - done, position + done);
      if (bytesRead === 0) return undefined;
      done += bytesRead;
    }
    return buf;
  } catch {
    return undefined;
  } finally {
    await handle.close();
  }
}

class Semaphore {
  private free: number;
  private readonly waiters: (() => void)[] = [];
  constructor(count: number) {
    this.free = count;
  }
  async acquire(): Promise<void> {
    if (this.free > 0) {
      this.free--;
      return;
    }
    await new Promise<void>((resolve) => this.waiters.push(resolve));
  }
  release(): void {
    const next = this.waiters.shift();
    if (next) next();
    else this.free++;
  }
}
