import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import type { EdgeApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import {
  HEADER_NONCE,
  HEADER_PROOF,
  HEADER_SIGNATURE,
  HEADER_TIME,
  MAX_CLOCK_SKEW_MS,
  RequestVerifier,
  responseProof,
  signRequest,
} from './auth.js';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';

const EDGE = 'edge-auth';

/** A FakeEdge that counts the calls that reach it. */
function countingEdge(): { edge: EdgeApi; calls: () => number } {
  const fake = new FakeEdge({ edgeId: EDGE });
  let calls = 0;
  const edge = new Proxy(fake, {
    get(target, prop) {
      const v = Reflect.get(target, prop, target) as unknown;
      if (typeof v !== 'function') return v;
      return (...args: unknown[]) => {
        calls++;
        return (v as (...a: unknown[]) => unknown).apply(target, args);
      };
    },
  });
  return { edge, calls: () => calls };
}

async function served(secret = newEdgeSecret()) {
  const { edge, calls } = countingEdge();
  const server = await serveEdge({ edge, secret });
  return { server, secret, calls, close: () => server.close() };
}

interface RawAnswer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: string;
}

function raw(
  url: string,
  path: string,
  headers: Record<string, string>,
  method = 'GET',
): Promise<RawAnswer> {
  return new Promise((resolve, reject) => {
    const req = http.request(`${url}${path}`, { method, headers, agent: false }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          headers: res.headers,
          body: Buffer.concat(chunks).toString(),
        }),
      );
    });
    req.on('error', reject);
    req.end();
  });
}

const code = (a: RawAnswer) => (JSON.parse(a.body) as { error: { code: string } }).error.code;

test('newEdgeSecret is 32 random bytes in base64url; short secrets are refused', async () => {
  const a = newEdgeSecret();
  assert.match(a, /^[A-Za-z0-9_-]{43}$/);
  assert.equal(Buffer.from(a, 'base64url').length, 32);
  assert.notEqual(newEdgeSecret(), a);
  await assert.rejects(serveEdge({ edge: new FakeEdge({ edgeId: EDGE }), secret: 'short' }), (e) =>
    isDsecError(e, 'invalid_argument'),
  );
  assert.throws(
    () => new RemoteEdge({ edgeId: EDGE, url: 'http://127.0.0.1:1', secret: 'short' }),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('a correctly signed request is answered, with a proof over its nonce', async () => {
  const s = await served();
  try {
    const { headers, nonce } = signRequest(s.secret, EDGE, 'GET', '/edge/v1/status');
    const a = await raw(s.server.url, '/edge/v1/status', headers);
    assert.equal(a.status, 200);
    assert.equal(a.headers[HEADER_PROOF], responseProof(s.secret, EDGE, nonce));
    assert.equal(s.calls(), 1);
  } finally {
    await s.close();
  }
});

test('a request signed with the wrong secret is refused before the edge is touched', async () => {
  const s = await served();
  try {
    const path = '/edge/v1/status';
    const { headers } = signRequest(newEdgeSecret(), EDGE, 'GET', path);
    const a = await raw(s.server.url, path, headers);
    assert.equal(a.status, 401);
    assert.equal(code(a), 'unauthenticated');
    assert.equal(s.calls(), 0);
    // The client with the wrong secret cannot check the answer either: it refuses it.
    const client = new RemoteEdge({ edgeId: EDGE, url: s.server.url, secret: newEdgeSecret() });
    await assert.rejects(
      client.status(),
      (e) => isDsecError(e, 'unavailable') && /failed to authenticate/.test(e.message),
    );
    client.close();
    assert.equal(s.calls(), 0);
  } finally {
    await s.close();
  }
});

test('missing or malformed signature headers are refused', async () => {
  const s = await served();
  try {
    const path = '/edge/v1/sandboxes';
    for (const drop of [HEADER_TIME, HEADER_NONCE, HEADER_SIGNATURE]) {
      const { headers } = signRequest(s.secret, EDGE, 'GET', path);
      delete headers[drop];
      const a = await raw(s.server.url, path, headers);
      assert.equal(a.status, 401, `without ${drop}`);
      assert.equal(code(a), 'unauthenticated');
    }
    const none = await raw(s.server.url, path, {});
    assert.equal(none.status, 401);
    assert.equal(none.headers[HEADER_PROOF], undefined, 'no nonce, nothing to prove');
    const { headers } = signRequest(s.secret, EDGE, 'GET', path);
    const bad = await raw(s.server.url, path, { ...headers, [HEADER_TIME]: 'yesterday' });
    assert.equal(bad.status, 401);
    assert.equal(s.calls(), 0);
  } finally {
    await s.close();
  }
});

test('a signature is bound to its method, path and edge ID', async () => {
  const s = await served();
  try {
    const forStatus = signRequest(s.secret, EDGE, 'GET', '/edge/v1/status');
    assert.equal((await raw(s.server.url, '/edge/v1/sandboxes', forStatus.headers)).status, 401);
    const forPost = signRequest(s.secret, EDGE, 'POST', '/edge/v1/status');
    assert.equal((await raw(s.server.url, '/edge/v1/status', forPost.headers)).status, 401);
    const otherEdge = signRequest(s.secret, 'edge-other', 'GET', '/edge/v1/status');
    assert.equal((await raw(s.server.url, '/edge/v1/status', otherEdge.headers)).status, 401);
    assert.equal(s.calls(), 0);
  } finally {
    await s.close();
  }
});

test('a replayed request is refused', async () => {
  const s = await served();
  try {
    const path = '/edge/v1/status';
    const { headers } = signRequest(s.secret, EDGE, 'GET', path);
    assert.equal((await raw(s.server.url, path, headers)).status, 200);
    const again = await raw(s.server.url, path, headers);
    assert.equal(again.status, 401);
    assert.match(JSON.parse(again.body).error.message, /replayed/);
    assert.equal(s.calls(), 1);
  } finally {
    await s.close();
  }
});

test('a timestamp beyond ±60 s of the edge clock is refused', async () => {
  const s = await served();
  try {
    const path = '/edge/v1/status';
    const now = Date.now();
    for (const skew of [-MAX_CLOCK_SKEW_MS - 5_000, MAX_CLOCK_SKEW_MS + 5_000]) {
      const { headers } = signRequest(s.secret, EDGE, 'GET', path, now + skew);
      const a = await raw(s.server.url, path, headers);
      assert.equal(a.status, 401, `skew ${skew}`);
      assert.equal(code(a), 'unauthenticated');
    }
    assert.equal(s.calls(), 0);
    const within = signRequest(s.secret, EDGE, 'GET', path, now - 30_000);
    assert.equal((await raw(s.server.url, path, within.headers)).status, 200);
  } finally {
    await s.close();
  }
});

test('nonces are forgotten once a replay would be stale anyway', () => {
  let now = 1_000_000;
  const secret = newEdgeSecret();
  const v = new RequestVerifier({ secret, edgeId: EDGE, now: () => now });
  const first = signRequest(secret, EDGE, 'GET', '/edge/v1/status', now);
  v.verify('GET', '/edge/v1/status', first.headers);
  assert.equal(v.rememberedNonces, 1);
  assert.throws(
    () => v.verify('GET', '/edge/v1/status', first.headers),
    (e) => isDsecError(e, 'unauthenticated'),
  );
  now += 2 * MAX_CLOCK_SKEW_MS + 1;
  const later = signRequest(secret, EDGE, 'GET', '/edge/v1/status', now);
  v.verify('GET', '/edge/v1/status', later.headers);
  assert.equal(v.rememberedNonces, 1, 'the first nonce was forgotten');
  // Replaying the first request now fails on its timestamp instead.
  assert.throws(
    () => v.verify('GET', '/edge/v1/status', first.headers),
    (e) => isDsecError(e, 'unauthenticated') && /timestamp/.test(e.message),
  );
});

test('an impostor server is refused: other secret, no proof, a replayed proof, a bare 101', async () => {
  const secret = newEdgeSecret();
  const ids = new SandboxIdCodec('auth-test-secret');
  // The right edge ID, served with another secret.
  const other = await serveEdge({ edge: new FakeEdge({ edgeId: EDGE }), secret: newEdgeSecret() });
  // A plain server that answers like an edge but cannot prove it: first with
  // no proof, then with a proof it saw on an earlier answer (another nonce).
  let seenProof: string | undefined;
  const fake = http.createServer((req, res) => {
    const headers: http.OutgoingHttpHeaders = { 'content-type': 'application/json' };
    if (seenProof) headers[HEADER_PROOF] = seenProof;
    seenProof = responseProof(secret, EDGE, String(req.headers[HEADER_NONCE]));
    res.writeHead(200, headers).end(JSON.stringify({ edgeId: EDGE, healthy: true }));
  });
  fake.on('upgrade', (_req, socket) => {
    socket.end(
      'HTTP/1.1 101 Switching Protocols\r\nupgrade: dsec-edge-pty\r\nconnection: Upgrade\r\n\r\n',
    );
  });
  await new Promise<void>((r) => fake.listen(0, '127.0.0.1', r));
  const fakeUrl = `http://127.0.0.1:${(fake.address() as AddressInfo).port}`;
  const refused = (e: unknown) =>
    isDsecError(e, 'unavailable') && /failed to authenticate/.test(e.message);
  try {
    const a = new RemoteEdge({ edgeId: EDGE, url: other.url, secret });
    await assert.rejects(a.status(), refused);
    await assert.rejects(a.io.openPty(ids.mint(EDGE)), refused);
    a.close();
    const b = new RemoteEdge({ edgeId: EDGE, url: fakeUrl, secret });
    await assert.rejects(b.status(), refused, 'no proof');
    await assert.rejects(b.status(), refused, "a proof over another request's nonce");
    await assert.rejects(b.io.openPty(ids.mint(EDGE)), refused, '101 without a proof');
    await assert.rejects(b.io.connectPort(ids.mint(EDGE), 80), refused, '101 without a proof');
    b.close();
  } finally {
    await other.close();
    await new Promise<void>((r) => fake.close(() => r()));
  }
});
