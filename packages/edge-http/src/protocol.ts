import { DsecError, toDsecError } from '@dsec/core';

/** Every route of the edge protocol starts with this (docs/edge-protocol.md). */
export const EDGE_PATH_PREFIX = '/edge/v1';

/** Trailer of a streamed answer that failed after its first byte: base64url JSON error body. */
export const HEADER_STREAM_ERROR = 'x-dsec-edge-error';

/** JSON request bodies (a command's inline stdin included) are capped here. */
export const MAX_JSON_BODY_BYTES = 64 * 1024 * 1024;

export function encodeStreamError(err: unknown): string {
  return Buffer.from(JSON.stringify(toDsecError(err).toJSON())).toString('base64url');
}

export function decodeStreamError(value: string): DsecError {
  let body: unknown;
  try {
    body = JSON.parse(Buffer.from(value, 'base64url').toString('utf8'));
  } catch {
    body = undefined;
  }
  return DsecError.fromBody(body, 502);
}
