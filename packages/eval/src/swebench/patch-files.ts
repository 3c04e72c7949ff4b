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
    const m = /^diff --git a\/(.*) b\/(.*)$/.exec(line);
    if (m) {
      out.push({ oldPath: m[1]!, path: m[2]!, created: false, deleted: false });
      continue;
    }
    const last = out.at(-1);
    if (!last) continue;
    if (line === '--- /dev/null' || line.startsWith('new file mode ')) last.created = true;
    if (line === '+++ /dev/null' || line.startsWith('deleted file mode ')) last.deleted = true;
  }
  return out;
}
