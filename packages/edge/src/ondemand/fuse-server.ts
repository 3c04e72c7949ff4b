import { createHash } from 'node:crypto';
import { read, readFileSync, writevSync } from 'node:fs';
import { DsecError, parseChunkTable } from '@dsec/core';
import { isValidChunkBytes, type ChunkCache, type RangeSource } from './chunk-cache.js';
import {
  DT_DIR,
  DT_REG,
  Errno,
  FOPEN_DIRECT_IO,
  FOPEN_KEEP_CACHE,
  FuseProtocolError,
  IN_HEADER_BYTES,
  MAX_PAGES,
  NO_REPLY_OPCODES,
  Opcode,
  S_IFDIR,
  S_IFREG,
  WRITE_OPCODES,
  encodeReplyHeader,
  decodeFh,
  decodeInHeader,
  decodeInitIn,
  decodeRequest,
  decodeName,
  decodeOpenFlags,
  decodeReadIn,
  encodeAttrOut,
  encodeDirents,
  encodeEntryOut,
  encodeInitOut,
  encodeOpenOut,
  encodeReply,
  encodeStatfsOut,
  negotiateInit,
  type Attr,
  type Dirent,
} from './fuse-protocol.js';

export interface BlobFuseServerOptions {
  /** An open `/dev/fuse` descriptor whose mount exists (INIT is the first request). */
  fd: number;
  source: RangeSource;
  cache: ChunkCache;
  /** Readahead asked of the kernel (capped by its offer). Default 128 KiB. */
  maxReadaheadBytes?: number;
  /**
   * Concurrent blocking reads of `/dev/fuse`, each holding a libuv pool
   * thread: keep UV_THREADPOOL_SIZE well above this. Default 4.
   */
  readers?: number;
  /** One line per unexpected failure. Default: stderr. */
  log?: (line: string) => void;
  /**
   * The host's page size, which with `MAX_PAGES` bounds the READ and
   * READDIR sizes the kernel may ask for. Default: the auxiliary vector's
   * (`AT_PAGESZ`), 4096 if unreadable.
   */
  pageBytes?: number;
}

/** Counters of the server itself (the `daemon` part of `.stats`). */
export interface BlobFuseCounters {
  pid: number;
  uptimeSec: number;
  requests: number;
  lookups: number;
  reads: number;
  readBytes: number;
  /** Requests answered EIO (fetch or disk failures). */
  ioErrors: number;
  /** Frames refused as malformed (EINVAL): short bodies, wrong lengths, sizes past the limits. */
  malformed: number;
  /** Names looked up so far (the files READDIR lists), verified or not. */
  knownBlobs: number;
}

export const STATS_FILE = '.stats';
const ROOT_INO = 1n;
const STATS_INO = 2n;
/** Blobs are immutable: names and attributes stay valid for a day. */
const BLOB_VALID_SEC = 86_400;
/** Room for the largest request we accept (no writes) plus slack. */
const READ_BUFFER_BYTES = (128 << 10) + 4096;
const O_ACCMODE = 3;
/** A chunk table larger than this is refused (it covers 2 PiB at 1 MiB chunks). */
const MAX_CHUNK_TABLE_BYTES = 64 << 20;
/** `.stats` snapshots open at once at most (each is held until its RELEASE); past it EMFILE. */
const MAX_STATS_HANDLES = 64;
const BLOB_NAME = /^([0-9a-f]{64})(?:\.([0-9a-f]{64}))?$/;

interface Blob {
  ino: bigint;
  /** The file name: `<blobhex>` or `<blobhex>.<tablehex>`. */
  name: string;
  hex: string;
  size: number;
  /** Raw sha256 of each chunk, for a name with a chunk table. */
  table?: Buffer[];
  /** The table's chunk size, which reads of this name are cut at. */
  tableChunkBytes?: number;
}

type Outcome = Buffer | { errno: number } | 'none';

/**
 * Serves a read-only FUSE filesystem on one `/dev/fuse` descriptor: a root
 * directory (inode 1) whose entries are the blobs of `source`, named by the
 * 64 hex digits of their sha256 digest and found by LOOKUP (never listed in
 * advance), read through the chunk cache; plus `.stats`, a JSON snapshot of
 * the cache and server counters taken at open.
 *
 * `<blobhex>.<tablehex>` names the same blob read with verification: the
 * chunk table blob `sha256:<tablehex>` (see `parseChunkTable`) is read whole
 * at LOOKUP, checked against its digest, its chunk count against the blob
 * size and its chunk size against what a cache can hold (a power of two
 * ≥ 64 KiB; reads of that name use the table's chunk size, so layers built
 * with another size than the daemon's keep working) (any failure: EIO, logged;
 * a missing blob or table: ENOENT), and every chunk fetched for that name
 * is checked against it (a corrupt chunk: EIO for reads touching it).
 *
 * The kernel hands out one request per read(2) of the device and takes one
 * reply per write(2), so several reads run at once (each blocks a libuv pool
 * thread) while replies are written synchronously from the event loop.
 *
 * Frames are parsed as untrusted (`respond`): lengths must agree, bodies must
 * hold the fields read, READ and READDIR sizes are at most `MAX_PAGES` pages
 * (what our INIT reply allows the kernel), `.stats` handles are capped;
 * anything else is EINVAL and counted (`malformed`), never a throw, a log
 * line per frame or an allocation the frame's size does not justify.
 */
export class BlobFuseServer {
  private readonly fd: number;
  private readonly source: RangeSource;
  private readonly cache: ChunkCache;
  private readonly maxReadaheadBytes: number;
  private readonly readers: number;
  private readonly log: (line: string) => void;
  /** By file name. */
  private readonly byName = new Map<string, Blob>();
  private readonly byIno = new Map<bigint, Blob>();
  private readonly lookups = new Map<string, Promise<Blob>>();
  private readonly snapshots = new Map<bigint, Buffer>();
  private nextIno = 3n;
  private nextFh = 1n;
  private stopped = false;
  private readonly startedMs = Date.now();
  private readonly maxReadBytes: number;
  private counters = {
    requests: 0,
    lookups: 0,
    reads: 0,
    readBytes: 0,
    ioErrors: 0,
    malformed: 0,
  };

  constructor(options: BlobFuseServerOptions) {
    this.fd = options.fd;
    this.source = options.source;
    this.cache = options.cache;
    this.maxReadaheadBytes = options.maxReadaheadBytes ?? 128 << 10;
    this.readers = Math.max(1, options.readers ?? 4);
    this.log = options.log ?? ((line) => process.stderr.write(`${line}\n`));
    this.maxReadBytes = MAX_PAGES * (options.pageBytes ?? hostPageBytes());
  }

  counterValues(): BlobFuseCounters {
    return {
      pid: process.pid,
      uptimeSec: Math.round((Date.now() - this.startedMs) / 1000),
      ...this.counters,
      knownBlobs: this.byName.size,
    };
  }

  /** Serves until the mount goes away (or DESTROY); never rejects. */
  async serve(): Promise<void> {
    const loops = Array.from({ length: this.readers }, () => this.readLoop());
    await Promise.all(loops);
  }

  private async readLoop(): Promise<void> {
    const buf = Buffer.allocUnsafe(READ_BUFFER_BYTES);
    while (!this.stopped) {
      let n: number;
      try {
        n = await readOnce(this.fd, buf);
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === 'EINTR' || code === 'EAGAIN' || code === 'ENOENT') continue;
        if (code !== 'ENODEV') this.log(`blobd: reading /dev/fuse: ${(err as Error).message}`);
        this.stopped = true;
        break;
      }
      if (n < IN_HEADER_BYTES) continue;
      void this.respond(Buffer.from(buf.subarray(0, n))).then(
        (parts) => parts && this.reply(parts),
        (err: unknown) => this.log(`blobd: ${String(err)}`), // respond never rejects; a bug if so
      );
    }
  }

  /**
   * The reply to one frame from the device, as the parts of one write(2), or
   * undefined for none (FORGET and the like, or a frame too short to carry
   * a `unique` to answer). Never rejects, whatever the bytes: a malformed
   * frame (`FuseProtocolError`) is EINVAL; every reply is at most the
   * header plus the larger of the fixed structures and the READ/READDIR
   * size asked, which is itself at most `MAX_PAGES` pages.
   */
  async respond(frame: Buffer): Promise<Buffer[] | undefined> {
    if (frame.length < IN_HEADER_BYTES) return undefined;
    const { unique, opcode } = decodeInHeader(frame);
    this.counters.requests++;
    let outcome: Outcome;
    try {
      const { header, body } = decodeRequest(frame);
      outcome = await this.dispatch(header.opcode, header.nodeid, body);
    } catch (err) {
      // A malformed FORGET is still a FORGET: the kernel waits for no answer.
      if (NO_REPLY_OPCODES.has(opcode)) return undefined;
      outcome = { errno: this.errnoOf(err) };
    }
    if (outcome === 'none') return undefined;
    if (Buffer.isBuffer(outcome)) {
      const head = encodeReplyHeader(unique, outcome.length);
      return outcome.length > 0 ? [head, outcome] : [head];
    }
    return [encodeReply(unique, outcome.errno)];
  }

  private reply(parts: Buffer[]): void {
    // One write(2) per reply: header and payload gathered by writev.
    try {
      writevSync(this.fd, parts);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOENT') return; // the request was interrupted meanwhile
      if (code === 'ENODEV') {
        this.stopped = true;
        return;
      }
      this.log(`blobd: replying: ${(err as Error).message}`);
    }
  }

  private errnoOf(err: unknown): number {
    if (err instanceof FuseProtocolError) {
      // Only a broken kernel or a test sends these; counted, not logged per frame.
      this.counters.malformed++;
      return Errno.EINVAL;
    }
    if (err instanceof DsecError && err.code === 'image_not_found') return Errno.ENOENT;
    this.counters.ioErrors++;
    // Fetch failures and corrupt chunks were logged by the chunk cache, bad
    // chunk tables by lookup; anything else is news.
    const logged =
      err instanceof DsecError &&
      (err.code === 'unavailable' ||
        err.details?.corruptChunk !== undefined ||
        err.details?.chunkTable !== undefined);
    if (!logged)
      this.log(`blobd: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
    return Errno.EIO;
  }

  private async dispatch(opcode: number, nodeid: bigint, body: Buffer): Promise<Outcome> {
    if (NO_REPLY_OPCODES.has(opcode)) return 'none';
    if (WRITE_OPCODES.has(opcode)) return { errno: Errno.EROFS };
    switch (opcode) {
      case Opcode.INIT: {
        const offer = decodeInitIn(body);
        if (offer.major < 7) return { errno: Errno.EPROTO };
        return encodeInitOut(negotiateInit(offer, { maxReadaheadBytes: this.maxReadaheadBytes }));
      }
      case Opcode.LOOKUP:
        return this.lookup(nodeid, decodeName(body));
      case Opcode.GETATTR: {
        const attr = this.attrOf(nodeid);
        if (!attr) return { errno: Errno.ENOENT };
        return encodeAttrOut(attr, nodeid === STATS_INO ? 0 : BLOB_VALID_SEC);
      }
      case Opcode.OPEN:
        return this.open(nodeid, decodeOpenFlags(body));
      case Opcode.READ:
        return this.read(nodeid, body);
      case Opcode.RELEASE:
        this.snapshots.delete(decodeFh(body));
        return Buffer.alloc(0);
      case Opcode.FLUSH:
      case Opcode.RELEASEDIR:
        return Buffer.alloc(0);
      case Opcode.OPENDIR:
        if (nodeid !== ROOT_INO) return { errno: Errno.ENOTDIR };
        return encodeOpenOut(0n, 0);
      case Opcode.READDIR:
        return this.readdir(nodeid, body);
      case Opcode.STATFS:
        return this.statfs();
      case Opcode.DESTROY:
        this.stopped = true;
        return Buffer.alloc(0);
      default:
        return { errno: Errno.ENOSYS };
    }
  }

  private attrOf(nodeid: bigint): Attr | undefined {
    const mtimeSec = Math.floor(this.startedMs / 1000);
    if (nodeid === ROOT_INO)
      // 0500: the kernel reads blobs for sandboxes through files opened at mount time; no
      // other host user may look up a blob (allow_other lets sandbox page faults through).
      return { ino: ROOT_INO, size: 0, mode: S_IFDIR | 0o500, nlink: 2, mtimeSec };
    if (nodeid === STATS_INO)
      return { ino: STATS_INO, size: 0, mode: S_IFREG | 0o444, nlink: 1, mtimeSec };
    const blob = this.byIno.get(nodeid);
    if (!blob) return undefined;
    return { ino: blob.ino, size: blob.size, mode: S_IFREG | 0o444, nlink: 1, mtimeSec: 0 };
  }

  private async lookup(parent: bigint, name: string): Promise<Outcome> {
    if (parent !== ROOT_INO) return { errno: Errno.ENOTDIR };
    if (name === STATS_FILE)
      return encodeEntryOut(this.attrOf(STATS_INO)!, { entrySec: BLOB_VALID_SEC, attrSec: 0 });
    if (!BLOB_NAME.test(name)) return { errno: Errno.ENOENT };
    this.counters.lookups++;
    const blob = await this.blobNamed(name);
    return encodeEntryOut(this.attrOf(blob.ino)!, {
      entrySec: BLOB_VALID_SEC,
      attrSec: BLOB_VALID_SEC,
    });
  }

  /** The inode of a blob name, asking the store once (failures are not remembered). */
  private blobNamed(name: string): Promise<Blob> {
    const known = this.byName.get(name);
    if (known) return Promise.resolve(known);
    let pending = this.lookups.get(name);
    if (!pending) {
      pending = this.resolveName(name).then(({ hex, size, table, tableChunkBytes }) => {
        const blob = this.byName.get(name) ?? {
          ino: this.nextIno++,
          name,
          hex,
          size,
          ...(table ? { table, tableChunkBytes } : {}),
        };
        this.byName.set(name, blob);
        this.byIno.set(blob.ino, blob);
        return blob;
      });
      this.lookups.set(name, pending);
      const done = () => void this.lookups.delete(name);
      pending.then(done, done);
    }
    return pending;
  }

  /** The blob's size and, for a verified name, its checked chunk table. */
  private async resolveName(
    name: string,
  ): Promise<{ hex: string; size: number; table?: Buffer[]; tableChunkBytes?: number }> {
    const [, hex, tableHex] = BLOB_NAME.exec(name)!;
    const { sizeBytes: size } = await this.source.statBlob(`sha256:${hex!}`);
    if (tableHex === undefined) return { hex: hex!, size };
    const tableDigest = `sha256:${tableHex}`;
    const bad = (why: string) => {
      const message = `chunk table ${tableDigest} of sha256:${hex!}: ${why}`;
      this.log(`blobd: ${message}`);
      return new DsecError('internal', message, { details: { chunkTable: tableDigest } });
    };
    const { sizeBytes: tableSize } = await this.source.statBlob(tableDigest);
    if (tableSize > MAX_CHUNK_TABLE_BYTES)
      throw bad(`${tableSize} bytes, over the ${MAX_CHUNK_TABLE_BYTES}-byte limit`);
    let bytes: Buffer;
    try {
      bytes = await this.source.readBlobRange(tableDigest, 0, tableSize);
    } catch (err) {
      if (err instanceof DsecError && err.code === 'image_not_found') throw err;
      throw bad(`reading it: ${err instanceof Error ? err.message : String(err)}`);
    }
    if (bytes.length !== tableSize) throw bad(`short read: ${bytes.length} of ${tableSize} bytes`);
    if (createHash('sha256').update(bytes).digest('hex') !== tableHex)
      throw bad('its bytes do not match its digest');
    let parsed;
    try {
      parsed = parseChunkTable(bytes);
    } catch (err) {
      throw bad(err instanceof Error ? err.message : String(err));
    }
    if (!isValidChunkBytes(parsed.chunkBytes))
      throw bad(`its chunk size ${parsed.chunkBytes} is not a power of two ≥ 64 KiB`);
    const chunks = Math.ceil(size / parsed.chunkBytes);
    if (parsed.digests.length !== chunks)
      throw bad(`${parsed.digests.length} chunks, but the blob's ${size} bytes make ${chunks}`);
    // Copies, so the table's bytes are not all kept alive by one view.
    return {
      hex: hex!,
      size,
      table: parsed.digests.map((d) => Buffer.from(d)),
      tableChunkBytes: parsed.chunkBytes,
    };
  }

  private open(nodeid: bigint, flags: number): Outcome {
    if ((flags & O_ACCMODE) !== 0) return { errno: Errno.EROFS };
    if (nodeid === ROOT_INO) return { errno: Errno.EISDIR };
    if (nodeid === STATS_INO) {
      if (this.snapshots.size >= MAX_STATS_HANDLES) return { errno: Errno.EMFILE };
      const fh = this.nextFh++;
      const stats = { cache: this.cache.stats(), daemon: this.counterValues() };
      this.snapshots.set(fh, Buffer.from(`${JSON.stringify(stats, null, 2)}\n`));
      return encodeOpenOut(fh, FOPEN_DIRECT_IO);
    }
    if (!this.byIno.has(nodeid)) return { errno: Errno.ENOENT };
    return encodeOpenOut(0n, FOPEN_KEEP_CACHE);
  }

  /** A READ or READDIR's arguments, its size within what the kernel may ask. */
  private readArgs(body: Buffer): { fh: bigint; offset: bigint; size: number } {
    const args = decodeReadIn(body);
    if (args.size > this.maxReadBytes)
      throw new FuseProtocolError(`read of ${args.size} bytes, over ${this.maxReadBytes}`);
    return args;
  }

  private async read(nodeid: bigint, body: Buffer): Promise<Outcome> {
    const { fh, offset, size } = this.readArgs(body);
    // Past 2^53 a Number loses precision, but every such offset lies past any blob's end.
    const at = Number(offset);
    if (nodeid === STATS_INO) {
      const snapshot = this.snapshots.get(fh) ?? Buffer.alloc(0);
      return snapshot.subarray(Math.min(at, snapshot.length), Math.min(at + size, snapshot.length));
    }
    const blob = this.byIno.get(nodeid);
    if (!blob) return { errno: Errno.EBADF };
    this.counters.reads++;
    const data = await this.cache.read(
      `sha256:${blob.hex}`,
      blob.size,
      at,
      size,
      blob.table,
      blob.tableChunkBytes,
    );
    this.counters.readBytes += data.length;
    return data;
  }

  private readdir(nodeid: bigint, body: Buffer): Outcome {
    if (nodeid !== ROOT_INO) return { errno: Errno.ENOTDIR };
    const { offset, size } = this.readArgs(body);
    const names: [bigint, number, string][] = [
      [ROOT_INO, DT_DIR, '.'],
      [ROOT_INO, DT_DIR, '..'],
      [STATS_INO, DT_REG, STATS_FILE],
      ...[...this.byName.values()].map((b): [bigint, number, string] => [b.ino, DT_REG, b.name]),
    ];
    const start = Number(offset);
    const entries: Dirent[] = names
      .slice(start)
      .map(([ino, type, name], i) => ({ ino, type, name, off: BigInt(start + i + 1) }));
    return encodeDirents(entries, size).buf;
  }

  private statfs(): Outcome {
    const s = this.cache.stats();
    const bsize = 4096;
    const blocks = Math.ceil(s.budgetBytes / bsize);
    const free = Math.max(0, blocks - Math.ceil(s.cachedBytes / bsize));
    return encodeStatfsOut({
      blocks,
      bfree: free,
      bavail: free,
      files: this.byName.size + 2,
      ffree: 0,
      bsize,
      namelen: 255,
      frsize: bsize,
    });
  }
}

/** AT_PAGESZ from /proc/self/auxv (pairs of 64-bit words, type 0 ends), else 4096. */
function hostPageBytes(): number {
  try {
    const auxv = readFileSync('/proc/self/auxv');
    for (let at = 0; at + 16 <= auxv.length; at += 16) {
      const type = auxv.readBigUInt64LE(at);
      if (type === 0n) break;
      if (type === 6n) {
        const bytes = Number(auxv.readBigUInt64LE(at + 8));
        if (bytes >= 4096 && bytes <= 1 << 16 && (bytes & (bytes - 1)) === 0) return bytes;
      }
    }
  } catch {
    // No procfs: the common page size.
  }
  return 4096;
}

function readOnce(fd: number, buf: Buffer): Promise<number> {
  return new Promise((resolve, reject) =>
    read(fd, buf, 0, buf.length, null, (err, n) => (err ? reject(err) : resolve(n))),
  );
}
