import { createHash } from 'node:crypto';
import {
  DsecError,
  formatLayerKey,
  formatLayerRef,
  isDsecError,
  parseLayerRef,
  randomId,
  resolveLayer,
  throwIfAborted,
} from '@dsec/core';
import type {
  BackendKind,
  CommandResult,
  CommandSpec,
  CreateSandboxRequest,
  EdgeApi,
  EdgeVolumeApi,
  EdgeVolumeInfo,
  EdgeSnapshotRequest,
  EdgeStatus,
  ImageStore,
  LayerInfo,
  LayerView,
  RunCommandOptions,
  SandboxInfo,
  SnapshotInfo,
} from '@dsec/core';

export interface FakeEdgeOptions {
  edgeId: string;
  capacity?: { memoryMb: number; cpuCores: number; sandboxes: number };
  backends?: BackendKind[];
  /** Simulated create latency (lets tests overlap concurrent creates). Default 0. */
  createDelayMs?: number;
  /** How long a paused sandbox waits for a resume before it is stopped. Default 86 400. */
  pausedTtlSeconds?: number;
  now?: () => number;
  /**
   * The platform's layers (`name` or `name:version`). Given, a create
   * resolves every layer it names as the real edge does (the platform's,
   * then the snapshots of `layerView`'s projects) and answers
   * `image_not_found` otherwise; absent, any name is a platform layer.
   */
  platformImages?: string[];
}

/** What `getSandbox` reports as charged memory: a running sandbox, and one whose memory went back. */
export const FAKE_MEMORY_BYTES = { running: 24 * 1024 * 1024, paused: 256 * 1024 } as const;

/**
 * An in-memory `EdgeApi` that keeps the contract of a real edge: admission
 * against its own capacity (`capacity_exhausted`), `sandbox_not_found` for
 * unknown IDs, `requestId` idempotency, TTL expiry (checked lazily), and
 * `runCommand` that "runs" by echoing: stdout is `argv.join(' ')` (or the
 * shell line) plus a newline, stderr is the stdin it was given; `false` as
 * argv[0] exits 1. Fault hooks: `healthy = false` fails `status()`,
 * `failNextCreate` makes the next create throw that error.
 *
 * Lifecycle as the real edge keeps it: pausing a paused sandbox and resuming
 * a running one are no-ops, a paused sandbox resumes on its next command,
 * and a stopped one answers `sandbox_not_running`. The running TTL clock
 * stops while paused (resume moves `expiresAt` by the time spent paused);
 * a paused sandbox is stopped at `pausedExpiresAt` instead. A snapshot
 * records its image in `images` under its layer key (`project/name:version`:
 * the sandbox's project owns it; a name its view already sees is
 * `conflict`) and weighs `snapshotBytes` (past the request's `maxBytes`:
 * `quota_exceeded`). `create` accepts any image name unless
 * `platformImages` is given (see there). `getSandbox` reports
 * `FAKE_MEMORY_BYTES` as the charged memory.
 */
export class FakeEdge implements EdgeApi {
  readonly edgeId: string;
  readonly capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
  readonly backends: BackendKind[];
  healthy = true;
  failNextCreate: Error | undefined;
  createCalls = 0;
  readonly #sandboxes = new Map<string, SandboxInfo>();
  readonly #byRequest = new Map<string, string>();
  /** Snapshot images by layer key (`project/name:version`). */
  readonly images = new Map<string, SnapshotInfo>();
  /** What the next snapshots weigh (`layer.sizeBytes`). */
  snapshotBytes = 0;
  /** The creates this edge was asked for, in order. */
  readonly creates: CreateSandboxRequest[] = [];
  readonly #platformImages: Set<string> | undefined;
  /** Running time left to a paused sandbox, by ID. */
  readonly #remainingMs = new Map<string, number>();
  readonly #createDelayMs: number;
  readonly #pausedTtlMs: number;
  readonly #now: () => number;
  /**
   * Volumes in memory (docs/volumes.md), by `project\nname`: a create that
   * names one the project lacks is `volume_not_found`, a delete while a live
   * sandbox names it `volume_in_use`, as on a real edge.
   */
  readonly volumes: EdgeVolumeApi;
  readonly #volumes = new Map<string, EdgeVolumeInfo>();

  constructor(options: FakeEdgeOptions) {
    this.edgeId = options.edgeId;
    this.capacity = options.capacity ?? { memoryMb: 1 << 20, cpuCores: 1024, sandboxes: 1000 };
    this.backends = options.backends ?? ['container'];
    this.#createDelayMs = options.createDelayMs ?? 0;
    this.#pausedTtlMs = (options.pausedTtlSeconds ?? 86_400) * 1000;
    this.#now = options.now ?? Date.now;
    this.volumes = this.#volumeApi();
    this.#platformImages =
      options.platformImages &&
      new Set(options.platformImages.map((r) => formatLayerRef(parseLayerRef(r)!)));
  }

  /** Layer records as a store would answer them: the platform's, and the snapshots taken here. */
  readonly #layers: Pick<ImageStore, 'getLayer'> = {
    getLayer: async (ref, options) => {
      const parsed = parseLayerRef(ref);
      const key = parsed && formatLayerKey({ ...parsed, project: options?.project });
      const snap = key === undefined ? undefined : this.images.get(key);
      if (snap) return snap.layer;
      const platform =
        parsed !== undefined &&
        options?.project === undefined &&
        (this.#platformImages?.has(formatLayerRef(parsed)) ?? true);
      if (!platform) throw new DsecError('image_not_found', `no layer ${ref}`);
      return fakeLayer(parsed);
    },
  };

  /** Every layer this edge knows, as a store lists them: the platform's, then the snapshots. */
  layers(): LayerInfo[] {
    const platform = [...(this.#platformImages ?? [])].map((r) => fakeLayer(parseLayerRef(r)!));
    return [...platform, ...[...this.images.values()].map((i) => clone(i.layer))];
  }

  /** Drops a snapshot of `project` (a store's `removeLayer`); `image_not_found` when absent. */
  async removeLayer(ref: string, project: string): Promise<void> {
    const parsed = parseLayerRef(ref);
    const key = parsed && formatLayerKey({ ...parsed, project });
    if (!key || !this.images.delete(key)) throw new DsecError('image_not_found', `no layer ${ref}`);
  }

  async status(signal?: AbortSignal): Promise<EdgeStatus> {
    throwIfAborted(signal);
    if (!this.healthy) throw new DsecError('unavailable', `edge ${this.edgeId} is down`);
    const used = { memoryMb: 0, cpuCores: 0, sandboxes: 0 };
    const sandboxesByProject: Record<string, number> = {};
    for (const s of this.#live()) {
      used.memoryMb += s.spec.memoryLimitMb;
      used.cpuCores += s.spec.cpuCoresLimit;
      used.sandboxes += 1;
      sandboxesByProject[s.projectId] = (sandboxesByProject[s.projectId] ?? 0) + 1;
    }
    return {
      edgeId: this.edgeId,
      url: `fake://${this.edgeId}`,
      healthy: true,
      backends: [...this.backends],
      capacity: { ...this.capacity },
      used,
      sandboxesByProject,
      labels: {},
    };
  }

  async createSandbox(req: CreateSandboxRequest, signal?: AbortSignal): Promise<SandboxInfo> {
    throwIfAborted(signal);
    this.createCalls++;
    if (this.failNextCreate) {
      const err = this.failNextCreate;
      this.failNextCreate = undefined;
      throw err;
    }
    if (!this.healthy) throw new DsecError('unavailable', `edge ${this.edgeId} is down`);
    this.creates.push(clone(req));
    const view = req.layerView ?? [req.projectId];
    const named: [string, string][] = [
      ['image', req.spec.image],
      ...(req.spec.workspace ? [['workspace', req.spec.workspace] as [string, string]] : []),
      ...req.spec.toolkits.map((t, i): [string, string] => [`toolkits.${i}`, t]),
    ];
    for (const [field, ref] of named) {
      await resolveLayer(this.#layers, ref, view).catch((err: unknown) => {
        if (isDsecError(err, 'image_not_found'))
          throw new DsecError('image_not_found', err.message, { field });
        throw err;
      });
    }
    const requestKey =
      req.requestId === undefined ? undefined : `${req.projectId}\n${req.requestId}`;
    const earlier = requestKey === undefined ? undefined : this.#byRequest.get(requestKey);
    if (earlier !== undefined) return clone(this.#get(earlier));
    if (this.#sandboxes.has(req.id)) throw new DsecError('conflict', `sandbox ${req.id} exists`);
    (req.spec.volumes ?? []).forEach((v, i) => {
      if (!this.#volumes.has(`${req.projectId}\n${v.name}`))
        throw new DsecError('volume_not_found', `no volume ${v.name}`, {
          field: `volumes.${i}.name`,
        });
    });
    if (!this.backends.includes(req.spec.backend)) {
      throw new DsecError(
        'capacity_exhausted',
        `edge ${this.edgeId} has no ${req.spec.backend} backend`,
      );
    }
    const live = this.#live();
    const mem = live.reduce((n, s) => n + s.spec.memoryLimitMb, 0);
    const cpu = live.reduce((n, s) => n + s.spec.cpuCoresLimit, 0);
    if (
      live.length + 1 > this.capacity.sandboxes ||
      mem + req.spec.memoryLimitMb > this.capacity.memoryMb ||
      cpu + req.spec.cpuCoresLimit > this.capacity.cpuCores + 1e-9
    ) {
      throw new DsecError('capacity_exhausted', `edge ${this.edgeId} is full`);
    }
    const now = this.#now();
    const info: SandboxInfo = {
      id: req.id,
      edgeId: this.edgeId,
      projectId: req.projectId,
      state: 'creating',
      spec: clone(req.spec),
      createdAt: new Date(now).toISOString(),
      expiresAt: new Date(now + req.spec.ttlSeconds * 1000).toISOString(),
    };
    // Admission is synchronous (capacity is taken before the first await), as on a real edge.
    this.#sandboxes.set(info.id, info);
    if (requestKey !== undefined) this.#byRequest.set(requestKey, info.id);
    if (this.#createDelayMs > 0) await new Promise((r) => setTimeout(r, this.#createDelayMs));
    if (info.state === 'creating') info.state = 'running';
    return clone(info);
  }

  async getSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    throwIfAborted(signal);
    const s = clone(this.#get(id));
    if (s.state === 'running' || s.state === 'creating') s.memoryBytes = FAKE_MEMORY_BYTES.running;
    else if (s.state === 'paused') s.memoryBytes = FAKE_MEMORY_BYTES.paused;
    return s;
  }

  async listSandboxes(
    filter: { projectIds?: string[] },
    signal?: AbortSignal,
  ): Promise<SandboxInfo[]> {
    throwIfAborted(signal);
    const want = filter.projectIds ? new Set(filter.projectIds) : undefined;
    return [...this.#sandboxes.values()]
      .map((s) => this.#get(s.id))
      .filter((s) => !want || want.has(s.projectId))
      .map(clone);
  }

  async stopSandbox(id: string, signal?: AbortSignal): Promise<void> {
    throwIfAborted(signal);
    const s = this.#get(id);
    if (s.state !== 'stopped' && s.state !== 'failed') this.#end(s, 'stopped by request');
  }

  async pauseSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    throwIfAborted(signal);
    const s = this.#running(id, true);
    if (s.state === 'running') {
      const now = this.#now();
      this.#remainingMs.set(id, Math.max(0, Date.parse(s.expiresAt) - now));
      s.state = 'paused';
      s.pausedAt = new Date(now).toISOString();
      s.pausedExpiresAt = new Date(now + this.#pausedTtlMs).toISOString();
    }
    return clone(s);
  }

  async resumeSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    throwIfAborted(signal);
    return clone(this.#resume(this.#running(id, true)));
  }

  async setSandboxTimeout(
    id: string,
    ttlSeconds: number,
    signal?: AbortSignal,
  ): Promise<SandboxInfo> {
    throwIfAborted(signal);
    if (!Number.isSafeInteger(ttlSeconds) || ttlSeconds < 1) {
      throw new DsecError('invalid_argument', 'ttlSeconds must be an integer ≥ 1', {
        field: 'ttlSeconds',
      });
    }
    const s = this.#running(id, true);
    const now = this.#now();
    s.expiresAt = new Date(now + ttlSeconds * 1000).toISOString();
    if (s.state === 'paused') this.#remainingMs.set(id, ttlSeconds * 1000);
    return clone(s);
  }

  async snapshotSandbox(
    id: string,
    req: EdgeSnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    throwIfAborted(signal);
    const ref = parseLayerRef(req.name);
    if (!ref) {
      throw new DsecError('invalid_argument', 'name must be a layer reference', { field: 'name' });
    }
    const s = this.#running(id, true);
    const image = formatLayerRef(ref);
    const owner = s.projectId;
    const view: LayerView = [...(req.layerView ?? []), owner];
    // Without `platformImages` every name would be the platform's: only snapshots can be taken.
    const taken = this.#platformImages
      ? await resolveLayer(this.#layers, image, view).then(
          () => true,
          () => false,
        )
      : view.some((p) => this.images.has(formatLayerKey({ ...ref, project: p })));
    if (taken) throw new DsecError('conflict', `image ${image} exists`, { field: 'name' });
    if (req.maxBytes !== undefined && this.snapshotBytes > req.maxBytes) {
      throw new DsecError('quota_exceeded', `snapshot ${image} is over its quota`, {
        details: { resource: 'imageBytes', limit: req.maxBytes, requested: this.snapshotBytes },
      });
    }
    const scrub = [...(req.scrub ?? [])];
    const parents = [
      s.spec.image,
      ...(s.spec.workspace ? [s.spec.workspace] : []),
      ...s.spec.toolkits,
    ];
    const digest = `sha256:${createHash('sha256').update(`${id}\n${image}`).digest('hex')}`;
    const info: SnapshotInfo = {
      image,
      layer: {
        name: ref.name,
        version: ref.version,
        kind: 'snapshot',
        digest,
        project: owner,
        sizeBytes: this.snapshotBytes,
        contentBytes: 0,
        fileCount: 0,
        createdAt: new Date(this.#now()).toISOString(),
        source: 'snapshot',
        parents,
      },
      parents,
      scrub,
      freezeMs: 0,
      totalMs: 0,
    };
    this.images.set(formatLayerKey({ ...ref, project: owner }), info);
    return clone(info);
  }

  async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    throwIfAborted(options.signal);
    const s = this.#get(id);
    // Another project's sandbox is not found, whatever its state (no existence leak).
    if (options.projectId !== undefined && s.projectId !== options.projectId)
      throw new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
    // A paused sandbox resumes on its next command, as on a real edge.
    if (s.state === 'paused') this.#resume(s);
    if (s.state !== 'running')
      throw new DsecError('sandbox_not_running', `sandbox ${id} is ${s.state}`);
    const stdout = Buffer.from(
      `${command.argv ? command.argv.join(' ') : (command.shell ?? '')}\n`,
    );
    const stderr = Buffer.from(command.stdin ?? '');
    // Two chunks, so streaming callers see more than one event.
    const half = Math.ceil(stdout.length / 2);
    options.onStdout?.(stdout.subarray(0, half));
    await Promise.resolve();
    options.onStdout?.(stdout.subarray(half));
    if (stderr.length > 0) options.onStderr?.(stderr);
    const cap = command.maxOutputBytes ?? 1_048_576;
    return {
      commandId: randomId('cmd'),
      exitCode: command.argv?.[0] === 'false' ? 1 : 0,
      outcome: 'exited',
      stdout: stdout.subarray(0, cap).toString(),
      stderr: stderr.subarray(0, cap).toString(),
      truncated: stdout.length > cap || stderr.length > cap,
      stdoutBytes: stdout.length,
      stderrBytes: stderr.length,
      durationMs: 0,
    };
  }

  /** Sandboxes holding capacity (creating, running or paused, not expired). */
  #volumeApi(): EdgeVolumeApi {
    const key = (projectId: string, name: string) => `${projectId}\n${name}`;
    const users = (projectId: string, name: string) =>
      this.#live()
        .filter((s) => s.projectId === projectId && s.spec.volumes?.some((v) => v.name === name))
        .map((s) => s.id);
    const find = (projectId: string, name: string) => {
      const v = this.#volumes.get(key(projectId, name));
      if (!v) throw new DsecError('volume_not_found', `no volume ${name}`, { field: 'name' });
      return { ...v, mountedBy: users(projectId, name) };
    };
    return {
      create: async (req, signal) => {
        throwIfAborted(signal);
        if (!this.healthy) throw new DsecError('unavailable', `edge ${this.edgeId} is down`);
        if (this.#volumes.has(key(req.projectId, req.name)))
          throw new DsecError('conflict', `volume ${req.name} exists`, { field: 'name' });
        const v: EdgeVolumeInfo = {
          ...req,
          createdAt: new Date(this.#now()).toISOString(),
          usedBytes: 0,
          mountedBy: [],
        };
        this.#volumes.set(key(req.projectId, req.name), v);
        return { ...v };
      },
      get: async (projectId, name) => find(projectId, name),
      list: async (projectId) =>
        [...this.#volumes.values()]
          .filter((v) => projectId === undefined || v.projectId === projectId)
          .map((v) => find(v.projectId, v.name)),
      delete: async (projectId, name) => {
        const v = find(projectId, name);
        if (v.mountedBy.length > 0)
          throw new DsecError('volume_in_use', `volume ${name} is mounted`, {
            details: { sandboxes: v.mountedBy },
          });
        this.#volumes.delete(key(projectId, name));
      },
    };
  }

  #live(): SandboxInfo[] {
    return [...this.#sandboxes.keys()]
      .map((id) => this.#get(id))
      .filter((s) => s.state === 'creating' || s.state === 'running' || s.state === 'paused');
  }

  /** A sandbox that is running (or, with `orPaused`, paused); `sandbox_not_running` otherwise. */
  #running(id: string, orPaused: boolean): SandboxInfo {
    const s = this.#get(id);
    if (s.state === 'running' || (orPaused && s.state === 'paused')) return s;
    throw new DsecError('sandbox_not_running', `sandbox ${id} is ${s.state}`, {
      details: { state: s.state },
    });
  }

  #resume(s: SandboxInfo): SandboxInfo {
    if (s.state !== 'paused') return s;
    const remaining = this.#remainingMs.get(s.id) ?? 0;
    this.#remainingMs.delete(s.id);
    s.state = 'running';
    s.expiresAt = new Date(this.#now() + remaining).toISOString();
    delete s.pausedAt;
    delete s.pausedExpiresAt;
    return s;
  }

  #end(s: SandboxInfo, reason: string): void {
    s.state = 'stopped';
    s.reason ??= reason;
    delete s.pausedAt;
    delete s.pausedExpiresAt;
    this.#remainingMs.delete(s.id);
  }

  #get(id: string): SandboxInfo {
    const s = this.#sandboxes.get(id);
    if (!s)
      throw new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
    const now = this.#now();
    if ((s.state === 'running' || s.state === 'creating') && Date.parse(s.expiresAt) <= now) {
      this.#end(s, 'ttl expired');
    } else if (s.state === 'paused' && Date.parse(s.pausedExpiresAt ?? '') <= now) {
      this.#end(s, 'paused ttl expired');
    }
    return s;
  }
}

function fakeLayer(ref: { name: string; version: string }): LayerInfo {
  return {
    name: ref.name,
    version: ref.version,
    kind: 'base',
    digest: `sha256:${createHash('sha256').update(formatLayerRef(ref)).digest('hex')}`,
    sizeBytes: 0,
    contentBytes: 0,
    fileCount: 0,
    createdAt: new Date(0).toISOString(),
    source: 'fake',
  };
}

function clone<T>(v: T): T {
  return structuredClone(v);
}
