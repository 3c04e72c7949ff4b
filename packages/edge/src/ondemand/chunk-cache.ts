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
  /**
   * Size of a chunk, the unit of fetching and eviction: a power of two ≥ 64 KiB.
   * Default 256 KiB (the paper's). A read with a chunk table uses the table's
   * chunk size instead, so layers built with another size keep working.
   */
  chunkBytes?: number;
  /** At most this many chunk fetches run at once. Default 8. */
  maxConcurrentFetches?: number;
  /**
   * Sequential read-ahead: once a run of reads of one blob is sequential, the
   * chunks ahead of it are fetched in the background, up to 1/16 of the run's
   * length so far (whole chunks) and at most this many bytes, nor more than
   * 1/8 of the budget. 0 turns it off. Default 0 (off); the blob daemon turns it on
   * ({@link DEFAULT_READAHEAD_MAX_BYTES}).
   */
  readaheadMaxBytes?: number;
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
  /** Chunk fetches started by sequential read-ahead (included in `fetches` once done). */
  readaheadFetches: number;
  /** Read-ahead chunks that a later read used. */
  readaheadHits: number;
}

export const DEFAULT_CHUNK_BYTES = 256 << 10;
export const DEFAULT_READAHEAD_MAX_BYTES = 2 << 20;
const MIN_CHUNK_BYTES = 64 << 10;
/** Sequential runs tracked per cache (several files of several sandboxes read at once). */
const MAX_STREAMS = 64;
/** Reads that must continue a run before read-ahead starts: one stray read is not a scan. */
const READAHEAD_AFTER_READS = 2;
/** At most this many read-ahead fetches in flight, leaving fetch slots for demand reads. */
const MAX_READAHEAD_INFLIGHT = 4;
/** Last-access times on disk are refreshed at most this often per chunk. */
const TOUCH_INTERVAL_MS = 60_000;
const HEX_DIGEST = /^sha256:([0-9a-f]{64})$/;

/** Where a read's chunks lie: the blob, its size and the chunk size it is read in. */
interface Geometry {
  hex: string;
  blobSize: number;
  chunkBytes: number;
}

interface Entry {
  file: string;
  bytes: number;
  touchedMs: number;
  /** Checked against a chunk table when fetched (the file name ends in `.v`). */
  verified: boolean;
  /** Fetched by read-ahead and not read since. */
  readahead?: boolean;
}

/** One sequential run of reads of a blob: where the next read is expected. */
interface Stream {
  /** `<hex>.<chunkBytes>` */
  blob: string;
  next: number;
  runBytes: number;
  reads: number;
}

/**
 * The largest chunk a cache holds (each is fetched and checked whole in memory): far above the
 * 256 KiB tables are written with, far below what a tampered table could ask for.
 */
export const MAX_CHUNK_BYTES = 64 * 1024 * 1024;

/**
 * A chunk size a cache can hold: a power of two from 64 KiB to `MAX_CHUNK_BYTES`. (A bare
 * `n & (n - 1)` works on 32 bits: 2^32 + 2^16 would pass it.)
 */
export function isValidChunkBytes(n: number): boolean {
  return (
    Number.isSafeInteger(n) &&
    n >= MIN_CHUNK_BYTES &&
    n <= MAX_CHUNK_BYTES &&
    Number.isInteger(Math.log2(n))
  );
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
 * its warm cache; temp files are removed. Chunks of several sizes can sit
 * side by side: a read with a chunk table is cut at the table's chunk size.
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
  /** In-flight fetches started by read-ahead, and those of them a read has waited on. */
  private readonly readaheadFlights = new Set<string>();
  private readonly demanded = new Set<string>();
  private readonly slots: Semaphore;
  private cachedBytes = 0;
  private tmpSeq = 0;
  private readonly readaheadMaxBytes: number;
  /** Sequential runs, least recently continued first. */
  private streams: Stream[] = [];
  private readaheadInflight = 0;
  private counters = {
    fetches: 0,
    bytesFetched: 0,
    hits: 0,
    misses: 0,
    evictions: 0,
    verifiedChunks: 0,
    corruptChunks: 0,
    readaheadFetches: 0,
    readaheadHits: 0,
  };

  private constructor(options: ChunkCacheOptions, chunkBytes: number) {
    this.dir = options.dir;
    this.source = options.source;
    this.budgetBytes = options.budgetBytes;
    this.chunkBytes = chunkBytes;
    this.log = options.log ?? ((line) => process.stderr.write(`${line}\n`));
    this.slots = new Semaphore(options.maxConcurrentFetches ?? 8);
    this.readaheadMaxBytes = options.readaheadMaxBytes ?? 0;
  }

  /**
   * Opens (creating) the cache directory and rebuilds the index from it.
   * Throws `invalid_argument` for a bad chunk size or budget.
   */
  static async open(options: ChunkCacheOptions): Promise<ChunkCache> {
    const chunkBytes = options.chunkBytes ?? DEFAULT_CHUNK_BYTES;
    if (!isValidChunkBytes(chunkBytes))
      throw new DsecError('invalid_argument', 'chunk size must be a power of two ≥ 64 KiB', {
        field: 'chunkBytes',
      });
    if (!Number.isSafeInteger(options.budgetBytes) || options.budgetBytes < 0)
      throw new DsecError('invalid_argument', 'cache budget must be a byte count ≥ 0', {
        field: 'budgetBytes',
      });
    const readahead = options.readaheadMaxBytes ?? 0;
    if (!Number.isSafeInteger(readahead) || readahead < 0)
      throw new DsecError('invalid_argument', 'read-ahead must be a byte count ≥ 0', {
        field: 'readaheadMaxBytes',
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

  /** Resolves once the fetches in flight now (read-ahead included) have ended, however they ended. */
  async settled(): Promise<void> {
    await Promise.allSettled([...this.inflight.values()]);
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
   * With `table` (the raw sha256 of each chunk, `ceil(blobSize / chunkBytes)`
   * of them) every chunk fetched is verified; a chunk that does not match
   * rejects `internal` (details `corruptChunk`). The table's chunks are of
   * `tableChunkBytes` (default this cache's chunk size), which this read
   * then fetches and caches in: a power of two ≥ 64 KiB.
   */
  async read(
    digest: string,
    blobSize: number,
    offset: number,
    length: number,
    table?: Buffer[],
    tableChunkBytes?: number,
  ): Promise<Buffer> {
    const hex = HEX_DIGEST.exec(digest)?.[1];
    if (!hex) throw new DsecError('invalid_argument', `malformed digest ${digest}`);
    const end = Math.min(offset + length, blobSize);
    if (offset < 0 || length < 0) throw new DsecError('invalid_argument', 'negative range');
    const chunkBytes = (table && tableChunkBytes) || this.chunkBytes;
    if (!isValidChunkBytes(chunkBytes))
      throw new DsecError(
        'invalid_argument',
        `chunk size ${chunkBytes} is not a power of two ≥ 64 KiB`,
      );
    if (table && table.length !== Math.ceil(blobSize / chunkBytes))
      throw new DsecError(
        'invalid_argument',
        `chunk table of ${table.length} chunks does not fit ${blobSize} bytes in chunks of ${chunkBytes}`,
      );
    if (offset >= end) return Buffer.alloc(0);
    const first = Math.floor(offset / chunkBytes);
    const last = Math.floor((end - 1) / chunkBytes);
    const parts: Promise<Buffer>[] = [];
    const geometry = { hex, blobSize, chunkBytes };
    for (let i = first; i <= last; i++) {
      const base = i * chunkBytes;
      const from = Math.max(offset, base) - base;
      const to = Math.min(end, base + chunkBytes) - base;
      parts.push(this.readChunk(geometry, i, from, to, table?.[i]));
    }
    this.readAhead(geometry, offset, end, table);
    const buffers = await Promise.all(parts);
    return buffers.length === 1 ? buffers[0]! : Buffer.concat(buffers);
  }

  /**
   * Notes the read `[offset, end)` against the sequential runs of its blob
   * and, once one has gone on long enough, starts background fetches of the
   * chunks ahead of it. The window is 1/16 of the run so far in whole chunks
   * (none for a run under 16 chunks), at most `readaheadMaxBytes`: what a
   * run fetches past where its reader stops is at most that share of what it
   * read. The kernel already reads up to 128 KiB ahead of every reader, and
   * each byte it reads past a file's end costs a chunk; a window of its own
   * on short runs (a 2 MiB file in 256 KiB chunks) would add one more chunk
   * to each, an eighth of the file.
   */
  private readAhead(g: Geometry, offset: number, end: number, table?: Buffer[]): void {
    if (this.readaheadMaxBytes === 0) return;
    const blob = `${g.hex}.${g.chunkBytes}`;
    // The kernel may issue a run's reads slightly out of order (async read-ahead):
    // a read starting within a chunk of where the run stands continues it.
    const at = this.streams.findIndex(
      (s) => s.blob === blob && offset >= s.next - g.chunkBytes && offset <= s.next + g.chunkBytes,
    );
    let stream: Stream;
    if (at >= 0) {
      stream = this.streams[at]!;
      this.streams.splice(at, 1);
      stream.runBytes += Math.max(0, end - Math.max(offset, stream.next));
      stream.next = Math.max(stream.next, end);
      stream.reads++;
    } else {
      stream = { blob, next: end, runBytes: end - offset, reads: 1 };
      if (this.streams.length >= MAX_STREAMS) this.streams.shift();
    }
    this.streams.push(stream);
    if (stream.reads < READAHEAD_AFTER_READS) return;
    // Chunks fetched ahead must not push out what is being read: a cache too
    // small to hold the window eight times over does no read-ahead.
    const cap = Math.min(this.readaheadMaxBytes, Math.floor(this.budgetBytes / 8));
    if (cap < g.chunkBytes) return;
    const windowBytes = Math.min(
      Math.floor(cap / g.chunkBytes) * g.chunkBytes,
      Math.floor(stream.runBytes / 16 / g.chunkBytes) * g.chunkBytes,
    );
    if (windowBytes === 0) return;
    // The chunks over [next, next + window).
    const from = Math.floor(stream.next / g.chunkBytes);
    const to = Math.min(
      Math.ceil(g.blobSize / g.chunkBytes),
      Math.ceil((stream.next + windowBytes) / g.chunkBytes),
    );
    for (let i = from; i < to; i++) {
      if (this.readaheadInflight >= MAX_READAHEAD_INFLIGHT) return;
      const key = this.keyOf(g.hex, g.chunkBytes, i);
      const sha256 = table?.[i];
      if (this.index.has(key) || this.inflight.has(sha256 ? `${key}.v` : key)) continue;
      const expected = Math.min(g.chunkBytes, g.blobSize - i * g.chunkBytes);
      this.readaheadInflight++;
      this.counters.readaheadFetches++;
      // Errors are the next demand read's to report: this one only logs them.
      this.fetch(g, i, key, expected, sha256, true)
        .catch(() => undefined)
        .finally(() => this.readaheadInflight--);
    }
  }

  private keyOf(hex: string, chunkBytes: number, index: number): string {
    return `${hex}.${chunkBytes}.${index}`;
  }

  /** Bytes `[from, to)` of chunk `index`, checked against `sha256` when given. */
  private async readChunk(
    g: Geometry,
    index: number,
    from: number,
    to: number,
    sha256?: Buffer,
  ): Promise<Buffer> {
    const key = this.keyOf(g.hex, g.chunkBytes, index);
    const expected = Math.min(g.chunkBytes, g.blobSize - index * g.chunkBytes);
    let entry = this.index.get(key);
    if (entry && entry.bytes === expected && sha256 && !entry.verified)
      entry = await this.upgrade(key, entry, sha256);
    if (entry && entry.bytes === expected) {
      const data = await readRange(entry.file, from, to - from);
      if (data) {
        this.counters.hits++;
        if (entry.readahead) {
          entry.readahead = false;
          this.counters.readaheadHits++;
        }
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
    const flight = sha256 ? `${key}.v` : key;
    if (this.readaheadFlights.has(flight) && !this.demanded.has(flight)) {
      this.counters.readaheadHits++;
      this.demanded.add(flight);
    }
    const chunk = await this.fetch(g, index, key, expected, sha256);
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
    g: Geometry,
    index: number,
    key: string,
    expected: number,
    sha256?: Buffer,
    readahead = false,
  ): Promise<Buffer> {
    const flight = sha256 ? `${key}.v` : key;
    let pending = this.inflight.get(flight);
    if (pending) return pending;
    pending = this.fetchAndStore(g, index, key, expected, sha256, readahead);
    this.inflight.set(flight, pending);
    if (readahead) this.readaheadFlights.add(flight);
    const done = () => {
      this.inflight.delete(flight);
      this.readaheadFlights.delete(flight);
      this.demanded.delete(flight);
    };
    pending.then(done, done);
    return pending;
  }

  private async fetchAndStore(
    g: Geometry,
    index: number,
    key: string,
    expected: number,
    sha256: Buffer | undefined,
    readahead: boolean,
  ): Promise<Buffer> {
    const digest = `sha256:${g.hex}`;
    let data: Buffer;
    await this.slots.acquire();
    try {
      data = await this.source.readBlobRange(digest, index * g.chunkBytes, expected);
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
    // A read waiting on this fetch already counted it; only an unawaited one is marked.
    const unread = readahead && !this.demanded.has(sha256 ? `${key}.v` : key);
    this.index.set(key, {
      file,
      bytes: data.length,
      touchedMs: Date.now(),
      verified: !!sha256,
      ...(unread ? { readahead: true } : {}),
    });
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
      if (!isValidChunkBytes(Number(m[2]))) {
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
