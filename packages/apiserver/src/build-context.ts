import { constants } from 'node:fs';
import { link, mkdir, open, symlink, type FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError, throwIfAborted } from '@dsec/core';

/** Bounds on one uploaded build context (`POST /v1/images/builds`). */
export interface BuildContextLimits {
  /** Entries of the archive (files, directories, links). Default 100 000. */
  maxEntries: number;
  /** Bytes of one path (after `./` and repeated slashes are dropped). Default 4096. */
  maxPathBytes: number;
  /** Directory depth of one path. Default 128. */
  maxDepth: number;
  /**
   * Bytes of all the paths the unpacking records (each entry's, and each
   * directory it makes for them), which it keeps in memory. Default 64 MiB.
   */
  maxTotalPathBytes: number;
}

export const DEFAULT_BUILD_CONTEXT_LIMITS: BuildContextLimits = {
  maxEntries: 100_000,
  maxPathBytes: 4096,
  maxDepth: 128,
  maxTotalPathBytes: 64 * 2 ** 20,
};

/** What a pax extended header may carry: its records are read whole, so they are bounded. */
const MAX_PAX_BYTES = 1024 * 1024;
const BLOCK = 512;
const COPY_CHUNK = 1024 * 1024;

export type EntryKind = 'dir' | 'file' | 'symlink';

export interface UnpackedContext {
  entries: number;
  /** Bytes of regular files written. */
  bytes: number;
  /**
   * What the archive made at `path` (a relative path, checked as the
   * archive's are), by this unpacking's own record: never a look-up on disk.
   */
  kindOf(path: string): EntryKind | undefined;
}

/**
 * Unpacks a build context sent as a tar archive (ustar, pax or GNU long
 * names; what `tar -c`, Python's `tarfile` and Docker clients write) into
 * `dest`, a fresh empty directory of the apiserver's own.
 *
 * The archive is the caller's: nothing in it decides where a byte lands
 * outside `dest`, and no path it names is ever resolved through the file
 * system. Every entry's path is checked as text (no absolute path, no `..`,
 * bounded length and depth) and every parent it goes under must be a
 * directory this unpacking made: the kind of each path written is kept in
 * memory, so a symlink the archive made (`a -> /etc`) is never a parent
 * (`a/passwd` is refused), and the last component is created with
 * `O_EXCL | O_NOFOLLOW` (`mkdir`, `symlink` never follow). Symlinks are
 * written as links with their text as is (the builder copies them as
 * links and buildah resolves them inside the context); a hard link must
 * name a regular file the archive already holds. Device nodes, FIFOs,
 * sparse and unknown entry kinds are refused; a path given twice is refused
 * unless both are directories. Permission bits are kept (no set-id or
 * sticky bit; directories stay owner-writable); owners and times are not.
 *
 * Refusals are `invalid_argument` (field `context`, `details.reason`:
 * `tar_malformed`, `tar_path`, `tar_entry_kind`, `tar_link`, `tar_duplicate`,
 * `context_too_large`); the caller removes `dest`.
 */
export async function unpackBuildContext(
  tarPath: string,
  dest: string,
  limits: BuildContextLimits = DEFAULT_BUILD_CONTEXT_LIMITS,
  signal?: AbortSignal,
): Promise<UnpackedContext> {
  const fh = await open(tarPath, constants.O_RDONLY | constants.O_NOFOLLOW);
  try {
    const reader = new BlockReader(fh);
    const kinds = new Map<string, EntryKind>([['', 'dir']]);
    let entries = 0;
    let pathBytes = 0;
    // Every path recorded counts, the directories an entry's path makes too (an archive of a
    // few entries, each 127 fresh directories deep, would otherwise make and keep thousands).
    const record = (path: string, kind: EntryKind): void => {
      if (++entries > limits.maxEntries)
        throw bad(
          'context_too_large',
          `the archive makes more than ${limits.maxEntries} entries (directories its paths go through count)`,
          { maxEntries: limits.maxEntries },
        );
      pathBytes += Buffer.byteLength(path);
      if (pathBytes > limits.maxTotalPathBytes)
        throw bad(
          'context_too_large',
          `the archive's paths add up to more than ${limits.maxTotalPathBytes} bytes`,
          { maxTotalPathBytes: limits.maxTotalPathBytes },
        );
      kinds.set(path, kind);
    };
    let bytes = 0;
    let longName: string | undefined;
    let longLink: string | undefined;
    let pax: Record<string, string> = {};
    for (;;) {
      throwIfAborted(signal);
      const header = await reader.block();
      if (header === undefined) break; // EOF without the end marker: as tar(1) accepts it
      if (header.every((b) => b === 0)) break;
      checkChecksum(header);
      const type = String.fromCharCode(header[156]!);
      const size = headerSize(header, pax['size']);
      if (type === 'x' || type === 'g' || type === 'L' || type === 'K') {
        if (size > MAX_PAX_BYTES)
          throw bad(
            'tar_malformed',
            `an extended header of ${size} bytes (at most ${MAX_PAX_BYTES})`,
          );
        const data = (await reader.data(size)).toString('utf8');
        if (type === 'x') pax = parsePax(data);
        else if (type === 'L') longName = data.replace(/\0.*$/s, '');
        else if (type === 'K') longLink = data.replace(/\0.*$/s, '');
        continue; // 'g' (global) headers carry nothing a context needs
      }
      const rawName = pax['path'] ?? longName ?? ustarName(header);
      const rawLink = pax['linkpath'] ?? longLink ?? cString(header, 157, 100);
      pax = {};
      longName = undefined;
      longLink = undefined;
      const path = checkPath(rawName, limits);
      const mode = parseOctal(header.subarray(100, 108), 'mode') & 0o777;
      if (path === '') {
        // `./` itself: the context's root, which exists.
        if (type !== '5')
          throw bad('tar_path', 'an entry names the context root as a non-directory');
        await reader.skip(size);
        continue;
      }
      await ensureParents(dest, path, kinds, record);
      const existing = kinds.get(path);
      const target = join(dest, path);
      switch (type) {
        case '5': {
          if (existing !== undefined && existing !== 'dir') throw duplicate(path);
          if (existing === undefined) {
            record(path, 'dir');
            await mkdir(target, { mode: mode | 0o700 });
          }
          await reader.skip(size);
          break;
        }
        case '0':
        case '\0':
        case '7': {
          if (existing !== undefined) throw duplicate(path);
          record(path, 'file');
          await reader.copyTo(target, size, mode);
          bytes += size;
          break;
        }
        case '2': {
          if (existing !== undefined) throw duplicate(path);
          if (
            rawLink === '' ||
            Buffer.byteLength(rawLink) > limits.maxPathBytes ||
            rawLink.includes('\0')
          )
            throw bad('tar_link', `${show(path)}: a symlink with an empty or over-long target`);
          record(path, 'symlink');
          await symlink(rawLink, target);
          await reader.skip(size);
          break;
        }
        case '1': {
          if (existing !== undefined) throw duplicate(path);
          const linked = checkPath(rawLink, limits, 'tar_link');
          if (kinds.get(linked) !== 'file') {
            throw bad(
              'tar_link',
              `${show(path)}: a hard link must name a regular file earlier in the archive (not ${show(rawLink)})`,
              { path: path.slice(0, 300) },
            );
          }
          record(path, 'file');
          // link(2) never follows a symlink at either end; both paths are this unpacking's files.
          await link(join(dest, linked), target);
          await reader.skip(size);
          break;
        }
        default:
          throw bad(
            'tar_entry_kind',
            `${show(path)}: ${KIND_NAMES[type] ?? `entries of type ${JSON.stringify(type)}`} cannot be part of a build context`,
            { path: path.slice(0, 300) },
          );
      }
    }
    return {
      entries,
      bytes,
      kindOf: (p) => {
        try {
          return kinds.get(checkPath(p, limits));
        } catch {
          return undefined;
        }
      },
    };
  } finally {
    await fh.close();
  }
}

const KIND_NAMES: Record<string, string> = {
  '3': 'character devices',
  '4': 'block devices',
  '6': 'FIFOs',
  S: 'sparse files',
  V: 'volume headers',
  M: 'multi-volume continuations',
};

/**
 * The parents of `path` as directories this unpacking owns: each must be
 * one it made or be made now (an archive may omit directory entries); a
 * parent that is a file or a symlink refuses the entry.
 */
async function ensureParents(
  dest: string,
  path: string,
  kinds: Map<string, EntryKind>,
  record: (path: string, kind: EntryKind) => void,
): Promise<void> {
  const parts = path.split('/');
  let cur = '';
  for (const part of parts.slice(0, -1)) {
    cur = cur === '' ? part : `${cur}/${part}`;
    const kind = kinds.get(cur);
    if (kind === 'dir') continue;
    if (kind !== undefined) {
      throw bad(
        'tar_path',
        `${show(path)} goes through ${show(cur)}, which is a ${kind === 'symlink' ? 'symlink' : 'file'}`,
        {
          path: path.slice(0, 300),
        },
      );
    }
    record(cur, 'dir');
    await mkdir(join(dest, cur), { mode: 0o755 });
  }
}

/** A path of the archive as a relative path of the context, checked as text only. */
function checkPath(raw: string, limits: BuildContextLimits, reason = 'tar_path'): string {
  if (raw.includes('\0')) throw bad(reason, 'a path with a NUL byte');
  if (raw.startsWith('/'))
    throw bad(reason, `${show(raw)} is absolute`, { path: raw.slice(0, 300) });
  const parts = raw.split('/').filter((p) => p !== '' && p !== '.');
  if (parts.includes('..'))
    throw bad(reason, `${show(raw)} leaves the context ('..')`, { path: raw.slice(0, 300) });
  const path = parts.join('/');
  if (
    Buffer.byteLength(path) > limits.maxPathBytes ||
    parts.some((p) => Buffer.byteLength(p) > 255)
  )
    throw bad(reason, `a path longer than ${limits.maxPathBytes} bytes (or a name past 255)`);
  if (parts.length > limits.maxDepth)
    throw bad('context_too_large', `${show(raw)} is nested deeper than ${limits.maxDepth}`, {
      maxDepth: limits.maxDepth,
    });
  return path;
}

function ustarName(h: Buffer): string {
  const name = cString(h, 0, 100);
  const magic = h.subarray(257, 262).toString('latin1');
  const prefix = magic === 'ustar' ? cString(h, 345, 155) : '';
  return prefix === '' ? name : `${prefix}/${name}`;
}

function cString(h: Buffer, at: number, len: number): string {
  const field = h.subarray(at, at + len);
  const end = field.indexOf(0);
  return field.subarray(0, end < 0 ? len : end).toString('utf8');
}

function parseOctal(field: Buffer, what: string): number {
  if ((field[0]! & 0x80) !== 0) throw bad('tar_malformed', `a base-256 ${what} (too large)`);
  const text = field
    .toString('latin1')
    .replace(/[\0 ]+$/g, '')
    .replace(/^[ ]+/, '');
  if (text === '') return 0;
  if (!/^[0-7]{1,12}$/.test(text)) throw bad('tar_malformed', `a header's ${what} is not octal`);
  return parseInt(text, 8);
}

function headerSize(h: Buffer, paxSize: string | undefined): number {
  if (paxSize !== undefined) {
    if (!/^\d{1,15}$/.test(paxSize)) throw bad('tar_malformed', 'a pax size that is not a number');
    return Number(paxSize);
  }
  return parseOctal(h.subarray(124, 136), 'size');
}

function checkChecksum(h: Buffer): void {
  const stored = parseOctal(h.subarray(148, 156), 'checksum');
  let sum = 0;
  for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 0x20 : h[i]!;
  if (sum !== stored)
    throw bad('tar_malformed', 'a tar header with a wrong checksum (not a tar archive?)');
}

/** `LEN key=value\n` records (POSIX pax). */
function parsePax(data: string): Record<string, string> {
  const out: Record<string, string> = {};
  const buf = Buffer.from(data, 'utf8');
  let at = 0;
  while (at < buf.length) {
    const space = buf.indexOf(0x20, at);
    if (space < 0) break;
    const len = Number(buf.subarray(at, space).toString('latin1'));
    if (!Number.isInteger(len) || len <= space - at || at + len > buf.length)
      throw bad('tar_malformed', 'a malformed pax record');
    const record = buf.subarray(space + 1, at + len - 1).toString('utf8');
    const eq = record.indexOf('=');
    if (eq > 0) out[record.slice(0, eq)] = record.slice(eq + 1);
    at += len;
  }
  return out;
}

function duplicate(path: string): DsecError {
  return bad('tar_duplicate', `${show(path)} is in the archive twice`, {
    path: path.slice(0, 300),
  });
}

function show(p: string): string {
  return JSON.stringify(p.length > 200 ? `${p.slice(0, 200)}…` : p);
}

function bad(reason: string, message: string, details: Record<string, unknown> = {}): DsecError {
  return new DsecError('invalid_argument', `build context: ${message}`, {
    field: 'context',
    details: { reason, ...details },
  });
}

/** Sequential 512-byte-block reads of the archive file. */
class BlockReader {
  #pos = 0;
  readonly #fh: FileHandle;
  constructor(fh: FileHandle) {
    this.#fh = fh;
  }

  async block(): Promise<Buffer | undefined> {
    const buf = Buffer.alloc(BLOCK);
    const { bytesRead } = await this.#fh.read(buf, 0, BLOCK, this.#pos);
    if (bytesRead === 0) return undefined;
    if (bytesRead < BLOCK) throw bad('tar_malformed', 'the archive ends inside a header');
    this.#pos += BLOCK;
    return buf;
  }

  async data(size: number): Promise<Buffer> {
    const buf = Buffer.alloc(size);
    const { bytesRead } = await this.#fh.read(buf, 0, size, this.#pos);
    if (bytesRead < size) throw bad('tar_malformed', 'the archive ends inside an entry');
    this.#pos += padded(size);
    return buf;
  }

  async skip(size: number): Promise<void> {
    this.#pos += padded(size);
  }

  /** Writes the next `size` bytes to a new file `to` (never an existing one, never through a link). */
  async copyTo(to: string, size: number, mode: number): Promise<void> {
    const out = await open(
      to,
      constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW,
      mode,
    );
    try {
      const buf = Buffer.allocUnsafe(Math.min(COPY_CHUNK, Math.max(size, 1)));
      let left = size;
      while (left > 0) {
        const n = Math.min(buf.length, left);
        const { bytesRead } = await this.#fh.read(buf, 0, n, this.#pos);
        if (bytesRead < n) throw bad('tar_malformed', 'the archive ends inside a file');
        await out.write(buf, 0, n);
        this.#pos += n;
        left -= n;
      }
      this.#pos += padded(size) - size;
      // The umask may have dropped bits; set-id and sticky bits were never kept.
      await out.chmod(mode);
    } finally {
      await out.close();
    }
  }
}

function padded(size: number): number {
  return Math.ceil(size / BLOCK) * BLOCK;
}
