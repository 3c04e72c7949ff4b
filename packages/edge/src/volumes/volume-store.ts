import { createHash } from 'node:crypto';
import {
  chmod,
  mkdir,
  readdir,
  readFile,
  rmdir,
  statfs,
  unlink,
  writeFile,
} from 'node:fs/promises';
import { dirname, join } from 'node:path';
import {
  checkVolumeName,
  checkVolumeSize,
  DsecError,
  type EdgeVolumeApi,
  type EdgeVolumeInfo,
  type VolumeMount,
} from '@dsec/core';
import { unmount } from '@dsec/native';
import { mountPoints } from '../layers/mountinfo.js';
import { runTool } from '../network/sys.js';
import type { EdgeLogFn } from '../observability/log.js';

/** The record of a made volume; written last by a create, removed first by a delete. */
const META = 'volume.json';
const IMAGE = 'volume.ext4';
const MOUNT = 'mnt';
/** A volume's directory: a digest of (project, name), never the tenant's name itself. */
const KEY_RE = /^[0-9a-f]{32}$/;
/** Bounds the metadata file a restart reads (the platform writes it; a few hundred bytes). */
const MAX_META_BYTES = 4096;
const MKFS_TIMEOUT_MS = 120_000;
/** Allocating a large image takes a while on some filesystems; bounded all the same. */
const FALLOCATE_TIMEOUT_MS = 120_000;
/**
 * Disk a create must leave free for the rest of the node (edge.db, layers,
 * upper images): 5% of the filesystem, at most 1 GiB.
 */
const RESERVE_FRACTION = 0.05;
const MAX_RESERVE_BYTES = 2 ** 30;

export interface VolumeStoreOptions {
  /** Where the images and their host-side mounts live (`<stateDir>/volumes`, local disk). */
  dir: string;
  /**
   * Live sandboxes of the node (creating, running, paused or stopping) that
   * name the volume: the edge's own records. A delete is refused while any do.
   */
  users: (projectId: string, name: string) => string[];
  log?: EdgeLogFn | undefined;
}

interface Entry {
  projectId: string;
  name: string;
  sizeMb: number;
  createdAt: string;
  state: 'creating' | 'ready' | 'deleting';
  dir: string;
}

/** Where the edge binds a volume from when it starts a sandbox (`BackendSandbox.volumes`). */
export interface VolumeSource {
  /** The volume's host-side mount root (platform-made path; nothing inside it is resolved). */
  source: string;
  /** The mount path inside the sandbox. */
  path: string;
}

/**
 * A node's volumes (docs/volumes.md). Each is a sparse ext4 image with a
 * journal, `sizeMb` big (bytes, and inodes at one per 16 KiB), attached to an
 * auto-clearing loop device and mounted `nosuid,nodev` once, host-side, at
 * `<dir>/<key>/mnt`, where `key` is a digest of (project, name). Sandboxes
 * get an idmapped clone of that mount (native `mount-rootfs --volume`), so
 * the bytes have one superblock however many sandboxes mount them, and
 * files keep their ids from one sandbox's id range to the next.
 *
 * The host never resolves a path inside a volume: it makes the image, mounts
 * it, `statfs`es its mount root, unmounts it and removes the image and the
 * empty mount point. What sandboxes wrote inside is never walked.
 *
 * State is in memory, rebuilt from the directories at `open` (a directory
 * without its record is an interrupted create or delete and is removed), so
 * the create/delete checks against the edge's sandbox records are
 * synchronous: a sandbox create that names a volume and a delete of it
 * never interleave.
 */
export class VolumeStore implements EdgeVolumeApi {
  readonly #options: VolumeStoreOptions;
  readonly #entries = new Map<string, Entry>();
  /**
   * Creates make their images one at a time: the free-space check and the
   * allocation are one step (two creates never both take the last room),
   * and a burst of creates runs one mkfs at a time, not one per request.
   */
  #making: Promise<unknown> = Promise.resolve();

  private constructor(options: VolumeStoreOptions) {
    this.#options = options;
  }

  /** Opens the store: finishes interrupted creates and deletes, mounts what is not mounted. */
  static async open(options: VolumeStoreOptions): Promise<VolumeStore> {
    const store = new VolumeStore(options);
    await mkdir(options.dir, { recursive: true, mode: 0o700 });
    await chmod(options.dir, 0o700);
    const mounted = await mountPoints();
    for (const key of await readdir(options.dir)) {
      const dir = join(options.dir, key);
      if (!KEY_RE.test(key)) continue;
      const meta = await readMeta(dir);
      if (!meta || volumeKey(meta.projectId, meta.name) !== key) {
        options.log?.('volume: removing an interrupted create or delete', { dir }, 'warn');
        await removeVolumeDir(dir, mounted.has(join(dir, MOUNT)));
        continue;
      }
      // One volume that no longer mounts (a damaged image) must not keep the
      // node, and every other tenant's sandboxes, from starting: it stays
      // listed, deletable, and refused at mount (`sources` tries again).
      if (!mounted.has(join(dir, MOUNT)))
        await mountImage(dir).catch((err: unknown) =>
          options.log?.('volume: mount at open failed', { dir, err: String(err) }, 'error'),
        );
      store.#entries.set(key, { ...meta, state: 'ready', dir });
    }
    return store;
  }

  async create(req: { projectId: string; name: string; sizeMb: number }): Promise<EdgeVolumeInfo> {
    const { projectId, name, sizeMb } = req;
    checkVolumeName(name);
    checkVolumeSize(sizeMb);
    const key = volumeKey(projectId, name);
    if (this.#entries.has(key))
      throw new DsecError('conflict', `volume ${name} exists`, { field: 'name' });
    const dir = join(this.#options.dir, key);
    const entry: Entry = {
      projectId,
      name,
      sizeMb,
      createdAt: new Date().toISOString(),
      state: 'creating',
      dir,
    };
    this.#entries.set(key, entry);
    let made = false;
    try {
      await mkdir(dir, { mode: 0o700 });
      made = true;
      await mkdir(join(dir, MOUNT), { mode: 0o700 });
      const making = this.#making.then(() => makeVolumeImage(join(dir, IMAGE), sizeMb));
      this.#making = making.catch(() => undefined);
      await making;
      await mountImage(dir);
      // The volume's root, made by mkfs and touched by nothing else yet: every
      // user of every sandbox may create files there (sticky: not remove
      // others'); a sandbox's root may change that for its own users.
      await chmod(join(dir, MOUNT), 0o1777);
      await writeFile(
        join(dir, META),
        JSON.stringify({ projectId, name, sizeMb, createdAt: entry.createdAt }),
        { mode: 0o600, flag: 'wx' },
      );
      entry.state = 'ready';
      this.#options.log?.('volume created', { projectId, name, sizeMb });
      return await this.#info(entry, await mountPoints());
    } catch (err) {
      this.#entries.delete(key);
      if (made) {
        const mounted = (await mountPoints()).has(join(dir, MOUNT));
        await removeVolumeDir(dir, mounted).catch((e: unknown) =>
          this.#options.log?.('volume: cleanup after a failed create failed', {
            dir,
            err: String(e),
          }),
        );
      }
      if (err instanceof DsecError) throw err;
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOSPC' || /No space left on device/.test(String(err)))
        throw new DsecError('capacity_exhausted', `no disk on edge for volume ${name}`, {
          cause: err,
        });
      throw new DsecError('internal', `volume ${name}: ${String(err)}`, { cause: err });
    }
  }

  async get(projectId: string, name: string): Promise<EdgeVolumeInfo> {
    const entry = this.#ready(projectId, name);
    return this.#info(entry, await mountPoints());
  }

  async list(projectId: string | undefined): Promise<EdgeVolumeInfo[]> {
    const entries = [...this.#entries.values()].filter(
      (e) => e.state === 'ready' && (projectId === undefined || e.projectId === projectId),
    );
    const mounted = await mountPoints();
    return Promise.all(entries.map((e) => this.#info(e, mounted)));
  }

  async delete(projectId: string, name: string): Promise<void> {
    // From here to `deleting` nothing awaits: the in-use check and the mark are one step.
    const entry = this.#ready(projectId, name);
    const users = this.#options.users(projectId, name);
    if (users.length > 0) {
      throw new DsecError('volume_in_use', `volume ${name} is mounted by ${users.join(', ')}`, {
        details: { sandboxes: users },
      });
    }
    entry.state = 'deleting';
    try {
      // The record goes first: a crash from here on leaves a directory that
      // the next `open` recognises as an interrupted delete and removes.
      // Tolerant of an earlier delete that failed after its unmount: a retry finishes it.
      await unlink(join(entry.dir, META)).catch(ignoreMissing);
      const mounted = (await mountPoints()).has(join(entry.dir, MOUNT));
      await removeVolumeDir(entry.dir, mounted);
    } catch (err) {
      // Still mounted (the unmount is what fails): the volume stays, its record written back.
      await writeFile(
        join(entry.dir, META),
        JSON.stringify({ projectId, name, sizeMb: entry.sizeMb, createdAt: entry.createdAt }),
        { mode: 0o600 },
      ).catch(() => undefined);
      entry.state = 'ready';
      throw new DsecError('internal', `delete volume ${name}: ${String(err)}`, { cause: err });
    }
    this.#entries.delete(volumeKey(projectId, name));
    this.#options.log?.('volume deleted', { projectId, name });
  }

  /**
   * Unmounts the host-side mounts of volumes no live sandbox uses (the next
   * `open` mounts them again). A used volume stays mounted: its sandboxes
   * keep running past the edge process.
   */
  async close(): Promise<void> {
    const mounted = await mountPoints();
    for (const e of this.#entries.values()) {
      const mnt = join(e.dir, MOUNT);
      if (e.state !== 'ready' || !mounted.has(mnt)) continue;
      if (this.#options.users(e.projectId, e.name).length > 0) continue;
      await unmount([mnt]).catch((err: unknown) =>
        this.#options.log?.('volume: unmount at close failed', { dir: e.dir, err: String(err) }),
      );
    }
  }

  /**
   * Synchronous check for a sandbox create: every named volume exists in the
   * project and is ready (`volume_not_found` otherwise, field `volumes.N.name`).
   */
  check(projectId: string, mounts: readonly VolumeMount[]): void {
    mounts.forEach((m, i) => this.#ready(projectId, m.name, `volumes.${i}.name`));
  }

  /**
   * Where to bind each volume from, for a sandbox that passed `check`: the
   * host-side mount, remounted first if something took it away (a sandbox
   * must never get the empty directory under it).
   */
  async sources(projectId: string, mounts: readonly VolumeMount[]): Promise<VolumeSource[]> {
    if (mounts.length === 0) return [];
    const mounted = await mountPoints();
    const out: VolumeSource[] = [];
    for (const [i, m] of mounts.entries()) {
      const entry = this.#ready(projectId, m.name, `volumes.${i}.name`);
      const source = join(entry.dir, MOUNT);
      if (!mounted.has(source)) await mountImage(entry.dir);
      out.push({ source, path: m.path });
    }
    return out;
  }

  #ready(projectId: string, name: string, field = 'name'): Entry {
    const entry = this.#entries.get(volumeKey(projectId, name));
    if (!entry || entry.projectId !== projectId || entry.name !== name || entry.state !== 'ready')
      throw new DsecError('volume_not_found', `no volume ${name}`, { field });
    return entry;
  }

  async #info(e: Entry, mounted: ReadonlySet<string>): Promise<EdgeVolumeInfo> {
    // statfs of the mount root: the platform's own path, nothing inside the volume.
    // Only while mounted: an empty mount point would report the node's own disk.
    const mnt = join(e.dir, MOUNT);
    const fs = mounted.has(mnt) ? await statfs(mnt).catch(() => undefined) : undefined;
    return {
      projectId: e.projectId,
      name: e.name,
      sizeMb: e.sizeMb,
      createdAt: e.createdAt,
      usedBytes: fs ? (fs.blocks - fs.bfree) * fs.bsize : 0,
      mountedBy: this.#options.users(e.projectId, e.name),
    };
  }
}

/** The directory name of (project, name): fixed length, no character of the tenant's. */
export function volumeKey(projectId: string, name: string): string {
  return createHash('sha256').update(`${projectId}\0${name}`).digest('hex').slice(0, 32);
}

/**
 * An ext4 image with a journal (a volume outlives sandboxes and edge
 * crashes), no reserved blocks, one inode per 16 KiB, its root owned by
 * disk id 0 (each sandbox's root through the idmap). Its blocks are
 * allocated up front (never a sparse file): a tenant that fills its volume
 * uses what it was given, never the disk the node and other tenants share
 * (a sparse image let volumes promise more than the disk holds, and the
 * writes that found it full failed in every tenant's volume at once).
 * `capacity_exhausted` when the disk has no room for it beside the reserve.
 */
async function makeVolumeImage(image: string, sizeMb: number): Promise<void> {
  const bytes = sizeMb * 2 ** 20;
  const fs = await statfs(dirname(image));
  const reserve = Math.min(MAX_RESERVE_BYTES, fs.blocks * fs.bsize * RESERVE_FRACTION);
  if (fs.bavail * fs.bsize - bytes < reserve)
    throw new DsecError(
      'capacity_exhausted',
      `no room on the edge's disk for a ${sizeMb} MiB volume (${Math.floor(
        (fs.bavail * fs.bsize) / 2 ** 20,
      )} MiB free)`,
    );
  await writeFile(image, '', { mode: 0o600, flag: 'wx' });
  await runTool('fallocate', ['-l', String(bytes), image], { timeoutMs: FALLOCATE_TIMEOUT_MS });
  await runTool(
    'mkfs.ext4',
    [
      '-q',
      '-F',
      '-m',
      '0',
      '-i',
      '16384',
      '-E',
      'lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0',
      image,
    ],
    { timeoutMs: MKFS_TIMEOUT_MS },
  );
}

/**
 * Mounts `dir/volume.ext4` on `dir/mnt` through an auto-clearing loop device
 * (util-linux sets `LO_FLAGS_AUTOCLEAR` for `-o loop`): the device goes when
 * the last mount of it does. Where a loop device already serves the image
 * (sandboxes still hold clones of an earlier mount) util-linux reuses it
 * rather than binding a second one, so the volume keeps one superblock: two
 * would be two ext4 writers on one file. `nosuid,nodev` carry into every
 * sandbox's clone.
 */
async function mountImage(dir: string): Promise<void> {
  await runTool('mount', [
    '-t',
    'ext4',
    '-o',
    'loop,nosuid,nodev,noatime',
    join(dir, IMAGE),
    join(dir, MOUNT),
  ]);
}

/**
 * Unmounts (never a lazy detach: a failure stops here, before anything is
 * removed) and removes the image, the then-empty mount point and the
 * directory. Nothing is walked: `rmdir` of a mount point that still holds a
 * volume fails instead of deleting what a sandbox wrote.
 */
async function removeVolumeDir(dir: string, mounted: boolean): Promise<void> {
  if (mounted) await unmount([join(dir, MOUNT)]);
  await unlink(join(dir, IMAGE)).catch(ignoreMissing);
  await unlink(join(dir, META)).catch(ignoreMissing);
  await rmdir(join(dir, MOUNT)).catch(ignoreMissing);
  await rmdir(dir);
}

function ignoreMissing(err: unknown): void {
  if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
}

async function readMeta(
  dir: string,
): Promise<{ projectId: string; name: string; sizeMb: number; createdAt: string } | undefined> {
  try {
    const text = await readFile(join(dir, META), 'utf8');
    if (text.length > MAX_META_BYTES) return undefined;
    const v = JSON.parse(text) as Record<string, unknown>;
    if (
      typeof v.projectId === 'string' &&
      typeof v.name === 'string' &&
      typeof v.sizeMb === 'number' &&
      typeof v.createdAt === 'string'
    )
      return { projectId: v.projectId, name: v.name, sizeMb: v.sizeMb, createdAt: v.createdAt };
  } catch {
    // Missing or unreadable: an interrupted create or delete.
  }
  return undefined;
}
