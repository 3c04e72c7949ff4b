import { createHash } from 'node:crypto';
import { copyFile, mkdir, readFile, rename, rm, rmdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { ImageStore, LayerInfo } from '@dsec/core';
import { ensureDir, PRIVATE_DIR_MODE } from '../state/host-state.js';
import { mountPoints } from './mountinfo.js';

/** The privileged operations the cache needs (the native helper in production). */
export interface LayerMounter {
  mountErofs(image: string, target: string, options?: { blobDevice?: string }): Promise<void>;
  unmount(targets: string[], options?: { detach?: boolean }): Promise<void>;
}

/**
 * Serves a remote store's data blobs to the kernel as local files, fetched
 * on demand (the node's blob daemon). Needed only when `store.local` is false.
 */
export interface RemoteBlobs {
  /**
   * A file the kernel can read the blob through; starts the server if needed.
   * With `chunkTable` (the digest of the blob's chunk table) every chunk the
   * server fetches is checked against it.
   */
  pathFor(digest: string, chunkTable?: string): Promise<string>;
  /** Stops the server; called when no mounted layer reads through it. */
  stop(): Promise<void>;
}

interface Entry {
  layer: LayerInfo;
  dir: string;
  refs: number;
  lastUsedMs: number;
  mounting?: Promise<void> | undefined;
}

/**
 * Node-wide cache of mounted layers (paper 5.1, 5.3). Each layer is mounted
 * once per node — read-only EROFS, file-backed (or, on kernels before 6.12,
 * through loop devices that clear themselves with the mount: the mounter
 * decides) — and shared by every sandbox that uses it. Concurrent acquires of one layer share a single
 * mount. Layers nobody uses stay mounted (the next sandbox starts faster)
 * until their total size passes the budget; then the least recently used are
 * unmounted.
 *
 * Lifecycle: `adopt` (after a restart, takes over mounts already there) →
 * `acquire`/`release` pairs per sandbox → `close` unmounts what is unused.
 */
export class LayerMountCache {
  readonly #entries = new Map<string, Entry>();

  constructor(
    readonly dir: string,
    readonly store: ImageStore,
    readonly mounter: LayerMounter,
    readonly budgetBytes: number,
    readonly remoteBlobs?: RemoteBlobs,
  ) {
    if (!store.local && !remoteBlobs) {
      throw new DsecError('invalid_argument', `a ${store.kind} image store needs a blob server`, {
        field: 'store',
      });
    }
  }

  /** Takes over layer mounts left by a previous edge process. */
  async adopt(layers: LayerInfo[]): Promise<void> {
    // Mounted layers are root's alone: the overlay is assembled by host root,
    // and the content of a tenant's layer is not every host user's to read.
    ensureDir(this.dir, PRIVATE_DIR_MODE);
    const mounted = await mountPoints();
    for (const layer of layers) {
      const dir = this.#dirFor(layer);
      if (mounted.has(dir) && !this.#entries.has(layer.digest)) {
        this.#entries.set(layer.digest, { layer, dir, refs: 0, lastUsedMs: Date.now() });
        // Re-attaches to the blob server the mount reads through (it outlives edges).
        if (layer.blobDigest && !this.store.local) await this.#blobDevice(layer);
      }
    }
  }

  /** Acquisitions that found the layer mounted (or mounting), and those that mounted it (metrics). */
  readonly counters = { hits: 0, misses: 0 };

  /** Mounts the layer if needed and returns its mount directory; pair with `release`. */
  async acquire(layer: LayerInfo): Promise<string> {
    let entry = this.#entries.get(layer.digest);
    this.counters[entry ? 'hits' : 'misses']++;
    if (!entry) {
      entry = { layer, dir: this.#dirFor(layer), refs: 0, lastUsedMs: Date.now() };
      entry.mounting = this.#mount(entry);
      this.#entries.set(layer.digest, entry);
    }
    entry.refs++;
    entry.lastUsedMs = Date.now();
    try {
      await entry.mounting;
    } catch (err) {
      entry.refs--;
      if (this.#entries.get(layer.digest) === entry) this.#entries.delete(layer.digest);
      throw err;
    }
    return entry.dir;
  }

  release(digest: string): void {
    const entry = this.#entries.get(digest);
    if (entry && entry.refs > 0) {
      entry.refs--;
      entry.lastUsedMs = Date.now();
    }
  }

  /** Unmounts unused layers, least recently used first, until the mounted total fits the budget. */
  async trim(budgetBytes = this.budgetBytes): Promise<void> {
    const settled = [...this.#entries.values()].filter((e) => !e.mounting);
    let total = settled.reduce((sum, e) => sum + e.layer.sizeBytes, 0);
    const idle = settled.filter((e) => e.refs === 0).sort((a, b) => a.lastUsedMs - b.lastUsedMs);
    for (const entry of idle) {
      if (total <= budgetBytes) break;
      this.#entries.delete(entry.layer.digest);
      await this.mounter.unmount([entry.dir]);
      await rmdir(entry.dir).catch(() => undefined);
      if (entry.layer.blobDigest) await rm(this.#metaFile(entry.layer.digest), { force: true });
      total -= entry.layer.sizeBytes;
    }
  }

  /**
   * Unmounts every unused layer. The blob server stops too, unless a layer
   * still in use reads through it (its sandboxes keep running across an edge
   * restart, and so does the server).
   */
  async close(): Promise<void> {
    await this.trim(0);
    const remoteInUse = [...this.#entries.values()].some((e) => e.layer.blobDigest);
    if (this.remoteBlobs && !this.store.local && !remoteInUse) await this.remoteBlobs.stop();
  }

  stats(): { mounted: number; inUse: number; bytes: number } {
    const entries = [...this.#entries.values()];
    return {
      mounted: entries.length,
      inUse: entries.filter((e) => e.refs > 0).length,
      bytes: entries.reduce((sum, e) => sum + e.layer.sizeBytes, 0),
    };
  }

  #metaFile(digest: string): string {
    return join(this.dir, '.meta', digest.replace(/^sha256:/, ''));
  }

  /** A verified local copy of a split layer's metadata image (kept while mounted). */
  async #localMetadata(digest: string): Promise<string> {
    const file = this.#metaFile(digest);
    if (
      await stat(file).then(
        (s) => s.isFile(),
        () => false,
      )
    )
      return file;
    await mkdir(join(this.dir, '.meta'), { recursive: true, mode: PRIVATE_DIR_MODE });
    const tmp = `${file}.tmp-${process.pid}-${Math.random().toString(36).slice(2)}`;
    try {
      await copyFile(await this.store.blobPath(digest), tmp);
      const got = `sha256:${createHash('sha256')
        .update(await readFile(tmp))
        .digest('hex')}`;
      if (got !== digest) {
        throw new DsecError('internal', `metadata blob ${digest} reads back as ${got}`);
      }
      await rename(tmp, file);
    } finally {
      await rm(tmp, { force: true });
    }
    return file;
  }

  /** Where the kernel reads a split layer's data blob. */
  async #blobDevice(layer: LayerInfo): Promise<string> {
    const digest = layer.blobDigest!;
    if (this.store.local) return await this.store.blobPath(digest);
    return await this.remoteBlobs!.pathFor(digest, layer.blobChunksDigest);
  }

  #dirFor(layer: LayerInfo): string {
    return join(this.dir, layer.digest.replace(/^sha256:/, '').slice(0, 32));
  }

  async #mount(entry: Entry): Promise<void> {
    const { layer } = entry;
    await mkdir(entry.dir, { recursive: true, mode: PRIVATE_DIR_MODE });
    if ((await mountPoints()).has(entry.dir)) {
      entry.mounting = undefined;
      return;
    }
    // Split layer: metadata copied to local disk (small reads stay local), data
    // read from the store, only the blocks a sandbox touches (paper 5.3): in
    // place from a POSIX store, through the blob server's chunk cache from a
    // remote one.
    const image = layer.blobDigest
      ? await this.#localMetadata(layer.digest)
      : await this.store.blobPath(layer.digest);
    const blobDevice = layer.blobDigest ? await this.#blobDevice(layer) : undefined;
    await this.mounter.mountErofs(image, entry.dir, blobDevice ? { blobDevice } : {});
    entry.mounting = undefined;
    await this.trim();
  }
}
