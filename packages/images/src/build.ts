import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, open, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join, resolve } from 'node:path';
import {
  CHUNK_TABLE_CHUNK_BYTES,
  DEFAULT_LAYER_VERSION,
  DsecError,
  encodeChunkTable,
  isDsecError,
  throwIfAborted,
  type ImageConfig,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import { confinedCommand, confinedTreeCommand, runConfinedOk } from '@dsec/native';
import { buildErofs, erofsArgs, type ErofsCompression } from './erofs.js';
import { DirImageStore } from './store/dir-store.js';
import { assertLayerKind, assertLayerName, assertLayerVersion } from './store/validate.js';
import { runTool } from './util/run-tool.js';
import { treeStats } from './walk.js';

export interface BuildProgress {
  /** `extract`, `scan`, `mkfs`, `store`, then `done`. */
  phase: string;
  done?: number;
  total?: number;
}

export interface BuildLayerOptions {
  name: string;
  version?: string;
  kind: LayerKind;
  /** A directory, or a tar archive (plain, .gz, .xz, .zst, .bz2; detected from its bytes). */
  from: { dir: string } | { tar: string };
  /** Build the metadata/data split (`--blobdev`): `digest` is the metadata image, `blobDigest` the data. */
  split?: boolean;
  /** Recorded as `source` (default `dir` or `tar`), e.g. `busybox`, `debootstrap`. */
  source?: string;
  /**
   * The project that owns the layer (`LayerInfo.project`): recorded in its
   * namespace, never the platform's (absent: the platform's).
   */
  project?: string | undefined;
  /** Recorded with the layer: an imported image's runtime defaults. */
  config?: ImageConfig | undefined;
  /** Recorded with the layer: the refs a collapsed layer merges, bottom first. */
  parents?: string[] | undefined;
  /** Compression of unsplit layers (default `lz4hc`; `true`/`false`: `lz4hc`/`none`). */
  compress?: boolean | ErofsCompression;
  /** Scratch space (default: the store's `tmp/` for a DirImageStore, else the OS temp dir). */
  workDir?: string;
  /**
   * The tree may hold what a sandbox made (a collapse over snapshot layers):
   * count and pack it confined (`@dsec/native` confine, mounting the private
   * root on this empty directory), never with host path walks.
   */
  confineRoot?: string | undefined;
  signal?: AbortSignal;
  onProgress?(p: BuildProgress): void;
}

/**
 * Builds an EROFS layer from a directory or a tar archive, stores its blobs
 * and records it as `name:version`. Idempotent: rebuilding the same content
 * under the same name returns the existing record; other content under a
 * taken name is `conflict`.
 */
export async function buildLayer(
  store: ImageStore,
  options: BuildLayerOptions,
): Promise<LayerInfo> {
  const version = options.version ?? DEFAULT_LAYER_VERSION;
  assertLayerName(options.name);
  assertLayerVersion(version);
  assertLayerKind(options.kind);
  const from = await checkSource(options.from);
  throwIfAborted(options.signal);

  const { signal } = options;
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const workRoot = options.workDir ?? (store instanceof DirImageStore ? store.tmpDir : tmpdir());
  await mkdir(workRoot, { recursive: true });
  const work = await mkdtemp(join(workRoot, 'build-'));
  try {
    let tree = from.path;
    if (from.kind === 'tar') {
      progress({ phase: 'extract' });
      tree = join(work, 'rootfs');
      await extractTar(from.path, tree, signal);
    }

    // The count comes first: a tree the (confined) scan refuses costs no mkfs.erofs, and a
    // sandbox-made tree is read by one confined program at a time.
    progress({ phase: 'scan' });
    const stats =
      options.confineRoot === undefined
        ? await treeStats(tree, { signal, onEntry: (done) => progress({ phase: 'scan', done }) })
        : await confinedTreeStats(tree, options.confineRoot, signal);
    progress({ phase: 'mkfs' });
    const image = join(work, options.split ? 'layer.meta' : 'layer.erofs');
    const blob = options.split ? join(work, 'layer.blob') : undefined;
    const erofs = {
      ...(options.compress !== undefined ? { compress: options.compress } : {}),
      ...(signal ? { signal } : {}),
    };
    if (options.confineRoot === undefined) {
      await buildErofs({
        sourceDir: tree,
        output: image,
        ...(blob !== undefined ? { blobDevice: blob } : {}),
        ...erofs,
      });
    } else {
      // The tree read-only and nosymfollow at /src, the images written under /out.
      const args = erofsArgs({
        sourceDir: '/src',
        output: `/out/${basename(image)}`,
        ...(blob !== undefined ? { blobDevice: `/out/${basename(blob)}` } : {}),
        ...erofs,
      });
      await runConfinedOk(
        confinedCommand(
          {
            rootDir: options.confineRoot,
            trees: [
              { path: tree, name: 'src' },
              { path: work, name: 'out', writable: true },
              { path: work, name: 'tmp', writable: true },
            ],
            tools: true,
          },
          ['mkfs.erofs', ...args],
        ),
        'mkfs.erofs',
        { signal },
      );
    }
    // A split layer's data blob gets a chunk table, so on-demand readers can
    // check each chunk they fetch (ADR 0006).
    const table = blob !== undefined ? join(work, 'layer.chunks') : undefined;
    if (blob !== undefined && table !== undefined) await writeChunkTable(blob, table, signal);
    const files = blob !== undefined && table !== undefined ? [image, blob, table] : [image];
    const puts: { digest: string; sizeBytes: number }[] = [];
    for (const [i, file] of files.entries()) {
      progress({ phase: 'store', done: i, total: files.length });
      // Linked into the store, not copied: the file is this build's own and goes next.
      puts.push(await store.putBlob(file, { move: true, ...(signal ? { signal } : {}) }));
    }
    progress({ phase: 'store', done: files.length, total: files.length });

    const layer: LayerInfo = {
      name: options.name,
      version,
      kind: options.kind,
      digest: puts[0]!.digest,
      ...(puts[1] ? { blobDigest: puts[1].digest } : {}),
      ...(puts[2] ? { blobChunksDigest: puts[2].digest } : {}),
      sizeBytes: (puts[0]?.sizeBytes ?? 0) + (puts[1]?.sizeBytes ?? 0),
      contentBytes: stats.contentBytes,
      fileCount: stats.fileCount,
      createdAt: new Date().toISOString(),
      source: options.source ?? from.kind,
      ...(options.config !== undefined ? { config: options.config } : {}),
      ...(options.parents !== undefined ? { parents: options.parents } : {}),
      ...(options.project !== undefined ? { project: options.project } : {}),
    };
    throwIfAborted(signal);
    await store.putLayer(layer);
    // Same content stored earlier: hand back the record as it is kept.
    const stored = await store.getLayer(
      `${layer.name}:${layer.version}`,
      options.project !== undefined ? { project: options.project } : {},
    );
    progress({ phase: 'done' });
    return stored;
  } catch (err) {
    if (err instanceof Error && err.name === 'AbortError') {
      throw new DsecError('aborted', 'layer build aborted', { cause: err });
    }
    throw err;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

/** `treeStats` of a tree a sandbox may have made: the helper's confined scan (same counting). */
async function confinedTreeStats(
  tree: string,
  rootDir: string,
  signal: AbortSignal | undefined,
): Promise<{ fileCount: number; contentBytes: number }> {
  const r = await runConfinedOk(
    confinedTreeCommand({ rootDir, trees: [{ path: tree, name: 't' }] }, ['scan', '/t']),
    'counting the tree',
    { signal },
  );
  const value = (key: string): number =>
    Number(new RegExp(`^${key} (\\d+)$`, 'm').exec(r.stdout)?.[1]);
  return { fileCount: value('files'), contentBytes: value('bytes') };
}

async function checkSource(
  from: BuildLayerOptions['from'],
): Promise<{ kind: 'dir' | 'tar'; path: string }> {
  const isDir = 'dir' in from && typeof from.dir === 'string';
  const isTar = 'tar' in from && typeof from.tar === 'string';
  if (isDir === isTar) {
    throw new DsecError('invalid_argument', 'from needs exactly one of dir or tar', {
      field: 'from',
    });
  }
  const kind = isDir ? 'dir' : 'tar';
  const path = resolve('dir' in from ? from.dir : from.tar);
  const st = await stat(path).catch(() => undefined);
  const ok = kind === 'dir' ? st?.isDirectory() : st?.isFile();
  if (!ok) {
    const want = kind === 'dir' ? 'a directory' : 'a file';
    throw new DsecError('invalid_argument', `${path} is not ${want}`, { field: `from.${kind}` });
  }
  return { kind, path };
}

/**
 * Extracts as root keeping numeric owners, modes and xattrs, so the layer
 * holds exactly what the archive says. GNU tar detects the compression from
 * the bytes, refuses `..` members and strips leading `/`.
 */
export async function extractTar(
  archive: string,
  dest: string,
  signal: AbortSignal | undefined,
  field = 'from.tar',
): Promise<void> {
  await mkdir(dest, { mode: 0o755 });
  try {
    await runTool(
      'tar',
      [
        '--extract',
        `--file=${archive}`,
        `--directory=${dest}`,
        '--same-owner',
        '--numeric-owner',
        '--same-permissions',
        '--xattrs',
        '--xattrs-include=*',
      ],
      { signal },
    );
  } catch (err) {
    // A tar that ran and failed means a bad archive; a missing tar stays `internal`.
    if (isDsecError(err, 'internal') && err.details?.['exitCode'] !== undefined) {
      throw new DsecError('invalid_argument', `cannot extract ${archive}: ${err.message}`, {
        field,
        cause: err,
      });
    }
    throw err;
  }
}

/** Writes the chunk table of `blob`: the sha256 of each CHUNK_TABLE_CHUNK_BYTES chunk. */
async function writeChunkTable(blob: string, table: string, signal?: AbortSignal): Promise<void> {
  const digests: Buffer[] = [];
  const input = await open(blob, 'r');
  try {
    const buf = Buffer.allocUnsafe(CHUNK_TABLE_CHUNK_BYTES);
    for (;;) {
      throwIfAborted(signal);
      let filled = 0;
      while (filled < buf.length) {
        const { bytesRead } = await input.read(buf, filled, buf.length - filled, null);
        if (bytesRead === 0) break;
        filled += bytesRead;
      }
      if (filled === 0) break;
      digests.push(createHash('sha256').update(buf.subarray(0, filled)).digest());
      if (filled < buf.length) break;
    }
  } finally {
    await input.close();
  }
  await writeFile(table, encodeChunkTable(CHUNK_TABLE_CHUNK_BYTES, digests));
}
