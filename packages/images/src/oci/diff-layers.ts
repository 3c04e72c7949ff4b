import { createHash } from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import { lstat, mkdir, open, rm, rmdir, unlink } from 'node:fs/promises';
import { join } from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { spawn } from 'node:child_process';
import { createGunzip } from 'node:zlib';
import { DsecError, isDsecError, throwIfAborted, type ImageStore } from '@dsec/core';
import { buildLayer, extractTar, type BuildProgress } from '../build.js';
import { copyLayer, type ErofsMounter } from '../collapse.js';
import { confinedCommand, runConfined } from '@dsec/native';
import { ociLayerToOverlay, overlayLayerTree, type LayerTree } from '../overlay/merge.js';
import { runTool } from '../util/run-tool.js';

/**
 * The name under which one converted OCI layer is kept, versioned by the hex
 * of its diff ID: the store's layer records are the diff-ID index, so a
 * layer shared by many images (a distro base under thousands of task images)
 * is converted once.
 */
export const OCI_DIFF_LAYER_NAME = 'oci-diff';

/** What {@link ConvertDiffLayersOptions.unpacked} bounds: bytes left, the bound, the image it is reported against. */
export interface UnpackBound {
  budget: { left: number };
  maxBytes: number;
  ref: string;
}

/** One image layer after {@link convertDiffLayers}: its diff ID, its record, whether it was reused. */
export interface DiffLayer {
  diffId: string;
  /** `oci-diff:<hex>` for a recorded layer; `''` for one converted in place (never recorded). */
  ref: string;
  reused: boolean;
}

export interface ConvertDiffLayersOptions {
  /** The image's diff IDs, bottom first. */
  diffIds: string[];
  /**
   * Each layer's blob (compressed or not), bottom first; may be empty when
   * every layer is already recorded. A blob is deleted once converted.
   */
  blobs: string[];
  /** Scratch space: layer `i` is unpacked under `work/layers/i`. */
  work: string;
  mounter: ErofsMounter;
  /**
   * Layers a sandbox made (a Dockerfile's `RUN`): unpacked without device
   * nodes, set-id bits or file capabilities, and never recorded under their
   * diff ID (what is kept is no longer what the diff ID names).
   */
  sandboxMade?: (index: number) => boolean;
  /** The field a bad layer is reported against (default `source`). */
  field?: string;
  /**
   * A bound on the bytes the layers unpack to, all together (`budget.left`
   * counts down across calls): a small blob can decompress to terabytes.
   * Past it, `resource_exhausted` with `details.reason: 'image_unpacks_too_large'`.
   */
  unpacked?: UnpackBound | undefined;
  signal?: AbortSignal | undefined;
  onProgress?(p: BuildProgress): void;
}

/**
 * Converts an image's layers bottom first into overlay trees for
 * `mergeImageLayers`: a layer whose `oci-diff:<hex>` record exists is copied
 * out of its stored EROFS image; any other is decompressed while hashed,
 * refused unless the hash is its diff ID, unpacked, and (unless
 * sandbox-made) recorded as `oci-diff:<hex>` so the next image sharing it
 * reuses it. Shared by the registry import and Dockerfile builds.
 */
export async function convertDiffLayers(
  store: ImageStore,
  options: ConvertDiffLayersOptions,
): Promise<{ trees: LayerTree[]; layers: DiffLayer[] }> {
  const { diffIds, work, signal } = options;
  const field = options.field ?? 'source';
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const trees: LayerTree[] = [];
  const layers: DiffLayer[] = [];
  for (const [i, diffId] of diffIds.entries()) {
    progress({ phase: 'convert', done: i, total: diffIds.length });
    throwIfAborted(signal);
    const version = diffId.slice('sha256:'.length);
    const sandboxMade = options.sandboxMade?.(i) === true;
    const ref = sandboxMade ? '' : `${OCI_DIFF_LAYER_NAME}:${version}`;
    const dir = join(work, 'layers', String(i));
    const existing = sandboxMade
      ? undefined
      : await store.getLayer(ref).catch((err: unknown) => {
          if (isDsecError(err, 'image_not_found')) return undefined;
          throw err;
        });
    if (existing) {
      trees.push(await copyLayer(store, existing, dir, options.mounter, signal));
      layers.push({ diffId, ref, reused: true });
    } else {
      const blob = options.blobs[i];
      if (blob === undefined) {
        throw new DsecError('internal', `layer ${diffId} is neither stored nor pulled`);
      }
      const tarFile = join(work, `layer-${i}.tar`);
      await decompressVerified(blob, diffId, tarFile, field, signal, options.unpacked);
      await mkdir(join(dir, '..'), { recursive: true });
      if (sandboxMade) await extractSandboxTar(tarFile, dir, signal, field);
      else await extractTar(tarFile, dir, signal, field);
      await rm(tarFile, { force: true });
      const tree = await ociLayerToOverlay(dir, signal);
      if (!sandboxMade) {
        await buildLayer(store, {
          name: OCI_DIFF_LAYER_NAME,
          version,
          kind: 'toolkit',
          from: { dir },
          source: 'oci-layer',
          // A cache read back once per image that shares it: compressing it would
          // cost more time here than the reuse saves. The merged image is
          // compressed as asked.
          compress: false,
          workDir: work,
          ...(signal ? { signal } : {}),
        });
      }
      trees.push(tree);
      layers.push({ diffId, ref, reused: false });
    }
    // The compressed blob is no longer needed: free its space before the next one.
    if (options.blobs[i] !== undefined) await rm(options.blobs[i], { force: true });
  }
  progress({ phase: 'convert', done: diffIds.length, total: diffIds.length });
  return { trees, layers };
}

/**
 * Unpacks a layer a sandbox made: no file capability is restored
 * (`security.capability` excluded), then device nodes are deleted and set-id
 * bits cleared. Nothing runs in the tree meanwhile (the build has ended), and
 * `find` neither follows symlinks nor leaves the tree's filesystem, so every
 * path it prints is the entry it matched.
 */
async function extractSandboxTar(
  tarFile: string,
  dest: string,
  signal: AbortSignal | undefined,
  field: string,
): Promise<void> {
  await mkdir(dest, { mode: 0o755 });
  await runTool(
    'tar',
    [
      '--extract',
      `--file=${tarFile}`,
      `--directory=${dest}`,
      '--same-owner',
      '--numeric-owner',
      '--same-permissions',
      '--xattrs',
      '--xattrs-include=*',
      '--xattrs-exclude=security.capability',
    ],
    { signal },
  ).catch((err: unknown) => {
    throw new DsecError('invalid_argument', `cannot extract a built layer: ${String(err)}`, {
      field,
      cause: err,
    });
  });
  await runTool(
    'find',
    ['-P', dest, '-xdev', '(', '-type', 'b', '-o', '-type', 'c', ')', '-delete'],
    {
      signal,
    },
  );
  await runTool(
    'find',
    ['-P', dest, '-xdev', '-type', 'f', '-perm', '/6000', '-exec', 'chmod', 'ug-s', '{}', '+'],
    { signal },
  );
  await runTool(
    'find',
    ['-P', dest, '-xdev', '-type', 'd', '-perm', '/6000', '-exec', 'chmod', 'g-s,u-s', '{}', '+'],
    { signal },
  );
}

/**
 * Decompresses a layer blob (gzip, zstd or plain) into a plain tar while
 * hashing it, and refuses it when the hash is not its diff ID (the key it
 * would be reused under by other images).
 */
async function decompressVerified(
  blob: string,
  diffId: string,
  tarFile: string,
  field: string,
  signal: AbortSignal | undefined,
  bound: UnpackBound | undefined,
): Promise<void> {
  const magic = Buffer.alloc(4);
  const fh = await open(blob, 'r');
  try {
    await fh.read(magic, 0, 4, 0);
  } finally {
    await fh.close();
  }
  const hash = createHash('sha256');
  const hashing = new Transform({
    transform(chunk: Buffer, _enc, done) {
      if (bound) bound.budget.left -= chunk.length;
      if (bound && bound.budget.left < 0) {
        done(
          new DsecError(
            'resource_exhausted',
            `${bound.ref}: the image's layers unpack to more than ${bound.maxBytes} bytes`,
            {
              field,
              details: { reason: 'image_unpacks_too_large', maxUnpackedBytes: bound.maxBytes },
            },
          ),
        );
        return;
      }
      hash.update(chunk);
      done(null, chunk);
    },
  });
  const out = createWriteStream(tarFile);
  if (magic[0] === 0x1f && magic[1] === 0x8b) {
    await pipeline(createReadStream(blob), createGunzip(), hashing, out, { signal });
  } else if (magic.readUInt32LE(0) === 0xfd2fb528) {
    const zstd = spawn('zstd', ['-dc', '--', blob], { stdio: ['ignore', 'pipe', 'inherit'] });
    const exited = new Promise<number | null>((res) => zstd.once('close', res));
    try {
      await pipeline(zstd.stdout, hashing, out, { signal });
    } catch (err) {
      zstd.kill('SIGKILL');
      await exited;
      throw err;
    }
    if ((await exited) !== 0) {
      throw new DsecError('invalid_argument', `cannot decompress layer ${diffId} (zstd)`, {
        field,
      });
    }
  } else {
    await pipeline(createReadStream(blob), hashing, out, { signal });
  }
  if (`sha256:${hash.digest('hex')}` !== diffId) {
    throw new DsecError('invalid_argument', `a layer does not match its diff ID ${diffId}`, {
      field,
    });
  }
}

/** One layer of an image as a container storage keeps it: an overlayfs-format directory. */
export interface StoredDiffLayer {
  diffId: string;
  /** The layer's own files (`overlay/<id>/diff`): read, hard-linked or copied, never changed. */
  diffDir: string;
}

/** Stored layers converted at once (each is a few processes: `cp`, `tar`, `getfattr`). */
const STORED_LAYER_CONCURRENCY = 4;

export interface ConvertStoredLayersOptions extends Omit<
  ConvertDiffLayersOptions,
  'diffIds' | 'blobs'
> {
  /** Bottom first. */
  layers: StoredDiffLayer[];
}

/**
 * {@link convertDiffLayers} for layers already unpacked in overlayfs format
 * (a Dockerfile build's image in buildah's storage, whose digests the
 * storage checked as it applied them): no export to a tar and no unpacking.
 * A recorded `oci-diff:<hex>` is copied out as there; another pulled layer is
 * recorded straight from its directory (in the background: `recorded`
 * settles when every record is stored, and must be awaited) and enters the
 * merge as a hard-linked copy, so the merge's renames never touch the
 * storage's files (a plain copy when they lie on another filesystem); a
 * sandbox-made layer is copied confined, without file capabilities, then
 * loses device nodes (whiteouts stay) and set-id bits.
 */
export async function convertStoredLayers(
  store: ImageStore,
  options: ConvertStoredLayersOptions,
): Promise<{ trees: LayerTree[]; layers: DiffLayer[]; recorded: Promise<void> }> {
  const { work, signal } = options;
  const field = options.field ?? 'source';
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const records: Promise<unknown>[] = [];
  const recording = new Set<string>();
  const record = (p: Promise<unknown>): void => {
    // Awaited later (`recorded`): a failure meanwhile is not an unhandled rejection.
    p.catch(() => undefined);
    records.push(p);
  };
  const convertOne = async (i: number): Promise<{ tree: LayerTree; layer: DiffLayer }> => {
    const { diffId, diffDir } = options.layers[i]!;
    throwIfAborted(signal);
    const version = diffId.slice('sha256:'.length);
    const sandboxMade = options.sandboxMade?.(i) === true;
    const ref = sandboxMade ? '' : `${OCI_DIFF_LAYER_NAME}:${version}`;
    const dir = join(work, 'layers', String(i));
    const existing = sandboxMade
      ? undefined
      : await store.getLayer(ref).catch((err: unknown) => {
          if (isDsecError(err, 'image_not_found')) return undefined;
          throw err;
        });
    if (existing) {
      const tree = await copyLayer(store, existing, dir, options.mounter, signal);
      return { tree, layer: { diffId, ref, reused: true } };
    }
    if (sandboxMade) {
      await copySandboxLayer(diffDir, dir, field, signal);
      return { tree: await confinedLayerTree(dir, signal), layer: { diffId, ref, reused: false } };
    }
    if (!recording.has(version)) {
      recording.add(version);
      record(
        buildLayer(store, {
          name: OCI_DIFF_LAYER_NAME,
          version,
          kind: 'toolkit',
          from: { dir: diffDir },
          source: 'oci-layer',
          // As convertDiffLayers: read back once per image, not worth compressing.
          compress: false,
          workDir: work,
          ...(signal ? { signal } : {}),
        }),
      );
    }
    await linkCopy(diffDir, dir, signal);
    return { tree: await overlayLayerTree(dir, signal), layer: { diffId, ref, reused: false } };
  };
  let converted: { tree: LayerTree; layer: DiffLayer }[];
  try {
    await mkdir(join(work, 'layers'), { recursive: true });
    // Layers are independent until the merge: several at once (separate processes, 2+ cores).
    let next = 0;
    let done = 0;
    let failed: { err: unknown } | undefined;
    const out: { tree: LayerTree; layer: DiffLayer }[] = [];
    const worker = async (): Promise<void> => {
      while (next < options.layers.length && failed === undefined) {
        const i = next++;
        try {
          out[i] = await convertOne(i);
          progress({ phase: 'convert', done: ++done, total: options.layers.length });
        } catch (err) {
          failed ??= { err };
        }
      }
    };
    progress({ phase: 'convert', done: 0, total: options.layers.length });
    await Promise.all(
      Array.from({ length: Math.min(STORED_LAYER_CONCURRENCY, options.layers.length) }, worker),
    );
    if (failed) throw failed.err;
    converted = out;
  } catch (err) {
    // Nothing keeps writing under `work` once this fails.
    await Promise.allSettled(records);
    throw err;
  }
  const recorded = (async (): Promise<void> => {
    const results = await Promise.allSettled(records);
    const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (failed) throw failed.reason;
  })();
  recorded.catch(() => undefined);
  return {
    trees: converted.map((c) => c.tree),
    layers: converted.map((c) => c.layer),
    recorded,
  };
}

/** `cp -al`: a tree of hard links (directories copied), else a full `cp -a` across filesystems. */
async function linkCopy(src: string, dest: string, signal: AbortSignal | undefined): Promise<void> {
  try {
    await runTool('cp', ['-al', '--', src, dest], { signal });
  } catch (err) {
    if (!/cross-device|Invalid cross-device link/i.test(String(err))) throw err;
    await rm(dest, { recursive: true, force: true });
    await runTool('cp', ['-a', '--', src, dest], { signal });
  }
}

/**
 * Copies a layer a sandbox made out of the storage, confined (the source
 * read-only and nosymfollow, writes only under `dest`): `tar` keeps owners,
 * modes, whiteouts and xattrs, except `security.capability`. Then, in the
 * copy (nothing runs in it), device nodes other than 0:0 whiteouts are
 * deleted and set-id bits cleared; `find` neither follows symlinks nor
 * leaves the tree's filesystem.
 */
async function copySandboxLayer(
  src: string,
  dest: string,
  field: string,
  signal: AbortSignal | undefined,
): Promise<void> {
  await mkdir(dest, { mode: 0o755 });
  const confineRoot = `${dest}.root`;
  await mkdir(confineRoot, { recursive: true });
  try {
    const r = await runConfined(
      confinedCommand(
        {
          rootDir: confineRoot,
          trees: [
            { path: src, name: 'src' },
            { path: dest, name: 'dst', writable: true },
          ],
          tools: true,
        },
        [
          '/usr/bin/bash',
          '-c',
          'set -o pipefail; tar -C /src -cf - --numeric-owner --xattrs --xattrs-include="*" . | ' +
            'tar -C /dst -xf - --same-owner --numeric-owner --same-permissions --xattrs --xattrs-include="*" ' +
            '--xattrs-exclude=security.capability',
        ],
      ),
      { signal },
    );
    if (r.exitCode !== 0) {
      throw new DsecError(
        'invalid_argument',
        `cannot copy a built layer: ${r.stderr.slice(-2000)}`,
        {
          field,
        },
      );
    }
  } finally {
    await rmdir(confineRoot).catch(() => undefined);
  }
  await runTool('find', ['-P', dest, '-xdev', '-type', 'b', '-delete'], { signal });
  const { stdout } = await runTool('find', ['-P', dest, '-xdev', '-type', 'c', '-print0'], {
    signal,
    maxStdoutBytes: 64 * 2 ** 20,
  });
  for (const path of stdout.split('\0')) {
    if (path === '') continue;
    const st = await lstat(path);
    if (st.isCharacterDevice() && st.rdev !== 0) await unlink(path);
  }
  await runTool(
    'find',
    ['-P', dest, '-xdev', '-type', 'f', '-perm', '/6000', '-exec', 'chmod', 'ug-s', '{}', '+'],
    { signal },
  );
  await runTool(
    'find',
    ['-P', dest, '-xdev', '-type', 'd', '-perm', '/6000', '-exec', 'chmod', 'g-s,u-s', '{}', '+'],
    { signal },
  );
}

/** The opaque marks of a sandbox-made tree, read confined. */
async function confinedLayerTree(dir: string, signal: AbortSignal | undefined): Promise<LayerTree> {
  const confineRoot = `${dir}.root`;
  await mkdir(confineRoot, { recursive: true });
  try {
    return await overlayLayerTree(dir, signal, confineRoot);
  } finally {
    await rmdir(confineRoot).catch(() => undefined);
  }
}
