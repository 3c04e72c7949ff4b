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
