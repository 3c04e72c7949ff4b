import { execFile } from 'node:child_process';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import type { Change, TreeEntry } from './steering.js';

const execFileAsync = promisify(execFile);
const GIT_MAX_BUFFER = 512 * 1024 * 1024;
/** No user's or system's configuration: nothing but git's defaults shapes the diff. */
const GIT_ENV: Record<string, string> = {
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
  GIT_TERMINAL_PROMPT: '0',
  LC_ALL: 'C',
};

/**
 * The changes as a git diff (`diff --git`, binary-safe: `GIT binary patch`
 * for non-text files, full blob IDs), what `git apply` takes back: the record
 * of what the grader applied. Built on the host in a scratch repository from
 * the bytes already read (nothing of either sandbox is touched): one tree
 * holds the changed paths as they were, another as the agent left them, and
 * `git diff-tree` compares them. Empty for no changes.
 */
export async function diffOfChanges(
  changes: readonly Change[],
  options: { tmpDir?: string } = {},
): Promise<string> {
  if (changes.length === 0) return '';
  const dir = await mkdtemp(join(options.tmpDir ?? tmpdir(), 'dsec-patch-'));
  const git = async (args: string[], input?: string): Promise<string> => {
    const child = execFileAsync('git', ['--git-dir', join(dir, 'repo'), ...args], {
      cwd: dir,
      env: { ...pathOnly(), ...GIT_ENV, GIT_INDEX_FILE: join(dir, 'index') },
      maxBuffer: GIT_MAX_BUFFER,
    });
    if (input !== undefined) {
      child.child.stdin?.end(input);
    }
    return (await child).stdout;
  };
  try {
    await execFileAsync('git', ['init', '-q', '--bare', join(dir, 'repo')], {
      env: { ...pathOnly(), ...GIT_ENV },
    });
    // Blobs: each side's content in a file named by its index, hashed in one call.
    const blobs: string[] = [];
    const sides: { path: string; entry: TreeEntry; side: 'base' | 'next'; file: string }[] = [];
    for (const c of changes) {
      for (const side of ['base', 'next'] as const) {
        const entry = c[side];
        if (!entry) continue;
        const file = join(dir, `blob-${sides.length}`);
        await writeFile(file, entry.type === 'file' ? entry.content : entry.target);
        sides.push({ path: c.path, entry, side, file });
        blobs.push(file);
      }
    }
    const ids = (
      await git(['hash-object', '-w', '--no-filters', '--stdin-paths'], blobs.join('\n') + '\n')
    )
      .trim()
      .split('\n');
    const tree = async (side: 'base' | 'next'): Promise<string> => {
      await rm(join(dir, 'index'), { force: true });
      const lines = sides
        .map((s, i) => ({ ...s, id: ids[i]! }))
        .filter((s) => s.side === side)
        .map((s) => `${modeOf(s.entry)} ${s.id}\t${s.path}\0`)
        .join('');
      if (lines !== '') await git(['update-index', '-z', '--add', '--index-info'], lines);
      return (await git(['write-tree'])).trim();
    };
    const before = await tree('base');
    const after = await tree('next');
    return await git([
      'diff-tree',
      '-r',
      '-p',
      '--binary',
      '--full-index',
      '--no-renames',
      '--no-color',
      before,
      after,
    ]);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

function modeOf(entry: TreeEntry): string {
  if (entry.type === 'symlink') return '120000';
  return entry.mode & 0o111 ? '100755' : '100644';
}

function pathOnly(): Record<string, string> {
  return { PATH: process.env['PATH'] ?? '/usr/bin:/bin' };
}
