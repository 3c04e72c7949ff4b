import type {
  CommandResult,
  ErrorCode,
  NetworkRules,
  NetworkTarget,
  QosClass,
  SandboxState,
} from '@dsec/core';

/** Every SDK call accepts these. */
export interface CallOptions {
  signal?: AbortSignal | undefined;
  /** Deadline for the call; defaults per call are documented on each method. */
  timeoutMs?: number | undefined;
}

export interface DSecClientOptions {
  /** Apiserver URL; default `DSEC_URL`, else `http://127.0.0.1:7420`. */
  url?: string | undefined;
  /** Bearer key; default `DSEC_API_KEY`. */
  apiKey?: string | undefined;
  /** Deadline of calls that do not say otherwise; default 30 s. */
  timeoutMs?: number | undefined;
  /** Pooled sockets per apiserver; default 256. */
  maxSockets?: number | undefined;
}

/**
 * A container sandbox request, shaped after libdsec's `DSecContainerRunArgs`.
 * Defaults are the server's (docs/CONVENTIONS.md, `CreateSandboxBody`).
 */
export interface RunContainerOptions {
  /** Base image layer, `name` or `name:version`. */
  image: string;
  workspace?: string | undefined;
  toolkits?: string[] | undefined;
  memoryLimitMb?: number | undefined;
  cpuCoresLimit?: number | undefined;
  pidsLimit?: number | undefined;
  /** Disk quota of the writable layer in MiB (ENOSPC past it); default: none. */
  diskLimitMb?: number | undefined;
  /**
   * CPU QoS class (default `latency-sensitive`): `best-effort` sandboxes run
   * under SCHED_IDLE with minimal CPU weight and only get cycles that
   * latency-sensitive work leaves idle.
   */
  qosClass?: QosClass | undefined;
  /** libdsec's `ttl_running_stop`: an alias of `ttlSeconds`. */
  ttlRunningStopSeconds?: number | undefined;
  ttlSeconds?: number | undefined;
  networkRules?: NetworkRules | undefined;
  /** Egress allowed on top of `networkRules`: `{ domain: '*.example.com', ports: [443] }`, `{ cidr }`. */
  networkAllow?: NetworkTarget[] | undefined;
  /** Egress denied whatever else allows it. */
  networkDeny?: NetworkTarget[] | undefined;
  initUser?: string | undefined;
  env?: Record<string, string> | undefined;
  labels?: Record<string, string> | undefined;
  /** Labels the chosen edge must carry, e.g. `{ pool: 'gpu', hardware: 'h200' }`; default: any edge. */
  edgeSelector?: Record<string, string> | undefined;
  projectId?: string | undefined;
  /** Idempotency key: a retry with the same ID returns the same sandbox. */
  requestId?: string | undefined;
}

export interface RunCommandOptions {
  /** Command timeout enforced by the server (default 60 s); the call's deadline is this + 30 s. */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
  user?: string | undefined;
  /** Whole stdin, sent then closed. */
  stdin?: string | undefined;
  /** Cap on captured bytes per stream (default 1 MiB); head and tail are kept. */
  maxOutputBytes?: number | undefined;
  /** When either callback is set the output streams; each gets decoded UTF-8 text in order. */
  onStdout?: ((chunk: string) => void) | undefined;
  onStderr?: ((chunk: string) => void) | undefined;
}

export type { CommandResult };

/** `GET /v1/whoami`. */
export interface Whoami {
  keyId: string;
  projectId: string;
  role: 'admin' | 'member';
  /** The key's scopes; absent for an unscoped key. */
  scopes?: string[] | undefined;
}

/** `Sandbox.snapshot`: capture the sandbox's filesystem as an image `runContainer` accepts. */
export interface SnapshotOptions extends CallOptions {
  /** Name of the image, `name` or `name:version` (lower-case name). */
  name: string;
  /**
   * Absolute paths removed from the captured layer first (build residue,
   * reference answers); a trailing `/**` takes a whole tree.
   */
  scrub?: string[] | undefined;
}

/** The answer of a whole-job operation (`pauseJob`, …): every selected sandbox, one list or the other. */
export interface JobResult {
  sandboxes: { id: string; state: SandboxState }[];
  failed: { id: string; code: ErrorCode; message: string }[];
}

/** Options of the whole-job operations. */
export interface JobOptions extends CallOptions {
  /** The project to look in (and its descendants); default the key's. */
  projectId?: string | undefined;
}

/** `GET /healthz`. */
export interface Health {
  ok: boolean;
  version: string;
}

export interface ProjectQuota {
  sandboxes?: number | undefined;
  memoryMb?: number | undefined;
  cpuCores?: number | undefined;
}

/**
 * A project as the apiserver returns it. Only `id` and `name` are relied on;
 * the rest is shown when present.
 */
export interface Project {
  id: string;
  name: string;
  parentId?: string | null | undefined;
  quota?: ProjectQuota | undefined;
  createdAt?: string | undefined;
}

export interface CreateProjectOptions extends CallOptions {
  name: string;
  parentId?: string | undefined;
  quota?: ProjectQuota | undefined;
}

export interface CreateKeyOptions extends CallOptions {
  projectId: string;
  role?: 'admin' | 'member' | undefined;
  name?: string | undefined;
  /**
   * Limits the key (default: unscoped, every right of its role):
   * `sandboxes:snapshot` to snapshot and fork, `images:run:<pattern>` to
   * create sandboxes from matching images (`*` matches anything).
   */
  scopes?: string[] | undefined;
}

/** `POST /v1/keys`; `key` is the secret and is shown only once. */
export interface CreatedKey {
  id: string;
  key: string;
  projectId: string;
  role: 'admin' | 'member';
  scopes?: string[] | undefined;
}
