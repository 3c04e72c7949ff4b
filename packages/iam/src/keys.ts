import { createHash, randomBytes } from 'node:crypto';

/**
 * API keys are `dsk_` + 32 random bytes (base64url, 43 chars). They carry
 * 256 bits of entropy, so a plain SHA-256 is a safe at-rest form: there is
 * nothing to brute-force that a slow hash would protect.
 */
export const API_KEY_PATTERN = /^dsk_[A-Za-z0-9_-]{43}$/;

export function newApiKey(): string {
  return `dsk_${randomBytes(32).toString('base64url')}`;
}

export function hashApiKey(rawKey: string): string {
  return createHash('sha256').update(rawKey, 'utf8').digest('hex');
}
