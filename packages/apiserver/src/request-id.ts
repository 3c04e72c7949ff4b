import { randomBytes } from 'node:crypto';

/**
 * Request IDs (`x-request-id`, logs) from a pooled buffer of random bytes:
 * one `randomBytes` call per 4 KiB instead of one per request, which cost
 * more than the rest of a warm exec's routing. Same CSPRNG, same shape as
 * `randomId('req', 9)`: `req-` and 12 URL-safe characters.
 */
let pool = Buffer.alloc(0);
let offset = 0;

export function requestId(): string {
  if (offset + 9 > pool.length) {
    pool = randomBytes(4095);
    offset = 0;
  }
  const id = `req-${pool.toString('base64url', offset, offset + 9)}`;
  offset += 9;
  return id;
}
