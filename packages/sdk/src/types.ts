import type { CreateSandboxBody, KeyBody, ProjectBody } from './wire.js';

export type { CommandResult, CreatedKey, Health, JobResult, Project, Whoami } from './wire.js';

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
  /**
   * Resending of calls that are safe to resend (see `RetryOptions`); `false`
   * turns it off. Default 3 retries, 250 ms doubling up to 4 s, with jitter.
   */
  retry?: RetryOptions | false | undefined;
}

/**
 * Exponential backoff with jitter for calls that are safe to resend: those
 * idempotent by nature (reads, deletes, pause, resume) and those carrying a
 * `requestId` the server deduplicates on (creates always carry one). They
 * are resent on `unavailable`, `capacity_exhausted` and `quota_exceeded`
 * (429): the platform was briefly down, full or over quota. Not on
 * `resource_exhausted` (the sandbox's own limit, which only the caller can
 * free). A call that never reached the server is resent whatever it is.
 * A streamed answer is never resent once output was delivered.
 */
export interface RetryOptions {
  /** Retries after the first attempt; default 3. */
  maxRetries?: number | undefined;
  /** Wait before the first retry, doubled each time; default 250. */
  baseDelayMs?: number | undefined;
  /** Cap on one wait; default 4000. */
  maxDelayMs?: number | undefined;
}

/**
 * A container sandbox request, shaped after libdsec's `DSecContainerRunArgs`:
 * the wire's `CreateSandboxBody` (defaults are the server's) without
 * `backend`, plus libdsec's `ttlRunningStopSeconds` alias.
 */
export interface RunContainerOptions extends Omit<CreateSandboxBody, 'backend'> {
  /** Base image layer, `name` or `name:version`. */
  image: string;
  /**
   * CPU QoS class (default `latency-sensitive`): `best-effort` sandboxes run
   * under SCHED_IDLE with minimal CPU weight and only get cycles that
   * latency-sensitive work leaves idle.
   */
  qosClass?: CreateSandboxBody['qosClass'];
  /** libdsec's `ttl_running_stop`: an alias of `ttlSeconds`. */
  ttlRunningStopSeconds?: number | undefined;
  /** Egress allowed on top of `networkRules`: `{ domain: '*.example.com', ports: [443] }`, `{ cidr }`. */
  networkAllow?: CreateSandboxBody['networkAllow'];
  /** Labels the chosen edge must carry, e.g. `{ pool: 'gpu', hardware: 'h200' }`; default: any edge. */
  edgeSelector?: CreateSandboxBody['edgeSelector'];
  /**
   * Idempotency key: a retry with the same ID returns the same sandbox.
   * Default: a fresh one per call, so the SDK's own retries are safe.
   */
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

/** Options of the whole-job operations. */
export interface JobOptions extends CallOptions {
  /** The project to look in (and its descendants); default the key's. */
  projectId?: string | undefined;
}

export type ProjectQuota = NonNullable<ProjectBody['quota']>;

export interface CreateProjectOptions extends CallOptions, ProjectBody {}

export interface CreateKeyOptions extends CallOptions, KeyBody {
  /**
   * Limits the key (default: unscoped, every right of its role):
   * `sandboxes:snapshot` to snapshot and fork, `images:run:<pattern>` to
   * create sandboxes from matching images (`*` matches anything).
   */
  scopes?: string[] | undefined;
}
