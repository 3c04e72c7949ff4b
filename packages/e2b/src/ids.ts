import { DsecError } from '@dsec/core';

/**
 * E2B-facing sandbox IDs. A DSec ID (`sb-` + base64url) is case-sensitive,
 * but the host-routed form `<port>-<sandboxId>.<domain>` puts the ID in a
 * host name, which URL parsers and DNS lower-case. So the E2B API shows the
 * same bytes in lower-case base32 (`sb` + [a-z2-7]): one ID, two spellings,
 * converted both ways without any lookup. Calls also accept the DSec form.
 */

const ALPHABET = 'abcdefghijklmnopqrstuvwxyz234567';
const DSEC_PREFIX = 'sb-';
const E2B_PREFIX = 'sb';
const E2B_ID = /^sb[a-z2-7]{1,400}$/;

/** The E2B spelling of a DSec sandbox ID. */
export function toE2bSandboxId(dsecId: string): string {
  if (!dsecId.startsWith(DSEC_PREFIX)) return dsecId;
  return E2B_PREFIX + base32Encode(Buffer.from(dsecId.slice(DSEC_PREFIX.length), 'base64url'));
}

/**
 * The DSec ID behind an E2B sandbox ID (either spelling). Throws
 * `sandbox_not_found` for anything malformed, as the native API does for a
 * forged ID; whether it names a real sandbox is the service's to say.
 */
export function toDsecSandboxId(id: string): string {
  if (id.startsWith(DSEC_PREFIX)) return id;
  const bytes = E2B_ID.test(id) ? base32Decode(id.slice(E2B_PREFIX.length)) : undefined;
  if (!bytes || bytes.length === 0) {
    throw new DsecError('sandbox_not_found', `no sandbox ${JSON.stringify(id.slice(0, 80))}`);
  }
  return DSEC_PREFIX + bytes.toString('base64url');
}

/** RFC 4648 base32, lower case, no padding. */
export function base32Encode(bytes: Buffer): string {
  let out = '';
  let bits = 0;
  let value = 0;
  for (const byte of bytes) {
    value = (value << 8) | byte;
    bits += 8;
    while (bits >= 5) {
      out += ALPHABET[(value >>> (bits - 5)) & 31];
      bits -= 5;
    }
  }
  if (bits > 0) out += ALPHABET[(value << (5 - bits)) & 31];
  return out;
}

/** Inverse of `base32Encode`; undefined for a string no encoding produces (stray bits set). */
export function base32Decode(text: string): Buffer | undefined {
  const out: number[] = [];
  let bits = 0;
  let value = 0;
  for (const ch of text) {
    const v = ALPHABET.indexOf(ch);
    if (v < 0) return undefined;
    value = ((value << 5) | v) & 0xffff;
    bits += 5;
    if (bits >= 8) {
      out.push((value >>> (bits - 8)) & 0xff);
      bits -= 8;
    }
  }
  // Leftover bits must be zero padding of the last byte, and fewer than a whole character.
  if (bits >= 5 || (value & ((1 << bits) - 1)) !== 0) return undefined;
  return Buffer.from(out);
}
