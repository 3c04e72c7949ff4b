import { lstat, mkdir, readdir, rename, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { throwIfAborted } from '@dsec/core';
import { listOpaqueDirs, makeWhiteout, setOpaque, stripMarks } from './marks.js';

/** A layer as a directory tree in overlayfs format, and which of its directories are opaque. */
export interface LayerTree {
  dir: string;
  /** Relative paths (`''` = the root) of directories carrying the opaque mark on disk. */
  opaque: Set<string>;
}

const OCI_WHITEOUT_PREFIX = '.wh.';
const OCI_OPAQUE = '.wh..wh..opq';

/**
 * Rewrites an extracted OCI layer in place into overlayfs format:
 * `.wh..wh..opq` becomes the opaque xattr on its directory, `.wh.NAME` a 0:0
 * character device NAME. A whiteout only hides lower layers (OCI image spec),
 * so when NAME also exists in this layer it stays, and a directory NAME is
 * marked opaque instead (fresh, not merged with what lies below).
 */
export async function ociLayerToOverlay(dir: string, signal?: AbortSignal): Promise<LayerTree> {
  const opaque = new Set<string>();
  const stack = [''];
  while (stack.length > 0) {
    throwIfAborted(signal);
    const rel = stack.pop()!;
    const abs = join(dir, rel);
    const entries = await readdir(abs, { withFileTypes: true });
    const names = new Set(entries.map((e) => e.name));
    const markOpaque = async (r: string): Promise<void> => {
      if (opaque.has(r)) return;
      await setOpaque(join(dir, r), signal);
      opaque.add(r);
    };
    if (names.has(OCI_OPAQUE)) {
      await rm(join(abs, OCI_OPAQUE), { recursive: true, force: true });
      await markOpaque(rel);
    }
    for (const e of entries) {
      if (e.name === OCI_OPAQUE || !e.name.startsWith(OCI_WHITEOUT_PREFIX)) continue;
      await rm(join(abs, e.name), { recursive: true, force: true });
      const target = e.name.slice(OCI_WHITEOUT_PREFIX.length);
      if (target === '' || target === '.' || target === '..') continue;
      const targetRel = join(rel, target);
      if (names.has(target)) {
        if ((await lstat(join(dir, targetRel))).isDirectory()) await markOpaque(targetRel);
      } else {
        await makeWhiteout(join(dir, targetRel), signal);
      }
    }
    for (const e of entries) {
      if (e.isDirectory() && !e.name.startsWith(OCI_WHITEOUT_PREFIX)) stack.push(join(rel, e.name));
    }
  }
  return { dir, opaque };
}

/** Reads the opaque marks of a layer tree already in overlayfs format (a copied EROFS layer). */
export async function overlayLayerTree(
  dir: string,
  signal?: AbortSignal,
  confineRoot?: string,
): Promise<LayerTree> {
  return { dir, opaque: await listOpaqueDirs(dir, signal, confineRoot) };
}

export interface MergeOptions {
  /**
   * Keep whiteouts and opaque marks in the result (something may lie below
   * it: a workspace or toolkit). False for a base: nothing is below, so the
   * marks are dropped and the result is a plain tree.
   */
  keepMarks: boolean;
  signal?: AbortSignal | undefined;
}

/**
 * An image's layer trees, lowest first, merged into one directory, which is
 * returned (the topmost tree's): what an imported image's single layer is
 * built from. An image without layers is an empty directory, `emptyDir`.
 * Marks (whiteouts, opaque dirs) are kept where `keepMarks` says so.
 */
export async function mergeImageLayers(
  lowestFirst: LayerTree[],
  options: MergeOptions & { emptyDir: string },
): Promise<string> {
  if (lowestFirst.length === 0) {
    await mkdir(options.emptyDir, { recursive: true, mode: 0o755 });
    return options.emptyDir;
  }
  const topFirst = [...lowestFirst].reverse();
  await mergeLayerTrees(topFirst, options);
  return topFirst[0]!.dir;
}

/**
 * Merges layer trees, topmost first, into the topmost one with exactly the
 * view overlayfs would give for that stack: an upper entry hides a lower one,
 * directories merge unless the upper one is opaque or the lower entry is not
 * a directory, a whiteout hides everything below it. Entries move by rename
 * (the trees must share a filesystem); the lower trees are consumed.
 * A merged directory keeps the upper layer's owner, mode and xattrs.
 */
export async function mergeLayerTrees(layers: LayerTree[], options: MergeOptions): Promise<void> {
  const [top, ...lowers] = layers;
  if (!top) return;
  const { signal } = options;
  // desired: the opaque marks the merged tree must carry; physical: those it does.
  const desired = new Set(top.opaque);
  const physical = new Set(top.opaque);

  const mergeDir = async (rel: string, lower: LayerTree): Promise<void> => {
    throwIfAborted(signal);
    for (const name of await readdir(join(lower.dir, rel))) {
      const r = rel === '' ? name : `${rel}/${name}`;
      const upper = await lstat(join(top.dir, r)).catch(() => undefined);
      if (!upper) {
        await rename(join(lower.dir, r), join(top.dir, r));
        for (const o of lower.opaque) {
          if (o === r || o.startsWith(`${r}/`)) {
            desired.add(o);
            physical.add(o);
          }
        }
        continue;
      }
      // An upper non-directory (file, link, whiteout) hides the lower entry entirely.
      if (!upper.isDirectory() || desired.has(r)) continue;
      const lowerIsDir = (await lstat(join(lower.dir, r))).isDirectory();
      if (lowerIsDir) {
        await mergeDir(r, lower);
        if (lower.opaque.has(r)) desired.add(r);
      } else {
        // A lower non-directory ends the merge: layers further down must not show through.
        desired.add(r);
      }
    }
  };

  for (const lower of lowers) {
    if (desired.has('')) break;
    await mergeDir('', lower);
    if (lower.opaque.has('')) desired.add('');
    await rm(lower.dir, { recursive: true, force: true });
  }

  if (options.keepMarks) {
    for (const rel of desired) {
      if (!physical.has(rel)) await setOpaque(join(top.dir, rel), signal);
    }
  } else {
    await stripMarks(top.dir, physical, signal);
  }
}
