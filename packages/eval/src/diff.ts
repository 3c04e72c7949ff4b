import { DsecError } from '@dsec/core';

/** One line of a hunk: context (` `), removed (`-`) or added (`+`). */
export interface HunkLine {
  op: ' ' | '-' | '+';
  text: string;
}

export interface Hunk {
  oldStart: number;
  oldLines: number;
  newStart: number;
  newLines: number;
  lines: HunkLine[];
  /** `\ No newline at end of file` after the hunk's last old-side line. */
  oldNoNewline: boolean;
  /** The same after its last new-side line: the result ends without a newline. */
  newNoNewline: boolean;
}

/** What a unified diff does to one file. Paths are relative, without `a/` / `b/`. */
export interface FilePatch {
  /** Undefined for a created file. */
  oldPath: string | undefined;
  /** Undefined for a deleted file. */
  newPath: string | undefined;
  /** Permission bits of a created file or a mode change (`0o755`), when the diff says. */
  newMode: number | undefined;
  hunks: Hunk[];
}

/**
 * Parses a unified diff (`git diff` output or plain `diff -u`) into per-file
 * patches. Binary patches are refused (`invalid_argument`): tasks and agents
 * edit text.
 */
export function parsePatch(text: string): FilePatch[] {
  const lines = text.split('\n');
  // A trailing newline leaves one empty element that is not a line of the diff.
  if (lines.length > 0 && lines[lines.length - 1] === '') lines.pop();
  const files: (FilePatch & { git: boolean })[] = [];
  let current: (FilePatch & { git: boolean }) | undefined;
  let i = 0;

  const start = (git: boolean): FilePatch & { git: boolean } => {
    const f = { oldPath: undefined, newPath: undefined, newMode: undefined, hunks: [], git };
    files.push(f);
    return f;
  };

  while (i < lines.length) {
    const line = lines[i]!;
    if (line.startsWith('diff --git ')) {
      current = start(true);
      const m = /^diff --git (?:"?a\/(.+?)"?) (?:"?b\/(.+?)"?)$/.exec(line);
      if (m) {
        current.oldPath = m[1];
        current.newPath = m[2];
      }
      i++;
      continue;
    }
    if (line.startsWith('--- ') && lines[i + 1]?.startsWith('+++ ')) {
      // A plain `diff -u` section, or the file header of a git section.
      if (!current || current.hunks.length > 0 || !current.git) current = start(false);
      const oldName = headerPath(line.slice(4));
      const newName = headerPath(lines[i + 1]!.slice(4));
      current.oldPath = oldName;
      current.newPath = newName;
      i += 2;
      continue;
    }
    if (line.startsWith('@@')) {
      if (!current) throw bad(`hunk before any file header (line ${i + 1})`);
      const [hunk, next] = parseHunk(lines, i);
      current.hunks.push(hunk);
      i = next;
      continue;
    }
    if (current?.git) {
      let m: RegExpExecArray | null;
      if ((m = /^new file mode (\d+)$/.exec(line))) {
        current.oldPath = undefined;
        current.newMode = parseInt(m[1]!, 8) & 0o7777;
      } else if ((m = /^deleted file mode \d+$/.exec(line))) {
        current.newPath = undefined;
      } else if ((m = /^new mode (\d+)$/.exec(line))) {
        current.newMode = parseInt(m[1]!, 8) & 0o7777;
      } else if ((m = /^rename from (.+)$/.exec(line))) {
        current.oldPath = m[1];
      } else if ((m = /^rename to (.+)$/.exec(line))) {
        current.newPath = m[1];
      } else if (line.startsWith('GIT binary patch') || /^Binary files .* differ$/.test(line)) {
        throw bad(`binary patch for ${current.newPath ?? current.oldPath ?? '?'} is not supported`);
      }
    }
    // Anything else (index lines, commit messages, similarity) carries nothing to apply.
    i++;
  }
  for (const f of files) {
    if (f.oldPath === undefined && f.newPath === undefined)
      throw bad('a file section names no file');
  }
  return files.map(({ git: _git, ...f }) => f);
}

/** `a/x.py\t2024-…` → `x.py`; `/dev/null` → undefined. */
function headerPath(raw: string): string | undefined {
  let p = raw.split('\t')[0]!.trim();
  if (p.startsWith('"') && p.endsWith('"')) p = p.slice(1, -1);
  if (p === '/dev/null') return undefined;
  if (p.startsWith('a/') || p.startsWith('b/')) p = p.slice(2);
  return p;
}

function parseHunk(lines: string[], at: number): [Hunk, number] {
  const m = /^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@/.exec(lines[at]!);
  if (!m) throw bad(`malformed hunk header at line ${at + 1}: ${lines[at]}`);
  const hunk: Hunk = {
    oldStart: Number(m[1]),
    oldLines: m[2] === undefined ? 1 : Number(m[2]),
    newStart: Number(m[3]),
    newLines: m[4] === undefined ? 1 : Number(m[4]),
    lines: [],
    oldNoNewline: false,
    newNoNewline: false,
  };
  let oldLeft = hunk.oldLines;
  let newLeft = hunk.newLines;
  let i = at + 1;
  let last: HunkLine['op'] | undefined;
  while (i < lines.length && (oldLeft > 0 || newLeft > 0 || lines[i]!.startsWith('\\'))) {
    const line = lines[i]!;
    if (line.startsWith('\\')) {
      // Applies to the line just before it, on the side(s) that line belongs to.
      if (last === '-' || last === ' ') hunk.oldNoNewline = true;
      if (last === '+' || last === ' ') hunk.newNoNewline = true;
      i++;
      continue;
    }
    // Some tools strip the single space of an empty context line.
    const op = (line === '' ? ' ' : line[0]) as string;
    const text = line === '' ? '' : line.slice(1);
    if (op === ' ') {
      oldLeft--;
      newLeft--;
    } else if (op === '-') oldLeft--;
    else if (op === '+') newLeft--;
    else break;
    if (oldLeft < 0 || newLeft < 0)
      throw bad(`hunk at line ${at + 1} is longer than its header says`);
    hunk.lines.push({ op, text });
    last = op;
    i++;
  }
  if (oldLeft > 0 || newLeft > 0) throw bad(`hunk at line ${at + 1} ends early`);
  return [hunk, i];
}

/**
 * Applies one file's hunks to its current content (undefined: the file does
 * not exist) and returns the new content (undefined: the file is deleted).
 * Each hunk is looked for at its line number shifted by what earlier hunks
 * added, then nearby, then anywhere after the previous hunk; context must
 * match exactly (then, as a fallback, ignoring trailing whitespace). A hunk
 * that matches nowhere is `conflict`.
 */
export function applyFilePatch(content: string | undefined, patch: FilePatch): string | undefined {
  const name = patch.newPath ?? patch.oldPath ?? '?';
  if (patch.oldPath === undefined && content !== undefined && content !== '') {
    throw new DsecError('conflict', `${name}: the patch creates it but it already exists`, {
      details: { path: name },
    });
  }
  if (patch.oldPath !== undefined && content === undefined) {
    throw new DsecError('conflict', `${name}: the patch changes it but it does not exist`, {
      details: { path: name },
    });
  }
  const text = content ?? '';
  const lines = text === '' ? [] : text.split('\n');
  let endsWithNewline = true;
  if (lines.length > 0) {
    if (lines[lines.length - 1] === '') lines.pop();
    else endsWithNewline = false;
  }

  let offset = 0;
  let floor = 0;
  for (const [n, hunk] of patch.hunks.entries()) {
    const oldSide = hunk.lines.filter((l) => l.op !== '+').map((l) => l.text);
    const newSide = hunk.lines.filter((l) => l.op !== '-').map((l) => l.text);
    // A hunk with no old lines inserts after line oldStart (0: at the top).
    const origin = oldSide.length === 0 ? hunk.oldStart : hunk.oldStart - 1;
    const at = locate(lines, oldSide, Math.max(floor, origin + offset), floor);
    if (at === undefined) {
      throw new DsecError(
        'conflict',
        `${name}: hunk ${n + 1} (@@ -${hunk.oldStart}) does not apply`,
        {
          details: { path: name, hunk: n + 1 },
        },
      );
    }
    lines.splice(at, oldSide.length, ...newSide);
    const endOfFile = at + newSide.length === lines.length;
    if (endOfFile && (hunk.newNoNewline || hunk.oldNoNewline)) endsWithNewline = !hunk.newNoNewline;
    // Where later hunks' original line numbers now are: this hunk's drift plus its growth.
    offset = at - origin + newSide.length - oldSide.length;
    floor = at + newSide.length;
  }
  if (patch.newPath === undefined) {
    if (lines.length > 0) {
      throw new DsecError('conflict', `${name}: the patch deletes it but content is left`, {
        details: { path: name },
      });
    }
    return undefined;
  }
  if (lines.length === 0) return '';
  return lines.join('\n') + (endsWithNewline ? '\n' : '');
}

function locate(
  lines: string[],
  needle: string[],
  expected: number,
  floor: number,
): number | undefined {
  const max = lines.length - needle.length;
  if (needle.length === 0) return Math.min(Math.max(expected, floor), lines.length);
  for (const eq of [exact, looseEq]) {
    const matches = (at: number) => {
      for (let k = 0; k < needle.length; k++) if (!eq(lines[at + k]!, needle[k]!)) return false;
      return true;
    };
    // Nearest first: expected, expected±1, … within the file, never before `floor`.
    for (let d = 0; d <= lines.length; d++) {
      for (const at of d === 0 ? [expected] : [expected - d, expected + d]) {
        if (at >= floor && at <= max && matches(at)) return at;
      }
      if (expected - d < floor && expected + d > max) break;
    }
  }
  return undefined;
}

const exact = (a: string, b: string) => a === b;
const looseEq = (a: string, b: string) => a.trimEnd() === b.trimEnd();

function bad(message: string): DsecError {
  return new DsecError('invalid_argument', `patch: ${message}`, { field: 'patch' });
}
