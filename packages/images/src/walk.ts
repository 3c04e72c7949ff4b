import { lstat, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { throwIfAborted } from '@dsec/core';

export interface TreeStats {
  /** Every entry below the root (files, directories, links, devices…), the root itself excluded. */
  fileCount: number;
  /** Bytes of regular files; a hard-linked file is counted once. */
  contentBytes: number;
}

/** Counts a tree without following symlinks. */
export async function treeStats(
  root: string,
  options: { signal?: AbortSignal | undefined; onEntry?: (count: number) => void } = {},
): Promise<TreeStats> {
  let fileCount = 0;
  let contentBytes = 0;
  const seen = new Set<string>();
  const stack = [root];
  while (stack.length > 0) {
    throwIfAborted(options.signal);
    const dir = stack.pop()!;
    for (const entry of await readdir(dir, { withFileTypes: true })) {
      fileCount++;
      const path = join(dir, entry.name);
      if (entry.isDirectory()) {
        stack.push(path);
      } else if (entry.isFile()) {
        const st = await lstat(path, { bigint: true });
        if (st.nlink > 1n) {
          const key = `${st.dev}:${st.ino}`;
          if (seen.has(key)) continue;
          seen.add(key);
        }
        contentBytes += Number(st.size);
      }
    }
    options.onEntry?.(fileCount);
  }
  return { fileCount, contentBytes };
}
