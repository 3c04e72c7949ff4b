import { Code, ConnectError } from '@connectrpc/connect';
import { toDsecError } from '@dsec/core';
import type { DsecError, ErrorCode } from '@dsec/core';

/**
 * How DSec's closed error set reads to an E2B client. The E2B control plane
 * answers `{ code: <HTTP status>, message }`; the in-sandbox daemon answers
 * Connect codes (RPC) or HTTP statuses (`/files`). A sandbox that is gone is
 * what E2B's proxy reports as 502 / `unavailable`, which the SDKs turn into
 * their "sandbox was killed or timed out" error, so DSec does the same.
 */

const CONNECT_CODES: Record<ErrorCode, Code> = {
  invalid_argument: Code.InvalidArgument,
  unauthenticated: Code.Unauthenticated,
  permission_denied: Code.PermissionDenied,
  not_found: Code.NotFound,
  sandbox_not_found: Code.Unavailable,
  image_not_found: Code.NotFound,
  command_not_found: Code.NotFound,
  volume_not_found: Code.NotFound,
  volume_in_use: Code.FailedPrecondition,
  conflict: Code.AlreadyExists,
  sandbox_not_running: Code.Unavailable,
  payload_too_large: Code.ResourceExhausted,
  quota_exceeded: Code.ResourceExhausted,
  resource_exhausted: Code.ResourceExhausted,
  rate_limited: Code.ResourceExhausted,
  capacity_exhausted: Code.Unavailable,
  unavailable: Code.Unavailable,
  deadline_exceeded: Code.DeadlineExceeded,
  aborted: Code.Canceled,
  internal: Code.Internal,
};

/** The Connect error an envd RPC answers for anything thrown. */
export function toConnectError(err: unknown): ConnectError {
  if (err instanceof ConnectError) return err;
  const e = toDsecError(err);
  const message = e.code === 'internal' ? 'internal error' : e.message;
  return new ConnectError(message, CONNECT_CODES[e.code], undefined, undefined, e);
}

/** The HTTP status of an envd HTTP answer (`/files`, `/health`). */
export function envdHttpStatus(e: DsecError): number {
  if (e.code === 'sandbox_not_found' || e.code === 'sandbox_not_running') return 502;
  if (e.code === 'resource_exhausted' && e.details?.resource === 'disk') return 507;
  return e.status;
}

/** The E2B error body: `code` is the HTTP status; `error_code` carries DSec's stable code. */
export function e2bErrorBody(
  status: number,
  e: DsecError,
): { code: number; message: string; error_code: string } {
  return { code: status, message: e.message, error_code: e.code };
}
