import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { DsecError } from './errors.js';

/**
 * Sandbox IDs encode the edge that owns the sandbox, so any stateless
 * apiserver can route a request without a lookup store (paper 3.2). The ID
 * carries an HMAC under the cluster secret: a forged or edited ID fails to
 * decode instead of routing to a host of the caller's choosing.
 *
 * Layout (before base64url): version(1) | edgeLen(1) | edge | random(9) | mac(8).
 */
const VERSION = 1;
const RANDOM_BYTES = 9;
const MAC_BYTES = 8;
const PREFIX = 'sb-';
export const EDGE_ID_PATTERN = /^[a-z0-9][a-z0-9-]{0,62}$/;

export interface DecodedSandboxId {
  edgeId: string;
}

export class SandboxIdCodec {
  readonly #secret: Buffer;

  constructor(secret: string | Buffer) {
    this.#secret = typeof secret === 'string' ? Buffer.from(secret, 'utf8') : secret;
    if (this.#secret.length < 16) throw new Error('cluster secret must be at least 16 bytes');
  }

  /** A new, unique ID for a sandbox placed on `edgeId`. */
  mint(edgeId: string): string {
    if (!EDGE_ID_PATTERN.test(edgeId)) throw new Error(`invalid edge id ${JSON.stringify(edgeId)}`);
    const edge = Buffer.from(edgeId, 'utf8');
    const body = Buffer.concat([
      Buffer.from([VERSION, edge.length]),
      edge,
      randomBytes(RANDOM_BYTES),
    ]);
    return PREFIX + Buffer.concat([body, this.#mac(body)]).toString('base64url');
  }

  /** Decodes and verifies an ID; throws `sandbox_not_found` for anything forged or malformed. */
  decode(id: string): DecodedSandboxId {
    const notFound = () =>
      new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
    if (typeof id !== 'string' || !id.startsWith(PREFIX) || id.length > 200) throw notFound();
    const raw = Buffer.from(id.slice(PREFIX.length), 'base64url');
    if (raw.toString('base64url') !== id.slice(PREFIX.length)) throw notFound();
    if (raw.length < 2 + RANDOM_BYTES + MAC_BYTES || raw[0] !== VERSION) throw notFound();
    const edgeLen = raw[1] ?? 0;
    const bodyLen = 2 + edgeLen + RANDOM_BYTES;
    if (raw.length !== bodyLen + MAC_BYTES) throw notFound();
    const body = raw.subarray(0, bodyLen);
    if (!timingSafeEqual(raw.subarray(bodyLen), this.#mac(body))) throw notFound();
    const edgeId = body.subarray(2, 2 + edgeLen).toString('utf8');
    if (!EDGE_ID_PATTERN.test(edgeId)) throw notFound();
    return { edgeId };
  }

  #mac(body: Buffer): Buffer {
    return createHmac('sha256', this.#secret).update(body).digest().subarray(0, MAC_BYTES);
  }
}

/** Random URL-safe identifier with a readable prefix (`cmd-…`, `key-…`). */
export function randomId(prefix: string, bytes = 12): string {
  return `${prefix}-${pooledRandomBytes(bytes).toString('base64url')}`;
}

let pool = Buffer.alloc(0);
let poolOffset = 0;

/**
 * `n` random bytes from a pooled buffer: one `randomBytes` call per 4 KiB
 * instead of one per ID (the synchronous call costs more than the rest of a
 * warm exec's routing). Same CSPRNG, same unpredictability. The answer is a
 * view of the pool: use it at once (`toString`), never keep it.
 */
export function pooledRandomBytes(n: number): Buffer {
  if (n > 4096) return randomBytes(n);
  if (poolOffset + n > pool.length) {
    pool = randomBytes(4096);
    poolOffset = 0;
  }
  const out = pool.subarray(poolOffset, poolOffset + n);
  poolOffset += n;
  return out;
}
