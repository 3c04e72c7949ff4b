import { randomBytes } from 'node:crypto';
import {
  DsecError,
  formatLayerKey,
  randomId,
  requireLifecycle,
  throwIfAborted,
  toDsecError,
} from '@dsec/core';
import type {
  CommandResult,
  CommandSpec,
  EdgeApi,
  ErrorCode,
  LayerView,
  RunCommandOptions,
  SandboxIdCodec,
  SandboxInfo,
  SandboxSpec,
  SandboxState,
  SnapshotInfo,
  SnapshotRequest,
} from '@dsec/core';
import {
  isScoped,
  mayRunImage,
  maySnapshot,
  requestFingerprint,
  SNAPSHOT_SCOPE,
  unrunnableImages,
} from '@dsec/iam';
import type { Iam, Principal } from '@dsec/iam';
import type { Placer } from '@dsec/placement';
import type { ApiMetrics } from './metrics.js';
import { requireVolumeScope } from './volume-service.js';

/** Finds the client for an edge ID; a Map or a lookup function. */
export type EdgeDirectory = Map<string, EdgeApi> | ((edgeId: string) => EdgeApi | undefined);

/** The part of the watcher's view the apiserver reads (structurally a `FleetView`). */
export interface FleetSource {
  view(): { edges: readonly { edgeId: string; healthy: boolean }[] };
}

export interface SandboxServiceDeps {
  iam: Iam;
  edges: EdgeDirectory;
  watcher: FleetSource;
  placer: Placer;
  ids: SandboxIdCodec;
  metrics: ApiMetrics;
  /** Called when a best-effort rollback or a list fan-out fails (never with secrets). */
  onWarning?: (message: string, context: Record<string, unknown>) => void;
  /** Removes a project's layer from the image store: a snapshot its quota cannot hold after all. */
  imagesRemove?: ((ref: string, project: string) => Promise<void>) | undefined;
  /** Volumes: where a sandbox that mounts some must run (docs/volumes.md). */
  volumes?: { pinnedEdge(projectId: string, spec: SandboxSpec): Promise<string | undefined> };
}

/** A sandbox the caller may operate on, and the edge that owns it. */
export interface OpenSandbox {
  edge: EdgeApi;
  info: SandboxInfo;
}

/** Edges tried for one create: the first choice plus retries after refusals. */
const MAX_PLACEMENT_ATTEMPTS = 3;

/** How long a listing waits for an edge the watcher marks down. */
const DOWN_EDGE_LIST_DEADLINE_MS = 1000;

/** Sandbox owners remembered per apiserver (about 100 bytes each). */
const OWNER_CACHE_ENTRIES = 100_000;

/**
 * What a snapshot of a sandbox with a disk limit reserves of its project's
 * `imageBytes` quota beyond that limit: room for the layer's own metadata
 * (inodes, directories, whiteouts; at most one inode per 16 KiB of the
 * limit). Without a disk limit a snapshot holds nothing up front: the edge
 * refuses a layer past the room left, and the charge checks it again.
 */
const SNAPSHOT_METADATA_BYTES = (diskLimitMb: number) => diskLimitMb * 1024 * 64 + 1024 * 1024;

/** Edge calls a whole-job operation keeps in flight at once. */
const JOB_CONCURRENCY = 16;

/** States a whole-job operation acts on: the sandbox still lives. */
const LIVE_STATES: ReadonlySet<SandboxState> = new Set(['creating', 'running', 'paused']);

/** What a whole-job operation does to each sandbox it selects. */
export type JobAction = 'pause' | 'resume' | 'stop' | 'extend';

/** The answer of a whole-job operation: one entry per selected sandbox, in one list or the other. */
export interface JobResult {
  sandboxes: { id: string; state: SandboxState }[];
  failed: { id: string; code: ErrorCode; message: string }[];
}

/** The answer of a fork: the new sandboxes, and the image they started from. */
export interface ForkResult {
  ids: string[];
  image: string;
}

/**
 * The sandbox domain of the apiserver: every route calls one method here.
 * Holds no durable state; quota and idempotency live in IAM, sandboxes on
 * their edges, and the edge of a sandbox is decoded from its ID.
 *
 * Create: project access → idempotency claim → quota reservation → placement
 * → mint ID → edge admission (retry on another edge after
 * `capacity_exhausted` / `unavailable`) → bind the reservation. Any failure
 * rolls back what earlier steps took (reservation, claim, half-made sandbox).
 *
 * Operate: decode ID (forged → `sandbox_not_found`) → load from its edge →
 * `canAccess`, where another tenant's sandbox is `sandbox_not_found` too, so
 * IDs cannot be probed for existence.
 *
 * Lifecycle (issue 11): pause, resume and TTL changes go to the sandbox's
 * edge, then move its quota reservation to the new deadline (so quota is
 * held exactly as long as the sandbox may live). Key scopes
 * (`@dsec/iam` scopes) gate snapshots and the images a create stacks.
 */
export class SandboxService {
  readonly #d: SandboxServiceDeps;
  /** Creates in flight per (project, requestId, fingerprint): concurrent duplicates share one. */
  readonly #creating = new Map<string, Promise<SandboxInfo>>();
  /**
   * Sandbox ID → project, learnt from the edge's answer once. A sandbox never
   * changes project and its ID is signed, so later calls authorise from here
   * and an exec is one edge call (which checks the project again itself).
   * The edge ID is kept once the ID was verified, so a warm call does not
   * recompute the ID's HMAC either.
   */
  readonly #owners = new Map<string, { projectId: string; edgeId?: string }>();

  constructor(deps: SandboxServiceDeps) {
    this.#d = deps;
  }

  async create(
    principal: Principal,
    input: { spec: SandboxSpec; projectId?: string | undefined; requestId?: string | undefined },
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    const projectId = input.projectId ?? principal.projectId;
    await this.#requireProject(principal, projectId);
    await this.#requireRunnable(principal, input.spec);
    const view = await this.#createView(principal, projectId);
    const { requestId } = input;
    if (requestId === undefined) {
      return this.#place(
        principal,
        projectId,
        input.spec,
        view,
        randomId('rsv'),
        undefined,
        signal,
      );
    }
    // Binds the requestId to this request: the same ID with another body is `conflict` (IAM).
    const fingerprint = requestFingerprint({ projectId, spec: input.spec });
    const key = `${projectId}\n${requestId}\n${fingerprint}`;
    const running = this.#creating.get(key);
    if (running) return running;
    const p = this.#createOnce(
      principal,
      projectId,
      input.spec,
      view,
      requestId,
      fingerprint,
      signal,
    ).finally(() => {
      this.#creating.delete(key);
    });
    this.#creating.set(key, p);
    return p;
  }

  async get(principal: Principal, id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    return (await this.open(principal, id, signal)).info;
  }

  /**
   * Sandboxes in `projectId` (default: the caller's project) and its
   * descendants, gathered from every known edge. An edge the watcher marks
   * down is still asked, with a short deadline: it may be back before the
   * next probe says so. An edge that fails to answer is skipped (and
   * reported through `onWarning`) rather than failing the whole listing.
   */
  async list(
    principal: Principal,
    projectId: string | undefined,
    signal?: AbortSignal,
    filter: { labels?: Record<string, string> | undefined } = {},
  ): Promise<SandboxInfo[]> {
    const root = projectId ?? principal.projectId;
    await this.#requireProject(principal, root);
    const projectIds = await this.#d.iam.subtreeIds(root);
    const allowed = new Set(projectIds);
    const healthy = new Map(this.#d.watcher.view().edges.map((e) => [e.edgeId, e.healthy]));
    // Edges configured but not yet probed are asked too, so a fresh apiserver does not list nothing.
    if (this.#d.edges instanceof Map) {
      for (const id of this.#d.edges.keys()) if (!healthy.has(id)) healthy.set(id, true);
    }
    const edgeIds = [...healthy.keys()];
    const results = await Promise.allSettled(
      edgeIds.map(async (edgeId) => {
        const edge = this.#edge(edgeId);
        if (!edge) return [];
        const deadline = AbortSignal.timeout(DOWN_EDGE_LIST_DEADLINE_MS);
        const s = healthy.get(edgeId)
          ? signal
          : signal
            ? AbortSignal.any([signal, deadline])
            : deadline;
        return edge.listSandboxes({ projectIds }, s);
      }),
    );
    const out: SandboxInfo[] = [];
    const labels = Object.entries(filter.labels ?? {});
    const wanted = (s: SandboxInfo) =>
      allowed.has(s.projectId) && labels.every(([k, v]) => s.spec.labels[k] === v);
    results.forEach((r, i) => {
      if (r.status === 'fulfilled') out.push(...r.value.filter(wanted));
      else this.#warn('listing an edge failed', { edgeId: edgeIds[i], error: String(r.reason) });
    });
    return out.sort((a, b) => a.createdAt.localeCompare(b.createdAt) || a.id.localeCompare(b.id));
  }

  /** Stops the sandbox and frees its quota. */
  async delete(principal: Principal, id: string, signal?: AbortSignal): Promise<void> {
    let sandbox: OpenSandbox;
    try {
      sandbox = await this.open(principal, id, signal);
    } catch (err) {
      // The edge may have lost the sandbox (reclaimed, node replaced): free its quota anyway.
      const owner = await this.#d.iam.reservationProject(id);
      if (owner !== undefined && (await this.#d.iam.canAccess(principal, owner))) {
        await this.#d.iam.release(id, { actorKeyId: principal.keyId, action: 'sandbox.delete' });
      }
      throw err;
    }
    await sandbox.edge.stopSandbox(id, signal);
    this.#owners.delete(id);
    await this.#d.iam.release(id, { actorKeyId: principal.keyId, action: 'sandbox.delete' });
  }

  /**
   * Pauses a sandbox (a no-op when paused): its processes stop and its
   * memory goes back to the host. `sandbox_not_running` when stopped;
   * `unavailable` from an edge that cannot pause.
   */
  async pause(principal: Principal, id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    const { edge } = await this.authorize(principal, id, signal);
    return this.#holdQuota(await requireLifecycle(edge, 'pauseSandbox').call(edge, id, signal));
  }

  /** Resumes a paused sandbox (a no-op when running); errors as `pause`. */
  async resume(principal: Principal, id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    const { edge } = await this.authorize(principal, id, signal);
    return this.#holdQuota(await requireLifecycle(edge, 'resumeSandbox').call(edge, id, signal));
  }

  /** The sandbox stops `seconds` from now, earlier or later than before; errors as `pause`. */
  async setTimeout(
    principal: Principal,
    id: string,
    seconds: number,
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    const { edge } = await this.authorize(principal, id, signal);
    const info = await requireLifecycle(edge, 'setSandboxTimeout').call(edge, id, seconds, signal);
    return this.#holdQuota(info);
  }

  /**
   * Captures a sandbox's writable layer as an image `create` accepts. The
   * layer is the sandbox's project's, named in that project's namespace, and
   * weighs on its `imageBytes` quota (and every ancestor's).
   * `permission_denied` for a scoped key without `sandboxes:snapshot`;
   * `sandbox_not_running` for a stopped sandbox; `conflict` when the project
   * already sees a layer of that name (the edge decides); `quota_exceeded`
   * when the layer would not fit the quota (nothing is stored).
   */
  async snapshot(
    principal: Principal,
    id: string,
    req: SnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    await this.#requireSnapshot(principal, id);
    await this.#requireUnrunnableName(principal, id, req.name);
    const sandbox = await this.open(principal, id, signal);
    const snap = await this.#snapshotCharged(principal, sandbox, req, signal);
    await this.#d.iam.audit(principal.keyId, 'sandbox.snapshot', id, 'ok', {
      image: snap.image,
      scrub: snap.scrub,
    });
    return snap;
  }

  /**
   * Starts `count` sandboxes from a sandbox's current filesystem: one
   * snapshot under a generated name, then `count` creates from that image
   * with the source's spec otherwise (project, limits, TTL, labels, network),
   * each through placement and quota like any create. When one create fails
   * the others are stopped and their quota freed before the error is thrown;
   * the snapshot image stays (layers are immutable and may be shared).
   * Needs `sandboxes:snapshot` and, for a scoped key, the right to run the
   * source's layers (the forks run exactly them, plus the new layer).
   */
  async fork(
    principal: Principal,
    id: string,
    count: number,
    signal?: AbortSignal,
  ): Promise<ForkResult> {
    await this.#requireSnapshot(principal, id);
    const sandbox = await this.open(principal, id, signal);
    const { info } = sandbox;
    await this.#requireRunnable(principal, info.spec);
    // Layer names are lower case; base64url IDs are not.
    const name = `fork-${randomBytes(8).toString('hex')}`;
    const snap = await this.#snapshotCharged(principal, sandbox, { name }, signal);
    const { workspace: _workspace, ...rest } = info.spec;
    const spec: SandboxSpec = { ...rest, image: snap.image, toolkits: [] };
    // The fork layer is the source's project's: the forks see through its view (its layers are
    // pinned by digest, so no name of anyone else's can stand in for them).
    const view = await this.#d.iam.lineage(info.projectId);
    const made = await Promise.allSettled(
      Array.from({ length: count }, () =>
        this.#place(principal, info.projectId, spec, view, randomId('rsv'), undefined, signal),
      ),
    );
    const failure = made.find((r) => r.status === 'rejected');
    const forks = made.flatMap((r) => (r.status === 'fulfilled' ? [r.value] : []));
    if (failure) {
      await Promise.all(forks.map((f) => this.#discard(f)));
      throw failure.reason;
    }
    const ids = forks.map((f) => f.id);
    await this.#d.iam.audit(principal.keyId, 'sandbox.fork', id, 'ok', { image: snap.image, ids });
    return { ids, image: snap.image };
  }

  /**
   * Pauses, resumes, stops or re-times (`extend`: stop `seconds` from now)
   * every live sandbox the caller may see in `projectId` (default its own)
   * whose labels include all of `labels`. Each sandbox succeeds or fails on
   * its own; the answer lists both.
   */
  async job(
    principal: Principal,
    input: {
      action: JobAction;
      labels: Record<string, string>;
      projectId?: string | undefined;
      seconds?: number | undefined;
    },
    signal?: AbortSignal,
  ): Promise<JobResult> {
    const { action, seconds } = input;
    if (Object.keys(input.labels).length === 0) {
      // An empty selector would select everything the key can see.
      throw new DsecError('invalid_argument', 'labels must name at least one label', {
        field: 'labels',
      });
    }
    if ((action === 'extend') !== (seconds !== undefined)) {
      throw new DsecError(
        'invalid_argument',
        action === 'extend' ? 'extend needs seconds' : `${action} takes no seconds`,
        { field: 'seconds' },
      );
    }
    const selected = (
      await this.list(principal, input.projectId, signal, { labels: input.labels })
    ).filter((s) => LIVE_STATES.has(s.state));
    for (const s of selected) this.#rememberOwner(s.id, s.projectId);
    const one = async (id: string): Promise<SandboxState> => {
      switch (action) {
        case 'pause':
          return (await this.pause(principal, id, signal)).state;
        case 'resume':
          return (await this.resume(principal, id, signal)).state;
        case 'extend':
          return (await this.setTimeout(principal, id, seconds!, signal)).state;
        case 'stop':
          await this.delete(principal, id, signal);
          return 'stopped';
      }
    };
    const outcomes = await mapLimit(selected, JOB_CONCURRENCY, (s) => one(s.id));
    const out: JobResult = { sandboxes: [], failed: [] };
    outcomes.forEach((o, i) => {
      const id = selected[i]!.id;
      if (o.status === 'fulfilled') out.sandboxes.push({ id, state: o.value });
      else {
        const e = toDsecError(o.reason);
        out.failed.push({
          id,
          code: e.code,
          message: e.code === 'internal' ? 'internal error' : e.message,
        });
      }
    });
    return out;
  }

  /** Resolves and authorises a sandbox; throws `sandbox_not_found` for forged, unknown or foreign IDs. */
  async open(principal: Principal, id: string, signal?: AbortSignal): Promise<OpenSandbox> {
    const { edgeId } = this.#d.ids.decode(id);
    const edge = this.#edge(edgeId);
    if (!edge) throw notFound(id);
    const info = await edge.getSandbox(id, signal);
    if (info.id !== id || !(await this.#d.iam.canAccess(principal, info.projectId))) {
      await this.#d.iam.audit(principal.keyId, 'sandbox.access', id, 'denied');
      throw notFound(id);
    }
    this.#rememberOwner(id, info.projectId);
    return { edge, info };
  }

  /**
   * A sandbox for a request that carries no key, when `allow` (the caller's
   * rule, e.g. E2B's public ports) accepts what it reads of it; otherwise
   * `sandbox_not_found`, the same answer as for an unknown ID. Costs one edge
   * lookup; never authorises anything else.
   */
  async openWithoutKey(
    id: string,
    allow: (info: SandboxInfo) => boolean,
    signal?: AbortSignal,
  ): Promise<OpenSandbox> {
    const { edgeId } = this.#d.ids.decode(id);
    const edge = this.#edge(edgeId);
    if (!edge) throw notFound(id);
    const info = await edge.getSandbox(id, signal);
    if (info.id !== id || !allow(info)) throw notFound(id);
    return { edge, info };
  }

  /**
   * Authorises a call on a sandbox without loading it when its project is
   * already known (see `#owners`); otherwise as `open`. The edge still
   * answers `sandbox_not_found` for a sandbox that has gone since.
   */
  async authorize(
    principal: Principal,
    id: string,
    signal?: AbortSignal,
  ): Promise<{ edge: EdgeApi; projectId: string }> {
    const known = this.#owners.get(id);
    if (known === undefined) {
      const { edge, info } = await this.open(principal, id, signal);
      return { edge, projectId: info.projectId };
    }
    const owner = known.projectId;
    known.edgeId ??= this.#d.ids.decode(id).edgeId;
    const edge = this.#edge(known.edgeId);
    if (!edge) throw notFound(id);
    if (!(await this.#d.iam.canAccess(principal, owner))) {
      await this.#d.iam.audit(principal.keyId, 'sandbox.access', id, 'denied');
      throw notFound(id);
    }
    return { edge, projectId: owner };
  }

  /** Runs a command in a sandbox the caller may use: one edge call once the owner is known. */
  async run(
    principal: Principal,
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    const { edge, projectId } = await this.authorize(principal, id, options.signal);
    try {
      return await edge.runCommand(id, command, { ...options, projectId });
    } catch (err) {
      if (toDsecError(err).code === 'sandbox_not_found') this.#owners.delete(id);
      throw err;
    }
  }

  /** Runs a command in an already opened sandbox (streaming routes open first, to answer 404 before streaming). */
  runIn(
    sandbox: OpenSandbox,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    return sandbox.edge.runCommand(sandbox.info.id, command, options);
  }

  async #createOnce(
    principal: Principal,
    projectId: string,
    spec: SandboxSpec,
    view: LayerView,
    requestId: string,
    fingerprint: string,
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    const { iam } = this.#d;
    const holder = randomId('rsv');
    const claim = await iam.claimRequest(projectId, requestId, holder, fingerprint, {
      actorKeyId: principal.keyId,
    });
    if (claim.state === 'done') return this.#load(claim.sandboxId, signal);
    if (claim.state === 'pending') {
      throw new DsecError(
        'conflict',
        'a create with this requestId is still in progress; retry later',
        {
          field: 'requestId',
        },
      );
    }
    try {
      return await this.#place(principal, projectId, spec, view, holder, requestId, signal);
    } catch (err) {
      await iam.abandonRequest(projectId, requestId, holder);
      throw err;
    }
  }

  async #place(
    principal: Principal,
    projectId: string,
    spec: SandboxSpec,
    view: LayerView,
    holder: string,
    requestId: string | undefined,
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    const { iam, placer, ids, metrics } = this.#d;
    // A sandbox that mounts volumes runs on their edge, or nowhere.
    let pinned: string | undefined;
    try {
      if (spec.volumes?.length) {
        if (!this.#d.volumes)
          throw new DsecError('invalid_argument', 'this apiserver keeps no volumes', {
            field: 'volumes',
          });
        pinned = await this.#d.volumes.pinnedEdge(projectId, spec);
      }
    } catch (err) {
      metrics.sandboxCreateFailures.inc({ code: toDsecError(err).code });
      throw err;
    }
    try {
      await iam.reserve(
        projectId,
        { memoryMb: spec.memoryLimitMb, cpuCores: spec.cpuCoresLimit },
        holder,
        {
          actorKeyId: principal.keyId,
        },
      );
    } catch (err) {
      metrics.sandboxCreateFailures.inc({ code: toDsecError(err).code });
      throw err;
    }
    const exclude = new Set<string>();
    let refusal: DsecError | undefined;
    try {
      for (let attempt = 0; attempt < MAX_PLACEMENT_ATTEMPTS; attempt++) {
        if (attempt > 0) metrics.placementRetries.inc();
        const edgeId = pinned ?? placer.place({ spec, exclude, layerView: view });
        const edge = this.#edge(edgeId);
        if (!edge) {
          exclude.add(edgeId);
          refusal = new DsecError(
            'unavailable',
            `edge ${edgeId} is not reachable from this apiserver`,
          );
          if (pinned) throw refusal;
          continue;
        }
        const id = ids.mint(edgeId);
        let info: SandboxInfo;
        try {
          info = await edge.createSandbox(
            { id, projectId, spec, requestId, layerView: [...view] },
            signal,
          );
        } catch (err) {
          const e = toDsecError(err);
          // Only a clean refusal is known to have created nothing; otherwise undo whatever exists.
          if (e.code !== 'capacity_exhausted') this.#rollback(edge, id);
          if ((e.code === 'capacity_exhausted' || e.code === 'unavailable') && !pinned) {
            exclude.add(edgeId);
            refusal = e;
            continue;
          }
          throw e;
        }
        try {
          await iam.bindReservation(holder, info.id, {
            expiresAt: info.expiresAt,
            requestId,
            actorKeyId: principal.keyId,
          });
        } catch (err) {
          this.#rollback(edge, info.id);
          throw err;
        }
        metrics.sandboxesCreated.inc({ backend: spec.backend });
        this.#rememberOwner(info.id, projectId);
        return info;
      }
      throw refusal ?? new DsecError('capacity_exhausted', 'no edge accepted the sandbox');
    } catch (err) {
      await iam.release(holder);
      metrics.sandboxCreateFailures.inc({ code: toDsecError(err).code });
      throw err;
    }
  }

  /** Loads a sandbox by ID without an access check (the caller already owns its project). */
  async #load(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    const edge = this.#edge(this.#d.ids.decode(id).edgeId);
    if (!edge) throw notFound(id);
    return edge.getSandbox(id, signal);
  }

  /**
   * Moves the sandbox's quota reservation to the latest moment it may still
   * live. A paused sandbox may be stopped at `pausedExpiresAt`, or resume
   * (on its own, at its next request) with the running time it had left.
   * A failure is reported, not thrown: the edge has already done the work.
   */
  async #holdQuota(info: SandboxInfo): Promise<SandboxInfo> {
    let until = Date.parse(info.expiresAt);
    if (info.state === 'paused' && info.pausedAt && info.pausedExpiresAt) {
      const left = Math.max(0, until - Date.parse(info.pausedAt));
      until = Math.max(until, Date.parse(info.pausedExpiresAt) + left);
    }
    if (Number.isFinite(until)) {
      await this.#d.iam.setReservationExpiry(info.id, until).catch((err: unknown) => {
        this.#warn('moving a reservation failed', { sandboxId: info.id, error: String(err) });
      });
    }
    return info;
  }

  /** Stops a sandbox this service just made and frees its quota (a fork's rollback). */
  async #discard(info: SandboxInfo): Promise<void> {
    const edge = this.#edge(info.edgeId);
    await edge?.stopSandbox(info.id).catch((err: unknown) => {
      if (toDsecError(err).code !== 'sandbox_not_found') {
        this.#warn('rolling back a fork failed', { sandboxId: info.id, error: String(err) });
      }
    });
    this.#owners.delete(info.id);
    await this.#d.iam.release(info.id);
  }

  /**
   * The layers a create may stack (docs/adr/0019-layer-ownership.md): those
   * `projectId` sees, or for a scoped key those its own project sees (a
   * runtime principal runs only layers of its own view, whichever
   * descendant's sandbox it starts).
   */
  async #createView(principal: Principal, projectId: string): Promise<LayerView> {
    return this.#d.iam.lineage(isScoped(principal) ? principal.projectId : projectId);
  }

  /**
   * One snapshot through the project's `imageBytes` quota: reserve before
   * (the sandbox's disk limit and room for metadata; without one nothing is
   * held, the bound is the room left), let the edge refuse a bigger layer, then charge the
   * layer what it weighs (the rest goes back). A layer the quota cannot hold
   * after all (an edge that ignores the limit) is deleted again.
   *
   * Once sent, the snapshot is accounted by the edge's answer, never by the
   * client: `signal` stops it only before it reaches the edge. A remote
   * edge's call rejects the moment its signal aborts while the edge may
   * already be storing the layer (no abort check there), so a client that
   * hung up at the right moment had its reservation released and its layer
   * stored, charged to no quota.
   */
  async #snapshotCharged(
    principal: Principal,
    { edge, info }: OpenSandbox,
    req: SnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    const { iam } = this.#d;
    throwIfAborted(signal);
    const holder = randomId('img');
    const disk = info.spec.diskLimitMb;
    const want =
      disk === undefined ? undefined : disk * 1024 * 1024 + SNAPSHOT_METADATA_BYTES(disk);
    const { maxBytes } = await iam.reserveImageBytes(info.projectId, holder, want, {
      actorKeyId: principal.keyId,
    });
    let snap: SnapshotInfo;
    try {
      const layerView = await iam.lineage(info.projectId);
      snap = await requireLifecycle(edge, 'snapshotSandbox').call(
        edge,
        info.id,
        { ...req, layerView, ...(maxBytes !== undefined ? { maxBytes } : {}) },
        undefined,
      );
    } catch (err) {
      await iam.releaseImageBytes(holder);
      throw err;
    }
    if (snap.layer.project !== info.projectId) {
      this.#warn('an edge stored a snapshot without its owner (upgrade the edge)', {
        sandboxId: info.id,
        edgeId: edge.edgeId,
      });
    }
    try {
      await iam.bindImageBytes(
        holder,
        info.projectId,
        formatLayerKey(snap.layer),
        snap.layer.sizeBytes,
        { actorKeyId: principal.keyId },
      );
    } catch (err) {
      await iam.releaseImageBytes(holder);
      await this.#d.imagesRemove?.(snap.image, info.projectId).catch((e: unknown) => {
        this.#warn('removing a snapshot over quota failed', {
          image: snap.image,
          error: String(e),
        });
      });
      throw err;
    }
    return snap;
  }

  async #requireSnapshot(principal: Principal, id: string): Promise<void> {
    if (maySnapshot(principal)) return;
    await this.#d.iam.audit(principal.keyId, 'sandbox.snapshot', id, 'denied', {
      reason: 'no snapshot scope',
    });
    throw new DsecError('permission_denied', `this key has no ${SNAPSHOT_SCOPE} scope`);
  }

  /**
   * A scoped key may not snapshot under a name its own run patterns match: a builder
   * (`sandboxes:snapshot`, `images:run:base*`) would otherwise name its snapshot `base-x` and
   * run what it built, which the split of builder and runtime keys exists to prevent.
   */
  async #requireUnrunnableName(principal: Principal, id: string, name: unknown): Promise<void> {
    if (!isScoped(principal) || typeof name !== 'string' || !mayRunImage(principal, name)) return;
    await this.#d.iam.audit(principal.keyId, 'sandbox.snapshot', id, 'denied', {
      reason: 'name within own run scope',
      image: name,
    });
    throw new DsecError(
      'permission_denied',
      `this key could run an image named ${JSON.stringify(name)} (its images:run scopes match it), so it may not snapshot under that name`,
      { field: 'name' },
    );
  }

  /**
   * A scoped key must hold a run scope for every layer the spec stacks, and
   * `volumes:use` to mount volumes.
   */
  async #requireRunnable(principal: Principal, spec: SandboxSpec): Promise<void> {
    if (spec.volumes?.length) await requireVolumeScope(this.#d.iam, principal);
    const layers: [string, string][] = [
      ['image', spec.image],
      ...(spec.workspace !== undefined ? [['workspace', spec.workspace] as [string, string]] : []),
      ...spec.toolkits.map((t, i): [string, string] => [`toolkits.${i}`, t]),
    ];
    const denied = unrunnableImages(
      principal,
      layers.map(([, ref]) => ref),
    );
    if (denied.length === 0) return;
    const field = layers.find(([, ref]) => ref === denied[0])?.[0];
    await this.#d.iam.audit(principal.keyId, 'sandbox.create', denied.join(','), 'denied', {
      reason: 'no run scope',
      images: denied,
    });
    throw new DsecError(
      'permission_denied',
      `this key may not run ${denied.map((d) => JSON.stringify(d)).join(', ')} (no matching images:run scope)`,
      { field, details: { images: denied } },
    );
  }

  #rollback(edge: EdgeApi, id: string): void {
    edge.stopSandbox(id).catch((err: unknown) => {
      if (toDsecError(err).code !== 'sandbox_not_found') {
        this.#warn('rolling back a failed create failed', {
          sandboxId: id,
          edgeId: edge.edgeId,
          error: String(err),
        });
      }
    });
  }

  async #requireProject(principal: Principal, projectId: string): Promise<void> {
    if (!(await this.#d.iam.canAccess(principal, projectId))) {
      await this.#d.iam.audit(principal.keyId, 'project.access', projectId, 'denied');
      throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`, {
        field: 'projectId',
      });
    }
  }

  #rememberOwner(id: string, projectId: string): void {
    if (this.#owners.has(id)) return;
    // Oldest first out: a Map iterates in insertion order.
    if (this.#owners.size >= OWNER_CACHE_ENTRIES)
      this.#owners.delete(this.#owners.keys().next().value!);
    this.#owners.set(id, { projectId });
  }

  #edge(edgeId: string): EdgeApi | undefined {
    const { edges } = this.#d;
    return typeof edges === 'function' ? edges(edgeId) : edges.get(edgeId);
  }

  #warn(message: string, context: Record<string, unknown>): void {
    this.#d.onWarning?.(message, context);
  }
}

/** `Promise.allSettled` over `items` with at most `limit` calls in flight, results in order. */
async function mapLimit<T, R>(
  items: readonly T[],
  limit: number,
  fn: (item: T) => Promise<R>,
): Promise<PromiseSettledResult<R>[]> {
  const out: PromiseSettledResult<R>[] = new Array<PromiseSettledResult<R>>(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      try {
        out[i] = { status: 'fulfilled', value: await fn(items[i]!) };
      } catch (reason) {
        out[i] = { status: 'rejected', reason };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

function notFound(id: string): DsecError {
  return new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
}
