import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import type { IncomingHttpHeaders } from 'node:http';
import { DsecError } from '@dsec/core';

/**
 * Mutual authentication of the apiserver ↔ edge link with one secret per
 * edge (docs/edge-protocol.md, "Authentication"):
 *
 * - the client signs every request: HMAC-SHA256 over the edge ID, method,
 *   path with query, a millisecond timestamp and a random nonce;
 * - the server accepts a request only within ±60 s of its own clock and
 *   only once per nonce, and answers 401 `unauthenticated` otherwise, before
 *   it touches the edge;
 * - the server proves itself on every answer (a 101 included) with an HMAC
 *   over the edge ID and the client's nonce, which the client checks before
 *   it reads anything else of the answer.
 *
 * The two messages start with different labels, so neither can stand in
 * for the other. Bodies are not covered: this authenticates the two ends;
 * confidentiality and integrity of the bytes in between need TLS (an
 * `https:` URL) or a private network.
 */

export const HEADER_TIME = 'x-dsec-edge-time';
export const HEADER_NONCE = 'x-dsec-edge-nonce';
export const HEADER_SIGNATURE = 'x-dsec-edge-signature';
export const HEADER_PROOF = 'x-dsec-edge-proof';

/** How far a request's timestamp may be from the server's clock, either way. */
export const MAX_CLOCK_SKEW_MS = 60_000;
/** Shortest secret `serveEdge` and `RemoteEdge` accept (a `newEdgeSecret()` is 43 characters). */
export const MIN_SECRET_LENGTH = 32;

const NONCE = /^[A-Za-z0-9_-]{16,128}$/;
const TIME = /^[0-9]{1,16}$/;

/** A fresh per-edge secret: 32 random bytes, base64url. */
export function newEdgeSecret(): string {
  return randomBytes(32).toString('base64url');
}

export function checkSecret(secret: string, field: string): void {
  if (typeof secret !== 'string' || secret.length < MIN_SECRET_LENGTH) {
    throw new DsecError(
      'invalid_argument',
      `the edge secret must be at least ${MIN_SECRET_LENGTH} characters (use newEdgeSecret())`,
      { field },
    );
  }
}

export function requestSignature(
  secret: string,
  edgeId: string,
  method: string,
  path: string,
  time: string,
  nonce: string,
): string {
  return createHmac('sha256', secret)
    .update(`dsec-edge-request\n${edgeId}\n${method.toUpperCase()}\n${path}\n${time}\n${nonce}`)
    .digest('base64url');
}

export function responseProof(secret: string, edgeId: string, nonce: string): string {
  return createHmac('sha256', secret)
    .update(`dsec-edge-response\n${edgeId}\n${nonce}`)
    .digest('base64url');
}

/** The headers that sign one request, and its nonce (to check the answer's proof). */
export function signRequest(
  secret: string,
  edgeId: string,
  method: string,
  path: string,
  nowMs: number = Date.now(),
): { headers: Record<string, string>; nonce: string } {
  const nonce = randomBytes(16).toString('base64url');
  const time = String(nowMs);
  return {
    nonce,
    headers: {
      [HEADER_TIME]: time,
      [HEADER_NONCE]: nonce,
      [HEADER_SIGNATURE]: requestSignature(secret, edgeId, method, path, time, nonce),
    },
  };
}

/** Constant-time string equality (the length, public anyway, is compared first). */
export function safeEqual(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}

/** The client's check of an answer: the proof must be over its own nonce. */
export function validProof(
  secret: string,
  edgeId: string,
  nonce: string,
  headers: IncomingHttpHeaders,
): boolean {
  const proof = headers[HEADER_PROOF];
  return typeof proof === 'string' && safeEqual(proof, responseProof(secret, edgeId, nonce));
}

/**
 * The server's check of requests. Nonces of accepted requests are kept
 * twice the skew window from their arrival, long enough that a replay is
 * either refused as seen or as stale. Only correctly signed requests are
 * remembered, so the set grows with the authenticated request rate alone
 * (a client without the secret cannot fill it).
 */
export class RequestVerifier {
  readonly #secret: string;
  readonly #edgeId: string;
  readonly #now: () => number;
  /** nonce → when it may be forgotten; insertion order is (nearly) expiry order. */
  readonly #seen = new Map<string, number>();

  constructor(options: { secret: string; edgeId: string; now?: () => number }) {
    this.#secret = options.secret;
    this.#edgeId = options.edgeId;
    this.#now = options.now ?? Date.now;
  }

  /**
   * Returns the request's nonce when it is authentic and fresh; throws
   * `unauthenticated` otherwise. `nonceOf` gives the nonce for the proof
   * even of a refused request, so the client can trust the 401 it gets.
   */
  verify(method: string, path: string, headers: IncomingHttpHeaders): string {
    const time = headers[HEADER_TIME];
    const nonce = headers[HEADER_NONCE];
    const signature = headers[HEADER_SIGNATURE];
    if (typeof time !== 'string' || typeof nonce !== 'string' || typeof signature !== 'string') {
      throw unauthenticated('the request is not signed with the edge secret');
    }
    if (!TIME.test(time) || !NONCE.test(nonce)) {
      throw unauthenticated('malformed edge signature headers');
    }
    const now = this.#now();
    if (Math.abs(Number(time) - now) > MAX_CLOCK_SKEW_MS) {
      throw unauthenticated(
        `the request's timestamp is more than ${MAX_CLOCK_SKEW_MS / 1000} s from the edge's clock`,
        { skewMs: Number(time) - now },
      );
    }
    const expected = requestSignature(this.#secret, this.#edgeId, method, path, time, nonce);
    if (!safeEqual(signature, expected)) {
      throw unauthenticated('bad request signature (a different secret, or not this edge)');
    }
    this.#forgetExpired(now);
    if (this.#seen.has(nonce)) throw unauthenticated('replayed request (nonce already used)');
    this.#seen.set(nonce, now + 2 * MAX_CLOCK_SKEW_MS);
    return nonce;
  }

  /** The nonce to prove an answer over, when the request carries a well-formed one. */
  static nonceOf(headers: IncomingHttpHeaders): string | undefined {
    const nonce = headers[HEADER_NONCE];
    return typeof nonce === 'string' && NONCE.test(nonce) ? nonce : undefined;
  }

  /** Nonces remembered now (for tests and metrics). */
  get rememberedNonces(): number {
    return this.#seen.size;
  }

  #forgetExpired(now: number): void {
    for (const [nonce, until] of this.#seen) {
      if (until > now) break;
      this.#seen.delete(nonce);
    }
  }
}

function unauthenticated(message: string, details?: Record<string, unknown>): DsecError {
  return new DsecError('unauthenticated', message, details ? { details } : {});
}
