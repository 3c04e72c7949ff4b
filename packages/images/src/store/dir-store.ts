import { createHash, randomBytes } from 'node:crypto';
import {
  chmod,
  link,
  mkdir,
  open,
  readdir,
  readFile,
  rename,
  rmdir,
  stat,
  unlink,
} from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import {
  DsecError,
  formatLayerKey,
  formatLayerRef,
  LAYER_NAME_PATTERN,
  LAYER_PROJECT_PATTERN,
  LAYER_VERSION_PATTERN,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
  type LayerKey,
} from '@dsec/core';
import {
  assertDigest,
  assertLayerBlobsStored,
  assertRange,
  assertSameLayer,
  compareLayers,
  layerDigests,
  normalizeLayerInfo,
  storeKey,
  validateLayerInfo,
} from './validate.js';

const COPY_CHUNK_BYTES = 1024 * 1024;
const RECORD_SUFFIX = '.json';

/**
 * An ImageStore over a POSIX directory: local disk, or a shared mount
 * (3FS, CephFS, NFS) used by many edges at once.
 *
 * Layout: `blobs/sha256/<hex>` (mode 0444, never rewritten, shared by every
 * owner), the platform's records at `layers/<name>/<version>.json` (where
 * every record written before owners existed already is), a project's at
 * `projects/<project>/layers/<name>/<version>.json`, and `tmp/` for
 * builders' scratch space.
 * Every write goes to a temp file in the destination directory, is fsynced,
 * then renamed (blobs) or hard-linked (records, so that creation fails
 * atomically when another process got there first). Nothing is locked: a
 * `removeLayer` racing a `putLayer` that reuses the same blob can still drop
 * that blob; `putLayer` checks the blobs exist to keep that window small.
 */
export class DirImageStore implements ImageStore {
  readonly kind = 'dir';
  readonly local = true;
  readonly root: string;

  constructor(root: string) {
    this.root = resolve(root);
  }

  get location(): string {
    return `dir:${this.root}`;
  }

  /** Scratch space on the store's filesystem, for builds and extractions. */
  get tmpDir(): string {
    return join(this.root, 'tmp');
  }

  private get blobDir(): string {
    return join(this.root, 'blobs', 'sha256');
  }

  private blobFile(digest: string): string {
    assertDigest(digest);
    return join(this.blobDir, digest.slice('sha256:'.length));
  }

  /** Where the records of one owner live: the platform's, or a project's. */
  private layersDir(project: string | undefined): string {
    return project === undefined
      ? join(this.root, 'layers')
      : join(this.root, 'projects', project, 'layers');
  }

  private recordFile(key: LayerKey): string {
    return join(this.layersDir(key.project), key.name, key.version + RECORD_SUFFIX);
  }

  async putBlob(
    file: string,
    options: {
      signal?: AbortSignal;
      onProgress?: (bytesDone: number) => void;
      move?: boolean;
    } = {},
  ): Promise<{ digest: string; sizeBytes: number }> {
    throwIfAborted(options.signal);
    const input = await open(file, 'r').catch((err: unknown) => {
      throw new DsecError('invalid_argument', `cannot read ${file}`, { field: 'file', cause: err });
    });
    let tmp: string | undefined;
    try {
      if (!(await input.stat()).isFile()) {
        throw new DsecError('invalid_argument', `${file} is not a regular file`, { field: 'file' });
      }
      await mkdir(this.blobDir, { recursive: true });
      tmp = join(this.blobDir, tempName());
      // A file given up on this filesystem is linked in and only read (hashed);
      // otherwise (or across filesystems) it is copied.
      const linked =
        options.move === true &&
        (await link(file, tmp).then(
          () => true,
          () => false,
        ));
      const out = linked ? undefined : await open(tmp, 'wx', 0o444);
      const hash = createHash('sha256');
      let sizeBytes = 0;
      try {
        const buf = Buffer.allocUnsafe(COPY_CHUNK_BYTES);
        for (;;) {
          throwIfAborted(options.signal);
          const { bytesRead } = await input.read(buf, 0, buf.length, null);
          if (bytesRead === 0) break;
          const chunk = buf.subarray(0, bytesRead);
          hash.update(chunk);
          await out?.write(chunk);
          sizeBytes += bytesRead;
          options.onProgress?.(sizeBytes);
        }
        if (linked) {
          await chmod(tmp, 0o444);
          await input.sync();
        } else {
          await out?.sync();
        }
      } finally {
        await out?.close();
      }
      const digest = `sha256:${hash.digest('hex')}`;
      const final = this.blobFile(digest);
      if (await exists(final)) {
        await unlink(tmp);
      } else {
        await rename(tmp, final);
        await fsyncDir(this.blobDir);
      }
      tmp = undefined;
      if (linked) await unlink(file).catch(() => undefined);
      return { digest, sizeBytes };
    } finally {
      await input.close();
      if (tmp !== undefined) await unlink(tmp).catch(() => undefined);
    }
  }

  async hasBlob(digest: string): Promise<boolean> {
    return await exists(this.blobFile(digest));
  }

  async blobPath(digest: string, options: { signal?: AbortSignal } = {}): Promise<string> {
    throwIfAborted(options.signal);
    const path = this.blobFile(digest);
    if (!(await exists(path))) throw new DsecError('image_not_found', `no blob ${digest}`);
    return path;
  }

  async statBlob(
    digest: string,
    options: { signal?: AbortSignal } = {},
  ): Promise<{ sizeBytes: number }> {
    throwIfAborted(options.signal);
    const st = await stat(this.blobFile(digest)).catch((err: unknown) => {
      if (errno(err) === 'ENOENT') throw new DsecError('image_not_found', `no blob ${digest}`);
      throw err;
    });
    return { sizeBytes: st.size };
  }

  async readBlobRange(
    digest: string,
    offset: number,
    length: number,
    options: { signal?: AbortSignal } = {},
  ): Promise<Buffer> {
    assertRange(offset, length);
    throwIfAborted(options.signal);
    const fh = await open(this.blobFile(digest), 'r').catch((err: unknown) => {
      if (errno(err) === 'ENOENT') throw new DsecError('image_not_found', `no blob ${digest}`);
      throw err;
    });
    try {
      const buf = Buffer.allocUnsafe(length);
      let got = 0;
      while (got < length) {
        const { bytesRead } = await fh.read(buf, got, length - got, offset + got);
        if (bytesRead === 0) break;
        got += bytesRead;
      }
      return buf.subarray(0, got);
    } finally {
      await fh.close();
    }
  }

  /** Deletes an unreferenced blob; `conflict` while a layer record still uses it. */
  async deleteBlob(digest: string): Promise<void> {
    const path = this.blobFile(digest);
    const user = (await this.listLayers()).find((l) => layerDigests(l).includes(digest));
    if (user) {
      throw new DsecError('conflict', `blob ${digest} is used by layer ${formatLayerKey(user)}`, {
        details: { layer: formatLayerKey(user) },
      });
    }
    await unlinkIfPresent(path);
  }

  async putLayer(layer: LayerInfo): Promise<void> {
    validateLayerInfo(layer);
    const record = normalizeLayerInfo(layer);
    await assertLayerBlobsStored(record, (digest) => this.hasBlob(digest));
    const final = this.recordFile(record);
    const dir = dirname(final);
    await mkdir(dir, { recursive: true });
    const tmp = join(dir, tempName());
    try {
      const fh = await open(tmp, 'wx', 0o644);
      try {
        await fh.writeFile(JSON.stringify(record, null, 2) + '\n');
        await fh.sync();
      } finally {
        await fh.close();
      }
      try {
        await link(tmp, final);
        await fsyncDir(dir);
        return;
      } catch (err) {
        if (errno(err) !== 'EEXIST') throw err;
      }
      assertSameLayer(await this.readRecord(final, formatLayerRef(record)), record);
    } finally {
      await unlink(tmp).catch(() => undefined);
    }
  }

  async getLayer(ref: string, options?: { project?: string | undefined }): Promise<LayerInfo> {
    return await this.readRecord(this.recordFile(storeKey(ref, options)), ref);
  }

  async listLayers(options?: { projects?: readonly string[] | undefined }): Promise<LayerInfo[]> {
    const owners: (string | undefined)[] = [undefined];
    const projects = options?.projects ?? (await readdirIfPresent(join(this.root, 'projects')));
    for (const p of new Set(projects)) {
      if (LAYER_PROJECT_PATTERN.test(p)) owners.push(p);
    }
    const out: LayerInfo[] = [];
    for (const project of owners) {
      const layersDir = this.layersDir(project);
      for (const name of await readdirIfPresent(layersDir)) {
        if (!LAYER_NAME_PATTERN.test(name)) continue;
        for (const file of await readdirIfPresent(join(layersDir, name))) {
          if (!file.endsWith(RECORD_SUFFIX)) continue;
          const version = file.slice(0, -RECORD_SUFFIX.length);
          if (!LAYER_VERSION_PATTERN.test(version)) continue;
          try {
            out.push(await this.readRecord(join(layersDir, name, file), `${name}:${version}`));
          } catch (err) {
            // Removed between readdir and read: not a layer any more.
            if (err instanceof DsecError && err.code === 'image_not_found') continue;
            throw err;
          }
        }
      }
    }
    return out.sort(compareLayers);
  }

  async removeLayer(ref: string, options?: { project?: string | undefined }): Promise<void> {
    const key = storeKey(ref, options);
    const file = this.recordFile(key);
    const removed = await this.readRecord(file, ref);
    try {
      await unlink(file);
    } catch (err) {
      if (errno(err) === 'ENOENT')
        throw new DsecError('image_not_found', `no layer ${ref}`, { cause: err });
      throw err;
    }
    // Empty directories go (a project's too); ones still holding records stay.
    await rmdir(dirname(file)).catch(() => undefined);
    if (key.project !== undefined) {
      await rmdir(this.layersDir(key.project)).catch(() => undefined);
      await rmdir(join(this.root, 'projects', key.project)).catch(() => undefined);
    }
    const inUse = new Set((await this.listLayers()).flatMap(layerDigests));
    for (const digest of layerDigests(removed)) {
      if (!inUse.has(digest)) await unlinkIfPresent(this.blobFile(digest));
    }
  }

  private async readRecord(file: string, ref: string): Promise<LayerInfo> {
    let text: string;
    try {
      text = await readFile(file, 'utf8');
    } catch (err) {
      if (errno(err) === 'ENOENT' || errno(err) === 'ENOTDIR') {
        throw new DsecError('image_not_found', `no layer ${ref}`, { cause: err });
      }
      throw err;
    }
    try {
      const layer = JSON.parse(text) as LayerInfo;
      validateLayerInfo(layer);
      // A record must sit where its name and version say, or lookups would lie.
      if (file !== this.recordFile(layer)) throw new Error(`record names ${formatLayerRef(layer)}`);
      return layer;
    } catch (err) {
      throw new DsecError('internal', `layer record ${file} is corrupt`, { cause: err });
    }
  }
}

function tempName(): string {
  return `.tmp-${process.pid}-${randomBytes(8).toString('hex')}`;
}

function errno(err: unknown): string | undefined {
  return (err as NodeJS.ErrnoException | undefined)?.code;
}

async function exists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch (err) {
    if (errno(err) === 'ENOENT') return false;
    throw err;
  }
}

async function unlinkIfPresent(path: string): Promise<void> {
  try {
    await unlink(path);
  } catch (err) {
    if (errno(err) !== 'ENOENT') throw err;
  }
}

async function readdirIfPresent(dir: string): Promise<string[]> {
  try {
    return await readdir(dir);
  } catch (err) {
    if (errno(err) === 'ENOENT' || errno(err) === 'ENOTDIR') return [];
    throw err;
  }
}

// Makes a rename or link durable; some filesystems refuse fsync on a directory.
async function fsyncDir(dir: string): Promise<void> {
  const fh = await open(dir, 'r');
  try {
    await fh.sync().catch(() => undefined);
  } finally {
    await fh.close();
  }
}
