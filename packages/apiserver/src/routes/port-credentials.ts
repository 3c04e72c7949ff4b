import type { IncomingHttpHeaders, OutgoingHttpHeaders } from 'node:http';
import { DsecError } from '@dsec/core';

/**
 * What of a caller's request reaches a sandbox's web server through a port
 * route (the native `…/ports/:port/*` and the E2B host-routed form): never a
 * credential. The sandbox runs the agent's code, so whatever it receives the
 * agent reads. Headers that carry DSec keys by name go (`Authorization` on
 * the native route, `X-API-Key`, `X-Access-Token`, `E2b-Traffic-Access-Token`,
 * `Proxy-Authorization`), with the platform's own `X-Dsec-*` and the E2B
 * routing headers; so does any header, cookie pair or query parameter whose
 * value carries one: the caller's own key, or anything shaped like a DSec API
 * key (`dsk_` and 43 base64url characters), as sent, percent-decoded, or
 * base64-decoded (a key as a Basic password, or in a base64 cookie). Every
 * check is a linear scan (no regular expression over the request).
 */

/** Hop-by-hop headers (RFC 9110 §7.6.1) and `expect`: the proxy's own business. */
const HOP_BY_HOP = new Set([
  'connection',
  'keep-alive',
  'proxy-connection',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
  'expect',
]);

/** Headers that carry a DSec key, or route the request, by their name. */
const CREDENTIAL_HEADERS = new Set([
  'proxy-authorization',
  'x-api-key',
  'x-access-token',
  'e2b-traffic-access-token',
  'e2b-sandbox-id',
  'e2b-sandbox-port',
]);

export interface SandboxBoundOptions {
  /** Secrets of this request to look for besides the DSec key shape (the caller's key). */
  secrets: readonly string[];
  /** Drop `Authorization` whatever it holds (the native route, where it is the DSec credential). */
  dropAuthorization: boolean;
  /** Drop `Host` (the native route sets its own). */
  dropHost?: boolean;
}

/** The headers to send into the sandbox (the caller's, less hop-by-hop and credentials). */
export function sandboxBoundHeaders(
  headers: IncomingHttpHeaders,
  options: SandboxBoundOptions,
): OutgoingHttpHeaders {
  const out: OutgoingHttpHeaders = {};
  for (const [key, value] of Object.entries(headers)) {
    if (value === undefined) continue;
    const name = key.toLowerCase();
    if (HOP_BY_HOP.has(name) || CREDENTIAL_HEADERS.has(name) || name.startsWith('x-dsec-'))
      continue;
    if (carriesCredential(name, options.secrets)) continue;
    if (name === 'authorization' && options.dropAuthorization) continue;
    if (name === 'host' && options.dropHost) continue;
    if (name === 'cookie') {
      const cookie = withoutCredentialCookies(
        Array.isArray(value) ? value.join('; ') : value,
        options.secrets,
      );
      if (cookie !== '') out[key] = cookie;
      continue;
    }
    const values = Array.isArray(value) ? value : [value];
    if (values.some((v) => carriesCredential(v, options.secrets))) continue;
    out[key] = value;
  }
  return out;
}

/**
 * The request target to send into the sandbox: query parameters that carry
 * a credential are left out; a path that carries one is refused
 * (`invalid_argument`, field `path`), since it cannot be sent without it.
 * Characters a request line cannot hold as they are (controls, spaces,
 * anything past ASCII) are percent-encoded.
 */
export function sandboxBoundUrl(raw: string, secrets: readonly string[]): string {
  const url = requestTarget(raw);
  const q = url.indexOf('?');
  const path = q >= 0 ? url.slice(0, q) : url;
  if (carriesCredential(path, secrets)) {
    throw new DsecError(
      'invalid_argument',
      'the path carries an API key; it is never sent to the sandbox',
      { field: 'path' },
    );
  }
  if (q < 0) return url;
  const kept = url
    .slice(q + 1)
    .split('&')
    .filter((param) => param !== '' && !carriesCredential(param, secrets));
  return kept.length > 0 ? `${path}?${kept.join('&')}` : path;
}

function requestTarget(url: string): string {
  let out = '';
  // Through UTF-8 and back: a lone surrogate becomes U+FFFD, which encodeURIComponent takes.
  for (const ch of Buffer.from(url, 'utf8').toString('utf8')) {
    const c = ch.codePointAt(0)!;
    out += c > 0x20 && c < 0x7f ? ch : encodeURIComponent(ch);
  }
  return out;
}

function withoutCredentialCookies(cookie: string, secrets: readonly string[]): string {
  return cookie
    .split(';')
    .map((pair) => pair.trim())
    .filter((pair) => pair !== '' && !carriesCredential(pair, secrets))
    .join('; ');
}

/**
 * Whether `value` carries a credential: one of `secrets`, or a DSec API key,
 * in the value as sent, percent-decoded (eight levels; a value still encoded
 * after that counts as carrying one), hex, or in a base64 token within it at
 * any alignment (UTF-16 too), and those nested once (base64 of base64, of a
 * percent-encoded key). Each level costs a few linear passes.
 */
export function carriesCredential(value: string, secrets: readonly string[]): boolean {
  return carries(value, secrets, 1);
}

function carries(value: string, secrets: readonly string[], nested: number): boolean {
  if (plainOrHexCarries(value, secrets)) return true;
  const decoded = percentDecoded(value);
  if (decoded === undefined) return true;
  if (decoded !== value && plainOrHexCarries(decoded, secrets)) return true;
  for (const token of base64Tokens(decoded)) {
    // A token glued to base64 characters before it ('v1_', 'token-') starts off the grid.
    for (let skip = 0; skip < 4 && token.length - skip >= MIN_KEY_BASE64; skip++) {
      const text = Buffer.from(token.slice(skip), 'base64').toString('latin1');
      if (plainOrHexCarries(text, secrets)) return true;
      if (text.includes('\0') && plainCarries(text.replaceAll('\0', ''), secrets)) return true;
      if (nested > 0 && carries(text, secrets, nested - 1)) return true;
    }
  }
  return false;
}

function plainOrHexCarries(value: string, secrets: readonly string[]): boolean {
  return plainCarries(value, secrets) || hexCarries(value, secrets);
}

/** `dsk_` in hex (either case), then the key's 43 characters, also in hex. */
const HEX_PREFIXES = ['64736b5f', '64736B5F'];
const HEX_KEY_CHARS = 2 * (4 + 43);

function hexCarries(value: string, secrets: readonly string[]): boolean {
  for (const prefix of HEX_PREFIXES) {
    for (let at = value.indexOf(prefix); at >= 0; at = value.indexOf(prefix, at + 1)) {
      const run = value.slice(at, at + HEX_KEY_CHARS);
      let n = 0;
      while (n < run.length && hexValue(run.charCodeAt(n)) >= 0) n++;
      if (n < HEX_KEY_CHARS) continue;
      if (plainCarries(Buffer.from(run, 'hex').toString('latin1'), secrets)) return true;
    }
  }
  return false;
}

const KEY_PREFIX = 'dsk_';
const KEY_BODY_CHARS = 43;
/** A base64 token shorter than this cannot hold a key (`dsk_` + 43 characters, encoded). */
const MIN_KEY_BASE64 = 4 * Math.ceil((KEY_PREFIX.length + KEY_BODY_CHARS) / 3) - 4;

function plainCarries(value: string, secrets: readonly string[]): boolean {
  for (const s of secrets) if (s !== '' && value.includes(s)) return true;
  for (let at = value.indexOf(KEY_PREFIX); at >= 0; at = value.indexOf(KEY_PREFIX, at + 1)) {
    let n = 0;
    while (n < KEY_BODY_CHARS && isBase64Url(value.charCodeAt(at + KEY_PREFIX.length + n))) n++;
    if (n === KEY_BODY_CHARS) return true;
  }
  return false;
}

function isBase64Url(c: number): boolean {
  return (
    (c >= 48 && c <= 57) || (c >= 65 && c <= 90) || (c >= 97 && c <= 122) || c === 45 || c === 95
  );
}

function isBase64(c: number): boolean {
  return isBase64Url(c) || c === 43 || c === 47;
}

/**
 * Runs of base64 (or base64url) characters long enough to hold an encoded
 * key; `=` ends a run (padding, or a `name=value` separator), so a run starts
 * where its encoding does.
 */
function* base64Tokens(value: string): Generator<string> {
  let start = -1;
  for (let i = 0; i <= value.length; i++) {
    const inside = i < value.length && isBase64(value.charCodeAt(i));
    if (inside && start < 0) start = i;
    else if (!inside && start >= 0) {
      if (i - start >= MIN_KEY_BASE64) yield value.slice(start, i);
      start = -1;
    }
  }
}

const PERCENT_ROUNDS = 8;

/**
 * `%XX` decoded until nothing changes, {@link PERCENT_ROUNDS} times at most;
 * malformed escapes stay. Undefined when the value is still encoded after
 * that (what a sandbox's server could go on decoding is treated as a key).
 */
function percentDecoded(value: string): string | undefined {
  let current = value;
  for (let round = 0; round <= PERCENT_ROUNDS && current.includes('%'); round++) {
    let next = '';
    for (let i = 0; i < current.length; i++) {
      const hi = hexValue(current.charCodeAt(i + 1));
      const lo = hexValue(current.charCodeAt(i + 2));
      if (current[i] === '%' && hi >= 0 && lo >= 0) {
        next += String.fromCharCode(hi * 16 + lo);
        i += 2;
      } else next += current[i];
    }
    if (next === current) break;
    if (round === PERCENT_ROUNDS) return undefined;
    current = next;
  }
  return current;
}

function hexValue(c: number): number {
  if (c >= 48 && c <= 57) return c - 48;
  if (c >= 65 && c <= 70) return c - 55;
  if (c >= 97 && c <= 102) return c - 87;
  return -1;
}
