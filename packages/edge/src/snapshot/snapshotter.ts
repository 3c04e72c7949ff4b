import { randomBytes } from 'node:crypto';
import { mkdirSync, readdirSync, readFileSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { mkdir, readdir, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import {
  DsecError,
  formatLayerKey,
  formatLayerRef,
  isDsecError,
  parseLayerKey,
  parseLayerRef,
  resolveLayer,
  toDsecError,
  type EdgeSnapshotRequest,
  type ImageStore,
  type LayerInfo,
  type LayerView,
  type SandboxState,
  type SnapshotInfo,
} from '@dsec/core';
import {
  copyUpperDir,
  packUpperDir,
  parseScrubPatterns,
  patternsShadowingLowers,
  scanUpper,
  scrubCopy,
  shiftErofsIds,
  type ConfinedRun,
  type ScrubPattern,
  type UpperScan,
  type UpperSource,
} from '@dsec/images';
import { removeTree, removeTreeSync } from '@dsec/native';
import { BackendSet } from '../backends/backend-set.js';
import { ContainerBackend } from '../backends/container/container-backend.js';
import type { CgroupDriver } from '../cgroups/cgroup-driver.js';
import { makeLimitedCgroup } from '../cgroups/limited-cgroup.js';
import type { LayerMountCache } from '../layers/layer-cache.js';
import type { SandboxRecord } from '../state/edge-store.js';
import { ensureDir, PRIVATE_DIR_MODE } from '../state/host-state.js';
import { Freezer } from './freezer.js';

/** Where a sandbox's writable layer and freezer are (the container backend's layout). */
export interface SnapshotSource {
  /** The overlay upper directory, as the host sees it. */
  upperDir: string;
  /**
   * With a disk quota the upper directory lives on an ext4 image mounted only
   * in the sandbox's own mount namespace; `upperDir` is then its path inside
   * that filesystem (`upper`), reached by mounting the image's loop device
   * again in a private namespace of our own.
   */
  upperImage?: string | undefined;
  cgroupDirs: string[];
  /** Where the packing's own cgroup goes: the node's driver and the sandboxes' parent. */
  packCgroup: { cgroups: CgroupDriver; parent: string };
}

/**
 * Bounds on one snapshot (SECURITY.md H35): what a sandbox can make the
 * node spend packing its tree. Every default can be changed by the operator.
 */
export interface SnapshotLimits {
  /** Entries in the writable layer (default 250 000: mkfs.erofs 1.5 holds ~4.7 KiB per inode). */
  maxFiles?: number | undefined;
  /**
   * Apparent bytes of its files, holes included (default 16 GiB); a sandbox
   * with a disk quota is held to its quota as well.
   */
  maxBytes?: number | undefined;
  /** Memory of the packing's cgroup, without swap (default 2 GiB: `maxFiles` inodes and slack). */
  memoryBytes?: number | undefined;
  /** The whole snapshot, freeze included (default 10 min). */
  timeoutMs?: number | undefined;
}

export const DEFAULT_SNAPSHOT_LIMITS = {
  maxFiles: 250_000,
  maxBytes: 16 * 2 ** 30,
  memoryBytes: 2 * 2 ** 30,
  timeoutMs: 600_000,
} as const satisfies Required<SnapshotLimits>;

/** Longest path mkfs.erofs takes: PATH_MAX with room for the `/src` prefix it sees in the confined root. */
const MAX_PATH_BYTES = 4000;
/** Deepest directory level packed (mkfs.erofs recurses once per level). */
const MAX_DEPTH = 1024;
/** Holes beyond this make the layer chunk-based, so they stay holes (upper-pack.ts). */
const SPARSE_THRESHOLD_BYTES = 4 * 2 ** 20;
/** Processes of one packing step (cp, mkfs.erofs and the helper: a handful). */
const PACK_PIDS_MAX = 64;

export interface SnapshotterOptions {
  /** Scratch space and crash markers: `<stateDir>/snapshots`. */
  dir: string;
  store: ImageStore;
  layers: LayerMountCache;
  limits?: SnapshotLimits | undefined;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/** What a crash marker records: enough to thaw the sandbox after a restart. */
interface Marker {
  sandboxId: string;
  cgroupDirs: string[];
  froze: boolean;
}

/**
 * pack_diff (paper 6.1): captures a sandbox's writable layer as an immutable
 * EROFS layer of kind `snapshot` whose `parents` are the sandbox's whole stack,
 * pinned by digest, so the snapshot's name is an image `create` accepts.
 *
 * The freeze covers only the capture. Measured on this node's ext4 for a
 * 200 MiB upper directory: `cp -a` 0.12 s, `mkfs.erofs` (uncompressed) 0.44 s,
 * lz4hc 75 s. Copying first would halve the freeze but write every byte twice
 * (and forks are judged on bytes written), so the layer is built straight
 * from the upper directory while frozen, leaving scrubbed paths out with
 * `mkfs.erofs --exclude-*`. Only when a scrubbed path also exists in a lower
 * layer (it needs a whiteout the upper directory does not have) is the upper
 * copied while frozen (`cp -a --reflink=auto`) and scrubbed in the copy.
 * Either way the running sandbox is never written to.
 *
 * The writable layer is the sandbox's: every step that reads, copies,
 * scrubs, packs or deletes it (or a copy, or a lower layer, which may be an
 * earlier snapshot) runs confined to the trees it needs (`@dsec/native`
 * confine), in a cgroup of its own with memory, CPU and pids limits and
 * under one deadline (`SnapshotLimits`). A scan before the freeze refuses a
 * tree past the file, byte (holes included: the disk quota or the operator's
 * cap), path-length or depth caps with `resource_exhausted` (`details.limit`
 * `snapshot_files`, `snapshot_bytes`, `snapshot_path`, `snapshot_depth`);
 * the packing's own limits catch a tree that grew after it (the image is
 * capped by RLIMIT_FSIZE, the counts are checked again in the image), and
 * running out of memory is `snapshot_memory`, of time `deadline_exceeded`.
 * A tree with holes is packed chunk-based so they stay holes. The layer made
 * is sanitized (`shiftErofsIds` with `sanitize`: no device node but
 * whiteouts, no set-id bit, no file capability).
 *
 * Crash safety: a marker is written before the freeze and removed after the
 * thaw, so an edge killed in between thaws the sandbox at its next start
 * (`recover`); the layer is built under scratch space and becomes visible
 * only through the store's atomic `putBlob` (rename) and `putLayer` (link).
 */
export class Snapshotter {
  readonly #locks = new Map<string, Promise<unknown>>();

  constructor(readonly options: SnapshotterOptions) {}

  /**
   * Thaws sandboxes a killed edge left frozen mid-snapshot (unless they are
   * paused now: then the pause owns the freezer) and removes scratch space.
   */
  recover(stateOf: (sandboxId: string) => SandboxState | undefined): void {
    ensureDir(this.options.dir, PRIVATE_DIR_MODE);
    for (const name of readdirSync(this.options.dir)) {
      const path = join(this.options.dir, name);
      if (name.endsWith('.marker')) {
        try {
          const marker = JSON.parse(readFileSync(path, 'utf8')) as Marker;
          if (marker.froze && stateOf(marker.sandboxId) !== 'paused') {
            const freezer = new Freezer(marker.cgroupDirs);
            if (freezer.available) freezer.thaw();
            this.options.log?.('thawed a sandbox left frozen by a snapshot', {
              id: marker.sandboxId,
            });
          }
        } catch (err) {
          this.options.log?.('snapshot marker unreadable', { path, err: String(err) });
        }
      }
      if (name.endsWith('.marker')) {
        rmSync(path, { force: true });
        continue;
      }
      // A packing cut short: its cgroup (killing what is left in it), then its scratch
      // space, which holds what a sandbox made: removed without following anything in it.
      try {
        const dirs = JSON.parse(readFileSync(join(path, 'cgroup'), 'utf8')) as string[];
        for (const dir of dirs) killCgroupDir(dir);
      } catch {
        // no packing cgroup recorded
      }
      try {
        removeTreeSync(path);
      } catch (err) {
        this.options.log?.('snapshot scratch not removed', { path, err: String(err) });
      }
    }
  }

  /** One snapshot per sandbox at a time; others queue behind it. */
  async snapshot(
    rec: SandboxRecord,
    source: SnapshotSource,
    req: EdgeSnapshotRequest,
    stateOf: () => SandboxState | undefined,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    const prior = this.#locks.get(rec.id) ?? Promise.resolve();
    const mine = prior
      .catch(() => undefined)
      .then(() => this.#snapshot(rec, source, req, stateOf, signal));
    const tail = mine.catch(() => undefined);
    this.#locks.set(rec.id, tail);
    try {
      return await mine;
    } finally {
      if (this.#locks.get(rec.id) === tail) this.#locks.delete(rec.id);
    }
  }

  async #snapshot(
    rec: SandboxRecord,
    source: SnapshotSource,
    req: EdgeSnapshotRequest,
    stateOf: () => SandboxState | undefined,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    const started = performance.now();
    const ref = typeof req.name === 'string' ? parseLayerRef(req.name) : undefined;
    if (!ref) {
      throw new DsecError('invalid_argument', 'name must be `name` or `name:version`', {
        field: 'name',
      });
    }
    const scrubList = req.scrub ?? [];
    if (!Array.isArray(scrubList) || scrubList.some((s) => typeof s !== 'string')) {
      throw new DsecError('invalid_argument', 'scrub must be an array of paths', {
        field: 'scrub',
      });
    }
    const patterns = parseScrubPatterns(scrubList);
    const image = formatLayerRef(ref);
    const { store } = this.options;
    const state = stateOf();
    if (state !== 'running' && state !== 'paused') {
      throw new DsecError('sandbox_not_running', `sandbox ${rec.id} is ${state ?? 'gone'}`, {
        details: { state },
      });
    }
    // The layer is the sandbox's project's. Its name is taken when the project already sees
    // one (the platform's, an ancestor's: it would shadow the snapshot) or holds one itself;
    // a name only another tenant holds is free (no refusal tells of it).
    const owner = rec.projectId;
    const taken = await resolveLayer(store, image, [...(req.layerView ?? []), owner]).then(
      () => true,
      (err: unknown) => {
        if (isDsecError(err, 'image_not_found')) return false;
        throw toDsecError(err);
      },
    );
    if (taken) throw new DsecError('conflict', `image ${image} already exists`, { field: 'name' });

    const uidMap = await hostIdRange(rec);
    const limits = { ...DEFAULT_SNAPSHOT_LIMITS, ...definedOnly(this.options.limits ?? {}) };
    const quotaBytes =
      rec.spec.diskLimitMb !== undefined ? rec.spec.diskLimitMb * 2 ** 20 : undefined;
    const maxBytes = Math.min(limits.maxBytes, quotaBytes ?? Infinity);
    const deadline = Date.now() + limits.timeoutMs;
    ensureDir(this.options.dir, PRIVATE_DIR_MODE);
    const work = join(this.options.dir, `work-${rec.id}-${Date.now().toString(36)}`);
    const marker = join(this.options.dir, `${rec.id}.marker`);
    await mkdir(work, { mode: PRIVATE_DIR_MODE });
    // The packing's own cgroup, under the sandboxes' parent: the sandbox's CPU share
    // (it is frozen meanwhile), a memory cap, few processes.
    const { cgroups, parent } = source.packCgroup;
    const packPath = `/${parent}/pack-${randomBytes(6).toString('hex')}`;
    let packCreated = false;
    const run = (): ConfinedRun => {
      const left = deadline - Date.now();
      if (left <= 0) throw snapshotTimeout(limits.timeoutMs);
      return {
        rootDir: join(work, 'root'),
        cgroupDirs: cgroups.dirs(packPath),
        timeoutMs: left,
        signal,
      };
    };
    // What went wrong in a confined step, in the terms of the limits it ran under.
    const step = async <T>(work: () => Promise<T>): Promise<T> => {
      try {
        return await work();
      } catch (err) {
        throw await packFailure(err, { cgroups, packPath, maxBytes, limits });
      }
    };
    try {
      mkdirSync(join(work, 'root'), { mode: PRIVATE_DIR_MODE });
      writeFileSync(join(work, 'cgroup'), JSON.stringify(cgroups.dirs(packPath)));
      await makeLimitedCgroup(cgroups, packPath, {
        memoryBytes: limits.memoryBytes,
        cpuCores: rec.spec.cpuCoresLimit > 0 ? rec.spec.cpuCoresLimit : 1,
        pidsMax: PACK_PIDS_MAX,
      });
      packCreated = true;
      const inNs = source.upperImage !== undefined;
      const upper: UpperSource = inNs
        ? { device: await loopDeviceOf(source.upperImage!), subdir: 'upper' }
        : { dir: source.upperDir };

      // The live tree, counted against the caps before anything is frozen or copied.
      const scan = await step(async () =>
        scanUpper(
          upper,
          {
            maxFiles: limits.maxFiles,
            maxBytes,
            maxPathBytes: MAX_PATH_BYTES,
            maxDepth: MAX_DEPTH,
          },
          run(),
        ),
      );
      if ('over' in scan)
        throw overCap(scan.over, scan.scan, { maxFiles: limits.maxFiles, maxBytes });
      const chunked = scan.holeBytes > SPARSE_THRESHOLD_BYTES;
      // Metadata beside the data: inodes, directories, xattrs, chunk indexes.
      const maxImageBytes = maxBytes + limits.maxFiles * 512 + 64 * 2 ** 20;

      // Lower layers are immutable: which scrubbed paths they show is known before the freeze.
      const lowerDirs = patterns.length ? await this.#lowerDirs(rec.layers) : undefined;
      let shadowing: ScrubPattern[] = [];
      try {
        if (lowerDirs)
          shadowing = await step(() =>
            patternsShadowingLowers(patterns, [...lowerDirs].reverse(), run()),
          );
      } finally {
        if (lowerDirs) for (const l of rec.layers) this.options.layers.release(l.digest);
      }
      const output = join(work, 'out', 'layer.erofs');
      mkdirSync(join(work, 'out'), { mode: PRIVATE_DIR_MODE });
      const staging = join(work, 'copy');

      // Paused: the pause holds the freezer already, and keeps holding it.
      const freeze = state === 'running';
      const freezer = new Freezer(source.cgroupDirs);
      writeFileSync(
        marker,
        JSON.stringify({ sandboxId: rec.id, cgroupDirs: source.cgroupDirs, froze: freeze }),
      );
      let freezeMs = 0;
      if (freeze) await freezer.freeze();
      const frozenAt = performance.now();
      try {
        if (shadowing.length) {
          mkdirSync(staging, { mode: PRIVATE_DIR_MODE });
          await step(() => copyUpperDir(upper, staging, { ...run(), maxFileBytes: maxBytes }));
        } else {
          await step(() =>
            packUpperDir(
              { source: upper, output, exclude: patterns, chunked, maxImageBytes },
              run(),
            ),
          );
        }
      } finally {
        // A pause that came in meanwhile owns the freezer now.
        if (freeze && stateOf() !== 'paused') freezer.thaw();
        freezeMs = freeze ? performance.now() - frozenAt : 0;
        rmSync(marker, { force: true });
      }
      if (shadowing.length) {
        const dirs = await this.#lowerDirs(rec.layers);
        try {
          await step(() =>
            scrubCopy(
              staging,
              patterns,
              { lowerDirs: [...dirs].reverse(), hostId: uidMap.hostId },
              run(),
            ),
          );
        } finally {
          for (const l of rec.layers) this.options.layers.release(l.digest);
        }
        await step(() =>
          packUpperDir({ source: { dir: staging }, output, chunked, maxImageBytes }, run()),
        );
        await removeTree(staging);
      }
      // Owners shifted to the sandbox's ids; what could grant a privilege taken out (H36).
      const stats = await shiftErofsIds(output, { ...uidMap, sanitize: true, signal });
      // The exact counts, of what was packed: the tree may have grown after the scan.
      const packed: UpperScan = {
        files: stats.fileCount,
        bytes: stats.contentBytes,
        holeBytes: 0,
        depth: 0,
      };
      if (stats.fileCount > limits.maxFiles)
        throw overCap('files', packed, { maxFiles: limits.maxFiles, maxBytes });
      if (stats.contentBytes > maxBytes)
        throw overCap('bytes', packed, { maxFiles: limits.maxFiles, maxBytes });
      if (Object.values(stats.neutralized).some((n) => n > 0))
        this.options.log?.('snapshot layer sanitized', { id: rec.id, ...stats.neutralized });
      // What the project's image quota reserved for it; nothing is stored past it.
      const bytes = (await stat(output)).size;
      if (req.maxBytes !== undefined && bytes > req.maxBytes) {
        throw new DsecError(
          'quota_exceeded',
          `snapshot ${image} is ${bytes} bytes, more than the ${req.maxBytes} its project's imageBytes quota has room for`,
          { details: { resource: 'imageBytes', limit: req.maxBytes, requested: bytes } },
        );
      }
      const put = await store.putBlob(output, { move: true, ...(signal ? { signal } : {}) });
      const layer: LayerInfo = {
        name: ref.name,
        version: ref.version,
        kind: 'snapshot',
        digest: put.digest,
        sizeBytes: put.sizeBytes,
        contentBytes: stats.contentBytes,
        fileCount: stats.fileCount,
        createdAt: new Date().toISOString(),
        source: 'snapshot',
        project: owner,
        parents: rec.layers.map(formatLayerKey),
        parentDigests: rec.layers.map((l) => l.digest),
        scrub: [...scrubList],
      };
      await store.putLayer(layer).catch(async (err: unknown) => {
        // Refused (most often a same-named snapshot stored first, past the check above): the
        // blob is no layer's and no quota's. Left, each lost race would keep up to a disk limit
        // of the shared store for good. deleteBlob leaves it if a record uses it after all.
        await store.deleteBlob(put.digest).catch(() => undefined);
        throw err;
      });
      return {
        image,
        layer: await store.getLayer(image, { project: owner }),
        parents: layer.parents!,
        scrub: [...scrubList],
        freezeMs: round(freezeMs),
        totalMs: round(performance.now() - started),
      };
    } finally {
      rmSync(marker, { force: true });
      if (packCreated) await cgroups.remove(packPath).catch(() => undefined);
      // A failure here must not hide the snapshot's own outcome; the next start retries it.
      await removeTree(work).catch((err: unknown) =>
        this.options.log?.('snapshot scratch not removed', { path: work, err: String(err) }),
      );
    }
  }

  /** Mounted roots of the layers, bottom first (acquired: release each after). */
  async #lowerDirs(layers: LayerInfo[]): Promise<string[]> {
    const dirs: string[] = [];
    try {
      for (const l of layers) dirs.push(await this.options.layers.acquire(l));
    } catch (err) {
      for (const l of layers.slice(0, dirs.length)) this.options.layers.release(l.digest);
      throw err;
    }
    return dirs;
  }
}

function round(ms: number): number {
  return Math.round(ms * 100) / 100;
}

/**
 * The sandbox's host id range, from its init's uid map (`0 <hostId> <count>`):
 * the owners the writable layer holds, shifted back to the sandbox's own ids.
 */
async function hostIdRange(rec: SandboxRecord): Promise<{ hostId: number; count: number }> {
  const text = await readFile(`/proc/${rec.initPid}/uid_map`, 'utf8').catch(() => '');
  const m = /^\s*0\s+(\d+)\s+(\d+)/m.exec(text);
  if (!m || rec.initPid === undefined) {
    throw new DsecError('sandbox_not_running', `sandbox ${rec.id} has no running init`);
  }
  return { hostId: Number(m[1]), count: Number(m[2]) };
}

/**
 * The loop device serving a sandbox's disk-quota image (mounted in the
 * sandbox's namespace). Confined steps mount that same device, which shares
 * its superblock, so they see exactly what the sandbox wrote (a second loop
 * device would be a second, inconsistent view of a mounted ext4).
 */
async function loopDeviceOf(image: string): Promise<string> {
  for (const name of await readdir('/sys/block')) {
    if (!name.startsWith('loop')) continue;
    const backing = await readFile(`/sys/block/${name}/loop/backing_file`, 'utf8').catch(() => '');
    if (backing.trim() === image) return `/dev/${name}`;
  }
  throw new DsecError('sandbox_not_running', `no loop device serves ${image}`);
}

/** Kills what a packing cgroup left and removes it (recovery: its driver call is async). */
function killCgroupDir(dir: string): void {
  for (let attempt = 0; attempt < 100; attempt++) {
    let procs: string;
    try {
      procs = readFileSync(join(dir, 'cgroup.procs'), 'utf8');
    } catch {
      return; // gone
    }
    for (const pid of procs.split('\n').filter(Boolean)) {
      try {
        process.kill(Number(pid), 'SIGKILL');
      } catch {
        // exiting
      }
    }
    try {
      rmdirSync(dir);
      return;
    } catch {
      // still draining
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10);
    }
  }
}

function definedOnly<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}

function snapshotTimeout(timeoutMs: number): DsecError {
  return new DsecError('deadline_exceeded', `the snapshot ran past its ${timeoutMs} ms limit`, {
    details: { limit: 'snapshot_time', timeoutMs },
  });
}

/** A refusal for a tree past one of the caps (`details.limit` names it). */
function overCap(
  over: 'files' | 'bytes' | 'path' | 'depth',
  scan: UpperScan,
  caps: { maxFiles: number; maxBytes: number },
): DsecError {
  switch (over) {
    case 'files':
      return new DsecError(
        'resource_exhausted',
        `the writable layer holds more than ${caps.maxFiles} entries, the most a snapshot takes`,
        { details: { limit: 'snapshot_files', max: caps.maxFiles } },
      );
    case 'bytes':
      return new DsecError(
        'resource_exhausted',
        `the writable layer's files add up to more than ${caps.maxBytes} bytes (holes included), the most a snapshot of this sandbox takes`,
        { details: { limit: 'snapshot_bytes', maxBytes: caps.maxBytes } },
      );
    case 'path':
      return new DsecError(
        'resource_exhausted',
        `the writable layer has a path longer than ${MAX_PATH_BYTES} bytes`,
        { details: { limit: 'snapshot_path', maxPathBytes: MAX_PATH_BYTES } },
      );
    case 'depth':
      return new DsecError(
        'resource_exhausted',
        `the writable layer nests directories deeper than ${MAX_DEPTH} levels (${scan.depth} seen)`,
        { details: { limit: 'snapshot_depth', max: MAX_DEPTH } },
      );
  }
}

/** A failed confined step, told by the limit it hit: time, the image size cap, memory. */
async function packFailure(
  err: unknown,
  ctx: {
    cgroups: CgroupDriver;
    packPath: string;
    maxBytes: number;
    limits: { memoryBytes: number; timeoutMs: number };
  },
): Promise<unknown> {
  if (isDsecError(err, 'deadline_exceeded')) return snapshotTimeout(ctx.limits.timeoutMs);
  if (!isDsecError(err, 'internal')) return err;
  if (err.details?.['signal'] === 'SIGXFSZ') {
    return new DsecError(
      'resource_exhausted',
      `the snapshot grew past ${ctx.maxBytes} bytes while it was packed`,
      { details: { limit: 'snapshot_bytes', maxBytes: ctx.maxBytes }, cause: err },
    );
  }
  if ((await ctx.cgroups.oomKills(ctx.packPath).catch(() => 0)) > 0) {
    return new DsecError(
      'resource_exhausted',
      `packing the writable layer needed more than its ${ctx.limits.memoryBytes} bytes of memory`,
      { details: { limit: 'snapshot_memory', maxBytes: ctx.limits.memoryBytes }, cause: err },
    );
  }
  return err;
}

/** The snapshot source of a container sandbox; `unavailable` for backends without one. */
export function containerSnapshotSource(backend: unknown, rec: SandboxRecord): SnapshotSource {
  if (backend instanceof BackendSet) backend = backend.for(rec);
  if (!(backend instanceof ContainerBackend)) {
    throw new DsecError('unavailable', 'this edge cannot snapshot its sandboxes');
  }
  const p = backend.paths(rec);
  const quota = rec.spec.diskLimitMb !== undefined;
  return {
    upperDir: quota ? p.quotaUpper : p.upper,
    ...(quota ? { upperImage: p.upperImage } : {}),
    cgroupDirs: backend.options.cgroups.dirs(p.cgroupsPath),
    packCgroup: { cgroups: backend.options.cgroups, parent: backend.options.cgroupParent },
  };
}

/**
 * The layers a snapshot image stands on, bottom first: its recorded parents,
 * each checked against the digest it had when the snapshot was taken (a
 * parent rebuilt under the same name since would put the captured changes on
 * a different tree). The list is already flat — a snapshot of a sandbox made
 * from a snapshot records that snapshot and everything under it — so there is
 * nothing to recurse into. Each parent is read from its owner's namespace,
 * which must be the platform's or one `view` sees (a record naming any other
 * is refused as if absent).
 */
export async function snapshotParents(
  store: ImageStore,
  snapshot: LayerInfo,
  view: LayerView,
): Promise<LayerInfo[]> {
  const refs = snapshot.parents ?? [];
  const digests = snapshot.parentDigests ?? [];
  const out: LayerInfo[] = [];
  for (const [i, ref] of refs.entries()) {
    const key = parseLayerKey(ref);
    const seen =
      key !== undefined &&
      (key.project === undefined || key.project === snapshot.project || view.includes(key.project));
    const found = seen
      ? store.getLayer(
          formatLayerRef(key),
          key.project === undefined ? {} : { project: key.project },
        )
      : Promise.reject(new DsecError('image_not_found', `no layer ${ref}`));
    const layer = await found.catch((err: unknown) => {
      throw new DsecError(
        'image_not_found',
        `layer ${ref} under snapshot ${formatLayerRef(snapshot)} is gone`,
        { field: 'image', cause: err },
      );
    });
    if (layer.digest !== digests[i]) {
      throw new DsecError(
        'image_not_found',
        `layer ${ref} under snapshot ${formatLayerRef(snapshot)} changed since the snapshot (${digests[i]} → ${layer.digest})`,
        { field: 'image' },
      );
    }
    out.push(layer);
  }
  if (out.length === 0 || out[0]!.kind !== 'base') {
    throw new DsecError('image_not_found', `snapshot ${formatLayerRef(snapshot)} has no base`, {
      field: 'image',
    });
  }
  return out;
}
