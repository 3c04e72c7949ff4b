import { Readable } from 'node:stream';
import { DsecError } from '@dsec/core';
import type { FileInfo, FileType } from '@dsec/core';
import type { CommandExit, SandboxChannel } from '../backends/channel.js';
import { DEFAULT_PATH } from './command-runner.js';
import {
  diskExhausted,
  isDiskFullLine,
  isPidsRefusal,
  pidsExhausted,
  pidsExhaustedDuring,
} from './exhaustion.js';
import { isUserRefusal, userRefused } from './spawn-user.js';
import type { UserField } from './spawn-user.js';

/**
 * File operations inside a sandbox. Each one is a small script run by the
 * platform's own busybox (never the sandbox's binaries) through chronus, as
 * the sandbox's user, inside the sandbox's mount namespace and root: every
 * path, `..` and symlink resolves there, so nothing the sandbox does to its
 * paths — even racing to swap them — can make an operation touch a host
 * file (SECURITY A9). Exit codes 10–15 are the scripts' own verdicts.
 */

const STAT_FORMAT = '%f %s %Y %u %g';

const SCRIPTS = {
  stat: `[ -e "$1" ] || [ -L "$1" ] || exit 10
stat -c '${STAT_FORMAT}' -- "$1" || exit 1
if [ -L "$1" ]; then readlink -- "$1"; fi
exit 0`,
  // Alternating "<stat fields>\\n" and "<name>\\0": a failed stat (the entry vanished) skips the name too.
  list: `[ -e "$1" ] || exit 10
[ -d "$1" ] || exit 11
cd -- "$1" 2>/dev/null || exit 12
exec find . -mindepth 1 -maxdepth 1 -exec stat -c '${STAT_FORMAT}' -- {} ';' -print0`,
  // One byte first, so the caller knows the checks passed before it answers 200. Regular files
  // only (through symlinks): opening a fifo the sandbox made would wait for a writer forever, and
  // a device such as /dev/zero never ends.
  read: `[ -e "$1" ] || exit 10
[ -f "$1" ] || exit 11
[ -r "$1" ] || exit 12
printf x
exec cat -- "$1"`,
  // Atomic: a temp file in the same directory, renamed over the target.
  write: `p=$1 mode=$2
case $p in */*) d=\${p%/*}; [ -n "$d" ] || d=/;; *) d=.;; esac
[ -d "$d" ] || exit 10
if [ -d "$p" ] && [ ! -L "$p" ]; then exit 11; fi
full() { case $1 in *": No space left on device"*|*": Disk quota exceeded"*) exit 15;; esac; }
t=$(mktemp "$d/.dsec-write.XXXXXX" 2>&1) || { full "$t"; exit 12; }
trap 'rm -f -- "$t"' EXIT
trap 'exit 1' TERM INT HUP
e=$(cat 2>&1 >"$t") || { full "$e"; echo "$e" >&2; exit 1; }
if [ -z "$mode" ]; then mode=$(stat -L -c %a -- "$p" 2>/dev/null) || mode=644; fi
chmod "$mode" "$t" || exit 1
mv -f -- "$t" "$p" || exit 1
trap - EXIT
stat -c '${STAT_FORMAT}' -- "$p"`,
  mkdir: `p=$1 parents=$2 mode=$3
if [ -e "$p" ] || [ -L "$p" ]; then
  if [ "$parents" = 1 ] && [ -d "$p" ]; then exit 0; fi
  exit 13
fi
if [ "$parents" != 1 ]; then
  case $p in */*) d=\${p%/*}; [ -n "$d" ] || d=/;; *) d=.;; esac
  [ -d "$d" ] || exit 10
  set -- "$p"
else
  set -- -p "$p"
fi
if [ -n "$mode" ]; then mkdir -m "$mode" "$@"; else mkdir "$@"; fi`,
  remove: `p=$1 rec=$2
[ -e "$p" ] || [ -L "$p" ] || exit 10
if [ -d "$p" ] && [ ! -L "$p" ]; then
  if [ "$rec" = 1 ]; then exec rm -rf -- "$p"; fi
  [ -z "$(ls -A -- "$p" 2>/dev/null)" ] || exit 14
  exec rmdir -- "$p"
fi
exec rm -f -- "$p"`,
  rename: `a=$1 b=$2 ow=$3
[ -e "$a" ] || [ -L "$a" ] || exit 10
if [ -e "$b" ] || [ -L "$b" ]; then [ "$ow" = 1 ] || exit 13; fi
exec mv -f -T -- "$a" "$b"`,
} as const;

type Script = keyof typeof SCRIPTS;

const MAX_SMALL_OUTPUT = 64 * 1024 * 1024;

export interface FileCallOptions {
  user: string;
  /** Where `user` came from, named if the sandbox cannot run as it (spawn-user.ts). */
  userField?: UserField | undefined;
  signal?: AbortSignal | undefined;
  /** The sandbox's limits, named in `resource_exhausted` errors. */
  pidsLimit?: number | undefined;
  diskLimitMb?: number | undefined;
}

/** Paths that do not start with `/` are relative to the user's home; `./` keeps them from reading as options. */
export function normalizePath(path: string, field = 'path'): string {
  if (path.length === 0) throw new DsecError('invalid_argument', `${field} is empty`, { field });
  if (path.includes('\0')) {
    throw new DsecError('invalid_argument', `${field} contains a NUL byte`, { field });
  }
  return path.startsWith('/') ? path : `./${path}`;
}

function spawnScript(
  conn: SandboxChannel,
  script: Script,
  args: string[],
  options: FileCallOptions & { stdin?: boolean },
) {
  return conn.spawn({
    argv: ['sh', '-c', SCRIPTS[script], 'sh', ...args],
    shell: true,
    user: options.user,
    env: { PATH: DEFAULT_PATH },
    stdin: options.stdin ?? false,
  });
}

function verdict(
  exit: Pick<CommandExit, 'exitCode' | 'signal'>,
  stderr: string,
  what: string,
  options: FileCallOptions,
): DsecError | undefined {
  if (exit.exitCode === 0) return undefined;
  const why = stderr.trim().split('\n').at(-1)?.slice(0, 300);
  // ENOSPC/EDQUOT: 15 from the write script, or a tool's message (mkdir, mv) otherwise.
  if (exit.exitCode === 15 || (why !== undefined && isDiskFullLine(why)))
    return diskExhausted(what, options.diskLimitMb);
  if (why !== undefined && /can't fork|Resource temporarily unavailable/.test(why))
    return pidsExhaustedDuring(what, options.pidsLimit);
  switch (exit.exitCode) {
    case 10:
      return new DsecError('not_found', `${what}: no such file or directory`, { field: 'path' });
    case 11:
      return new DsecError('invalid_argument', `${what}: wrong file type for this operation`, {
        field: 'path',
      });
    case 12:
      return new DsecError('permission_denied', `${what}: permission denied`, { field: 'path' });
    case 13:
      return new DsecError('conflict', `${what}: already exists`, { field: 'path' });
    case 14:
      return new DsecError('conflict', `${what}: directory not empty (use recursive)`, {
        field: 'path',
      });
    default:
      return new DsecError(
        'invalid_argument',
        `${what}: ${why || `failed (${exit.signal ?? `exit ${exit.exitCode}`})`}`,
        { details: { exitCode: exit.exitCode } },
      );
  }
}

/** A spawn refused at the pids limit, or a lost connection. */
function channelError(e: unknown, options: FileCallOptions): DsecError {
  if (isPidsRefusal(e)) return pidsExhausted(options.pidsLimit, e);
  if (isUserRefusal(e)) return userRefused(options.user, options.userField ?? 'user', e);
  return new DsecError('unavailable', `lost the sandbox's command channel: ${String(e)}`, {
    cause: e,
  });
}

async function runSmall(
  conn: SandboxChannel,
  script: Script,
  args: string[],
  options: FileCallOptions,
  what: string,
): Promise<Buffer> {
  const h = spawnScript(conn, script, args, options);
  const out: Buffer[] = [];
  let outBytes = 0;
  let err = '';
  h.onStdout((c) => {
    outBytes += c.length;
    if (outBytes <= MAX_SMALL_OUTPUT) out.push(c);
    else h.killTree();
  });
  h.onStderr((c) => {
    if (err.length < 4096) err += c.toString('utf8');
  });
  const onAbort = () => h.killTree();
  options.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    const exit = await h.exited.catch((e: unknown) => {
      throw channelError(e, options);
    });
    if (options.signal?.aborted) throw new DsecError('aborted', 'operation aborted');
    if (outBytes > MAX_SMALL_OUTPUT) {
      throw new DsecError('payload_too_large', `${what}: answer exceeds 64 MiB`);
    }
    const bad = verdict(exit, err, what, options);
    if (bad) throw bad;
    return Buffer.concat(out);
  } finally {
    options.signal?.removeEventListener('abort', onAbort);
  }
}

const TYPES: Record<number, FileType> = {
  0o100000: 'file',
  0o040000: 'directory',
  0o120000: 'symlink',
  0o010000: 'fifo',
  0o140000: 'socket',
  0o020000: 'char',
  0o060000: 'block',
};

/** Parses one `%f %s %Y %u %g` line. */
export function parseStatLine(line: string, path: string): FileInfo {
  const [rawMode, size, mtime, uid, gid] = line.trim().split(' ');
  const mode = parseInt(rawMode ?? '', 16);
  if (!Number.isFinite(mode)) throw new DsecError('internal', 'unexpected stat output');
  const trimmed = path.length > 1 ? path.replace(/\/+$/, '') : path;
  return {
    name: trimmed.slice(trimmed.lastIndexOf('/') + 1) || trimmed,
    path,
    type: TYPES[mode & 0o170000] ?? 'unknown',
    size: Number(size),
    mode: mode & 0o7777,
    mtime: new Date(Number(mtime) * 1000).toISOString(),
    uid: Number(uid),
    gid: Number(gid),
  };
}

/** Parses the list script's output: `<fields>\n<./name>\0` repeated. */
export function parseListing(buf: Buffer, dir: string): FileInfo[] {
  const entries: FileInfo[] = [];
  let off = 0;
  const base = dir.endsWith('/') ? dir : `${dir}/`;
  while (off < buf.length) {
    const nl = buf.indexOf(0x0a, off);
    if (nl < 0) break;
    const nul = buf.indexOf(0x00, nl + 1);
    if (nul < 0) break;
    const line = buf.subarray(off, nl).toString('latin1');
    const name = buf
      .subarray(nl + 1, nul)
      .toString('utf8')
      .replace(/^\.\//, '');
    const info = parseStatLine(line, base + name);
    entries.push({ ...info, name });
    off = nul + 1;
  }
  return entries.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
}

export async function statFile(
  conn: SandboxChannel,
  path: string,
  options: FileCallOptions,
): Promise<FileInfo> {
  const p = normalizePath(path);
  const out = (await runSmall(conn, 'stat', [p], options, path)).toString('utf8');
  const nl = out.indexOf('\n');
  const info = parseStatLine(out.slice(0, nl < 0 ? undefined : nl), path);
  if (info.type === 'symlink' && nl >= 0) info.target = out.slice(nl + 1).replace(/\n$/, '');
  return info;
}

export async function listDir(
  conn: SandboxChannel,
  path: string,
  options: FileCallOptions,
): Promise<FileInfo[]> {
  const p = normalizePath(path);
  return parseListing(await runSmall(conn, 'list', [p], options, path), path);
}

export async function makeDir(
  conn: SandboxChannel,
  path: string,
  options: FileCallOptions & { parents?: boolean | undefined; mode?: number | undefined },
): Promise<void> {
  const mode = options.mode === undefined ? '' : modeString(options.mode);
  await runSmall(
    conn,
    'mkdir',
    [normalizePath(path), options.parents ? '1' : '0', mode],
    options,
    path,
  );
}

export async function removePath(
  conn: SandboxChannel,
  path: string,
  options: FileCallOptions & { recursive?: boolean | undefined },
): Promise<void> {
  await runSmall(
    conn,
    'remove',
    [normalizePath(path), options.recursive ? '1' : '0'],
    options,
    path,
  );
}

export async function renamePath(
  conn: SandboxChannel,
  from: string,
  to: string,
  options: FileCallOptions & { overwrite?: boolean | undefined },
): Promise<void> {
  await runSmall(
    conn,
    'rename',
    [normalizePath(from, 'from'), normalizePath(to, 'to'), options.overwrite ? '1' : '0'],
    options,
    from,
  );
}

function modeString(mode: number): string {
  if (!Number.isInteger(mode) || mode < 0 || mode > 0o7777) {
    throw new DsecError('invalid_argument', 'mode must be between 0 and 0o7777', {
      field: 'mode',
    });
  }
  return mode.toString(8);
}

/**
 * Streams a file out of the sandbox over a dedicated connection: the
 * connection is paused whenever the returned stream's reader falls behind,
 * which makes chronus pause `cat` (back-pressure end to end, no buffering).
 * Resolves once the checks passed (the first byte arrived); rejects with
 * `not_found` & co. before any byte of content.
 */
export function readFileStream(
  conn: SandboxChannel,
  path: string,
  options: FileCallOptions,
): Promise<Readable> {
  const h = spawnScript(conn, 'read', [normalizePath(path)], options);
  let err = '';
  let gotMarker = false;
  let finished = false;
  const stream = new Readable({
    highWaterMark: 1 << 20,
    read: () => conn.resume(),
    destroy: (e, cb) => {
      if (!finished) h.killTree();
      conn.close();
      cb(e);
    },
  });
  stream.on('error', () => undefined); // the consumer's listeners get it; none must crash the edge
  return new Promise<Readable>((resolve, reject) => {
    const onAbort = () => {
      stream.destroy(new DsecError('aborted', 'operation aborted'));
      reject(new DsecError('aborted', 'operation aborted'));
    };
    options.signal?.addEventListener('abort', onAbort, { once: true });
    h.onStdout((chunk) => {
      if (!gotMarker) {
        gotMarker = true;
        chunk = chunk.subarray(1);
        resolve(stream);
      }
      if (chunk.length > 0 && !stream.push(chunk)) conn.pause();
    });
    h.onStderr((c) => {
      if (err.length < 4096) err += c.toString('utf8');
    });
    h.exited.then(
      (exit) => {
        finished = true;
        options.signal?.removeEventListener('abort', onAbort);
        const bad = verdict(exit, err, path, options);
        if (!gotMarker) {
          reject(bad ?? new DsecError('internal', 'file read ended without its marker'));
          conn.close();
        } else if (bad) stream.destroy(bad);
        else {
          stream.push(null);
          conn.close();
        }
      },
      (e: unknown) => {
        finished = true;
        const lost = channelError(e, options);
        if (!gotMarker) reject(lost);
        stream.destroy(lost);
      },
    );
  });
}

/** Writes a file atomically from a stream over a dedicated connection, waiting on the socket to drain. */
export async function writeFileStream(
  conn: SandboxChannel,
  path: string,
  body: Readable | Buffer,
  options: FileCallOptions & { mode?: number | undefined },
): Promise<FileInfo> {
  const mode = options.mode === undefined ? '' : modeString(options.mode);
  const h = spawnScript(conn, 'write', [normalizePath(path), mode], { ...options, stdin: true });
  let out = '';
  let err = '';
  h.onStdout((c) => (out += c.toString('utf8')));
  h.onStderr((c) => {
    if (err.length < 4096) err += c.toString('utf8');
  });
  let exited = false;
  const exit = h.exited.finally(() => (exited = true));
  exit.catch(() => undefined);
  try {
    await h.started;
    if (Buffer.isBuffer(body)) {
      if (!h.write(body)) await conn.drained();
    } else {
      for await (const chunk of body) {
        if (options.signal?.aborted) throw new DsecError('aborted', 'operation aborted');
        if (exited) break; // the script failed early; its verdict says why
        if (!h.write(chunk as Buffer)) await conn.drained();
      }
    }
    if (options.signal?.aborted) throw new DsecError('aborted', 'operation aborted');
    h.endStdin();
  } catch (e) {
    if (isPidsRefusal(e)) throw pidsExhausted(options.pidsLimit, e); // it never started
    if (isUserRefusal(e)) throw userRefused(options.user, options.userField ?? 'user', e);
    // TERM, not KILL: the script's trap removes its temp file.
    h.signal('SIGTERM');
    await exit.catch(() => undefined);
    throw e instanceof DsecError ? e : new DsecError('aborted', `upload interrupted: ${String(e)}`);
  }
  const result = await exit.catch((e: unknown) => {
    throw channelError(e, options);
  });
  const bad = verdict(result, err, path, options);
  if (bad) throw bad;
  return parseStatLine(out.split('\n')[0] ?? '', path);
}
