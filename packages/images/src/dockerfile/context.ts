import { createHash } from 'node:crypto';
import { constants } from 'node:fs';
import { lstat, mkdir, open, readdir, readlink, symlink, chmod, utimes } from 'node:fs/promises';
import { join, posix } from 'node:path';
import { DsecError, throwIfAborted } from '@dsec/core';

export interface ContextLimits {
  /** Apparent bytes of all files (a sparse file counts at its length). Default {@link DEFAULT_MAX_CONTEXT_BYTES}. */
  maxContextBytes?: number | undefined;
  /** Entries (files, directories, symlinks). Default {@link DEFAULT_MAX_CONTEXT_ENTRIES}. */
  maxContextEntries?: number | undefined;
}

/** 4 GiB of file bytes in a build context. */
export const DEFAULT_MAX_CONTEXT_BYTES = 4 * 2 ** 30;
/** 500 000 entries in a build context. */
export const DEFAULT_MAX_CONTEXT_ENTRIES = 500_000;
/** Directory depth in a build context (deeper trees are refused, not walked). */
const MAX_DEPTH = 256;
const COPY_CHUNK_BYTES = 1024 * 1024;
/** Files of one directory copied at once (a repository is thousands of small files). */
const COPY_CONCURRENCY = 8;

export interface StagedContext {
  /** sha256 over every entry's path, type, mode and content (or link target), in path order. */
  digest: string;
  bytes: number;
  entries: number;
}

/**
 * Copies a build context into `dest` (a fresh directory of DSec's), which
 * is what buildah then reads: the digest names exactly what was built, and
 * a context that changes during the build cannot change it. Nothing outside
 * `src` is read: every entry is opened with `O_NOFOLLOW` and checked to be
 * what `lstat` said; symlinks are copied as symlinks (as `docker build`
 * sends them; buildah resolves them inside the context), never followed.
 * Refused with `invalid_argument` (field `dockerfile`, `details.reason`):
 * device nodes, FIFOs and sockets (`special_file`), and a context past its
 * bounds (`context_too_large`), counted before a byte of a file is copied,
 * so a huge sparse file costs nothing.
 */
export async function stageContext(
  src: string,
  dest: string,
  limits: ContextLimits = {},
  signal?: AbortSignal,
): Promise<StagedContext> {
  const maxBytes = limits.maxContextBytes ?? DEFAULT_MAX_CONTEXT_BYTES;
  const maxEntries = limits.maxContextEntries ?? DEFAULT_MAX_CONTEXT_ENTRIES;
  const top = await lstat(src).catch(() => undefined);
  if (!top?.isDirectory()) {
    throw new DsecError('invalid_argument', `${src} is not a directory`, {
      field: 'contextDir',
    });
  }
  const hash = createHash('sha256');
  let bytes = 0;
  let entries = 0;
  const tooLarge = (what: string): DsecError =>
    new DsecError(
      'invalid_argument',
      `the build context ${src} has more than ${what}; raise the limit or add a .dockerignore`,
      {
        field: 'contextDir',
        details: {
          reason: 'context_too_large',
          maxContextBytes: maxBytes,
          maxContextEntries: maxEntries,
        },
      },
    );
  // Depth-first, sorted, iterative (a deep tree costs no stack).
  const stack: { rel: string; depth: number }[] = [{ rel: '', depth: 0 }];
  await mkdir(dest, { recursive: true, mode: 0o755 });
  const dirModes: { path: string; mode: number }[] = [];
  while (stack.length > 0) {
    throwIfAborted(signal);
    const { rel, depth } = stack.pop()!;
    const names = (await readdir(join(src, rel))).sort();
    const subdirs: string[] = [];
    // Hashed in name order once the directory's files are copied.
    const lines: (string | (() => Promise<string>))[] = [];
    for (const name of names) {
      const r = rel === '' ? name : `${rel}/${name}`;
      const from = join(src, r);
      const to = join(dest, r);
      const st = await lstat(from);
      if (++entries > maxEntries) throw tooLarge(`${maxEntries} entries`);
      const mode = st.mode & 0o7777;
      if (st.isDirectory()) {
        if (depth + 1 > MAX_DEPTH) {
          throw new DsecError(
            'invalid_argument',
            `${r}: the build context is nested deeper than ${MAX_DEPTH}`,
            {
              field: 'contextDir',
              details: { reason: 'context_too_large' },
            },
          );
        }
        lines.push(`d ${JSON.stringify(r)} ${mode.toString(8)}\n`);
        await mkdir(to, { mode: 0o755 });
        dirModes.push({ path: to, mode: mode & 0o777 });
        subdirs.push(r);
      } else if (st.isSymbolicLink()) {
        const target = await readlink(from);
        lines.push(`l ${JSON.stringify(r)} ${JSON.stringify(target)}\n`);
        await symlink(target, to);
      } else if (st.isFile()) {
        bytes += st.size;
        if (bytes > maxBytes) throw tooLarge(`${maxBytes} bytes of files`);
        lines.push(async () => {
          const content = await copyRegular(from, to, st.size, mode & 0o777);
          await utimes(to, st.atime, st.mtime);
          return `f ${JSON.stringify(r)} ${(mode & 0o777).toString(8)} ${st.size} ${content}\n`;
        });
      } else {
        throw new DsecError(
          'invalid_argument',
          `${r} in the build context is a device node, FIFO or socket; remove it or list it in .dockerignore`,
          { field: 'contextDir', details: { reason: 'special_file', path: r } },
        );
      }
    }
    for (const line of await inPool(lines, COPY_CONCURRENCY, signal)) hash.update(line);
    // Popped in order: push the subdirectories reversed.
    for (const d of subdirs.reverse()) stack.push({ rel: d, depth: depth + 1 });
  }
  // Modes last, so a read-only directory could still be filled.
  for (const d of dirModes.reverse()) await chmod(d.path, d.mode);
  return { digest: `sha256:${hash.digest('hex')}`, bytes, entries };
}

/**
 * The values of `items` in order, running the functions among them at most
 * `limit` at a time; the first failure is thrown once none is running.
 */
async function inPool(
  items: (string | (() => Promise<string>))[],
  limit: number,
  signal: AbortSignal | undefined,
): Promise<string[]> {
  const out: string[] = new Array<string>(items.length);
  let next = 0;
  let failed: { err: unknown } | undefined;
  const worker = async (): Promise<void> => {
    while (next < items.length && failed === undefined) {
      const i = next++;
      const item = items[i]!;
      try {
        throwIfAborted(signal);
        out[i] = typeof item === 'string' ? item : await item();
      } catch (err) {
        failed ??= { err };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  if (failed) throw failed.err;
  return out;
}

/**
 * Copies one regular file without following a link at its last component,
 * refusing one that changed type or grew meanwhile; returns its sha256.
 */
async function copyRegular(from: string, to: string, size: number, mode: number): Promise<string> {
  const input = await open(from, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  try {
    const st = await input.stat();
    if (!st.isFile()) {
      throw new DsecError(
        'invalid_argument',
        `${posix.basename(from)} changed while the context was read`,
        {
          field: 'contextDir',
          details: { reason: 'special_file' },
        },
      );
    }
    const out = await open(to, 'wx', mode);
    const hash = createHash('sha256');
    try {
      const buf = Buffer.allocUnsafe(Math.min(COPY_CHUNK_BYTES, Math.max(size, 1)));
      let copied = 0;
      // At most the size lstat gave: a file that grows cannot grow the copy.
      while (copied < size) {
        const { bytesRead } = await input.read(buf, 0, Math.min(buf.length, size - copied), null);
        if (bytesRead === 0) break;
        hash.update(buf.subarray(0, bytesRead));
        await out.write(buf, 0, bytesRead);
        copied += bytesRead;
      }
    } finally {
      await out.close();
    }
    return hash.digest('hex');
  } finally {
    await input.close();
  }
}
