/**
 * The closed set of DSec errors. Every error that crosses a module or process
 * boundary is a `DsecError` with one of these codes; the HTTP status is mapped
 * here and nowhere else. Clients match on `code`, never on message text.
 * docs/errors.md lists every code (a test keeps the two in sync).
 */
export const ERROR_CODES = {
  invalid_argument: { status: 400, retryable: false, summary: 'A request field is invalid.' },
  unauthenticated: {
    status: 401,
    retryable: false,
    summary: 'Missing, malformed or revoked API key.',
  },
  permission_denied: { status: 403, retryable: false, summary: 'The caller may not do this.' },
  not_found: { status: 404, retryable: false, summary: 'No such route or resource.' },
  sandbox_not_found: { status: 404, retryable: false, summary: 'No such sandbox (or not yours).' },
  image_not_found: { status: 404, retryable: false, summary: 'No image or layer with that name.' },
  command_not_found: { status: 404, retryable: false, summary: 'No command with that ID.' },
  volume_not_found: {
    status: 404,
    retryable: false,
    summary: 'No volume of that name in the project (or not yours).',
  },
  conflict: { status: 409, retryable: false, summary: 'The resource already exists or changed.' },
  sandbox_not_running: { status: 409, retryable: false, summary: 'The sandbox is not running.' },
  volume_in_use: {
    status: 409,
    retryable: true,
    summary: 'A sandbox mounts the volume (or is being created with it); stop it first.',
  },
  payload_too_large: { status: 413, retryable: false, summary: 'The request body is too large.' },
  quota_exceeded: { status: 429, retryable: true, summary: 'A project quota would be exceeded.' },
  resource_exhausted: {
    status: 429,
    retryable: true,
    summary: 'The sandbox hit one of its own limits (pids, memory, disk); details name it.',
  },
  rate_limited: {
    status: 429,
    retryable: true,
    summary: 'Too many requests of one kind from this client; wait `Retry-After`.',
  },
  capacity_exhausted: {
    status: 503,
    retryable: true,
    summary: 'No node has capacity for the sandbox now.',
  },
  unavailable: { status: 503, retryable: true, summary: 'A component is down; retry.' },
  deadline_exceeded: {
    status: 504,
    retryable: true,
    summary: 'The operation ran past its deadline.',
  },
  aborted: { status: 499, retryable: true, summary: 'The caller cancelled the operation.' },
  internal: { status: 500, retryable: true, summary: 'A bug or a host fault; see server logs.' },
} as const satisfies Record<string, { status: number; retryable: boolean; summary: string }>;

export type ErrorCode = keyof typeof ERROR_CODES;

export interface DsecErrorOptions {
  /** The request field at fault, as a dotted path (`memoryLimitMb`, `argv.0`). */
  field?: string;
  /** Structured context safe to show a client (never secrets). */
  details?: Record<string, unknown>;
  cause?: unknown;
}

export class DsecError extends Error {
  readonly code: ErrorCode;
  readonly field: string | undefined;
  readonly details: Record<string, unknown> | undefined;

  constructor(code: ErrorCode, message: string, options: DsecErrorOptions = {}) {
    super(message, { cause: options.cause });
    this.name = 'DsecError';
    this.code = code;
    this.field = options.field;
    this.details = options.details;
  }

  get status(): number {
    return ERROR_CODES[this.code].status;
  }

  get retryable(): boolean {
    return ERROR_CODES[this.code].retryable;
  }

  /** The wire form: `{ error: { code, message, field?, details? } }`. */
  toJSON(): ErrorBody {
    return {
      error: {
        code: this.code,
        message: this.message,
        ...(this.field !== undefined ? { field: this.field } : {}),
        ...(this.details !== undefined ? { details: this.details } : {}),
      },
    };
  }

  /** Rebuilds an error from its wire form; unknown codes become `internal`. */
  static fromBody(body: unknown, fallbackStatus = 500): DsecError {
    const e = (body as Partial<ErrorBody> | undefined)?.error;
    if (e && typeof e.code === 'string' && typeof e.message === 'string') {
      const code = isErrorCode(e.code) ? e.code : 'internal';
      return new DsecError(code, e.message, { field: e.field, details: e.details });
    }
    return new DsecError(
      fallbackStatus >= 500 ? 'unavailable' : 'internal',
      `HTTP ${fallbackStatus}`,
    );
  }
}

export interface ErrorBody {
  error: { code: ErrorCode; message: string; field?: string; details?: Record<string, unknown> };
}

export function isErrorCode(code: string): code is ErrorCode {
  return Object.hasOwn(ERROR_CODES, code);
}

export function isDsecError(err: unknown, code?: ErrorCode): err is DsecError {
  return err instanceof DsecError && (code === undefined || err.code === code);
}

/**
 * Wraps anything thrown into a DsecError, keeping DsecErrors as they are. A
 * full disk (ENOSPC, EDQUOT, SQLite's SQLITE_FULL) is `unavailable`: the node
 * cannot take the write now, and a retry may succeed (elsewhere, or later).
 */
export function toDsecError(err: unknown, code: ErrorCode = 'internal'): DsecError {
  if (err instanceof DsecError) return err;
  if (err instanceof Error && err.name === 'AbortError') {
    return new DsecError('aborted', 'operation aborted', { cause: err });
  }
  const errCode = (err as { code?: unknown } | undefined)?.code;
  if (errCode === 'ENOSPC' || errCode === 'EDQUOT' || errCode === 'SQLITE_FULL') {
    const message = err instanceof Error ? err.message : String(err);
    return new DsecError('unavailable', `the node is out of disk space: ${message}`, {
      cause: err,
      details: { reason: 'disk_full' },
    });
  }
  const message = err instanceof Error ? err.message : String(err);
  return new DsecError(code, message, { cause: err });
}

/** Throws `aborted` if the signal has fired. */
export function throwIfAborted(signal: AbortSignal | undefined): void {
  if (signal?.aborted)
    throw new DsecError('aborted', 'operation aborted', { cause: signal.reason });
}
