import { createHash } from 'node:crypto';
import { DsecError } from '@dsec/core';
import {
  leaveOut,
  normalizeRelative,
  type Change,
  type GradingScope,
  type TreeEntry,
} from './steering.js';
import type { SandboxTools } from './tools.js';

/**
 * The agent's work as a patch of the repository, taken without trusting
 * anything in the agent's sandbox but the bytes of its files: both sandboxes
 * (the agent's, and a fresh one of the task's environment) list the workdir
 * with the platform's own shell and tools (`find`, `stat`, `base64` of the
 * sealed busybox, whatever the sandbox has on its PATH); the lists are
 * compared here; only paths whose metadata differ are read, from both sides,
 * and compared byte for byte. `.git` is never read: the agent's commits,
 * hooks and config stay behind. Every step is a command with a request ID
 * (`SandboxTools.exec`), so a resumed grader replays them.
 */

/** One path of a workdir listing. */
export interface ListedEntry {
  path: string;
  type: 'file' | 'symlink' | 'other';
  /** Permission bits (0o7777). */
  mode: number;
  size: number;
  mtime: number;
  ctime: number;
}

export interface Listing {
  entries: Map<string, ListedEntry>;
  /** Names the grader cannot carry (control characters, invalid UTF-8): left out. */
  unsupported: string[];
}

/** A path the grader did not carry over, and why (`rule` is a LEAVE_OUT_RULES ID or one of the structural ones here). */
export interface LeftOut {
  path: string;
  rule: string;
  reason: string;
}

/** Bytes of one file the grader carries at most; bigger ones are left out (`too-large`). */
export const MAX_PATCH_FILE_BYTES = 16 * 1024 * 1024;
/** Bytes of all carried files together; past it the rest is left out (`patch-too-large`). */
export const MAX_PATCH_BYTES = 64 * 1024 * 1024;
/** Changed paths carried at most; past it the rest is left out (`too-many-changes`). */
export const MAX_PATCH_ENTRIES = 20_000;
/** Raw bytes read per command (base64 makes a third more). */
const READ_BATCH_BYTES = 4 * 1024 * 1024;
const READ_BATCH_PATHS = 2000;
/** A command's stdin holds at most 1 MiB; records are base64 lines. */
const APPLY_BATCH_CHARS = 900 * 1024;
const APPLY_CHUNK_BYTES = 600 * 1024;
const LIST_TIMEOUT_MS = 120_000;
const IO_TIMEOUT_MS = 300_000;
/** The listing's output cap: about 800 000 paths. */
const LIST_OUTPUT_BYTES = 64 * 1024 * 1024;
/** As root whoever the sandbox's user is: the agent may have made files only root can read. */
const AS_ROOT = '0';

/** Every regular file, symlink and other non-directory under the workdir, `.git` pruned. */
export const LIST_SCRIPT =
  "find . -name .git -prune -o ! -type d -exec stat -c '%f %s %Y %Z %n' {} +";

/** Fails when a directory on the way to \`$1\` (relative to the workdir) is a symlink. */
const SAFE_PATH_FUNCTION = `safe() {
  rest=$1; cur=.
  while :; do
    case $rest in
      */*) cur=$cur/\${rest%%/*}; rest=\${rest#*/}; [ -L "$cur" ] && return 1 ;;
      *) return 0 ;;
    esac
  done
}`;

/**
 * Reads the paths on stdin, one record per line: `F <mode> <base64>`, `L
 * <base64 target>` or `M` (missing). Never through a symlink: a path with one
 * among its directories is `M`, whatever the listing said (a name with a
 * newline can forge listing lines, and the read runs as root).
 */
export const READ_SCRIPT = `${SAFE_PATH_FUNCTION}
while IFS= read -r p; do
  if ! safe "$p"; then echo M
  elif [ -L "$p" ]; then printf 'L %s\\n' "$(readlink -- "$p" | base64 -w 0)"
  elif [ -f "$p" ] && c=$(base64 -w 0 < "$p"); then printf 'F %s %s\\n' "$(stat -c %a -- "$p")" "$c"
  else echo M; fi
done`;

/**
 * Applies records from stdin, two lines each (a header, then base64 data or
 * an empty line): \`D path\` removes, \`W mode path\` writes a file, \`S n\` /
 * \`A n\` start and extend a staged file that \`C mode n path\` moves into place,
 * \`L path\` makes a symlink. Nothing is written through a symlink: a record
 * whose path has one among its directories fails (\`fail <record>\` on stdout),
 * as does one that cannot be applied; the others go on.
 */
export const APPLY_SCRIPT = `${SAFE_PATH_FUNCTION}
put() {
  if [ -L "$1" ] || [ -f "$1" ]; then rm -f -- "$1" || return 1
  elif [ -d "$1" ]; then rmdir -- "$1" || return 1; fi
  mkdir -p -- "$(dirname -- "$1")"
}
S=/tmp/.dsec-grader-stage
mkdir -p "$S" || exit 90
t=$(mktemp -d) || exit 90
cat > "$t/in" || exit 90
awk -v d="$t" 'NR % 2 == 1 { print > (d "/h"); next } { f = d "/" (NR / 2); printf "%s", $0 > f; close(f) }' "$t/in" || exit 91
i=0
while IFS= read -r h; do
  i=$((i + 1)); d="$t/$i"
  case $h in
    "D "*) p=\${h#D }; { safe "$p" && rm -f -- "$p"; } || echo "fail $i" ;;
    "W "*) r=\${h#W }; m=\${r%% *}; p=\${r#* }
      { safe "$p" && put "$p" && base64 -d < "$d" > "$p" && chmod "$m" -- "$p"; } || echo "fail $i" ;;
    "S "*) base64 -d < "$d" > "$S/\${h#S }" || echo "fail $i" ;;
    "A "*) base64 -d < "$d" >> "$S/\${h#A }" || echo "fail $i" ;;
    "C "*) r=\${h#C }; m=\${r%% *}; r=\${r#* }; n=\${r%% *}; p=\${r#* }
      { safe "$p" && put "$p" && mv -f -- "$S/$n" "$p" && chmod "$m" -- "$p"; } || echo "fail $i" ;;
    "L "*) p=\${h#L }
      { safe "$p" && put "$p" && ln -s -- "$(base64 -d < "$d")" "$p"; } || echo "fail $i" ;;
    *) echo "fail $i" ;;
  esac
done < "$t/h"
rm -rf "$t"`;

/**
 * A printable, normalised relative path: no control character, no U+FFFD, no
 * `.`/`..`/empty segment, and no `.git` segment (the listing prunes those; a
 * name with a newline could forge one).
 */
function carriable(path: string): boolean {
  if (normalizeRelative(path) !== path || path === '') return false;
  if (path.split('/').some((s) => s.toLowerCase() === '.git')) return false;
  for (let i = 0; i < path.length; i++) {
    const c = path.charCodeAt(i);
    if (c < 0x20 || c === 0x7f || c === 0xfffd) return false;
  }
  return true;
}

/**
 * Parses LIST_SCRIPT's output. A line that is not an entry continues the
 * name before it (a newline in a name): that name is unsupported, as is one
 * with a control character, invalid UTF-8 or a `.`/`..` segment.
 */
export function parseListing(stdout: string): Listing {
  const listed: { entry: ListedEntry; name: string }[] = [];
  for (const line of stdout.split('\n')) {
    const e = parseListLine(line);
    if (e) listed.push({ entry: e, name: e.path });
    else if (listed.length > 0 && line !== '') listed[listed.length - 1]!.name += `\n${line}`;
  }
  const entries = new Map<string, ListedEntry>();
  const unsupported: string[] = [];
  for (const { entry, name } of listed) {
    if (name !== entry.path || !carriable(name)) unsupported.push(name);
    else entries.set(name, entry);
  }
  return { entries, unsupported };
}

/** `81a4 11 1700000000 1700000000 ./a/b`: raw mode in hex, size, mtime, ctime, name. */
function parseListLine(line: string): ListedEntry | undefined {
  const fields: string[] = [];
  let at = 0;
  for (let k = 0; k < 4; k++) {
    const sp = line.indexOf(' ', at);
    if (sp <= at) return undefined;
    fields.push(line.slice(at, sp));
    at = sp + 1;
  }
  if (!line.startsWith('./', at)) return undefined;
  const [hex, size, mtime, ctime] = fields as [string, string, string, string];
  if (!/^[0-9a-f]{1,8}$/.test(hex) || ![size, mtime, ctime].every((n) => /^\d{1,20}$/.test(n))) {
    return undefined;
  }
  const raw = parseInt(hex, 16);
  const kind = raw & 0o170000;
  return {
    path: line.slice(at + 2),
    type: kind === 0o100000 ? 'file' : kind === 0o120000 ? 'symlink' : 'other',
    mode: raw & 0o7777,
    size: Number(size),
    mtime: Number(mtime),
    ctime: Number(ctime),
  };
}

function sameListing(a: ListedEntry, b: ListedEntry): boolean {
  return (
    a.type === b.type &&
    a.mode === b.mode &&
    a.size === b.size &&
    a.mtime === b.mtime &&
    a.ctime === b.ctime
  );
}

/** Lists the workdir of the sandbox `tools` act on. */
export async function listWorkdir(tools: SandboxTools): Promise<Listing> {
  const r = await tools.exec(LIST_SCRIPT, {
    timeoutMs: LIST_TIMEOUT_MS,
    maxOutputBytes: LIST_OUTPUT_BYTES,
    user: AS_ROOT,
  });
  if (r.truncated) {
    throw new DsecError(
      'resource_exhausted',
      `the workdir lists more than ${LIST_OUTPUT_BYTES} bytes of paths`,
      { details: { limit: 'workdir_listing', maxBytes: LIST_OUTPUT_BYTES } },
    );
  }
  // A listing cut short would read as files deleted: only a whole one counts. find exits 1 when a
  // file vanishes under it (an agent's leftover at work), and the rest is still listed.
  if (r.outcome !== 'exited' || r.exitCode > 1) {
    throw new DsecError(
      'internal',
      `listing the workdir failed (${r.outcome}, exit ${r.exitCode}): ${r.stderr.trim().slice(0, 500)}`,
    );
  }
  return parseListing(r.stdout);
}

/** Reads files and symlinks (paths relative to the workdir); undefined for those gone or unreadable meanwhile. */
export async function readEntries(
  tools: SandboxTools,
  paths: string[],
  sizeOf: (path: string) => number,
): Promise<Map<string, TreeEntry | undefined>> {
  const out = new Map<string, TreeEntry | undefined>();
  let batch: string[] = [];
  let bytes = 0;
  const flush = async () => {
    if (batch.length === 0) return;
    const expected = Math.ceil((bytes * 4) / 3) + batch.length * 64 + 64 * 1024;
    const r = await tools.exec(READ_SCRIPT, {
      stdin: batch.join('\n') + '\n',
      timeoutMs: IO_TIMEOUT_MS,
      maxOutputBytes: Math.min(LIST_OUTPUT_BYTES, expected * 2),
      user: AS_ROOT,
    });
    // A record counts only with its newline: a command cut short (timeout, cap) loses the rest.
    const lines = r.truncated || r.outcome !== 'exited' ? [] : r.stdout.split('\n');
    lines.pop();
    batch.forEach((p, i) => out.set(p, parseRecord(lines[i])));
    batch = [];
    bytes = 0;
  };
  for (const p of paths) {
    const size = sizeOf(p);
    if (batch.length > 0 && (bytes + size > READ_BATCH_BYTES || batch.length >= READ_BATCH_PATHS)) {
      await flush();
    }
    batch.push(p);
    bytes += size;
  }
  await flush();
  return out;
}

function parseRecord(line: string | undefined): TreeEntry | undefined {
  if (line === undefined) return undefined;
  if (line.startsWith('L ')) {
    const target = Buffer.from(line.slice(2), 'base64').toString('utf8');
    // readlink ends the target with a newline.
    return { type: 'symlink', target: target.endsWith('\n') ? target.slice(0, -1) : target };
  }
  if (line.startsWith('F ')) {
    const sp = line.indexOf(' ', 2);
    if (sp < 0) return undefined;
    const mode = parseInt(line.slice(2, sp), 8);
    if (!Number.isInteger(mode)) return undefined;
    return {
      type: 'file',
      mode: mode & 0o7777,
      content: Buffer.from(line.slice(sp + 1), 'base64'),
    };
  }
  return undefined;
}

function sameEntry(a: TreeEntry | undefined, b: TreeEntry | undefined): boolean {
  if (a === undefined || b === undefined) return a === b;
  if (a.type === 'symlink') return b.type === 'symlink' && a.target === b.target;
  if (b.type === 'symlink') return false;
  return (a.mode & 0o777) === (b.mode & 0o777) && a.content.equals(b.content);
}

/** Where a symlink in `fromDir` pointing at `target` lands, lexically, relative to the workdir; undefined when outside. */
export function resolveWithin(
  fromDir: string,
  target: string,
  workdir: string,
): string | undefined {
  if (target.startsWith('/')) {
    if (target === workdir) return '';
    if (!target.startsWith(workdir + '/')) return undefined;
    return normalizeRelative(target.slice(workdir.length + 1));
  }
  const parts = fromDir === '' ? [] : fromDir.split('/');
  for (const s of target.split('/')) {
    if (s === '' || s === '.') continue;
    if (s === '..') {
      if (parts.length === 0) return undefined;
      parts.pop();
    } else parts.push(s);
  }
  return parts.join('/');
}

/** What the agent's patch is: the changes carried over, and what was left out. */
export interface AgentPatch {
  changes: Change[];
  leftOut: LeftOut[];
  /** Bytes of carried file content (the agent's side). */
  bytes: number;
}

/**
 * Compares the agent's workdir with a fresh one and reads what differs: the
 * changes to carry (each passed through LEAVE_OUT_RULES) and what is left
 * out with its reason. `agent` acts on the agent's sandbox, `freshSandbox`
 * on the grading sandbox (only read here; it may still be starting).
 */
export async function takeAgentPatch(
  agent: SandboxTools,
  freshSandbox: SandboxTools | Promise<SandboxTools>,
  scopeOf: (base: Listing, next: Listing) => GradingScope,
): Promise<AgentPatch> {
  const workdir = agent.workdir;
  // The two sandboxes work at once (the grading one may still be starting): each phase numbers its own steps.
  const [next, { fresh, base }] = await Promise.all([
    listWorkdir(agent),
    Promise.resolve(freshSandbox).then(async (fresh) => ({
      fresh,
      base: await listWorkdir(fresh),
    })),
  ]);
  const leftOut: LeftOut[] = next.unsupported.map((path) => ({
    path,
    rule: 'unsupported-name',
    reason: 'the name holds a control character or is not valid UTF-8',
  }));
  const symlinkDirs = new Set<string>();
  for (const l of [base, next]) {
    for (const e of l.entries.values()) if (e.type === 'symlink') symlinkDirs.add(e.path);
  }
  const underSymlink = (p: string): string | undefined => {
    for (let i = p.indexOf('/'); i >= 0; i = p.indexOf('/', i + 1)) {
      if (symlinkDirs.has(p.slice(0, i))) return p.slice(0, i);
    }
    return undefined;
  };

  const readNext: string[] = [];
  const readBase: string[] = [];
  const paths = new Set([...next.entries.keys(), ...base.entries.keys()]);
  for (const p of [...paths].sort()) {
    const a = next.entries.get(p);
    const b = base.entries.get(p);
    if (a && b && sameListing(a, b)) continue;
    if (a?.type === 'other' || b?.type === 'other') {
      leftOut.push({ path: p, rule: 'not-regular', reason: 'not a regular file or a symlink' });
      continue;
    }
    const link = underSymlink(p);
    if (link !== undefined) {
      leftOut.push({ path: p, rule: 'under-symlink', reason: `${link} is a symlink` });
      continue;
    }
    if ((a && a.size > MAX_PATCH_FILE_BYTES) || (b && b.size > MAX_PATCH_FILE_BYTES)) {
      leftOut.push({
        path: p,
        rule: 'too-large',
        reason: `larger than ${MAX_PATCH_FILE_BYTES} bytes`,
      });
      continue;
    }
    if (a) readNext.push(p);
    if (b) readBase.push(p);
  }
  const [nextContent, baseContent] = await Promise.all([
    readEntries(agent, readNext, (p) => next.entries.get(p)?.size ?? 0),
    readEntries(fresh, readBase, (p) => base.entries.get(p)?.size ?? 0),
  ]);

  const candidates: Change[] = [];
  for (const p of [...new Set([...readNext, ...readBase])].sort()) {
    const n = nextContent.get(p);
    const b = baseContent.get(p);
    if (next.entries.has(p) && n === undefined) {
      leftOut.push({
        path: p,
        rule: 'changed-while-read',
        reason: 'it changed or vanished while the grader read it',
      });
      continue;
    }
    if (base.entries.has(p) && b === undefined) {
      throw new DsecError('internal', `the grading sandbox's ${p} could not be read`);
    }
    if (sameEntry(n, b)) continue;
    candidates.push({ path: p, base: b, next: n });
  }

  const scope = scopeOf(base, next);
  const changes: Change[] = [];
  let bytes = 0;
  for (const c of candidates) {
    if (c.next?.type === 'symlink') {
      const dir = c.path.includes('/') ? c.path.slice(0, c.path.lastIndexOf('/')) : '';
      if (resolveWithin(dir, c.next.target, workdir) === undefined) {
        leftOut.push({
          path: c.path,
          rule: 'symlink-escape',
          reason: `it points out of the repository (${c.next.target})`,
        });
        continue;
      }
    }
    const out = leaveOut(c, scope);
    if (out) {
      leftOut.push({ path: c.path, ...out });
      continue;
    }
    const size = c.next?.type === 'file' ? c.next.content.length : 0;
    if (changes.length >= MAX_PATCH_ENTRIES) {
      leftOut.push({
        path: c.path,
        rule: 'too-many-changes',
        reason: `past ${MAX_PATCH_ENTRIES} changed paths`,
      });
      continue;
    }
    if (bytes + size > MAX_PATCH_BYTES) {
      leftOut.push({
        path: c.path,
        rule: 'patch-too-large',
        reason: `past ${MAX_PATCH_BYTES} bytes of changes`,
      });
      continue;
    }
    bytes += size;
    changes.push(c);
  }
  leftOut.sort((x, y) => (x.path < y.path ? -1 : x.path > y.path ? 1 : 0));
  return { changes, leftOut, bytes };
}

/** Applies changes in the grading sandbox: removals first, then files, then symlinks. Returns the paths that failed. */
export async function applyAgentPatch(tools: SandboxTools, changes: Change[]): Promise<string[]> {
  const records: { header: string; data: string; path: string }[] = [];
  const ordered = [
    ...changes.filter((c) => c.next === undefined),
    ...changes.filter((c) => c.next?.type === 'file'),
    ...changes.filter((c) => c.next?.type === 'symlink'),
  ];
  let staged = 0;
  for (const c of ordered) {
    const n = c.next;
    if (n === undefined) {
      records.push({ header: `D ${c.path}`, data: '', path: c.path });
    } else if (n.type === 'symlink') {
      records.push({
        header: `L ${c.path}`,
        data: Buffer.from(n.target).toString('base64'),
        path: c.path,
      });
    } else {
      const mode = (n.mode & 0o777).toString(8);
      if (n.content.length <= APPLY_CHUNK_BYTES) {
        records.push({
          header: `W ${mode} ${c.path}`,
          data: n.content.toString('base64'),
          path: c.path,
        });
        continue;
      }
      const name = String(++staged);
      for (let at = 0; at < n.content.length; at += APPLY_CHUNK_BYTES) {
        const chunk = n.content.subarray(at, at + APPLY_CHUNK_BYTES).toString('base64');
        records.push({ header: `${at === 0 ? 'S' : 'A'} ${name}`, data: chunk, path: c.path });
      }
      records.push({ header: `C ${mode} ${name} ${c.path}`, data: '', path: c.path });
    }
  }
  const failed = new Set<string>();
  let batch: typeof records = [];
  let chars = 0;
  const flush = async () => {
    if (batch.length === 0) return;
    const r = await tools.exec(APPLY_SCRIPT, {
      stdin: batch.map((x) => `${x.header}\n${x.data}\n`).join(''),
      timeoutMs: IO_TIMEOUT_MS,
      user: AS_ROOT,
    });
    if (r.exitCode !== 0) {
      throw new DsecError(
        'internal',
        `applying the patch failed (exit ${r.exitCode}): ${r.stderr.trim().slice(0, 500)}`,
      );
    }
    for (const line of r.stdout.split('\n')) {
      if (!line.startsWith('fail ')) continue;
      const rec = batch[Number(line.slice(5)) - 1];
      if (rec) failed.add(rec.path);
    }
    batch = [];
    chars = 0;
  };
  for (const rec of records) {
    const size = rec.header.length + rec.data.length + 2;
    if (batch.length > 0 && chars + size > APPLY_BATCH_CHARS) await flush();
    batch.push(rec);
    chars += size;
  }
  await flush();
  return [...failed].sort();
}

export function sha256(data: string | Buffer): string {
  return createHash('sha256').update(data).digest('hex');
}
