import { DsecError } from '@dsec/core';
import type { ForkResult, SandboxInfo, SnapshotInfo } from './wire.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions, JobResult, SnapshotOptions } from './types.js';

/**
 * Pause, resume, TTL, snapshot and fork of one sandbox, and the same over a
 * label selector (issue 11). Used by `Sandbox` and `DSecClient`; exported for
 * callers that hold only an ID.
 */

/** Deadline of calls that wait on work (snapshot, fork, whole-job operations) by default. */
export const DEFAULT_LIFECYCLE_TIMEOUT_MS = 120_000;

/** What a whole-job operation does; `extend` sets each TTL to `seconds` from now. */
export type JobAction = 'pause' | 'resume' | 'stop' | 'extend';

type Defaults = CallOptions & { defaultTimeoutMs: number };

const sandboxPath = (id: string, action: string) =>
  `/v1/sandboxes/${encodeURIComponent(id)}/${action}`;

/** `pause` or `resume`: both are no-ops when repeated, so a resend is safe. */
export function setPaused(
  http: HttpTransport,
  id: string,
  paused: boolean,
  options: Defaults,
): Promise<SandboxInfo> {
  return http.json<SandboxInfo>({
    method: 'POST',
    path: sandboxPath(id, paused ? 'pause' : 'resume'),
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? options.defaultTimeoutMs,
    idempotent: true,
  });
}

/**
 * The sandbox stops `timeoutMs` from now (E2B's `setTimeout`); the server
 * counts whole seconds, so this rounds up. Throws `invalid_argument` before
 * any request for a value below 1 ms.
 */
export async function setSandboxTimeout(
  http: HttpTransport,
  id: string,
  timeoutMs: number,
  options: Defaults,
): Promise<SandboxInfo> {
  if (!Number.isFinite(timeoutMs) || timeoutMs < 1) {
    throw new DsecError('invalid_argument', 'timeoutMs must be at least 1', {
      field: 'timeoutMs',
    });
  }
  return http.json<SandboxInfo>({
    method: 'POST',
    path: sandboxPath(id, 'timeout'),
    body: { seconds: Math.ceil(timeoutMs / 1000) },
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? options.defaultTimeoutMs,
    // A resend sets the same deadline, give or take the time the first took.
    idempotent: true,
  });
}

export function snapshotSandbox(
  http: HttpTransport,
  id: string,
  options: SnapshotOptions,
): Promise<SnapshotInfo> {
  return http.json<SnapshotInfo>({
    method: 'POST',
    path: sandboxPath(id, 'snapshot'),
    body: { name: options.name, ...(options.scrub ? { scrub: options.scrub } : {}) },
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? DEFAULT_LIFECYCLE_TIMEOUT_MS,
  });
}

export function forkSandbox(
  http: HttpTransport,
  id: string,
  count: number,
  options: CallOptions,
): Promise<ForkResult> {
  return http.json<ForkResult>({
    method: 'POST',
    path: sandboxPath(id, 'fork'),
    body: { count },
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? DEFAULT_LIFECYCLE_TIMEOUT_MS,
  });
}

/** `POST /v1/sandboxes:<action>` over a label selector. */
export function jobAction(
  http: HttpTransport,
  action: JobAction,
  labels: Record<string, string>,
  options: CallOptions & { projectId?: string | undefined; seconds?: number | undefined },
): Promise<JobResult> {
  return http.json<JobResult>({
    method: 'POST',
    path: `/v1/sandboxes:${action}`,
    body: {
      labels,
      ...(options.projectId !== undefined ? { projectId: options.projectId } : {}),
      ...(options.seconds !== undefined ? { seconds: options.seconds } : {}),
    },
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? DEFAULT_LIFECYCLE_TIMEOUT_MS,
    // Every action is a no-op on a sandbox already in its target state.
    idempotent: true,
  });
}
