/** One file a patch touches, from its `diff --git` header. */
export interface PatchFile {
  /** The path before (`a/…`); the same as `path` unless the patch renames. */
  oldPath: string;
  /** The path after (`b/…`): what SWE-bench takes as a test directive. */
  path: string;
  /** The patch creates it (`--- /dev/null` or `new file mode`). */
  created: boolean;
  /** The patch removes it (`+++ /dev/null` or `deleted file mode`). */
  deleted: boolean;
}

/**
 * The files a git patch touches, read from its `diff --git a/X b/Y`
 * headers only, so binary hunks (`GIT binary patch`, `Binary files … differ`)
 * need no parsing: `git apply` in the sandbox applies them. As SWE-bench's
 * `diff --git a/.* b/(.*)`, the new path is what follows the last ` b/`.
 */
export function patchFiles(patch: string): PatchFile[] {
  const out: PatchFile[] = [];
  for (const line of patch.split('\n')) {
    const header = diffHeader(line);
    if (header) {
      out.push({ ...header, created: false, deleted: false });
      continue;
    }
    const last = out.at(-1);
    if (!last) continue;
    if (line === '--- /dev/null' || line.startsWith('new file mode ')) last.created = true;
    if (line === '+++ /dev/null' || line.startsWith('deleted file mode ')) last.deleted = true;
  }
  return out;
}

const DIFF_GIT = 'diff --git a/';

/**
 * `^diff --git a\/(.*) b\/(.*)$` over one line without its backtracking (a
 * crafted header with many ` b/` and a `\r` took a backtracking engine
 * minutes, on the host, at load time): `.` takes no line terminator, so a
 * line holding one is no header; otherwise the old path runs to the last ` b/`.
 */
function diffHeader(line: string): { oldPath: string; path: string } | undefined {
  if (!line.startsWith(DIFF_GIT) || /[\n\r\u2028\u2029]/.test(line)) return undefined;
  const rest = line.slice(DIFF_GIT.length);
  const b = rest.lastIndexOf(' b/');
  if (b < 0) return undefined;
  return { oldPath: rest.slice(0, b), path: rest.slice(b + ' b/'.length) };
}
