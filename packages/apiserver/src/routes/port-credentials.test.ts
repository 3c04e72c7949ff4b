import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { carriesCredential, sandboxBoundHeaders, sandboxBoundUrl } from './port-credentials.js';

/** A key as IAM makes them (`dsk_` + 32 random bytes, base64url). */
const newApiKey = () => `dsk_${randomBytes(32).toString('base64url')}`;
const pct = (s: string) => encodeURIComponent(s).replaceAll('_', '%5F').replaceAll('-', '%2D');

/** Ways a key can sit inside a header value, cookie or query parameter. */
const ENCODINGS: ((key: string) => string)[] = [
  (k) => k,
  (k) => `Bearer ${k}`,
  (k) => `Basic ${Buffer.from(`user:${k}`).toString('base64')}`,
  (k) => `Basic ${Buffer.from(`${k}:`).toString('base64url')}`,
  (k) => pct(k),
  (k) => pct(pct(k)),
  (k) => Buffer.from(k).toString('base64'),
  (k) => Buffer.from(JSON.stringify({ token: k })).toString('base64url'),
  (k) => `"${k}"`,
  (k) => `prefix-${k}-suffix`,
];

test('carriesCredential finds a DSec key in every encoding, and the caller’s own secret', () => {
  fc.assert(
    fc.property(
      fc.constantFrom(...ENCODINGS),
      fc.string({ maxLength: 20 }),
      fc.string({ maxLength: 20 }),
      (encode, before, after) => {
        const key = newApiKey();
        assert.ok(carriesCredential(`${before} ${encode(key)} ${after}`, []), encode(key));
      },
    ),
  );
  assert.ok(carriesCredential('x=not-a-dsk-key-but-mine', ['not-a-dsk-key-but-mine']));
});

test('carriesCredential leaves ordinary values alone', () => {
  for (const v of [
    'text/html,application/xhtml+xml',
    'Mozilla/5.0 (X11; Linux x86_64)',
    'Bearer app-session-token',
    `Basic ${Buffer.from('alice:s3cret').toString('base64')}`,
    'dsk_short',
    `dsk_${'a'.repeat(42)}!`,
    'theme=dark',
    '',
  ]) {
    assert.equal(carriesCredential(v, []), false, v);
  }
});

test('carriesCredential is linear: a megabyte of near-keys is scanned at once', () => {
  const nearKeys = `dsk_${'A'.repeat(42)}.`.repeat(20_000);
  assert.equal(carriesCredential(nearKeys, []), false);
  assert.equal(carriesCredential('%'.repeat(1 << 20), []), false);
  assert.equal(carriesCredential('A'.repeat(1 << 20), []), false);
});

test('sandboxBoundHeaders: credential headers, platform headers, hop-by-hop go; others stay', () => {
  const key = newApiKey();
  const out = sandboxBoundHeaders(
    {
      host: 'h',
      connection: 'keep-alive',
      'transfer-encoding': 'chunked',
      authorization: 'Bearer app-token',
      'x-api-key': 'anything',
      'x-access-token': 'anything',
      'e2b-traffic-access-token': 'anything',
      'proxy-authorization': 'anything',
      'e2b-sandbox-id': 'sb',
      'x-dsec-edge-signature': 'x',
      'x-custom': `v ${key}`,
      cookie: `a=1; s=${pct(key)}; b=2`,
      accept: 'text/plain',
    },
    { secrets: [key], dropAuthorization: false },
  );
  assert.deepEqual(out, {
    host: 'h',
    authorization: 'Bearer app-token',
    cookie: 'a=1; b=2',
    accept: 'text/plain',
  });
  const native = sandboxBoundHeaders(
    { host: 'h', authorization: 'Bearer app-token', cookie: `s=${key}` },
    { secrets: [key], dropAuthorization: true, dropHost: true },
  );
  assert.deepEqual(native, {});
});

test('sandboxBoundHeaders: whatever the headers, none that leaves carries the key', () => {
  const name = fc.constantFrom(
    'x-a',
    'cookie',
    'authorization',
    'referer',
    'x-forwarded-for',
    'x-b',
  );
  fc.assert(
    fc.property(
      fc.array(fc.tuple(name, fc.constantFrom(...ENCODINGS), fc.string({ maxLength: 8 })), {
        maxLength: 6,
      }),
      (entries) => {
        const key = newApiKey();
        const headers: Record<string, string> = {};
        for (const [n, encode, noise] of entries) {
          const v = n === 'cookie' ? `${noise.replace(/[;=]/g, '')}=${encode(key)}` : encode(key);
          headers[n] = headers[n] ? `${headers[n]}${n === 'cookie' ? '; ' : ', '}${v}` : v;
        }
        const out = sandboxBoundHeaders(headers, { secrets: [key], dropAuthorization: false });
        for (const v of Object.values(out))
          assert.equal(carriesCredential(String(v), [key]), false);
        assert.ok(!JSON.stringify(out).includes(key));
      },
    ),
  );
});

test('sandboxBoundUrl drops credential parameters, keeps the rest, refuses a key in the path', () => {
  const key = newApiKey();
  assert.equal(
    sandboxBoundUrl(`/a?x=1&t=${key}&y=${pct(key)}&z=2&b=${Buffer.from(key).toString('base64')}`, [
      key,
    ]),
    '/a?x=1&z=2',
  );
  assert.equal(sandboxBoundUrl(`/a?t=${key}`, [key]), '/a');
  assert.equal(sandboxBoundUrl('/a?x=1', [key]), '/a?x=1');
  assert.equal(sandboxBoundUrl('/a', [key]), '/a');
  assert.throws(
    () => sandboxBoundUrl(`/k/${pct(key)}`, [key]),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === 'path',
  );
});

// Review of issue 24 point 9: encodings the first scanner missed.
const hexOf = (s: string) => Buffer.from(s).toString('hex');
const pctEvery = (s: string) =>
  [...s].map((c) => `%${c.charCodeAt(0).toString(16).padStart(2, '0')}`).join('');

test('carriesCredential: base64 glued to other base64 characters (any alignment)', () => {
  const key = newApiKey();
  for (const prefix of ['x', 'xy', 'v1_', 'token-', 'abcd', 'sess_2026']) {
    const b64 = Buffer.from(key).toString('base64');
    assert.ok(carriesCredential(`${prefix}${b64}`, []), prefix);
    assert.ok(
      carriesCredential(`a=${prefix}${Buffer.from(key).toString('base64url')}`, []),
      prefix,
    );
  }
});

test('carriesCredential: nested encodings, hex, UTF-16, percent-encoding past three levels', () => {
  const key = newApiKey();
  const b64 = (s: string, enc: BufferEncoding = 'utf8') => Buffer.from(s, enc).toString('base64');
  let deep = pctEvery(key);
  for (let i = 0; i < 5; i++) deep = encodeURIComponent(deep);
  for (const v of [
    b64(b64(key)),
    b64(pctEvery(key)),
    b64(key, 'utf16le'),
    hexOf(key),
    hexOf(key).toUpperCase(),
    `0x${hexOf(`k=${key}`)}`,
    deep,
  ]) {
    assert.ok(carriesCredential(v, []), v.slice(0, 40));
  }
  // Ordinary values still pass: hex digests, a once-encoded URL, a percent sign.
  for (const v of [hexOf('a'.repeat(64)), 'a%20b%2520c', '100%', randomBytes(48).toString('hex')]) {
    assert.equal(carriesCredential(v, []), false, v);
  }
});

test('sandboxBoundHeaders: a header whose name carries the key goes', () => {
  const key = newApiKey();
  const out = sandboxBoundHeaders(
    { [`x-${key}`]: '1', [`x-${hexOf(key)}`]: '1', accept: '*/*' },
    { secrets: [key], dropAuthorization: true },
  );
  assert.deepEqual(out, { accept: '*/*' });
});

test('carriesCredential stays linear on nested-looking input', () => {
  assert.equal(carriesCredential('%25'.repeat(1 << 18), []), false);
  // Encoded nine times or more: no ordinary value is, so it fails closed (after eight rounds).
  assert.equal(carriesCredential(`%${'25'.repeat(1 << 18)}41`, []), true);
  assert.equal(carriesCredential('64736b5f2e'.repeat(1 << 17), []), false);
  assert.equal(carriesCredential(Buffer.from('Z'.repeat(1 << 19)).toString('base64'), []), false);
});
