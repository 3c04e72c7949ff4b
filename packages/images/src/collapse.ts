import { mkdir, mkdtemp, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import {
  DsecError,
  formatLayerRef,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import { buildLayer, type BuildProgress } from './build.js';
import { confinedCommand, confinedTreeCommand, removeTree, runConfinedOk } from '@dsec/native';
import { overlayLayerTree, type LayerTree } from './overlay/merge.js';
import { DirImageStore } from './store/dir-store.js';
import { assertLayerKind, assertLayerName } from './store/validate.js';

/** Mounting an EROFS layer read-only, as `@dsec/native` does it (file-backed, no loop device). */
export interface ErofsMounter {
  mountErofs(image: string, target: string, options?: { blobDevice?: string }): Promise<void>;
  unmount(targets: string[], options?: { detach?: boolean }): Promise<void>;
}

/** The paper's collapse threshold (5.3): layers are merged while their total stays below it. */
export const DEFAULT_COLLAPSE_MAX_BYTES = 3 * 2 ** 30;

export interface CollapseLayersOptions {
  /** Consecutive layers of a stack, bottom first (as a sandbox lists them: base, workspace, toolkits). */
  refs: string[];
  name: string;
  version?: string;
  /** Default: `base` when the bottom layer is a base, else the kind of the top layer. */
  kind?: LayerKind;
  /** Metadata + data blob output; default: when any input is split. */
  split?: boolean;
  /** Refuses when the layers hold more content than this (default 3 GiB). */
  maxContentBytes?: number;
  mounter: ErofsMounter;
  workDir?: string;
  signal?: AbortSignal;
  onProgress?(p: BuildProgress): void;
}

/**
 * Collapses consecutive layers into one EROFS layer (paper 5.3) holding
 * exactly the view overlayfs gives of their stack: a whiteout in an upper
 * layer deletes the lower file, an opaque directory replaces lower content.
 * Whiteouts and opaque marks that still matter — they hide layers below the
 * collapsed range — are kept, unless the range starts at a base (nothing is
 * below it). Fewer layers per sandbox means fewer mounts and lowerdirs.
 */
export async function collapseLayers(
  store: ImageStore,
  options: CollapseLayersOptions,
): Promise<LayerInfo> {
  assertLayerName(options.name);
  if (options.kind !== undefined) assertLayerKind(options.kind);
  if (options.refs.length < 2) {
    throw new DsecError('invalid_argument', 'collapse needs at least two layers', {
      field: 'refs',
    });
  }
  const { signal } = options;
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const layers: LayerInfo[] = [];
  for (const ref of options.refs) layers.push(await store.getLayer(ref));
  layers.slice(1).forEach((l, i) => {
    if (l.kind === 'base') {
      throw new DsecError(
        'invalid_argument',
        `${formatLayerRef(l)} is a base: only the bottom layer may be one`,
        {
          field: `refs.${i + 1}`,
        },
      );
    }
  });
  const total = layers.reduce((s, l) => s + l.contentBytes, 0);
  const max = options.maxContentBytes ?? DEFAULT_COLLAPSE_MAX_BYTES;
  if (total > max) {
    throw new DsecError(
      'invalid_argument',
      `the layers hold ${total} bytes, above the ${max}-byte collapse threshold`,
      {
        field: 'refs',
        details: { contentBytes: total, maxContentBytes: max },
      },
    );
  }
  const bottomIsBase = layers[0]!.kind === 'base';
  const kind = options.kind ?? (bottomIsBase ? 'base' : layers[layers.length - 1]!.kind);
  const split = options.split ?? layers.some((l) => l.blobDigest !== undefined);

  const workRoot = options.workDir ?? (store instanceof DirImageStore ? store.tmpDir : tmpdir());
  await mkdir(workRoot, { recursive: true });
  const work = await mkdtemp(join(workRoot, 'collapse-'));
  // Layers may be snapshots (trees sandboxes made): every step on the copies runs confined.
  const confineRoot = join(work, 'root');
  await mkdir(confineRoot);
  try {
    const trees: string[] = [];
    for (const [i, layer] of layers.entries()) {
      progress({ phase: 'copy', done: i, total: layers.length });
      const dir = join(work, String(i));
      await copyLayerTree(store, layer, dir, options.mounter, confineRoot, signal);
      trees.push(dir);
    }
    progress({ phase: 'copy', done: layers.length, total: layers.length });
    progress({ phase: 'merge' });
    const topFirst = [...trees].reverse();
    // One tree attached (renames cannot cross mounts), the copies in it by name.
    await runConfinedOk(
      confinedTreeCommand(
        { rootDir: confineRoot, trees: [{ path: work, name: 'w', writable: true }] },
        [
          'merge',
          bottomIsBase ? '--strip-marks' : '--keep-marks',
          ...topFirst.map((d) => `/w/${basename(d)}`),
        ],
      ),
      'merging the layers',
      { signal },
    );
    throwIfAborted(signal);
    return await buildLayer(store, {
      name: options.name,
      ...(options.version !== undefined ? { version: options.version } : {}),
      kind,
      from: { dir: topFirst[0]! },
      split,
      source: 'collapse',
      parents: layers.map(formatLayerRef),
      workDir: work,
      confineRoot,
      ...(signal ? { signal } : {}),
      onProgress: progress,
    });
  } finally {
    await removeTree(work);
  }
}

/** Copies a layer's tree out of its EROFS into `dir` (`cp -a`, confined: whiteouts, xattrs, holes kept). */
async function copyLayerTree(
  store: ImageStore,
  layer: LayerInfo,
  dir: string,
  mounter: ErofsMounter,
  confineRoot: string,
  signal: AbortSignal | undefined,
): Promise<void> {
  const mnt = `${dir}.mnt`;
  await mkdir(mnt, { recursive: true });
  await mkdir(dir, { recursive: true });
  const image = await store.blobPath(layer.digest, signal ? { signal } : {});
  const blobDevice = layer.blobDigest ? await store.blobPath(layer.blobDigest) : undefined;
  await mounter.mountErofs(image, mnt, blobDevice ? { blobDevice } : {});
  try {
    await runConfinedOk(
      confinedCommand(
        {
          rootDir: confineRoot,
          trees: [
            { path: mnt, name: 'src' },
            { path: dir, name: 'dst', writable: true },
          ],
          tools: true,
        },
        ['cp', '-a', '--', '/src/.', '/dst/'],
      ),
      `copying layer ${formatLayerRef(layer)}`,
      { signal },
    );
  } finally {
    await mounter.unmount([mnt], { detach: true });
    await rmdir(mnt);
  }
}

/**
 * Copies a layer's tree out of its EROFS, keeping whiteout devices and
 * xattrs (`cp -a`), and reads its opaque marks; both confined (the layer may
 * be one a sandbox made), with the private root on `${dir}.root`.
 */
export async function copyLayer(
  store: ImageStore,
  layer: LayerInfo,
  dir: string,
  mounter: ErofsMounter,
  signal: AbortSignal | undefined,
): Promise<LayerTree> {
  const confineRoot = `${dir}.root`;
  await mkdir(confineRoot, { recursive: true });
  try {
    await copyLayerTree(store, layer, dir, mounter, confineRoot, signal);
    return await overlayLayerTree(dir, signal, confineRoot);
  } finally {
    await rmdir(confineRoot);
  }
}
