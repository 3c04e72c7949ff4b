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

/** A key in E2B's format: `e2b_` + 64 lower-case hex digits (the same 32 bytes). */
export const E2B_KEY_PATTERN = /^e2b_[0-9a-f]{64}$/;

/**
 * The key in E2B's format (`e2b_` + hex of its 32 bytes), which E2B's SDKs
 * accept without `E2B_VALIDATE_API_KEY=false`; undefined for a string that is
 * not a DSec key. The same secret, spelled otherwise: `fromE2bKeyForm` turns
 * it back.
 */
export function e2bKeyForm(key: string): string | undefined {
  if (!API_KEY_PATTERN.test(key)) return undefined;
  const bytes = Buffer.from(key.slice(4), 'base64url');
  // 43 base64url characters hold 32 bytes and 2 spare bits, which a key's own are 0.
  if (bytes.length !== 32 || `dsk_${bytes.toString('base64url')}` !== key) return undefined;
  return `e2b_${bytes.toString('hex')}`;
}

/** A key given in E2B's format as the DSec key it spells; any other string unchanged. */
export function fromE2bKeyForm(key: string): string {
  if (!E2B_KEY_PATTERN.test(key)) return key;
  return `dsk_${Buffer.from(key.slice(4), 'hex').toString('base64url')}`;
}

export function hashApiKey(rawKey: string): string {
  return createHash('sha256').update(rawKey, 'utf8').digest('hex');
}
