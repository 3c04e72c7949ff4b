import { randomBytes } from 'node:crypto';

/**
 * Random bytes from a pooled buffer: one `randomBytes` call per 4 KiB instead
 * of one per command (the synchronous call costs more than the rest of a
 * warm session round trip). Same CSPRNG, same unpredictability.
 */
let pool = Buffer.alloc(0);
let offset = 0;

export function pooledRandom(n: number): Buffer {
  if (offset + n > pool.length) {
    pool = randomBytes(4096);
    offset = 0;
  }
  const out = pool.subarray(offset, offset + n);
  offset += n;
  return out;
}

/** A 128-bit hex nonce. */
export function nonce(): string {
  return pooledRandom(16).toString('hex');
}

/** `prefix-` and 16 URL-safe characters (96 bits), like `randomId` in @dsec/core. */
export function fastId(prefix: string): string {
  return `${prefix}-${pooledRandom(12).toString('base64url')}`;
}
