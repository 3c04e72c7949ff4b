import { join } from 'node:path';
import {
  checkSandboxUser,
  checkVolumeMounts,
  DsecError,
  formatLayerKey,
  LAYER_PROJECT_PATTERN,
  resolveLayer,
  toDsecError,
  validateDisplayInput,
} from '@dsec/core';
import type {
  AdmissionRefusal,
  CommandResult,
  CommandSpec,
  CreateSandboxRequest,
  EdgeApi,
  DisplayInput,
  EdgeStatus,
  FnCallOptions,
  FnCallPoolStatus,
  FnCallRequest,
  FnCallResult,
  ImageStore,
  LayerInfo,
  NetworkPolicyPatch,
  RunCommandOptions,
  SandboxEvent,
  SandboxInfo,
  EdgeSnapshotRequest,
  LayerView,
  SnapshotInfo,
} from '@dsec/core';
import type { AdmissionController } from './admission/admission-controller.js';
import type { Backend } from './backends/backend.js';
import type { GpuSpecFragment } from './gpu/oci-fragment.js';
import { EdgeGpus, type EdgeGpuConfig } from './gpu/edge-gpus.js';
import { CreateGate, type CreateGateOptions } from './create-gate.js';
import type { EventLog } from './events/event-log.js';
import type { NetworkManager } from './network/network-manager.js';
import { applyPatch } from './network/policy.js';
import type { LayerMountCache } from './layers/layer-cache.js';
import { EdgeStore, type SandboxRecord } from './state/edge-store.js';
import { ensureDir, TRAVERSE_DIR_MODE } from './state/host-state.js';
import { SandboxIo } from './sessions/sandbox-io.js';
import { needsInitUserProbe, probeInitUser } from './sessions/spawn-user.js';
import { effectiveExpiresAt, Lifecycle } from './lifecycle/lifecycle.js';
import type { SwapArea } from './lifecycle/swap-area.js';
import {
  containerSnapshotSource,
  snapshotParents,
  Snapshotter,
  type SnapshotLimits,
} from './snapshot/snapshotter.js';
import { FNCALL_PROJECT, FnCallPools, type FnCallPoolsOptions } from './fncall/pools.js';
import type { EdgeLogFn } from './observability/log.js';
import type { EdgeMetrics } from './observability/metrics.js';
import { VolumeStore } from './volumes/volume-store.js';

/** What only the edge adds to a create (not in the public `SandboxSpec`, not persisted). */
export interface EdgeStartOptions {
  /** GPUs assigned to the sandbox (an FnCall worker's), for the container backend's OCI config. */
  gpu?: GpuSpecFragment | undefined;
}

/** How long `status()` reuses its listing of the image store's layers. */
const LAYER_LIST_TTL_MS = 10_000;

/**
 * Absolute admission caps, the older way to configure an edge (`capacity`):
 * `sandboxes` is the hard cap, `memoryMb` and `cpuCores` bound the sums of
 * requested ceilings. `AdmissionConfig` (ratios, measured thresholds) is the
 * newer one; where both are given these win.
 */
export interface EdgeCapacity {
  memoryMb: number;
  cpuCores: number;
  sandboxes: number;
}

export interface EdgeOptions {
  edgeId: string;
  url?: string;
  /** Labels placement selects edges by (`pool=burst`, `hardware=h200`). */
  labels?: Record<string, string> | undefined;
  /**
   * Report the layers of the image store in `status()` (`EdgeStatus.layers`),
   * so placement can send burst work here only when every layer it needs is
   * present. Default: when labelled `pool=burst`.
   */
  reportLayers?: boolean | undefined;
  /** Local directory for the edge's database and per-sandbox state. */
  stateDir: string;
  store: ImageStore;
  backend: Backend;
  layers: LayerMountCache;
  /** Admission by measured use (docs/adr/0007-admission-by-real-use.md). */
  admission: AdmissionController;
  /** How many sandbox starts run at once and how long the rest may queue. */
  createGate?: CreateGateOptions | undefined;
  /** How often expired sandboxes are looked for. */
  ttlSweepMs?: number;
  /** How long a stopped sandbox's record stays readable. */
  retentionMs?: number;
  /** Lifecycle log (docs/observability.md): `edgeLog(jsonLogger(...))`, or any function. */
  log?: EdgeLogFn | undefined;
  /** Prometheus metrics the edge counts into (refusals, create time, command outcomes). */
  metrics?: EdgeMetrics | undefined;
  /** The backend's network manager, for live policy updates and restart clean-up. */
  network?: NetworkManager | undefined;
  /** Audit events of misbehaviour per sandbox. */
  events?: EventLog | undefined;
  /** How long finished commands stay readable by ID (default 1 h). */
  commandRetentionMs?: number | undefined;
  /** Finished commands kept per sandbox (default 256). */
  maxCommandsPerSandbox?: number | undefined;
  /**
   * How long a paused sandbox is kept before it is stopped, its own limit
   * beside the running TTL (default 24 h; docs/adr/0012-pause-and-resume.md).
   */
  pausedTtlMs?: number | undefined;
  /**
   * Pause (not stop) a running sandbox after this long without a command,
   * session, file or port call; a command or session line in progress counts
   * as use. Default: off.
   */
  idleTimeoutMs?: number | undefined;
  /** The swap files pauses push memory into; switched off at `close` when nothing is paused. */
  swap?: SwapArea | undefined;
  /** FnCall warm pools (docs/adr/0014-fncall.md); `false` turns FnCall off. Default: on, pools made on demand. */
  fncall?: FnCallPoolsOptions | false | undefined;
  /**
   * GPUs for FnCall workers (docs/gpu.md): `off` (default), `auto`, or
   * settings (`inventoryFile`, discovery and sharing options). Found once at
   * `open`; a configured GPU host whose discovery fails does not start.
   */
  gpus?: EdgeGpuConfig | undefined;
  /** Bounds on one snapshot: files, bytes, memory, time (snapshot/snapshotter.ts; every one has a default). */
  snapshot?: SnapshotLimits | undefined;
  /**
   * Volumes (docs/volumes.md), kept in `stateDir/volumes`. Default: on when
   * the backend runs containers (the only sandboxes that mount them); `false`
   * turns them off (the edge then refuses creates that name volumes).
   */
  volumes?: false | undefined;
}

/**
 * The per-node agent (paper 3.3). It has final admission authority, creates
 * sandboxes through its backend, enforces TTLs, and keeps what it needs in a
 * local database so that after its own restart running sandboxes are adopted
 * and half-created ones are rolled back.
 */
export class Edge implements EdgeApi {
  readonly edgeId: string;
  readonly #store: EdgeStore;
  readonly #inflight = new Map<string, Promise<SandboxInfo>>();
  /** The image store's layer refs for `status()`, listed at most every `LAYER_LIST_TTL_MS`. */
  #layerRefs: { at: number; refs: Promise<string[]> } | undefined;
  readonly #stopping = new Map<string, Promise<void>>();
  /** Bounds the sandbox starts in progress; a burst queues (create-gate.ts). */
  readonly #gate: CreateGate;
  #sweeper: NodeJS.Timeout | undefined;
  /** Command log, background commands, sessions, files, ports, terminals. */
  readonly io: SandboxIo;
  /** Pause, resume, TTL control and idle reclamation (lifecycle/lifecycle.ts). */
  readonly #lifecycle: Lifecycle;
  /** pack_diff: writable layers captured as snapshot layers (snapshot/snapshotter.ts). */
  readonly #snapshots: Snapshotter;
  /** FnCall: warm pools of worker sandboxes (fncall/pools.ts). */
  readonly #fncall: FnCallPools | undefined;
  /** The node's GPUs and their assignment to FnCall workers (gpu/edge-gpus.ts). */
  readonly #gpus: EdgeGpus | undefined;
  /** The node's volumes (volumes/volume-store.ts); set by `open`. */
  #volumes: VolumeStore | undefined;

  private constructor(
    readonly options: EdgeOptions,
    store: EdgeStore,
    gpus: EdgeGpus | undefined,
  ) {
    this.#gpus = gpus;
    this.edgeId = options.edgeId;
    this.#store = store;
    this.#gate = new CreateGate(options.createGate);
    this.#snapshots = new Snapshotter({
      dir: join(options.stateDir, 'snapshots'),
      store: options.store,
      layers: options.layers,
      limits: options.snapshot,
      log: options.log,
    });
    this.io = new SandboxIo({
      dbFile: join(options.stateDir, 'edge.db'),
      backend: options.backend,
      running: (id, projectId) => this.#requireRunning(id, projectId),
      commandRetentionMs: options.commandRetentionMs,
      maxCommandsPerSandbox: options.maxCommandsPerSandbox,
      onPidsLimit: (rec, event) =>
        options.events?.recordPidsLimit(rec.id, rec.spec.pidsLimit, event),
    });
    // Foreground commands are counted where runCommand returns them (after its OOM check);
    // background ones only finish here.
    this.io.registry.onFinish((info, result) => {
      if (info.background) options.metrics?.commandFinished(result.outcome);
    });
    this.#lifecycle = new Lifecycle({
      store,
      backend: options.backend,
      pausedTtlMs: options.pausedTtlMs,
      idleTimeoutMs: options.idleTimeoutMs,
      swap: options.swap,
      forgetRecord: (id) => this.io.forgetRecord(id),
      busy: (id) =>
        this.#fncall?.owns(id) === true ||
        this.io.registry.list(id).some((c) => c.state === 'running' && !c.background),
      stop: (rec, reason) => this.#stop(rec, reason),
      log: options.log,
    });
    this.#fncall =
      options.fncall === false
        ? undefined
        : new FnCallPools(
            {
              edgeId: options.edgeId,
              backendKind: options.backend.kind,
              events: options.events,
              gpus,
              host: {
                create: async (id, spec, signal, start) => {
                  // Workers run the platform's runtime images only.
                  const req = { id, projectId: FNCALL_PROJECT, spec, layerView: [] };
                  await this.#create(req, signal, start);
                },
                stop: (id) => this.#stop(this.#get(id), 'fncall worker retired'),
                channel: (id) => options.backend.channel(this.#get(id), { dedicated: true }),
                oomKilled: async (id) =>
                  (await options.backend.oomKilled?.(this.#get(id))) ?? false,
                log: options.log,
              },
            },
            options.fncall,
          );
  }

  /** Opens the local store, reconciles with what is actually running, starts the TTL sweeper. */
  static async open(options: EdgeOptions): Promise<Edge> {
    // 0711: a sandbox's mapped root must traverse down to its rootfs; nobody may list.
    ensureDir(options.stateDir, TRAVERSE_DIR_MODE);
    // Before anything else: a GPU host that was told to use GPUs and cannot does not start.
    const gpus = await EdgeGpus.open(options.gpus, { log: options.log });
    const edge = new Edge(options, new EdgeStore(join(options.stateDir, 'edge.db')), gpus);
    const kinds = options.backend.kinds ?? [options.backend.kind];
    if (options.volumes !== false && kinds.includes('container')) {
      edge.#volumes = await VolumeStore.open({
        dir: join(options.stateDir, 'volumes'),
        users: (projectId, name) => edge.#volumeUsers(projectId, name),
        log: options.log,
      });
    }
    // Thaw what a snapshot interrupted by a crash left frozen, before adopting it.
    edge.#snapshots.recover((id) => edge.#store.get(id)?.state);
    await edge.#reconcile();
    // Workers of a previous edge process: their zygotes' channels are gone with it.
    for (const rec of edge.#store.list(['creating', 'running', 'paused']))
      if (rec.projectId === FNCALL_PROJECT)
        await edge.#stop(rec, 'fncall worker of a previous edge');
    edge.#fncall?.prewarm();
    edge.#sweeper = setInterval(() => void edge.#sweep(), options.ttlSweepMs ?? 1000);
    edge.#sweeper.unref();
    return edge;
  }

  /** Stops background work, unmounts unused layers and closes the store. Sandboxes keep running. */
  async close(): Promise<void> {
    clearInterval(this.#sweeper);
    // FnCall workers are the edge's own, not users' sandboxes: they stop with it.
    await this.#fncall?.close();
    await Promise.allSettled([...this.#inflight.values(), ...this.#stopping.values()]);
    // Waits for pauses and resumes; with nothing paused, the pause swap files go.
    await this.#lifecycle.close();
    // The command log closes first: commands still running are then recorded
    // as cut by the restart (by the next edge), not as failed here when the
    // backend drops their connections, the last handles that would keep a
    // shutting-down process alive.
    this.io.close();
    await this.#volumes?.close();
    await this.options.backend.close?.();
    await this.options.network?.close();
    this.options.events?.close();
    await this.options.layers.close();
    this.#store.close();
  }

  async status(): Promise<EdgeStatus> {
    // Cached pressure: the probe must stay cheap under load. A host read waits on the thread
    // pool and the event loop behind every call in flight (hundreds of ms, past the watcher's
    // 1.5 s once), so only the first status waits for one; later ones start the next read.
    const reading = this.options.admission.refresh();
    if (!this.options.admission.view().pressure) await reading;
    const live = this.#store.list(['creating', 'running', 'stopping', 'paused']);
    const byProject: Record<string, number> = {};
    for (const r of live) byProject[r.projectId] = (byProject[r.projectId] ?? 0) + 1;
    const { capacity, used, pressure } = this.options.admission.view();
    return {
      edgeId: this.edgeId,
      url: this.options.url ?? '',
      healthy: true,
      backends: [...(this.options.backend.kinds ?? [this.options.backend.kind])],
      capacity,
      used,
      sandboxesByProject: byProject,
      labels: { ...this.options.labels },
      ...(pressure ? { pressure } : {}),
      ...(this.#fncall ? { fncall: this.#fncall.status() } : {}),
      ...(this.#gpus ? { gpus: this.#gpus.status() } : {}),
      ...((this.options.reportLayers ?? this.options.labels?.pool === 'burst')
        ? { layers: await this.#listLayerRefs() }
        : {}),
    };
  }

  #listLayerRefs(): Promise<string[]> {
    const now = Date.now();
    if (!this.#layerRefs || now - this.#layerRefs.at > LAYER_LIST_TTL_MS) {
      const refs = this.options.store
        .listLayers()
        // By owner (`project/name:version` for a project's): placement must not take B's layer
        // for A's name, nor tell A by where it sends A that B has one (docs/adr/0019).
        .then((layers) => layers.map((l) => formatLayerKey(l)));
      // A failed listing is retried at the next status, not cached.
      refs.catch(() => (this.#layerRefs = undefined));
      this.#layerRefs = { at: now, refs };
    }
    return this.#layerRefs.refs;
  }

  createSandbox(req: CreateSandboxRequest, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#create(req, signal);
  }

  /** The node's volumes (docs/volumes.md); absent when the edge runs no containers. */
  get volumes(): VolumeStore | undefined {
    return this.#volumes;
  }

  /** Live sandboxes of `projectId` that mount its volume `name` (or are being created with it). */
  #volumeUsers(projectId: string, name: string): string[] {
    return this.#store
      .list(['creating', 'running', 'paused', 'stopping'])
      .filter((r) => r.projectId === projectId && r.spec.volumes?.some((v) => v.name === name))
      .map((r) => r.id);
  }

  /** `createSandbox` with what only the edge adds (an FnCall worker's GPUs). */
  async #create(
    req: CreateSandboxRequest,
    signal?: AbortSignal,
    start: EdgeStartOptions = {},
  ): Promise<SandboxInfo> {
    const { spec } = req;
    checkSandboxUser(spec.initUser, 'initUser');
    if (start.gpu && spec.backend !== 'container')
      throw new DsecError('unavailable', `GPUs are given to container sandboxes only`, {
        field: 'gpu',
      });
    const kinds = this.options.backend.kinds ?? [this.options.backend.kind];
    const volumes = spec.volumes ?? [];
    if (volumes.length > 0) {
      checkVolumeMounts(volumes);
      if (spec.backend !== 'container' || !this.#volumes)
        throw new DsecError(
          'invalid_argument',
          'volumes are mounted into container sandboxes only',
          {
            field: 'volumes',
          },
        );
    }
    if (!kinds.includes(spec.backend)) {
      throw new DsecError(
        'invalid_argument',
        `this edge runs ${kinds.join(', ')} sandboxes, not ${spec.backend}`,
        {
          field: 'backend',
        },
      );
    }
    // Pressure is read at most every sampleIntervalMs, shared by concurrent creates.
    const [layers] = await Promise.all([
      this.#resolveLayers(spec.image, spec.workspace, spec.toolkits, layerViewOf(req)),
      this.options.admission.refresh(),
    ]);
    // From here to the insert nothing awaits: the check and the insert are one step.
    if (req.requestId !== undefined) {
      const prior = this.#store.findByRequest(req.projectId, req.requestId);
      if (prior) return this.#inflight.get(prior.id) ?? toInfo(prior, this.edgeId);
    }
    this.options.network?.validate(spec);
    // Every volume exists and is not being deleted; the insert below makes the sandbox a user.
    if (volumes.length > 0) this.#volumes?.check(req.projectId, volumes);
    const { admission } = this.options;
    try {
      admission.admit(req.id, spec);
    } catch (err) {
      this.#refused(req, err);
      throw err;
    }
    const now = new Date();
    let record: SandboxRecord;
    try {
      record = this.#store.insert({
        id: req.id,
        projectId: req.projectId,
        requestId: req.requestId,
        spec,
        layers,
        createdAt: now.toISOString(),
        expiresAt: new Date(now.getTime() + spec.ttlSeconds * 1000).toISOString(),
      });
    } catch (err) {
      admission.release(req.id);
      throw toDsecError(err); // a full disk, most likely: nothing was made
    }
    const creating = this.#start(record, signal, start).finally(() => {
      this.#inflight.delete(record.id);
      admission.settle(record.id);
    });
    this.#inflight.set(record.id, creating);
    return creating;
  }

  async getSandbox(id: string): Promise<SandboxInfo> {
    const rec = this.#get(id);
    // Only here, not in lists: one cgroup read per sandbox.
    const memoryBytes =
      rec.state === 'running' || rec.state === 'paused'
        ? await this.options.backend.memoryBytes?.(rec)
        : undefined;
    return { ...toInfo(rec, this.edgeId), ...(memoryBytes !== undefined ? { memoryBytes } : {}) };
  }

  async listSandboxes(filter: {
    projectIds?: string[];
    includeEnded?: boolean;
  }): Promise<SandboxInfo[]> {
    const projects = filter.projectIds && new Set(filter.projectIds);
    return (
      this.#store
        .list(filter.includeEnded ? undefined : ['creating', 'running', 'stopping', 'paused'])
        // FnCall workers are listed only when their project is asked for by name.
        .filter((r) => (projects ? projects.has(r.projectId) : r.projectId !== FNCALL_PROJECT))
        .map((r) => toInfo(r, this.edgeId))
    );
  }

  async stopSandbox(id: string): Promise<void> {
    const rec = this.#get(id);
    await this.#stop(rec, 'stopped by request');
  }

  /** Runs one stateless call in a warm pool (issue 14, docs/adr/0014-fncall.md). */
  async fncall(req: FnCallRequest, options: FnCallOptions): Promise<FnCallResult> {
    const metrics = this.options.metrics;
    const start = performance.now();
    try {
      if (!this.#fncall)
        throw new DsecError('unavailable', `edge ${this.edgeId} runs no function calls`);
      const result = await this.#fncall.call(req, options);
      metrics?.fncallFinished(req.language, result.outcome, (performance.now() - start) / 1000);
      return result;
    } catch (err) {
      metrics?.fncallFailed(toDsecError(err).code);
      throw err;
    }
  }

  /** The FnCall pools' sizes (none on an edge that runs no function calls). */
  fncallPools(): FnCallPoolStatus[] {
    return this.#fncall?.status() ?? [];
  }

  // ---- pause, resume, TTL (issue 11; lifecycle/lifecycle.ts, docs/adr/0012-pause-and-resume.md) ----

  /** Freezes the sandbox and gives its memory back; a no-op on a paused one. */
  async pauseSandbox(id: string): Promise<SandboxInfo> {
    return toInfo(await this.#lifecycle.pause(id), this.edgeId);
  }

  /** Thaws a paused sandbox; a no-op on a running one. Commands, sessions, files and ports resume by themselves. */
  async resumeSandbox(id: string): Promise<SandboxInfo> {
    return toInfo(await this.#lifecycle.resume(id), this.edgeId);
  }

  /** The sandbox stops `ttlSeconds` (1 s to 7 days) from now, or from its resume when paused. */
  async setSandboxTimeout(id: string, ttlSeconds: number): Promise<SandboxInfo> {
    return toInfo(this.#lifecycle.setTimeout(id, ttlSeconds), this.edgeId);
  }

  /** A PNG of the sandbox's screen (`unavailable` for a backend without a display). */
  async screenshot(id: string): Promise<Buffer> {
    const b = this.options.backend;
    if (!b.screenshot)
      throw new DsecError('unavailable', 'this edge runs no sandboxes with a display');
    return b.screenshot(await this.#requireRunning(id));
  }

  /** Keys and pointer events to the sandbox's screen (`unavailable` without a display). */
  async sendInput(id: string, input: DisplayInput): Promise<void> {
    const b = this.options.backend;
    if (!b.input) throw new DsecError('unavailable', 'this edge runs no sandboxes with a display');
    validateDisplayInput(input);
    await b.input(await this.#requireRunning(id), input);
  }

  async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    // Through the command log: every command gets an ID and a retained result.
    let result = await this.io.runCommand(id, command, options).catch((err: unknown) => {
      throw toDsecError(err);
    });
    // A shell reports its OOM-killed child as exit 137 rather than dying of SIGKILL itself;
    // ask the cgroup only then (never on the hot path of a normal exit).
    if (
      result.outcome === 'exited' &&
      result.exitCode === 137 &&
      (await this.options.backend.oomKilled?.(this.#get(id)))
    )
      result = { ...result, outcome: 'oom' };
    this.options.events?.recordCommand(id, result);
    this.options.metrics?.commandFinished(result.outcome);
    return result;
  }

  /**
   * With `projectId`, another project's sandbox is not found, whatever its
   * state. Every io call passes here: a paused sandbox is resumed first
   * (then the caller awaits), a running one is returned synchronously.
   */
  #requireRunning(id: string, projectId?: string): SandboxRecord | Promise<SandboxRecord> {
    const rec = this.#get(id);
    if (projectId !== undefined && rec.projectId !== projectId)
      throw new DsecError('sandbox_not_found', `no sandbox ${id}`);
    return this.#lifecycle.ensureRunning(rec);
  }

  async updateNetwork(id: string, patch: NetworkPolicyPatch): Promise<SandboxInfo> {
    const rec = this.#get(id);
    if (rec.state !== 'running') {
      throw new DsecError('sandbox_not_running', `sandbox ${id} is ${rec.state}`, {
        details: { state: rec.state },
      });
    }
    const spec = applyPatch(rec.spec, patch);
    const network = this.options.network;
    if (network) {
      network.validate(spec);
      await network.update({ ...rec, spec });
    }
    this.#store.update(id, { spec });
    return toInfo({ ...rec, spec }, this.edgeId);
  }

  /**
   * pack_diff (paper 6.1): the writable layer, frozen briefly and scrubbed,
   * becomes the snapshot layer `req.name` over the sandbox's own stack.
   */
  async snapshotSandbox(
    id: string,
    req: EdgeSnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    const rec = this.#get(id);
    if (rec.state !== 'running' && rec.state !== 'paused') {
      throw new DsecError('sandbox_not_running', `sandbox ${id} is ${rec.state}`, {
        details: { state: rec.state },
      });
    }
    const source = containerSnapshotSource(this.options.backend, rec);
    const info = await this.#snapshots.snapshot(
      rec,
      source,
      req,
      () => this.#store.get(id)?.state,
      signal,
    );
    this.#layerRefs = undefined; // status() lists the new image from now on
    return info;
  }

  async listEvents(
    id: string,
    query: { afterId?: number | undefined; limit?: number | undefined } = {},
  ): Promise<SandboxEvent[]> {
    this.#get(id);
    await this.options.network?.collectEvents();
    return this.options.events?.list(id, query.afterId, query.limit) ?? [];
  }

  /** An admission refusal: counted, and logged with the `AdmissionRefusal` fields. */
  #refused(req: CreateSandboxRequest, err: unknown): void {
    const e = toDsecError(err);
    if (e.code !== 'capacity_exhausted') return;
    // The details name the edge too; the edge's log lines already do.
    const { edgeId: _edgeId, ...refusal } = (e.details ?? {}) as Partial<AdmissionRefusal> & {
      edgeId?: string;
    };
    this.options.metrics?.admissionRefused({
      resource: refusal.resource ?? 'sandboxes',
      measure: refusal.measure ?? 'unknown',
    });
    this.options.log?.(
      'admission refused',
      { id: req.id, projectId: req.projectId, ...refusal },
      'warn',
    );
  }

  #get(id: string): SandboxRecord {
    const rec = this.#store.get(id);
    if (!rec) throw new DsecError('sandbox_not_found', `no sandbox ${id}`);
    return rec;
  }

  async #start(
    rec: SandboxRecord,
    signal?: AbortSignal,
    start: EdgeStartOptions = {},
  ): Promise<SandboxInfo> {
    const { log, metrics } = this.options;
    const startMs = performance.now();
    try {
      // A bounded number of starts at once; a burst queues (create-gate.ts).
      const volumes = rec.spec.volumes?.length
        ? await this.#volumes?.sources(rec.projectId, rec.spec.volumes)
        : undefined;
      const started = await this.#gate.run(
        () =>
          this.options.backend.start(
            {
              ...rec,
              ...(start.gpu ? { gpu: start.gpu } : {}),
              ...(volumes ? { volumes } : {}),
            },
            signal,
          ),
        signal,
      );
      // A named initUser the image does not have would fail every call: refuse the create.
      if (needsInitUserProbe(rec.spec.initUser))
        await probeInitUser(
          await this.options.backend.channel({ ...rec, ...started }),
          rec.spec.initUser,
        );
      this.#store.update(rec.id, { state: 'running', ...started });
      const ms = performance.now() - startMs;
      metrics?.observePhase('total', ms / 1000);
      metrics?.started(true);
      log?.('sandbox started', { id: rec.id, projectId: rec.projectId, createMs: Math.round(ms) });
      return toInfo({ ...rec, ...started, state: 'running' }, this.edgeId);
    } catch (err) {
      const reason = toDsecError(err).message;
      metrics?.started(false);
      log?.('sandbox start failed', { id: rec.id, projectId: rec.projectId, reason }, 'error');
      await this.options.backend.stop(rec).then(
        () => log?.('sandbox rolled back', { id: rec.id, reason }, 'warn'),
        (e: unknown) => log?.('rollback failed', { id: rec.id, reason, err: String(e) }, 'error'),
      );
      try {
        this.#store.update(rec.id, { state: 'failed', reason: toDsecError(err).message });
        this.options.admission.release(rec.id);
      } catch (e) {
        // The record stays `creating`; the next reconcile finishes the rollback.
        this.options.log?.('recording the failed create failed', { id: rec.id, err: String(e) });
      }
      throw toDsecError(err);
    }
  }

  #stop(rec: SandboxRecord, reason: string): Promise<void> {
    if (rec.state === 'stopped' || rec.state === 'failed') return Promise.resolve();
    let stopping = this.#stopping.get(rec.id);
    if (!stopping) {
      stopping = (async () => {
        await this.#inflight.get(rec.id)?.catch(() => undefined);
        const current = this.#store.get(rec.id) ?? rec;
        if (current.state === 'stopped' || current.state === 'failed') return;
        this.#store.update(rec.id, { state: 'stopping' });
        this.io.forgetSandbox(rec.id);
        // No snapshot may read the writable layer while the stop removes it.
        await this.#snapshots.cancel(rec.id);
        await this.options.backend.stop(current);
        this.#store.update(rec.id, { state: 'stopped', reason });
        this.options.admission.release(rec.id);
        this.options.log?.('sandbox stopped', { id: rec.id, reason });
      })().finally(() => this.#stopping.delete(rec.id));
      this.#stopping.set(rec.id, stopping);
    }
    return stopping;
  }

  async #sweep(): Promise<void> {
    const now = new Date().toISOString();
    for (const rec of this.#store.list(['running'])) {
      if (rec.expiresAt <= now) {
        this.options.log?.('ttl expired: stopping', { id: rec.id, expiresAt: rec.expiresAt });
        await this.#stop(rec, 'ttl expired').catch((err: unknown) =>
          this.options.log?.('ttl stop failed', { id: rec.id, err: String(err) }),
        );
      }
    }
    // Paused TTLs and idle reclamation.
    await this.#lifecycle.sweep();
    const retentionMs = this.options.retentionMs ?? 3_600_000;
    if (this.#store.purgeEnded(new Date(Date.now() - retentionMs).toISOString()) > 0)
      this.options.events?.purge(new Set(this.#store.list().map((r) => r.id)));
  }

  /**
   * After a restart: adopt sandboxes whose init still runs (restarting their
   * command daemon if needed), finish stopping the rest, roll back creates
   * that were interrupted, and enforce TTLs that expired while we were down.
   */
  async #reconcile(): Promise<void> {
    const backend = this.options.backend;
    const live = this.#store.list(['creating', 'running', 'stopping', 'paused']);
    await this.options.layers.adopt(live.flatMap((r) => r.layers));
    const now = new Date().toISOString();
    const { log } = this.options;
    const outcome = { adopted: 0, stopped: 0, rolledBack: 0, chronusRestarted: 0 };
    for (const found of live) {
      // A pause or resume a crash interrupted is finished first (lifecycle.ts).
      const rec = await this.#lifecycle.recover(found);
      const paused = rec.state === 'paused';
      const running = (rec.state === 'running' || paused) && (await backend.isRunning(rec));
      // A paused sandbox's running TTL does not run down; its paused TTL does.
      const deadline = paused ? (rec.pausedExpiresAt ?? rec.expiresAt) : rec.expiresAt;
      if (running && deadline > now) {
        for (const layer of rec.layers) await this.options.layers.acquire(layer);
        outcome.adopted++;
        log?.('sandbox adopted', { id: rec.id, state: rec.state });
        // Adopted paused: its frozen daemon is checked when it resumes.
        if (paused) continue;
        const chronusPid = await backend.ensureChronus(rec).catch((err: unknown) => {
          log?.('command daemon restart failed', { id: rec.id, err: String(err) }, 'error');
          return undefined;
        });
        if (chronusPid !== undefined) {
          outcome.chronusRestarted++;
          log?.('command daemon restarted', { id: rec.id, chronusPid });
          this.#store.update(rec.id, { chronusPid });
        }
        continue;
      }
      const reason =
        rec.state === 'creating'
          ? 'interrupted while creating'
          : running
            ? paused
              ? 'paused ttl expired'
              : 'ttl expired'
            : 'exited';
      // stop() releases layers it holds; acquire first so the counts balance.
      for (const layer of rec.layers)
        await this.options.layers.acquire(layer).catch(() => undefined);
      await backend.stop(rec);
      this.#store.update(rec.id, {
        state: rec.state === 'creating' ? 'failed' : 'stopped',
        reason,
      });
      if (rec.state === 'creating') outcome.rolledBack++;
      else outcome.stopped++;
      log?.(
        rec.state === 'creating' ? 'sandbox rolled back' : 'sandbox stopped',
        { id: rec.id, reason },
        rec.state === 'creating' ? 'warn' : 'info',
      );
    }
    log?.('reconciled after start', outcome);
    // Adopt the survivors' networks; remove namespaces and firewall entries of the rest.
    await this.options.network?.reconcile(this.#store.list(['running', 'paused']));
    this.options.admission.adopt(
      this.#store
        .list(['creating', 'running', 'stopping', 'paused'])
        .map((r) => ({ id: r.id, request: r.spec })),
    );
  }

  /** The stack a create names, each layer as `view` resolves it (docs/adr/0019-layer-ownership.md). */
  async #resolveLayers(
    image: string,
    workspace: string | undefined,
    toolkits: string[],
    view: LayerView,
  ): Promise<LayerInfo[]> {
    const resolve = async (ref: string, field: string, kind: LayerInfo['kind']) => {
      const layer = await resolveLayer(this.options.store, ref, view).catch((err: unknown) => {
        throw new DsecError('image_not_found', toDsecError(err).message, { field, cause: err });
      });
      if (kind !== 'base' && (layer.kind === 'base' || layer.kind === 'snapshot')) {
        throw new DsecError('invalid_argument', `${ref} is a ${layer.kind} image, not a ${kind}`, {
          field,
        });
      }
      return layer;
    };
    const top = await resolve(image, 'image', 'base');
    // A snapshot image is its whole stack (base, workspace, toolkits, earlier
    // snapshots) plus the snapshot layer; more toolkits may go on top.
    const layers =
      top.kind === 'snapshot'
        ? [...(await snapshotParents(this.options.store, top, view)), top]
        : [top];
    if (workspace && top.kind === 'snapshot') {
      throw new DsecError('invalid_argument', `${image} is a snapshot: it has its workspace`, {
        field: 'workspace',
      });
    }
    if (workspace) layers.push(await resolve(workspace, 'workspace', 'workspace'));
    for (const [i, t] of toolkits.entries())
      layers.push(await resolve(t, `toolkits.${i}`, 'toolkit'));
    return layers;
  }
}

/**
 * The layer view a create names; the sandbox's own project alone without
 * one (a caller that is not the apiserver: tests, benches). `invalid_argument`
 * for anything but a list of project IDs.
 */
function layerViewOf(req: CreateSandboxRequest): LayerView {
  const view = req.layerView as unknown;
  if (view === undefined) return [req.projectId];
  if (
    !Array.isArray(view) ||
    view.length > 64 ||
    view.some((p) => typeof p !== 'string' || !LAYER_PROJECT_PATTERN.test(p))
  ) {
    throw new DsecError('invalid_argument', 'layerView must be a list of project IDs', {
      field: 'layerView',
    });
  }
  return view as string[];
}

function toInfo(rec: SandboxRecord, edgeId: string): SandboxInfo {
  return {
    id: rec.id,
    edgeId,
    projectId: rec.projectId,
    state: rec.state,
    spec: rec.spec,
    createdAt: rec.createdAt,
    expiresAt: effectiveExpiresAt(rec),
    ...(rec.reason !== undefined ? { reason: rec.reason } : {}),
    ...(rec.state === 'paused' && rec.pausedAt !== undefined
      ? { pausedAt: rec.pausedAt, pausedExpiresAt: rec.pausedExpiresAt }
      : {}),
  };
}
