import { createHash } from 'node:crypto';
import {
  chown,
  link,
  mkdir,
  mkdtemp,
  readFile,
  rm,
  symlink,
  utimes,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export const isRoot = process.getuid?.() === 0;

/** A temp dir removed by the returned cleanup. */
export async function tempDir(
  prefix = 'dsec-images-',
): Promise<{ dir: string; cleanup(): Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), prefix));
  return { dir, cleanup: () => rm(dir, { recursive: true, force: true }) };
}

export async function sha256File(path: string): Promise<string> {
  return createHash('sha256')
    .update(await readFile(path))
    .digest('hex');
}

/**
 * A small tree with the things EROFS must keep: nested dirs, a big and an
 * empty file, a symlink, a hard link, an executable, and (as root) a file
 * owned by 1000:1000. `order` flips creation order; `mtime` sets every file's
 * times, so two calls give the same content with different metadata noise.
 */
export async function makeTree(
  root: string,
  options: { order?: 'forward' | 'reverse'; mtime?: Date } = {},
): Promise<void> {
  await mkdir(join(root, 'etc'), { recursive: true });
  await mkdir(join(root, 'usr/bin'), { recursive: true });
  await mkdir(join(root, 'home/user'), { recursive: true });
  const names = Array.from({ length: 50 }, (_, i) => `f${i}`);
  if (options.order === 'reverse') names.reverse();
  for (const n of names) await writeFile(join(root, 'etc', n), `content of ${n}\n`);
  await writeFile(join(root, 'usr/bin/big'), Buffer.from('0123456789abcdef'.repeat(20_000)));
  await writeFile(join(root, 'usr/bin/tool'), '#!/bin/sh\necho hi\n', { mode: 0o755 });
  await writeFile(join(root, 'empty'), '');
  await symlink('../etc/f1', join(root, 'usr/link'));
  await link(join(root, 'etc/f2'), join(root, 'hard'));
  await writeFile(join(root, 'home/user/notes'), 'mine\n', { mode: 0o600 });
  if (isRoot) {
    await chown(join(root, 'home/user'), 1000, 1000);
    await chown(join(root, 'home/user/notes'), 1000, 1000);
  }
  if (options.mtime) {
    for (const p of ['etc/f1', 'usr/bin/big', 'home/user/notes', 'etc', '.']) {
      await utimes(join(root, p), options.mtime, options.mtime);
    }
  }
}

/** Bytes in makeTree's regular files (hard link counted once). */
export function makeTreeContentBytes(): number {
  let n = 0;
  for (let i = 0; i < 50; i++) n += `content of f${i}\n`.length;
  return n + 16 * 20_000 + '#!/bin/sh\necho hi\n'.length + 'mine\n'.length;
}
