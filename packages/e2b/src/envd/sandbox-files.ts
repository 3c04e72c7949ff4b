import type { Readable } from 'node:stream';
import { DsecError, toDsecError } from '@dsec/core';
import type { FileInfo, FileType } from '@dsec/core';
import { BoundedMap } from '../sandbox-access.js';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';

/**
 * What envd knows about files that DSec's file interface does not say:
 * owner names, where a symlink leads, and directories made for a user who
 * could not make them. Each is found inside the sandbox (its own
 * /etc/passwd read through the sandbox, a small script run by the
 * platform's shell in the sandbox's namespaces): the host never resolves a
 * path the sandbox made (SECURITY A9).
 */

/** Bytes of /etc/passwd or /etc/group read; the rest of a bigger file is ignored. */
export const MAX_ID_FILE_BYTES = 1024 * 1024;
/** Names one read parses per file (the read's own, dropped after the call). */
const MAX_NAMES = 65_536;
/** Names the cache keeps per file and sandbox: those asked about, not the whole file. */
const MAX_CACHED_NAMES = 1024;
/** Sandboxes whose names are cached. */
const NAME_CACHE_SANDBOXES = 4096;
/** Symlinks one call resolves; the rest are reported as files without a target. */
export const MAX_SYMLINKS_PER_CALL = 1000;
/** Output of one symlink resolution: a line per link. */
const MAX_RESOLVE_OUTPUT = 8 * 1024 * 1024;
/** How long the helper scripts may run. */
const SCRIPT_TIMEOUT_MS = 30_000;

export interface IdNames {
  users: Map<number, string>;
  groups: Map<number, string>;
}

/** `name:x:uid:...` lines to uid → name (the first name of a uid wins, as getpwuid). */
export function parseIdFile(text: string): Map<number, string> {
  const out = new Map<number, string>();
  for (const line of text.split('\n')) {
    if (out.size >= MAX_NAMES) break;
    const fields = line.split(':');
    const name = fields[0];
    const id = fields[2];
    if (!name || id === undefined || !/^\d{1,10}$/.test(id)) continue;
    const n = Number(id);
    if (!out.has(n)) out.set(n, name);
  }
  return out;
}

async function readCapped(body: Readable, cap: number): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  try {
    for await (const c of body as AsyncIterable<Buffer>) {
      const room = cap - size;
      chunks.push(c.length > room ? c.subarray(0, room) : c);
      size += Math.min(c.length, room);
      if (size >= cap) break;
    }
  } finally {
    body.destroy();
  }
  const text = Buffer.concat(chunks).toString('utf8');
  // A cut file's last line is partial: drop it.
  return size >= cap ? text.slice(0, text.lastIndexOf('\n') + 1) : text;
}

/**
 * uid and gid names from the sandbox's own /etc/passwd and /etc/group,
 * read through the sandbox as root. Cached per sandbox; an ID the cache
 * does not name makes one fresh read per call (`lookup`), so a user added
 * since is named at once and a call costs at most two bounded reads.
 */
export class OwnerNames {
  readonly #cache = new BoundedMap<string, IdNames>(NAME_CACHE_SANDBOXES);

  async #read(
    sb: OpenedSandbox,
    files: readonly FileInfo[],
    signal: AbortSignal | undefined,
  ): Promise<IdNames> {
    const one = async (path: string): Promise<Map<number, string>> => {
      try {
        const body = await sb.io.readFile(sb.id, path, { user: 'root', signal });
        return parseIdFile(await readCapped(body, MAX_ID_FILE_BYTES));
      } catch (err) {
        const code = toDsecError(err).code;
        // No such file (or not readable): numeric IDs, as envd shows unknown ones.
        if (code === 'not_found' || code === 'permission_denied' || code === 'invalid_argument') {
          return new Map();
        }
        throw err;
      }
    };
    const [users, groups] = await Promise.all([one('/etc/passwd'), one('/etc/group')]);
    // The cache keeps the names asked about (now and before), so its size is bounded by
    // use, not by what the sandbox writes in its files.
    const old = this.#cache.get(sb.id);
    const keep = (all: Map<number, string>, ids: Iterable<number>) => {
      const kept = new Map<number, string>();
      for (const id of ids) {
        if (kept.size >= MAX_CACHED_NAMES) break;
        const name = all.get(id);
        if (name !== undefined) kept.set(id, name);
      }
      return kept;
    };
    this.#cache.set(sb.id, {
      users: keep(users, [...files.map((f) => f.uid), ...(old?.users.keys() ?? [])]),
      groups: keep(groups, [...files.map((f) => f.gid), ...(old?.groups.keys() ?? [])]),
    });
    return { users, groups };
  }

  /** Names for these entries' owners, reading the files again if one is unknown. */
  async lookup(
    sb: OpenedSandbox,
    files: readonly FileInfo[],
    signal: AbortSignal | undefined,
  ): Promise<IdNames> {
    const cached = this.#cache.get(sb.id);
    if (cached && files.every((f) => cached.users.has(f.uid) && cached.groups.has(f.gid))) {
      return cached;
    }
    return this.#read(sb, files, signal);
  }

  forget(sandboxId: string): void {
    this.#cache.delete(sandboxId);
  }
}

/** An owner's name, or its number when the sandbox names none (root is root regardless). */
export function nameOf(names: Map<number, string> | undefined, id: number): string {
  return names?.get(id) ?? (id === 0 ? 'root' : String(id));
}

/** Where a symlink leads: the target's type (`unknown` when broken) and its absolute path. */
export interface LinkTarget {
  type: FileType;
  /** Absolute, every link on the way resolved (`readlink -f`); empty if it cannot be. */
  path: string;
  /** The link's own text (`readlink`). */
  text?: string | undefined;
}

// Two lines per link: "<hex mode of the end|-> <resolved path>", then the link's own text.
// A value with a newline is left empty so the lines stay in step.
const RESOLVE_SCRIPT = `nl='
'
while IFS= read -r p; do
  t=$(readlink -f -- "$p" 2>/dev/null) || t=
  r=$(readlink -- "$p" 2>/dev/null) || r=
  m=$(stat -L -c %f -- "$p" 2>/dev/null) || m=-
  case $t in *"$nl"*) t=;; esac
  case $r in *"$nl"*) r=;; esac
  printf '%s %s\\n%s\\n' "$m" "$t" "$r"
done`;

const TYPE_BITS: Record<number, FileType> = {
  0o100000: 'file',
  0o040000: 'directory',
  0o120000: 'symlink',
  0o010000: 'fifo',
  0o140000: 'socket',
  0o020000: 'char',
  0o060000: 'block',
};

/** Parses the resolve script's answer (two lines per link), in the order of `paths`. */
export function parseResolved(paths: readonly string[], out: string): Map<string, LinkTarget> {
  const lines = out.split('\n');
  const result = new Map<string, LinkTarget>();
  paths.forEach((p, i) => {
    const line = lines[2 * i];
    const text = lines[2 * i + 1];
    if (line === undefined || text === undefined) return;
    const sp = line.indexOf(' ');
    const mode = sp < 0 ? NaN : parseInt(line.slice(0, sp), 16);
    const target = sp < 0 ? '' : line.slice(sp + 1);
    result.set(p, {
      type: Number.isFinite(mode) ? (TYPE_BITS[mode & 0o170000] ?? 'unknown') : 'unknown',
      path: target.startsWith('/') ? target : '',
      text,
    });
  });
  return result;
}

/**
 * Resolves symlinks inside the sandbox, as `user`, in one command: each
 * path's target type and absolute target. Paths with a newline, and those
 * past `MAX_SYMLINKS_PER_CALL`, are left out of the answer.
 */
export async function resolveSymlinks(
  sb: OpenedSandbox,
  paths: readonly string[],
  user: string | undefined,
  signal: AbortSignal | undefined,
): Promise<Map<string, LinkTarget>> {
  const todo = paths.filter((p) => !p.includes('\n')).slice(0, MAX_SYMLINKS_PER_CALL);
  if (todo.length === 0) return new Map();
  const r = await sb.io.runCommand(
    sb.id,
    {
      shell: RESOLVE_SCRIPT,
      stdin: `${todo.join('\n')}\n`,
      ...(user !== undefined ? { user } : {}),
      timeoutMs: SCRIPT_TIMEOUT_MS,
      maxOutputBytes: MAX_RESOLVE_OUTPUT,
    },
    { signal },
  );
  if (r.outcome !== 'exited' || r.exitCode !== 0 || r.truncated) return new Map();
  return parseResolved(todo, r.stdout);
}

/**
 * Makes `dir` and its missing parents as root and gives each directory it
 * made to `user` (envd, running as root, does the same), so a user who may
 * not write the first existing ancestor can still write below it. Run by the
 * platform's shell inside the sandbox; `U` and `P` travel as environment
 * variables, never in the script text.
 *
 * The sandbox's user may race it, so root acts only where that user cannot
 * change the path: every component of the deepest existing ancestor, as
 * written and as resolved, must be root's and writable by no one else (a
 * sticky directory, as /tmp, may be: its root-owned entries stay). Root then
 * works on the resolved path, makes each missing directory with a plain
 * `mkdir` (an entry someone put there first fails it) and chowns them
 * deepest first, so no chown ever walks through a directory already given
 * to the user (who could swap an entry of it for a symlink). A path through
 * the user's own directories is the user's to make (`MAKE_AS_USER_SCRIPT`).
 */
export const ENSURE_DIRS_SCRIPT = `set -f
umask 022
case $U in
  *[!0-9]*) u=$(id -u "$U" 2>/dev/null) || exit 20; g=$(id -g "$U" 2>/dev/null) || exit 20;;
  *) u=$U; g=$(id -g "$U" 2>/dev/null) || g=$U;;
esac
top=$P last=
while [ ! -e "$top" ] && [ ! -L "$top" ]; do last=$top; top=\${top%/*}; [ -n "$top" ] || top=/; done
[ -d "$top" ] || exit 21
[ -n "$last" ] || exit 0
safe() {
  s=$(stat -c '%u %f' -- "$1" 2>/dev/null) || return 1
  o=\${s% *} m=$((0x\${s#* }))
  [ "$o" = 0 ] || return 1
  [ $((m & 0170000)) -eq $((0120000)) ] && return 0
  [ $((m & 022)) -eq 0 ] || [ $((m & 01000)) -ne 0 ]
}
chain() {
  safe / || return 1
  c=
  rest=\${1#/}
  IFS=/
  for x in $rest; do
    IFS=' '
    [ -n "$x" ] || continue
    c=$c/$x
    safe "$c" || return 1
  done
  IFS=' '
  return 0
}
chain "$top" || exit 24
r=$(cd -P -- "$top" && pwd -P) || exit 24
chain "$r" || exit 24
base=\${r%/}
sub=\${P#"$top"}
d=$base
IFS=/
for c in $sub; do
  [ -n "$c" ] || continue
  case $c in .|..) exit 22;; esac
  d=$d/$c
  mkdir -- "$d" || exit 22
done
IFS=' '
while [ "$d" != "$base" ]; do
  chown -h "$u:$g" -- "$d" || exit 23
  d=\${d%/*}
done`;

/** The user's own `mkdir -p`: where it may make the directories, no root is needed. */
const MAKE_AS_USER_SCRIPT = 'mkdir -p -- "$P" 2>/dev/null';

export async function ensureDirsAs(
  sb: OpenedSandbox,
  dir: string,
  user: string,
  signal: AbortSignal | undefined,
): Promise<void> {
  if (!dir.startsWith('/')) throw new DsecError('internal', 'ensureDirsAs needs an absolute path');
  // Where the user may make them itself, it does: root never works in the user's directories.
  const own = await sb.io.runCommand(
    sb.id,
    {
      shell: MAKE_AS_USER_SCRIPT,
      env: { P: dir },
      user,
      timeoutMs: SCRIPT_TIMEOUT_MS,
      maxOutputBytes: 64 * 1024,
    },
    { signal },
  );
  if (own.outcome === 'exited' && own.exitCode === 0) return;
  const r = await sb.io.runCommand(
    sb.id,
    {
      shell: ENSURE_DIRS_SCRIPT,
      env: { U: user, P: dir },
      user: 'root',
      timeoutMs: SCRIPT_TIMEOUT_MS,
      maxOutputBytes: 64 * 1024,
    },
    { signal },
  );
  if (r.outcome === 'exited' && r.exitCode === 0) return;
  const why = r.stderr.trim().split('\n').at(-1)?.slice(0, 300) ?? '';
  switch (r.outcome === 'exited' ? r.exitCode : -1) {
    case 20:
      throw new DsecError('invalid_argument', `user ${user} does not exist in the sandbox`, {
        field: 'user',
      });
    case 21:
      throw new DsecError('invalid_argument', `${dir}: a parent is not a directory`, {
        field: 'path',
      });
    case 24:
      throw new DsecError(
        'permission_denied',
        `${dir}: user ${user} may not make it, and root makes directories for a user only where no one but root may change the path`,
        { field: 'path' },
      );
    default:
      throw new DsecError(
        'invalid_argument',
        `${dir}: cannot make the directory${why ? `: ${why}` : ''}`,
        { field: 'path' },
      );
  }
}

/**
 * Makes `dir` (and its parents) for `user`, as envd does before a write or
 * a `MakeDir`: root makes them itself; another user makes them with
 * `ensureDirsAs` when they are missing, so they are the user's even where the
 * user may not write (the caller's key may act as root in the sandbox anyway).
 */
export async function ensureParents(
  access: SandboxAccess,
  sb: OpenedSandbox,
  dir: string,
  user: string | undefined,
  signal: AbortSignal | undefined,
): Promise<void> {
  const who = user ?? (await access.defaultUser(sb, signal));
  if (who === 'root' || who === '0') {
    await sb.io.mkdir(sb.id, dir, { user: who, parents: true, signal });
    return;
  }
  try {
    const info = await sb.io.statFile(sb.id, dir, { user: who, signal });
    if (info.type === 'directory') return;
  } catch (err) {
    const code = toDsecError(err).code;
    if (code !== 'not_found' && code !== 'permission_denied') throw err;
  }
  await ensureDirsAs(sb, dir, who, signal);
}
