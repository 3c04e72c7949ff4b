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
}

/** Options of an edge's (or the apiserver's) call entry point. */
export interface FnCallOptions {
  signal?: AbortSignal | undefined;
  /** The caller's project: quotas and audit. */
  projectId: string;
  /** Idempotency is not offered: calls are cheap and stateless, retry them. */
}
