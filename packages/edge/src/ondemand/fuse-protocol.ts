/**
 * The slice of the Linux FUSE kernel protocol (`/usr/include/linux/fuse.h`,
 * protocol 7.31) a read-only file server needs: request headers in, replies
 * out. Every structure is little-endian and laid out exactly as the UAPI
 * header declares it; sizes are checked by the unit tests.
 *
 * Decoders trust nothing in the bytes: each checks that the fields it reads
 * lie inside the buffer, and every malformed input throws `FuseProtocolError`
 * and nothing else (no Node `ERR_OUT_OF_RANGE`, no silent truncation), which
 * the property tests check on arbitrary and mutated frames.
 */

/** A frame or structure that does not hold what its lengths claim. The server answers EINVAL. */
export class FuseProtocolError extends Error {
  override readonly name = 'FuseProtocolError';
}

function need(buf: Buffer, bytes: number, what: string): void {
  if (buf.length < bytes)
    throw new FuseProtocolError(`short ${what}: ${buf.length} of ${bytes} bytes`);
}

export const FUSE_KERNEL_VERSION = 7;
/** The minor version we speak; the reply carries min(kernel, this). */
export const FUSE_KERNEL_MINOR_VERSION = 31;

export const Opcode = {
  LOOKUP: 1,
  FORGET: 2,
  GETATTR: 3,
  SETATTR: 4,
  READLINK: 5,
  SYMLINK: 6,
  MKNOD: 8,
  MKDIR: 9,
  UNLINK: 10,
  RMDIR: 11,
  RENAME: 12,
  LINK: 13,
  OPEN: 14,
  READ: 15,
  WRITE: 16,
  STATFS: 17,
  RELEASE: 18,
  FSYNC: 20,
  SETXATTR: 21,
  GETXATTR: 22,
  LISTXATTR: 23,
  REMOVEXATTR: 24,
  FLUSH: 25,
  INIT: 26,
  OPENDIR: 27,
  READDIR: 28,
  RELEASEDIR: 29,
  FSYNCDIR: 30,
  ACCESS: 34,
  CREATE: 35,
  INTERRUPT: 36,
  DESTROY: 38,
  BATCH_FORGET: 42,
  FALLOCATE: 43,
  RENAME2: 45,
  COPY_FILE_RANGE: 47,
  TMPFILE: 51,
} as const;

/** Opcodes that would modify the filesystem: answered with EROFS. */
export const WRITE_OPCODES: ReadonlySet<number> = new Set([
  Opcode.SETATTR,
  Opcode.SYMLINK,
  Opcode.MKNOD,
  Opcode.MKDIR,
  Opcode.UNLINK,
  Opcode.RMDIR,
  Opcode.RENAME,
  Opcode.LINK,
  Opcode.WRITE,
  Opcode.SETXATTR,
  Opcode.REMOVEXATTR,
  Opcode.CREATE,
  Opcode.FALLOCATE,
  Opcode.RENAME2,
  Opcode.COPY_FILE_RANGE,
  Opcode.TMPFILE,
]);

/** Opcodes the kernel expects no reply to. */
export const NO_REPLY_OPCODES: ReadonlySet<number> = new Set([
  Opcode.FORGET,
  Opcode.BATCH_FORGET,
  Opcode.INTERRUPT,
]);

// fuse_init_in / fuse_init_out flags
export const FUSE_ASYNC_READ = 1 << 0;
export const FUSE_MAX_PAGES = 1 << 22;
/**
 * The `max_pages` our INIT reply asks for: no READ or READDIR the kernel
 * sends is larger than this many pages (the server refuses larger ones).
 */
export const MAX_PAGES = 256;
// fuse_open_out.open_flags
export const FOPEN_DIRECT_IO = 1 << 0;
export const FOPEN_KEEP_CACHE = 1 << 1;

export const Errno = {
  ENOENT: 2,
  EIO: 5,
  EBADF: 9,
  EACCES: 13,
  ENOTDIR: 20,
  EISDIR: 21,
  EINVAL: 22,
  EMFILE: 24,
  EROFS: 30,
  ERANGE: 34,
  ENOSYS: 38,
  EPROTO: 71,
} as const;

export const S_IFDIR = 0o040000;
export const S_IFREG = 0o100000;
/** `d_type` values of a dirent. */
export const DT_DIR = 4;
export const DT_REG = 8;

export const IN_HEADER_BYTES = 40;
export const OUT_HEADER_BYTES = 16;
export const ATTR_BYTES = 88;
export const ENTRY_OUT_BYTES = 128;
export const ATTR_OUT_BYTES = 104;
export const OPEN_OUT_BYTES = 16;
export const READ_IN_BYTES = 40;
export const INIT_IN_BYTES = 64;
export const INIT_OUT_BYTES = 64;
export const KSTATFS_BYTES = 80;
export const DIRENT_HEADER_BYTES = 24;

/** struct fuse_in_header. */
export interface InHeader {
  len: number;
  opcode: number;
  unique: bigint;
  nodeid: bigint;
  uid: number;
  gid: number;
  pid: number;
  totalExtlen: number;
}

export function decodeInHeader(buf: Buffer): InHeader {
  need(buf, IN_HEADER_BYTES, 'fuse_in_header');
  return {
    len: buf.readUInt32LE(0),
    opcode: buf.readUInt32LE(4),
    unique: buf.readBigUInt64LE(8),
    nodeid: buf.readBigUInt64LE(16),
    uid: buf.readUInt32LE(24),
    gid: buf.readUInt32LE(28),
    pid: buf.readUInt32LE(32),
    totalExtlen: buf.readUInt16LE(36),
  };
}

/** One request from the device: its header and its body (the opcode's arguments). */
export interface Request {
  header: InHeader;
  body: Buffer;
}

/**
 * Splits one frame as read(2) returned it: the header's `len` must be the
 * frame's length, and the extensions it announces (`total_extlen`, appended
 * after the arguments since 7.38; never sent to us, as we negotiate 7.31)
 * must fit between the header and the end. The body is a view of the frame.
 */
export function decodeRequest(frame: Buffer): Request {
  const header = decodeInHeader(frame);
  if (header.len !== frame.length)
    throw new FuseProtocolError(
      `fuse_in_header.len ${header.len} but the frame has ${frame.length} bytes`,
    );
  const end = header.len - header.totalExtlen * 8;
  if (end < IN_HEADER_BYTES)
    throw new FuseProtocolError(
      `${header.totalExtlen * 8} bytes of extensions in a ${header.len}-byte frame`,
    );
  return { header, body: frame.subarray(IN_HEADER_BYTES, end) };
}

/** Encodes a fuse_in_header (tests and fakes build requests with it). */
export function encodeInHeader(h: InHeader): Buffer {
  const buf = Buffer.alloc(IN_HEADER_BYTES);
  buf.writeUInt32LE(h.len, 0);
  buf.writeUInt32LE(h.opcode, 4);
  buf.writeBigUInt64LE(h.unique, 8);
  buf.writeBigUInt64LE(h.nodeid, 16);
  buf.writeUInt32LE(h.uid, 24);
  buf.writeUInt32LE(h.gid, 28);
  buf.writeUInt32LE(h.pid, 32);
  buf.writeUInt16LE(h.totalExtlen, 36);
  return buf;
}

/**
 * One whole reply: fuse_out_header then the payload, in one buffer, because
 * the kernel takes each reply from a single write(2). `errno` > 0 makes an
 * error reply (the payload must then be empty).
 */
export function encodeReply(unique: bigint, errno: number, payload?: Buffer): Buffer {
  const size = OUT_HEADER_BYTES + (payload?.length ?? 0);
  const buf = Buffer.allocUnsafe(size);
  buf.writeUInt32LE(size, 0);
  buf.writeInt32LE(-errno, 4);
  buf.writeBigUInt64LE(unique, 8);
  payload?.copy(buf, OUT_HEADER_BYTES);
  return buf;
}

/**
 * The fuse_out_header of a successful reply whose `payloadBytes` follow it
 * in the same write (writev of header and payload).
 */
export function encodeReplyHeader(unique: bigint, payloadBytes: number): Buffer {
  const buf = Buffer.alloc(OUT_HEADER_BYTES);
  buf.writeUInt32LE(OUT_HEADER_BYTES + payloadBytes, 0);
  buf.writeBigUInt64LE(unique, 8);
  return buf;
}

export interface OutHeader {
  len: number;
  error: number;
  unique: bigint;
}

export function decodeOutHeader(buf: Buffer): OutHeader {
  need(buf, OUT_HEADER_BYTES, 'fuse_out_header');
  return { len: buf.readUInt32LE(0), error: buf.readInt32LE(4), unique: buf.readBigUInt64LE(8) };
}

/** struct fuse_init_in (the fields we use). */
export interface InitIn {
  major: number;
  minor: number;
  maxReadahead: number;
  flags: number;
}

export function decodeInitIn(body: Buffer): InitIn {
  need(body, 16, 'fuse_init_in');
  return {
    major: body.readUInt32LE(0),
    minor: body.readUInt32LE(4),
    maxReadahead: body.readUInt32LE(8),
    flags: body.readUInt32LE(12),
  };
}

export function encodeInitIn(init: InitIn): Buffer {
  const buf = Buffer.alloc(INIT_IN_BYTES);
  buf.writeUInt32LE(init.major, 0);
  buf.writeUInt32LE(init.minor, 4);
  buf.writeUInt32LE(init.maxReadahead, 8);
  buf.writeUInt32LE(init.flags >>> 0, 12);
  return buf;
}

/** struct fuse_init_out. */
export interface InitOut {
  major: number;
  minor: number;
  maxReadahead: number;
  flags: number;
  maxBackground: number;
  congestionThreshold: number;
  maxWrite: number;
  timeGran: number;
  maxPages: number;
}

export function encodeInitOut(out: InitOut): Buffer {
  const buf = Buffer.alloc(INIT_OUT_BYTES);
  buf.writeUInt32LE(out.major, 0);
  buf.writeUInt32LE(out.minor, 4);
  buf.writeUInt32LE(out.maxReadahead, 8);
  buf.writeUInt32LE(out.flags >>> 0, 12);
  buf.writeUInt16LE(out.maxBackground, 16);
  buf.writeUInt16LE(out.congestionThreshold, 18);
  buf.writeUInt32LE(out.maxWrite, 20);
  buf.writeUInt32LE(out.timeGran, 24);
  buf.writeUInt16LE(out.maxPages, 28);
  // map_alignment (u16 @30), flags2 (u32 @32) and unused[7] stay zero.
  return buf;
}

export function decodeInitOut(buf: Buffer): InitOut {
  need(buf, 30, 'fuse_init_out');
  return {
    major: buf.readUInt32LE(0),
    minor: buf.readUInt32LE(4),
    maxReadahead: buf.readUInt32LE(8),
    flags: buf.readUInt32LE(12),
    maxBackground: buf.readUInt16LE(16),
    congestionThreshold: buf.readUInt16LE(18),
    maxWrite: buf.readUInt32LE(20),
    timeGran: buf.readUInt32LE(24),
    maxPages: buf.readUInt16LE(28),
  };
}

export interface InitOptions {
  /** Upper bound of the readahead we ask for; the kernel's offer caps it. */
  maxReadaheadBytes: number;
}

/**
 * The INIT reply to the kernel's offer: protocol 7.min(kernel, 31),
 * asynchronous reads and 1 MiB requests (256 pages) where offered, writes
 * kept minimal (the filesystem is read-only).
 */
export function negotiateInit(offer: InitIn, options: InitOptions): InitOut {
  return {
    major: FUSE_KERNEL_VERSION,
    minor: Math.min(offer.minor, FUSE_KERNEL_MINOR_VERSION),
    maxReadahead: Math.min(offer.maxReadahead, options.maxReadaheadBytes),
    flags: (offer.flags & (FUSE_ASYNC_READ | FUSE_MAX_PAGES)) >>> 0,
    maxBackground: 16,
    congestionThreshold: 12,
    maxWrite: 4096,
    timeGran: 1,
    maxPages: MAX_PAGES,
  };
}

/** struct fuse_attr. Times are seconds since the epoch. */
export interface Attr {
  ino: bigint;
  size: number;
  mode: number;
  nlink: number;
  mtimeSec: number;
  uid?: number;
  gid?: number;
  blksize?: number;
}

export function writeAttr(buf: Buffer, at: number, a: Attr): void {
  buf.fill(0, at, at + ATTR_BYTES);
  buf.writeBigUInt64LE(a.ino, at);
  buf.writeBigUInt64LE(BigInt(a.size), at + 8);
  buf.writeBigUInt64LE(BigInt(Math.ceil(a.size / 512)), at + 16); // blocks of 512 B
  const t = BigInt(a.mtimeSec);
  buf.writeBigUInt64LE(t, at + 24); // atime
  buf.writeBigUInt64LE(t, at + 32); // mtime
  buf.writeBigUInt64LE(t, at + 40); // ctime
  // atimensec, mtimensec, ctimensec at +48..+59 stay zero
  buf.writeUInt32LE(a.mode, at + 60);
  buf.writeUInt32LE(a.nlink, at + 64);
  buf.writeUInt32LE(a.uid ?? 0, at + 68);
  buf.writeUInt32LE(a.gid ?? 0, at + 72);
  // rdev at +76 stays zero
  buf.writeUInt32LE(a.blksize ?? 4096, at + 80);
  // flags at +84 stays zero
}

export function readAttr(buf: Buffer, at: number): Required<Attr> {
  if (!(Number.isSafeInteger(at) && at >= 0)) throw new FuseProtocolError(`fuse_attr at ${at}`);
  need(buf, at + ATTR_BYTES, 'fuse_attr');
  return {
    ino: buf.readBigUInt64LE(at),
    size: Number(buf.readBigUInt64LE(at + 8)),
    mtimeSec: Number(buf.readBigUInt64LE(at + 32)),
    mode: buf.readUInt32LE(at + 60),
    nlink: buf.readUInt32LE(at + 64),
    uid: buf.readUInt32LE(at + 68),
    gid: buf.readUInt32LE(at + 72),
    blksize: buf.readUInt32LE(at + 80),
  };
}

/** Cache timeouts in seconds (whole seconds; the nsec fields stay zero). */
export interface Validity {
  entrySec: number;
  attrSec: number;
}

/** struct fuse_entry_out (LOOKUP reply). */
export function encodeEntryOut(attr: Attr, valid: Validity, generation = 0n): Buffer {
  const buf = Buffer.alloc(ENTRY_OUT_BYTES);
  buf.writeBigUInt64LE(attr.ino, 0);
  buf.writeBigUInt64LE(generation, 8);
  buf.writeBigUInt64LE(BigInt(valid.entrySec), 16);
  buf.writeBigUInt64LE(BigInt(valid.attrSec), 24);
  writeAttr(buf, 40, attr);
  return buf;
}

/** struct fuse_attr_out (GETATTR reply). */
export function encodeAttrOut(attr: Attr, attrValidSec: number): Buffer {
  const buf = Buffer.alloc(ATTR_OUT_BYTES);
  buf.writeBigUInt64LE(BigInt(attrValidSec), 0);
  writeAttr(buf, 16, attr);
  return buf;
}

/** struct fuse_open_out (OPEN/OPENDIR reply). */
export function encodeOpenOut(fh: bigint, openFlags: number): Buffer {
  const buf = Buffer.alloc(OPEN_OUT_BYTES);
  buf.writeBigUInt64LE(fh, 0);
  buf.writeUInt32LE(openFlags, 8);
  return buf;
}

/** struct fuse_read_in (READ and READDIR requests). */
export interface ReadIn {
  fh: bigint;
  offset: bigint;
  size: number;
}

export function decodeReadIn(body: Buffer): ReadIn {
  need(body, 24, 'fuse_read_in');
  return {
    fh: body.readBigUInt64LE(0),
    offset: body.readBigUInt64LE(8),
    size: body.readUInt32LE(16),
  };
}

export function encodeReadIn(r: ReadIn): Buffer {
  const buf = Buffer.alloc(READ_IN_BYTES);
  buf.writeBigUInt64LE(r.fh, 0);
  buf.writeBigUInt64LE(r.offset, 8);
  buf.writeUInt32LE(r.size, 16);
  return buf;
}

/**
 * fuse_open_in.flags / fuse_release_in.fh: the first fields of their bodies.
 * A body too short for them is malformed (reading it as 0 would turn a
 * truncated open for writing into a read-only one).
 */
export function decodeOpenFlags(body: Buffer): number {
  need(body, 4, 'fuse_open_in');
  return body.readUInt32LE(0);
}

export function decodeFh(body: Buffer): bigint {
  need(body, 8, 'fuse_release_in');
  return body.readBigUInt64LE(0);
}

/** The NUL-terminated name of a LOOKUP request; the kernel always sends the NUL. */
export function decodeName(body: Buffer): string {
  const end = body.indexOf(0);
  if (end < 0) throw new FuseProtocolError('name without its NUL');
  return body.toString('utf8', 0, end);
}

export interface Dirent {
  ino: bigint;
  /** Offset of the entry after this one (what the next READDIR passes back). */
  off: bigint;
  type: number;
  name: string;
}

/** Bytes of a fuse_dirent carrying `name`, padded to 8. */
export function direntBytes(name: string): number {
  return paddedDirentBytes(Buffer.byteLength(name));
}

function paddedDirentBytes(nameBytes: number): number {
  return Math.ceil((DIRENT_HEADER_BYTES + nameBytes) / 8) * 8;
}

/**
 * Packs dirents while they fit in `maxBytes` (the READDIR size); returns the
 * buffer and how many entries went in.
 */
export function encodeDirents(entries: Dirent[], maxBytes: number): { buf: Buffer; count: number } {
  let total = 0;
  let count = 0;
  for (const e of entries) {
    const n = direntBytes(e.name);
    if (total + n > maxBytes) break;
    total += n;
    count++;
  }
  const buf = Buffer.alloc(total);
  let at = 0;
  for (const e of entries.slice(0, count)) {
    const name = Buffer.from(e.name);
    buf.writeBigUInt64LE(e.ino, at);
    buf.writeBigUInt64LE(e.off, at + 8);
    buf.writeUInt32LE(name.length, at + 16);
    buf.writeUInt32LE(e.type, at + 20);
    name.copy(buf, at + DIRENT_HEADER_BYTES);
    at += direntBytes(e.name);
  }
  return { buf, count };
}

/**
 * The dirents of a READDIR reply. Each must lie wholly inside the buffer
 * (its name included; the padding of the last may be cut), and the walk
 * advances by the recorded name length, so a name that is not valid UTF-8
 * cannot shift the entries after it.
 */
export function decodeDirents(buf: Buffer): Dirent[] {
  const out: Dirent[] = [];
  let at = 0;
  while (at < buf.length) {
    if (at + DIRENT_HEADER_BYTES > buf.length) throw new FuseProtocolError('truncated fuse_dirent');
    const namelen = buf.readUInt32LE(at + 16);
    const nameEnd = at + DIRENT_HEADER_BYTES + namelen;
    if (nameEnd > buf.length)
      throw new FuseProtocolError(`fuse_dirent name of ${namelen} bytes past the end`);
    out.push({
      ino: buf.readBigUInt64LE(at),
      off: buf.readBigUInt64LE(at + 8),
      type: buf.readUInt32LE(at + 20),
      name: buf.toString('utf8', at + DIRENT_HEADER_BYTES, nameEnd),
    });
    at += paddedDirentBytes(namelen);
  }
  return out;
}

/** struct fuse_kstatfs (STATFS reply, 80 bytes). */
export interface Kstatfs {
  blocks: number;
  bfree: number;
  bavail: number;
  files: number;
  ffree: number;
  bsize: number;
  namelen: number;
  frsize: number;
}

export function encodeStatfsOut(s: Kstatfs): Buffer {
  const buf = Buffer.alloc(KSTATFS_BYTES);
  buf.writeBigUInt64LE(BigInt(s.blocks), 0);
  buf.writeBigUInt64LE(BigInt(s.bfree), 8);
  buf.writeBigUInt64LE(BigInt(s.bavail), 16);
  buf.writeBigUInt64LE(BigInt(s.files), 24);
  buf.writeBigUInt64LE(BigInt(s.ffree), 32);
  buf.writeUInt32LE(s.bsize, 40);
  buf.writeUInt32LE(s.namelen, 44);
  buf.writeUInt32LE(s.frsize, 48);
  return buf;
}

export function decodeStatfsOut(buf: Buffer): Kstatfs {
  need(buf, KSTATFS_BYTES, 'fuse_kstatfs');
  return {
    blocks: Number(buf.readBigUInt64LE(0)),
    bfree: Number(buf.readBigUInt64LE(8)),
    bavail: Number(buf.readBigUInt64LE(16)),
    files: Number(buf.readBigUInt64LE(24)),
    ffree: Number(buf.readBigUInt64LE(32)),
    bsize: buf.readUInt32LE(40),
    namelen: buf.readUInt32LE(44),
    frsize: buf.readUInt32LE(48),
  };
}
