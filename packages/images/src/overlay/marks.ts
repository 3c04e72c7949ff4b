import { lstat, readdir, unlink } from 'node:fs/promises';
import { join, relative, sep } from 'node:path';
import { throwIfAborted } from '@dsec/core';
import { confinedCommand, runConfinedOk } from '@dsec/native';
import { runTool } from '../util/run-tool.js';

/**
 * Overlayfs marks as they sit in a layer tree (and in the EROFS built from
 * it): a whiteout is a 0:0 character device, an opaque directory carries
 * `trusted.overlay.opaque=y`. Node has neither mknod nor xattrs, so these
 * call `mknod` (coreutils) and `setfattr`/`getfattr` (Debian `attr`); all
 * need root, as `trusted.*` xattrs and device nodes do.
 */
export const OPAQUE_XATTR = 'trusted.overlay.opaque';

export async function makeWhiteout(path: string, signal?: AbortSignal): Promise<void> {
  await runTool('mknod', [path, 'c', '0', '0'], { signal });
}

export async function isWhiteout(path: string): Promise<boolean> {
  const st = await lstat(path).catch(() => undefined);
  return st !== undefined && st.isCharacterDevice() && st.rdev === 0;
}

export async function setOpaque(dir: string, signal?: AbortSignal): Promise<void> {
  await runTool('setfattr', ['-h', '-n', OPAQUE_XATTR, '-v', 'y', dir], { signal });
}

export async function clearOpaque(dir: string, signal?: AbortSignal): Promise<void> {
  await runTool('setfattr', ['-h', '-x', OPAQUE_XATTR, dir], { signal });
}

/**
 * The directories under `root` (relative paths, `''` for the root itself)
 * marked opaque. One `getfattr -R` for the whole tree, not one per directory.
 */
export async function listOpaqueDirs(
  root: string,
  signal?: AbortSignal,
  confineRoot?: string,
): Promise<Set<string>> {
  const args = (dir: string): string[] => [
    '-R',
    '-P',
    '-h',
    '--absolute-names',
    '-d',
    '-m',
    `^${OPAQUE_XATTR.replace(/\./g, '\\.')}$`,
    dir,
  ];
  // A tree a sandbox may have made (a layer copied out of a snapshot): read confined, as /t.
  const stdout =
    confineRoot === undefined
      ? (await runTool('getfattr', args(root), { signal })).stdout
      : (
          await runConfinedOk(
            confinedCommand(
              { rootDir: confineRoot, trees: [{ path: root, name: 't' }], tools: true },
              ['getfattr', ...args('/t')],
            ),
            'reading opaque marks',
            { signal },
          )
        ).stdout;
  const base = confineRoot === undefined ? root : '/t';
  const out = new Set<string>();
  let file: string | undefined;
  for (const line of stdout.split('\n')) {
    if (line.startsWith('# file: ')) file = unescapeGetfattr(line.slice('# file: '.length));
    else if (file !== undefined && line === `${OPAQUE_XATTR}="y"`) {
      out.add(toRel(base, file));
    }
  }
  return out;
}

/** Removes every whiteout and opaque mark: for a tree with nothing below it (a base). */
export async function stripMarks(
  root: string,
  opaque: Iterable<string>,
  signal?: AbortSignal,
): Promise<void> {
  for (const rel of opaque) await clearOpaque(join(root, rel), signal);
  const stack = [root];
  while (stack.length > 0) {
    throwIfAborted(signal);
    const dir = stack.pop()!;
    for (const e of await readdir(dir, { withFileTypes: true })) {
      const path = join(dir, e.name);
      if (e.isDirectory()) stack.push(path);
      else if (e.isCharacterDevice() && (await isWhiteout(path))) await unlink(path);
    }
  }
}

export function toRel(root: string, path: string): string {
  const rel = relative(root, path);
  return sep === '/' ? rel : rel.split(sep).join('/');
}

// getfattr writes unusual bytes as backslash-octal escapes (`\\` for a backslash).
function unescapeGetfattr(s: string): string {
  const raw = Buffer.from(s, 'utf8');
  const bytes: number[] = [];
  for (let i = 0; i < raw.length; i++) {
    const octal = raw.subarray(i + 1, i + 4).toString('latin1');
    if (raw[i] === 0x5c && /^[0-7]{3}$/.test(octal)) {
      bytes.push(parseInt(octal, 8));
      i += 3;
    } else bytes.push(raw[i]!);
  }
  return Buffer.from(bytes).toString('utf8');
}
