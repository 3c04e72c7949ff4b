import { DsecError, isDsecError } from '@dsec/core';

interface FastifyLikeError {
  code?: unknown;
  statusCode?: unknown;
}

/**
 * Maps anything a request can throw to a `DsecError`. Transport-level
 * rejections from fastify (body too large, bad JSON, wrong content type) are
 * the client's fault and become 4xx; anything unrecognised is `internal`
 * with a generic message (the cause stays in the server log, not the answer).
 */
export function toHttpError(err: unknown, requestId: string): DsecError {
  if (isDsecError(err)) {
    // An internal error's message may describe the host; the client gets the request ID instead.
    return err.code === 'internal'
      ? new DsecError('internal', `internal error (request ${requestId})`, { cause: err })
      : err;
  }
  const e = (typeof err === 'object' && err !== null ? err : {}) as FastifyLikeError;
  const status = typeof e.statusCode === 'number' ? e.statusCode : undefined;
  const code = typeof e.code === 'string' ? e.code : '';
  if (code === 'FST_ERR_CTP_BODY_TOO_LARGE' || status === 413) {
    return new DsecError('payload_too_large', 'request body exceeds the 1 MiB limit', {
      cause: err,
    });
  }
  if (code === 'FST_ERR_CTP_INVALID_MEDIA_TYPE' || status === 415) {
    return new DsecError('invalid_argument', 'request bodies must be application/json', {
      cause: err,
    });
  }
  if (
    code === 'FST_ERR_CTP_INVALID_JSON_BODY' ||
    code === 'FST_ERR_CTP_EMPTY_JSON_BODY' ||
    err instanceof SyntaxError
  ) {
    return new DsecError('invalid_argument', 'request body is not valid JSON', { cause: err });
  }
  if (status === 404) return new DsecError('not_found', 'no such route', { cause: err });
  if (code === 'FST_ERR_MAX_PARAM_LENGTH') {
    return new DsecError('invalid_argument', 'a path parameter is longer than 256 characters', {
      field: 'path',
      cause: err,
    });
  }
  if (status !== undefined && status >= 400 && status < 500) {
    return new DsecError('invalid_argument', 'malformed request', { cause: err });
  }
  return new DsecError('internal', `internal error (request ${requestId})`, { cause: err });
}
