import { createHash, createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import type { IncomingHttpHeaders } from 'node:http';
import { DsecError } from '@dsec/core';

/**
 * Mutual authentication of the apiserver ↔ edge link with one secret per
 * edge (docs/edge-protocol.md, "Authentication"):
 *
 * - the client signs every request: HMAC-SHA256 over the edge ID, method,
 *   path with query, a millisecond timestamp, a random nonce and the
 *   request body's SHA-256 (or `stream`, and then a MAC trailer after the
 *   body);
 * - the server accepts a request only within ±60 s of its own clock and
 *   only once per nonce, and answers 401 `unauthenticated` otherwise, before
 *   it touches the edge, and with no proof: a proof is only ever made for a
 *   request that verified;
 * - the server proves every answer to a verified request (a 101 included)
 *   with an HMAC over that request (edge ID, nonce, method, path) and the
 *   answer's status, content type, upgrade and body SHA-256 (or `stream`);
 *   a streamed answer then authenticates its bytes itself: every frame
 *   carries a MAC in sequence (commands, terminals, ports), a byte answer
 *   ends with a MAC trailer over its SHA-256 (file downloads).
 *
 * Every message starts with its own label, so none can stand in for
 * another. This authenticates both ends and every byte between them; it
 * does not hide them: confidentiality needs TLS (`serveEdge`'s `tls`, and
 * `RemoteEdge`'s `tls.pinSha256`) or a private network.
 */

export const HEADER_TIME = 'x-dsec-edge-time';
export const HEADER_NONCE = 'x-dsec-edge-nonce';
export const HEADER_SIGNATURE = 'x-dsec-edge-signature';
/** The request body's digest, signed: `sha256:<base64url>`, or `stream` (then a MAC trailer). */
export const HEADER_BODY = 'x-dsec-edge-body';
export const HEADER_PROOF = 'x-dsec-edge-proof';
/** Trailer after a streamed body (either way): base64url HMAC over its SHA-256. */
export const TRAILER_BODY_MAC = 'x-dsec-edge-body-mac';

/** The body marker of a streamed request or answer. */
export const STREAMED = 'stream';

/** How far a request's timestamp may be from the server's clock, either way. */
export const MAX_CLOCK_SKEW_MS = 60_000;
/** Shortest secret `serveEdge` and `RemoteEdge` accept (a `newEdgeSecret()` is 43 characters). */
export const MIN_SECRET_LENGTH = 32;
/** Bytes of the MAC after each frame of a command, terminal or port stream. */
export const FRAME_MAC_BYTES = 32;

const NONCE = /^[A-Za-z0-9_-]{16,128}$/;
const TIME = /^[0-9]{1,16}$/;
const DIGEST = /^sha256:[A-Za-z0-9_-]{43}$/;

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

/** `sha256:<base64url>` of a body, the form both ends sign and prove. */
export function bodyDigest(body: Buffer | Uint8Array): string {
  return `sha256:${createHash('sha256').update(body).digest('base64url')}`;
}

/** The digest of a hash fed as the bytes went by. */
export function digestOf(hash: ReturnType<typeof createHash>): string {
  return `sha256:${hash.digest('base64url')}`;
}

/**
 * `upgrade` is the protocol an upgrade request asks for (its `Upgrade`
 * header) and '' for any other request: which one the server takes it for
 * must be what the client signed, or a header added or dropped on the way
 * would make a request the other kind (and its refusal a proven answer).
 */
export function requestSignature(
  secret: string,
  edgeId: string,
  method: string,
  path: string,
  time: string,
  nonce: string,
  body: string,
  upgrade = '',
): string {
  return createHmac('sha256', secret)
    .update(
      `dsec-edge-request\n${edgeId}\n${method.toUpperCase()}\n${path}\n${time}\n${nonce}\n${body}\n${upgrade}`,
    )
    .digest('base64url');
}

/** What an answer's proof covers besides the request: the parts the client can see. */
export interface AnswerHead {
  status: number;
  /** The `content-type` header, '' without one. */
  contentType: string;
  /** The `upgrade` header of a 101, '' otherwise. */
  upgrade: string;
  /** `bodyDigest(body)` of a whole answer; `stream` where the body authenticates itself. */
  body: string;
}

/**
 * One signed exchange as both ends know it: the edge, and the request's
 * nonce, method and path. Everything the server proves about its answer is
 * bound to these, so nothing proven for one request passes for another.
 */
export class SignedExchange {
  readonly #secret: string;
  readonly method: string;

  constructor(
    secret: string,
    readonly edgeId: string,
    readonly nonce: string,
    method: string,
    readonly path: string,
  ) {
    this.#secret = secret;
    this.method = method.toUpperCase();
  }

  /** HMAC(secret, label | edge ID | nonce | method | path | fields), lines joined by `\n`. */
  #mac(label: string, ...fields: (string | number)[]): Buffer {
    return createHmac('sha256', this.#secret)
      .update([label, this.edgeId, this.nonce, this.method, this.path, ...fields].join('\n'))
      .digest();
  }

  /** The `x-dsec-edge-proof` of an answer. */
  proof(head: AnswerHead): string {
    const { status, contentType, upgrade, body } = head;
    return this.#mac('dsec-edge-response', status, contentType, upgrade, body).toString(
      'base64url',
    );
  }

  /** The client's check of an answer's proof (constant time). */
  validProof(headers: IncomingHttpHeaders, head: AnswerHead): boolean {
    const proof = headers[HEADER_PROOF];
    return typeof proof === 'string' && safeEqual(proof, this.proof(head));
  }

  /** The trailer MAC of a streamed request body (`direction` 'request') or answer ('answer'). */
  bodyMac(direction: 'request' | 'answer', digest: string, error = ''): string {
    return this.#mac(`dsec-edge-${direction}-body`, digest, error).toString('base64url');
  }

  /** Sealer of frames one way: `request` is client → edge, `answer` edge → client. */
  sealer(direction: 'request' | 'answer'): FrameMac {
    return new FrameMac(this.#mac('dsec-edge-frames', direction));
  }
}

/**
 * The MACs of one direction of a framed stream: frame `i` is authenticated
 * by HMAC(key, u64be i | u8 type | u32be length | payload) with a key of
 * its exchange and direction, so a frame changed, dropped, repeated,
 * reordered or taken from another stream fails, and the last frame (a
 * result, an exit, an end) proves the stream was not cut short.
 */
export class FrameMac {
  readonly #key: Buffer;
  /** Frames so far; a number is exact to 2^53, far beyond any stream. */
  #seq = 0;

  constructor(key: Buffer) {
    this.#key = key;
  }

  /** The MAC of the next frame (the sender's side). */
  next(type: number, payload: Buffer): Buffer {
    const head = Buffer.allocUnsafe(13);
    const seq = this.#seq++;
    head.writeUInt32BE(Math.floor(seq / 2 ** 32), 0);
    head.writeUInt32BE(seq % 2 ** 32, 4);
    head.writeUInt8(type, 8);
    head.writeUInt32BE(payload.length, 9);
    return createHmac('sha256', this.#key).update(head).update(payload).digest();
  }

  /** Whether `mac` is the next frame's (the receiver's side; constant time). */
  check(type: number, payload: Buffer, mac: Buffer): boolean {
    const want = this.next(type, payload);
    return mac.length === want.length && timingSafeEqual(mac, want);
  }
}

/** The headers that sign one request, and its exchange (to check the answer with). */
export function signRequest(
  secret: string,
  edgeId: string,
  method: string,
  path: string,
  options: { body?: Buffer | typeof STREAMED; nowMs?: number; upgrade?: string } = {},
): { headers: Record<string, string>; exchange: SignedExchange } {
  const nonce = randomBytes(16).toString('base64url');
  const time = String(options.nowMs ?? Date.now());
  const body = options.body ?? Buffer.alloc(0);
  const digest = body === STREAMED ? STREAMED : bodyDigest(body);
  const upgrade = options.upgrade ?? '';
  return {
    exchange: new SignedExchange(secret, edgeId, nonce, method, path),
    headers: {
      [HEADER_TIME]: time,
      [HEADER_NONCE]: nonce,
      [HEADER_BODY]: digest,
      [HEADER_SIGNATURE]: requestSignature(
        secret,
        edgeId,
        method,
        path,
        time,
        nonce,
        digest,
        upgrade,
      ),
    },
  };
}

/** Constant-time string equality (the length, public anyway, is compared first). */
export function safeEqual(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}

/** A request that verified: its exchange, and what its signature says of its body. */
export interface VerifiedRequest {
  exchange: SignedExchange;
  /** `sha256:…` of the whole body, or `stream` (its MAC comes in a trailer). */
  body: string;
}

/**
 * The server's check of requests. Nonces of accepted requests are kept
 * twice the skew window from their arrival, long enough that a replay is
 * either refused as seen or as stale. Only correctly signed requests are
 * remembered, so the set grows with the authenticated request rate alone
 * (a client without the secret cannot fill it). The set lives in memory,
 * so a request signed before this verifier existed is refused too: the
 * nonces a previous process of the edge accepted are gone, and without
 * this an edge restart would take again every request of the minute before
 * it. (A client whose clock is behind the edge's by d is refused for d
 * after a restart.)
 */
export class RequestVerifier {
  readonly #secret: string;
  readonly #edgeId: string;
  readonly #now: () => number;
  /** nonce → when it may be forgotten; insertion order is (nearly) expiry order. */
  readonly #seen = new Map<string, number>();
  /** Requests signed earlier may have been accepted by a process before this one. */
  readonly #startedAt: number;

  constructor(options: { secret: string; edgeId: string; now?: () => number }) {
    this.#secret = options.secret;
    this.#edgeId = options.edgeId;
    this.#now = options.now ?? Date.now;
    this.#startedAt = this.#now();
  }

  /**
   * Returns the verified request when it is authentic and fresh; throws
   * `unauthenticated` otherwise. The body is checked later, by whoever
   * reads it (`bodyMatches`, `Call.rawBody`), against what this returns.
   * `upgrade` is the `Upgrade` header of a request taken as an upgrade,
   * '' for one taken as a plain request (whatever its headers say).
   */
  verify(
    method: string,
    path: string,
    headers: IncomingHttpHeaders,
    upgrade = '',
  ): VerifiedRequest {
    const time = headers[HEADER_TIME];
    const nonce = headers[HEADER_NONCE];
    const signature = headers[HEADER_SIGNATURE];
    const body = headers[HEADER_BODY];
    if (
      typeof time !== 'string' ||
      typeof nonce !== 'string' ||
      typeof signature !== 'string' ||
      typeof body !== 'string'
    ) {
      throw unauthenticated('the request is not signed with the edge secret');
    }
    if (!TIME.test(time) || !NONCE.test(nonce) || (body !== STREAMED && !DIGEST.test(body))) {
      throw unauthenticated('malformed edge signature headers');
    }
    const now = this.#now();
    if (Math.abs(Number(time) - now) > MAX_CLOCK_SKEW_MS) {
      throw unauthenticated(
        `the request's timestamp is more than ${MAX_CLOCK_SKEW_MS / 1000} s from the edge's clock`,
        { skewMs: Number(time) - now },
      );
    }
    const expected = requestSignature(
      this.#secret,
      this.#edgeId,
      method,
      path,
      time,
      nonce,
      body,
      upgrade,
    );
    if (!safeEqual(signature, expected)) {
      throw unauthenticated('bad request signature (a different secret, or not this edge)');
    }
    if (Number(time) < this.#startedAt) {
      throw unauthenticated(
        "the request was signed before the edge's server started (a replay across a restart?)",
        { skewMs: Number(time) - now },
      );
    }
    this.#forgetExpired(now);
    if (this.#seen.has(nonce)) throw unauthenticated('replayed request (nonce already used)');
    this.#seen.set(nonce, now + 2 * MAX_CLOCK_SKEW_MS);
    return { exchange: new SignedExchange(this.#secret, this.#edgeId, nonce, method, path), body };
  }

  /** Nonces remembered now (for tests and metrics). */
  get rememberedNonces(): number {
    return this.#seen.size;
  }

  #forgetExpired(now: number): void {
    for (const [nonce, until] of this.#seen) {
      // Kept through its last millisecond: at `until` a request signed a full skew ahead is
      // still within the skew, one millisecond later it is not.
      if (until >= now) break;
      this.#seen.delete(nonce);
    }
  }
}

/**
 * Whether a body read whole is the one the request signed: its digest
 * equals the signed one, or (a streamed body) its trailer MAC is right.
 */
export function bodyMatches(
  request: VerifiedRequest,
  digest: string,
  trailers: Record<string, string | undefined>,
): boolean {
  if (request.body !== STREAMED) return safeEqual(digest, request.body);
  const mac = trailers[TRAILER_BODY_MAC];
  return typeof mac === 'string' && safeEqual(mac, request.exchange.bodyMac('request', digest));
}

export function unauthenticated(message: string, details?: Record<string, unknown>): DsecError {
  return new DsecError('unauthenticated', message, details ? { details } : {});
}
