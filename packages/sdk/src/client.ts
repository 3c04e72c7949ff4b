import { randomUUID } from 'node:crypto';
import { DsecError } from '@dsec/core';
import type { Answer, Body, EdgeStatus, LayerInfo, SandboxInfo, VolumeInfo } from './wire.js';
import { jobAction } from './lifecycle.js';
import { Sandbox } from './sandbox.js';
import { FnCalls } from './fncall.js';
import { HttpTransport } from './transport.js';
import type {
  CallOptions,
  CreatedKey,
  CreateKeyOptions,
  CreateProjectOptions,
  DSecClientOptions,
  Health,
  JobOptions,
  JobResult,
  Project,
  RunContainerOptions,
  Whoami,
} from './types.js';

export const DEFAULT_URL = 'http://127.0.0.1:7420';
export const DEFAULT_TIMEOUT_MS = 30_000;
export const DEFAULT_CREATE_TIMEOUT_MS = 120_000;
/** A full VM boots Debian and X: minutes under TCG (no KVM). */
export const VM_CREATE_TIMEOUT_MS = 900_000;

/** An idempotency key (`[A-Za-z0-9._:-]{1,128}`) for a call the SDK may resend. */
export function newRequestId(): string {
  return `ts-${randomUUID()}`;
}

/**
 * A connection to one DSec apiserver. Cheap to keep: it pools keep-alive
 * sockets, so one client should serve many sandboxes and concurrent calls.
 * Every method throws `DsecError`; `unavailable` when the server cannot be
 * reached, `aborted` on `signal`, `deadline_exceeded` past `timeoutMs`.
 */
export class DSecClient {
  readonly url: string;
  /** Who the key belongs to; set by `open()`. */
  whoami: Whoami | undefined;
  /** Stateless function calls in warm pools (`run`, `map`; docs/fncall.md). */
  readonly fncall: FnCalls;
  readonly #http: HttpTransport;
  readonly #timeoutMs: number;

  constructor(options: DSecClientOptions = {}) {
    this.url = options.url ?? process.env.DSEC_URL ?? DEFAULT_URL;
    this.#timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.#http = new HttpTransport({
      url: this.url,
      apiKey: options.apiKey ?? process.env.DSEC_API_KEY,
      maxSockets: options.maxSockets,
      retry: options.retry,
    });
    this.fncall = new FnCalls(this.#http);
  }

  /**
   * Checks that the server answers and the key is valid, and records
   * `whoami`. Optional: every other call works without it, but this fails
   * early with a clear `unavailable` or `unauthenticated`.
   */
  async open(options: CallOptions = {}): Promise<Whoami> {
    await this.health(options);
    this.whoami = await this.#get<Whoami>('/v1/whoami', options);
    return this.whoami;
  }

  /** Releases pooled sockets. Later calls throw `unavailable`. */
  close(): void {
    this.#http.close();
  }

  health(options: CallOptions = {}): Promise<Health> {
    return this.#get<Health>('/healthz', options);
  }

  /**
   * Creates a container sandbox and returns once it is running (the paper's
   * `run_container`). Deadline: `timeoutMs`, default 120 s. Pass `requestId`
   * to make a retry after a lost answer return the same sandbox.
   * Throws `invalid_argument` (with `field`), `image_not_found`,
   * `quota_exceeded`, `capacity_exhausted`, and the transport errors.
   */
  async runContainer(spec: RunContainerOptions, options: CallOptions = {}): Promise<Sandbox> {
    const { ttlRunningStopSeconds, ttlSeconds, ...rest } = spec;
    if (
      ttlRunningStopSeconds !== undefined &&
      ttlSeconds !== undefined &&
      ttlRunningStopSeconds !== ttlSeconds
    ) {
      throw new DsecError(
        'invalid_argument',
        'give ttlSeconds or ttlRunningStopSeconds, not both',
        {
          field: 'ttlRunningStopSeconds',
        },
      );
    }
    const body: Body<'createSandbox'> = {
      backend: 'container',
      ...rest,
      ttlSeconds: ttlSeconds ?? ttlRunningStopSeconds,
      // With an idempotency key a resend cannot create a second sandbox.
      requestId: spec.requestId ?? newRequestId(),
    };
    const info = await this.#http.json<Answer<'createSandbox', 201>>({
      method: 'POST',
      path: '/v1/sandboxes',
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? DEFAULT_CREATE_TIMEOUT_MS,
      idempotent: true,
    });
    return new Sandbox(this.#http, info.id, info, this.#timeoutMs);
  }

  /**
   * Like `runContainer`, in a microVM (`backend: 'microvm'`): the sandbox
   * gets its own guest kernel, and everything else (commands, sessions,
   * files, ports, terminals) works the same. Edges without QEMU refuse it.
   */
  runMicroVM(spec: RunContainerOptions, options: CallOptions = {}): Promise<Sandbox> {
    // runContainer spreads the spec after its `backend`, so this one wins.
    return this.runContainer({ ...spec, backend: 'microvm' } as RunContainerOptions, options);
  }

  /**
   * A full VM (`backend: 'vm'`): a Debian guest with a display, booted under
   * QEMU; `sandbox.screenshot()` and `sandbox.input(...)` drive its screen,
   * and commands, files and the xterm's shell run in `image`'s layers (the
   * guest's own system only provides the kernel, X and the agent), under the
   * spec's disk, pids and network rules. Needs 384 MiB or more of memory;
   * booting takes minutes without KVM.
   */
  runVM(spec: RunContainerOptions, options: CallOptions = {}): Promise<Sandbox> {
    return this.runContainer({ ...spec, backend: 'vm' } as RunContainerOptions, {
      ...options,
      timeoutMs: options.timeoutMs ?? VM_CREATE_TIMEOUT_MS,
    });
  }

  /** A handle for an existing sandbox; makes no request (`refresh()` loads its info). */
  sandbox(id: string): Sandbox {
    return new Sandbox(this.#http, id, undefined, this.#timeoutMs);
  }

  /** Fetches a sandbox's info; throws `sandbox_not_found`. */
  async getSandbox(id: string, options: CallOptions = {}): Promise<Sandbox> {
    const sandbox = this.sandbox(id);
    await sandbox.refresh(options);
    return sandbox;
  }

  /**
   * The sandboxes this key may see, optionally of one project, optionally
   * only those carrying every label of `labels` (`{ job: 'rl-7' }`).
   */
  async listSandboxes(
    options: CallOptions & {
      projectId?: string | undefined;
      labels?: Record<string, string> | undefined;
    } = {},
  ): Promise<SandboxInfo[]> {
    const q = new URLSearchParams();
    if (options.projectId) q.append('projectId', options.projectId);
    for (const [k, v] of Object.entries(options.labels ?? {})) q.append('label', `${k}=${v}`);
    const query = q.size > 0 ? `?${q.toString()}` : '';
    return (await this.#get<{ sandboxes: SandboxInfo[] }>(`/v1/sandboxes${query}`, options))
      .sandboxes;
  }

  /**
   * Pauses every live sandbox carrying all of `labels` (what a trainer sends
   * when its job is preempted). Each sandbox succeeds or fails on its own:
   * the answer lists both. `labels` must name at least one label.
   */
  pauseJob(labels: Record<string, string>, options: JobOptions = {}): Promise<JobResult> {
    return jobAction(this.#http, 'pause', labels, options);
  }

  /** Resumes every paused sandbox carrying all of `labels`; see `pauseJob`. */
  resumeJob(labels: Record<string, string>, options: JobOptions = {}): Promise<JobResult> {
    return jobAction(this.#http, 'resume', labels, options);
  }

  /** Stops every live sandbox carrying all of `labels` and frees its quota; see `pauseJob`. */
  stopJob(labels: Record<string, string>, options: JobOptions = {}): Promise<JobResult> {
    return jobAction(this.#http, 'stop', labels, options);
  }

  /** Every live sandbox carrying all of `labels` stops `seconds` from now; see `pauseJob`. */
  extendJob(
    labels: Record<string, string>,
    seconds: number,
    options: JobOptions = {},
  ): Promise<JobResult> {
    return jobAction(this.#http, 'extend', labels, { ...options, seconds });
  }

  /**
   * The layers the key's project sees: the platform's bases, workspaces and
   * toolkits, and the snapshots and forks of the project and its ancestors
   * (`project` names the owner; absent: the platform's). `projectId` lists
   * what that project (the key's own or a descendant) sees; `all` adds the
   * per-OCI-layer records (`oci-diff:*`) registry imports keep.
   */
  async listImages(
    options: CallOptions & { all?: boolean; projectId?: string } = {},
  ): Promise<LayerInfo[]> {
    const query = new URLSearchParams();
    if (options.all) query.set('all', 'true');
    if (options.projectId !== undefined) query.set('projectId', options.projectId);
    const path = query.size > 0 ? `/v1/images?${query.toString()}` : '/v1/images';
    return (await this.#get<{ layers: LayerInfo[] }>(path, options)).layers;
  }

  /**
   * Deletes a snapshot or fork the key's project (or `projectId`, a
   * descendant) owns, giving its bytes back to the project's `imageBytes`
   * quota. `image_not_found` for any layer the project does not own itself
   * (the platform's, an ancestor's, another tenant's); `conflict` while
   * another layer was snapshotted on top of it.
   */
  async deleteImage(
    ref: string,
    options: CallOptions & { projectId?: string } = {},
  ): Promise<void> {
    const query =
      options.projectId !== undefined ? `?projectId=${encodeURIComponent(options.projectId)}` : '';
    await this.#http.json<undefined>({
      method: 'DELETE',
      path: `/v1/images/${encodeURIComponent(ref)}${query}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }

  /**
   * Creates the project's volume `name` (docs/volumes.md): `sizeMb` of
   * ext4 on one edge, counted against the `volumeBytes` quota. Mount it with
   * `volumes: [{ name, path }]` on `runContainer`. `conflict` when the project
   * has one of that name; `quota_exceeded` when it does not fit. Never resent.
   */
  async createVolume(
    name: string,
    options: CallOptions & { sizeMb: number; projectId?: string },
  ): Promise<VolumeInfo> {
    const body: Body<'createVolume'> = {
      name,
      sizeMb: options.sizeMb,
      ...(options.projectId !== undefined ? { projectId: options.projectId } : {}),
    };
    return this.#http.json<VolumeInfo>({
      method: 'POST',
      path: '/v1/volumes',
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
    });
  }

  /** The project's volumes (the key's, or `projectId`: its own or a descendant). */
  async listVolumes(options: CallOptions & { projectId?: string } = {}): Promise<VolumeInfo[]> {
    return (
      await this.#get<{ volumes: VolumeInfo[] }>(`/v1/volumes${projectQuery(options)}`, options)
    ).volumes;
  }

  /** One volume with its use now (`usedBytes`, `mountedBy`); `volume_not_found` when absent. */
  async getVolume(
    name: string,
    options: CallOptions & { projectId?: string } = {},
  ): Promise<VolumeInfo> {
    return this.#get<VolumeInfo>(
      `/v1/volumes/${encodeURIComponent(name)}${projectQuery(options)}`,
      options,
    );
  }

  /** Deletes a volume and its bytes; `volume_in_use` while a sandbox mounts it. */
  async deleteVolume(
    name: string,
    options: CallOptions & { projectId?: string } = {},
  ): Promise<void> {
    await this.#http.json<undefined>({
      method: 'DELETE',
      path: `/v1/volumes/${encodeURIComponent(name)}${projectQuery(options)}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }

  async createProject(options: CreateProjectOptions): Promise<Project> {
    const body: Body<'createProject'> = {
      name: options.name,
      parentId: options.parentId,
      quota: options.quota,
    };
    return this.#http.json<Project>({
      method: 'POST',
      path: '/v1/projects',
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
    });
  }

  /** The key's project and its descendants. */
  async listProjects(options: CallOptions = {}): Promise<Project[]> {
    return (await this.#get<{ projects: Project[] }>('/v1/projects', options)).projects;
  }

  /** The cluster's edges with their health and load; needs an admin key of the root project. */
  async listEdges(options: CallOptions = {}): Promise<EdgeStatus[]> {
    return (await this.#get<{ edges: EdgeStatus[] }>('/v1/edges', options)).edges;
  }

  /** Creates an API key; the secret in `key` is returned only this once. */
  async createKey(options: CreateKeyOptions): Promise<CreatedKey> {
    const body: Body<'createKey'> = {
      projectId: options.projectId,
      role: options.role,
      name: options.name,
      scopes: options.scopes,
    };
    return this.#http.json<CreatedKey>({
      method: 'POST',
      path: '/v1/keys',
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
    });
  }

  async deleteKey(id: string, options: CallOptions = {}): Promise<void> {
    await this.#http.json<undefined>({
      method: 'DELETE',
      path: `/v1/keys/${encodeURIComponent(id)}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }

  #get<T>(path: string, options: CallOptions): Promise<T> {
    return this.#http.json<T>({
      method: 'GET',
      path,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }
}

function projectQuery(options: { projectId?: string | undefined }): string {
  return options.projectId !== undefined
    ? `?projectId=${encodeURIComponent(options.projectId)}`
    : '';
}
