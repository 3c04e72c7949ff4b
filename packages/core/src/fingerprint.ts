import { createHash } from 'node:crypto';

/**
 * The fingerprint that binds an idempotency key to its request: SHA-256
 * (hex) of the request's canonical JSON, in which object keys are sorted at
 * every depth and `undefined` members are left out, so two requests that
 * mean the same thing hash the same however their bodies were written.
 * Callers hash the request after defaults are applied (the normalised
 * spec), so spelling a default out does not change the fingerprint.
 */
export function requestFingerprint(request: unknown): string {
  return createHash('sha256').update(canonicalJson(request), 'utf8').digest('hex');
}

/** JSON with sorted object keys and no `undefined` members; throws on cycles and non-JSON values. */
export function canonicalJson(value: unknown): string {
  return JSON.stringify(canonical(value, new Set()));
}

function canonical(value: unknown, seen: Set<object>): unknown {
  if (value === null || typeof value !== 'object') {
    if (typeof value === 'bigint' || typeof value === 'function' || typeof value === 'symbol')
      throw new TypeError(`canonicalJson: ${typeof value} is not JSON`);
    return value;
  }
  if (seen.has(value)) throw new TypeError('canonicalJson: cyclic value');
  seen.add(value);
  try {
    if (Array.isArray(value))
      return value.map((v) => (v === undefined ? null : canonical(v, seen)));
    const json = (value as { toJSON?: () => unknown }).toJSON;
    if (typeof json === 'function') return canonical(json.call(value), seen);
    const out: Record<string, unknown> = {};
    for (const key of Object.keys(value).sort()) {
      const v = (value as Record<string, unknown>)[key];
      if (v !== undefined) out[key] = canonical(v, seen);
    }
    return out;
  } finally {
    seen.delete(value);
  }
}
