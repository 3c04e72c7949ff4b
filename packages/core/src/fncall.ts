/**
 * FnCall (paper 2.2, 7; issue 14): stateless function calls run in warm pools
 * of pre-created sandboxes. One call runs one program to completion; nothing
 * it leaves behind (files, processes, environment) is seen by the next call.
 */

/** Why a call ended. `ok` only says the program ran to its own exit; read `exitCode`. */
export type FnCallOutcome =
  'ok' | 'timeout' | 'oom' | 'output_limit' | 'signaled' | 'pids_limit' | 'runtime_error';

/** One call, as the SDK, the HTTP API and the edge take it. */
export interface FnCallRequest {
  /** A runtime name (`python`, `node`, `bash`, or one an operator added). */
  language: string;
  /** The program's source, written to the runtime's entry file. */
  code: string;
  /** Whole stdin, sent then closed. */
  stdin?: string | undefined;
  /** Extra files beside the program, by relative path (UTF-8 text). */
  files?: Record<string, string> | undefined;
  /** Arguments after the program (`sys.argv[1:]`, `process.argv.slice(2)`). */
  args?: string[] | undefined;
  env?: Record<string, string> | undefined;
  /** Wall-clock limit of the call (default 10 s, at most 300 s). */
  timeoutMs?: number | undefined;
  /** Memory ceiling of the call (default: the runtime's). */
  memoryMb?: number | undefined;
  /** Egress allowed (default false: no network). Calls with network run in a separate pool. */
  network?: boolean | undefined;
  /** Cap on captured bytes per stream (default 1 MiB); past it the call ends with `output_limit`. */
  maxOutputBytes?: number | undefined;
  /** GPU assignment for runtimes on GPU edges (issue 14.5): `shared` or `exclusive`, and how many. */
  gpu?: FnCallGpuRequest | undefined;
  /** Labels an edge must carry, as for sandboxes. */
  edgeSelector?: Record<string, string> | undefined;
}

export interface FnCallGpuRequest {
  mode: 'shared' | 'exclusive';
  count?: number | undefined;
  /** Only devices of this model (`H200`, `A100-80GB`), or MIG profile (`1g.10gb`). */
  model?: string | undefined;
}

export interface FnCallResult {
  /** The program's exit code (128 + signal when a signal ended it, -1 when it never ran). */
  exitCode: number;
  stdout: string;
  stderr: string;
  /** True when either stream went past `maxOutputBytes`. */
  truncated: boolean;
  outcome: FnCallOutcome;
  /** From the start of the program to its end, as the worker measured it. */
  durationMs: number;
  /** Set when the platform, not the program, ended or failed the call. */
  reason?: string | undefined;
  /** Which edge ran it (for support; never needed to interpret the result). */
  edgeId?: string | undefined;
}

/** A runtime's warm pool on one edge, as the edge reports it in `EdgeStatus.fncall`. */
export interface FnCallPoolStatus {
  language: string;
  network: boolean;
  /** Workers started and waiting for a call. */
  idle: number;
  /** Workers running a call now. */
  busy: number;
  /** Workers being created or recycled. */
  starting: number;
  /** The most workers this pool may hold (admission may cap it lower). */
  max: number;
  /** The GPU request every worker of this pool holds (GPU pools only; absent: no GPU). */
  gpu?: FnCallGpuRequest | undefined;
}

/** One GPU unit of an edge (a whole GPU or a MIG instance), as it reports it in `EdgeStatus.gpus`. */
export interface FnCallGpuUnitStatus {
  kind: 'gpu' | 'mig';
  uuid: string;
  /** A whole GPU's name (`NVIDIA H200`); a MIG instance's profile (`1g.10gb`). */
  model: string;
  /** `free` when no worker holds it. */
  mode: 'free' | 'shared' | 'exclusive';
  /** Workers holding it now. */
  workers: number;
  /** Workers one unit takes at most in shared mode. */
  maxSharedWorkers: number;
}

/** `1g.10gb`, `3g.40gb`, `1g.10gb+me`, `1c.3g.40gb`, `1g.18gb` (H200): a MIG profile, not a GPU model. */
const MIG_PROFILE = /^(\d+c\.)?\d+g\.\d+gb(\+[a-z]+)?$/i;

export function isMigProfile(model: string): boolean {
  return MIG_PROFILE.test(model);
}

/**
 * Whether a GPU named `name` (`NVIDIA A100-SXM4-80GB`) is a `model` a caller
 * asked for (`A100-80GB`, `a100`, `H200`, the full name): every dash- or
 * space-separated word of the request is a word of the name, ignoring case
 * and a leading `NVIDIA`. So `A100` matches every A100, `A100-80GB` only the
 * 80 GB ones.
 */
export function gpuModelMatches(name: string, model: string): boolean {
  const words = (s: string) =>
    s
      .toLowerCase()
      .split(/[\s-]+/)
      .filter((w) => w !== '' && w !== 'nvidia');
  const have = new Set(words(name));
  const want = words(model);
  return want.length > 0 && want.every((w) => have.has(w));
}

/**
 * Whether a unit (`kind`, and `model` as `FnCallGpuUnitStatus` names it) is
 * one a request's `model` selects: a MIG profile selects MIG instances of
 * exactly that profile, anything else whole GPUs by `gpuModelMatches`, no
 * model any whole GPU (never a MIG instance).
 */
export function gpuUnitMatches(
  unit: { kind: 'gpu' | 'mig'; model: string },
  model: string | undefined,
): boolean {
  const m = model?.trim() || undefined;
  if (m === undefined) return unit.kind === 'gpu';
  if (isMigProfile(m)) return unit.kind === 'mig' && unit.model.toLowerCase() === m.toLowerCase();
  return unit.kind === 'gpu' && gpuModelMatches(unit.model, m);
}

/**
 * How many of an edge's units (`EdgeStatus.gpus`) a request could be given
 * now: matching its model, and free (exclusive) or not held exclusively and
 * with room (shared). The edge's allocator decides; this is for routing.
 */
export function gpuUnitsUsable(
  units: readonly FnCallGpuUnitStatus[],
  request: FnCallGpuRequest,
): number {
  return units.filter(
    (u) =>
      gpuUnitMatches(u, request.model) &&
      (request.mode === 'exclusive'
        ? u.mode === 'free'
        : u.mode !== 'exclusive' && u.workers < u.maxSharedWorkers),
  ).length;
}

/** Options of an edge's (or the apiserver's) call entry point. */
export interface FnCallOptions {
  signal?: AbortSignal | undefined;
  /** The caller's project: quotas and audit. */
  projectId: string;
  /** Idempotency is not offered: calls are cheap and stateless, retry them. */
}
