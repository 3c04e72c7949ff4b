import { mkdir, mkdtemp, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import {
  DsecError,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import { buildLayer, extractTar, type BuildProgress } from '../build.js';
import type { ErofsCompression } from '../erofs.js';
import { mergeImageLayers, ociLayerToOverlay, type LayerTree } from '../overlay/merge.js';
import { DirImageStore } from '../store/dir-store.js';
import { assertLayerKind, assertLayerName } from '../store/validate.js';
import { runTool } from '../util/run-tool.js';
import { readOciImage } from './read-image.js';

export interface ImportOciOptions {
  /** An OCI image layout directory, or a tar of one, or a docker-archive tar (`podman save`). */
  path: string;
  name: string;
  version?: string;
  kind: LayerKind;
  /** Picks one image by tag when the layout or archive holds several. */
  ref?: string;
  /**
   * Keep the image's whiteouts and opaque directories as overlayfs marks, so
   * the layer can delete or replace what lies below it. Default: true for a
   * workspace or toolkit, false for a base (nothing below; marks dropped).
   */
  keepWhiteouts?: boolean;
  split?: boolean;
  /** Compression of an unsplit layer (default `lz4hc`). */
  compress?: boolean | ErofsCompression;
  workDir?: string;
  signal?: AbortSignal;
  onProgress?(p: BuildProgress): void;
}

/**
 * Imports an OCI image as one EROFS layer: its layer tarballs are extracted
 * and merged bottom to top with overlay semantics (a whiteout deletes what the
 * layers below put there, an opaque directory replaces their content), and
 * the image config (Env, Cmd, Entrypoint, WorkingDir, User) is recorded with
 * the layer. Same image in, same digest out.
 */
export async function importOci(store: ImageStore, options: ImportOciOptions): Promise<LayerInfo> {
  assertLayerName(options.name);
  assertLayerKind(options.kind);
  const { signal } = options;
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const path = resolve(options.path);
  const st = await stat(path).catch(() => undefined);
  if (!st?.isDirectory() && !st?.isFile()) {
    throw new DsecError('invalid_argument', `${path} does not exist`, { field: 'path' });
  }
  const workRoot = options.workDir ?? (store instanceof DirImageStore ? store.tmpDir : tmpdir());
  await mkdir(workRoot, { recursive: true });
  const work = await mkdtemp(join(workRoot, 'import-'));
  try {
    let root = path;
    if (st.isFile()) {
      progress({ phase: 'unpack' });
      root = join(work, 'archive');
      await mkdir(root);
      await runTool(
        'tar',
        ['--extract', `--file=${path}`, `--directory=${root}`, '--no-same-owner'],
        {
          signal,
        },
      ).catch((err: unknown) => {
        throw new DsecError('invalid_argument', `cannot unpack ${path}`, {
          field: 'path',
          cause: err,
        });
      });
    }
    progress({ phase: 'read' });
    const image = await readOciImage(root, { ref: options.ref, signal });

    const trees: LayerTree[] = [];
    for (const [i, layer] of image.layers.entries()) {
      progress({ phase: 'extract', done: i, total: image.layers.length });
      const dir = join(work, 'layers', String(i));
      await mkdir(join(work, 'layers'), { recursive: true });
      await extractTar(layer, dir, signal, 'path');
      trees.push(await ociLayerToOverlay(dir, signal));
    }
    progress({ phase: 'extract', done: image.layers.length, total: image.layers.length });
    throwIfAborted(signal);
    progress({ phase: 'merge' });
    const rootDir = await mergeImageLayers(trees, {
      emptyDir: join(work, 'layers', 'empty'),
      keepMarks: options.keepWhiteouts ?? options.kind !== 'base',
      signal,
    });
    if (archiveRootDir(root, path)) await rm(root, { recursive: true, force: true });

    return await buildLayer(store, {
      name: options.name,
      ...(options.version !== undefined ? { version: options.version } : {}),
      kind: options.kind,
      from: { dir: rootDir },
      source: 'oci',
      config: image.config,
      ...(options.split !== undefined ? { split: options.split } : {}),
      ...(options.compress !== undefined ? { compress: options.compress } : {}),
      workDir: work,
      ...(signal ? { signal } : {}),
      onProgress: progress,
    });
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

// The unpacked archive is scratch (free its space before mkfs); a layout directory is the user's.
function archiveRootDir(root: string, path: string): boolean {
  return root !== path;
}
