import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import type { EdgeApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import {
  bodyDigest,
  HEADER_BODY,
  HEADER_NONCE,
  HEADER_PROOF,
  HEADER_SIGNATURE,
  HEADER_TIME,
  MAX_CLOCK_SKEW_MS,
  RequestVerifier,
  SignedExchange,
  signRequest,
  STREAMED,
} from './auth.js';
import type { FrameMac } from './auth.js';
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

test('a correctly signed request is answered, with a proof over it and the answer', async () => {
  const s = await served();
  try {
    const { headers, exchange } = signRequest(s.secret, EDGE, 'GET', '/edge/v1/status');
    const a = await raw(s.server.url, '/edge/v1/status', headers);
    assert.equal(a.status, 200);
    const head = {
      status: 200,
      contentType: 'application/json',
      upgrade: '',
      body: bodyDigest(Buffer.from(a.body)),
    };
    assert.equal(a.headers[HEADER_PROOF], exchange.proof(head));
    assert.ok(exchange.validProof(a.headers, head));
    assert.ok(!exchange.validProof(a.headers, { ...head, status: 201 }));
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
    assert.equal(a.headers[HEADER_PROOF], undefined, 'a refused request gets no proof');
    assert.equal(s.calls(), 0);
    // The client with the wrong secret gets an answer nobody proved: it refuses it,
    // and shows what the answer said as an unverified hint.
    const client = new RemoteEdge({ edgeId: EDGE, url: s.server.url, secret: newEdgeSecret() });
    await assert.rejects(
      client.status(),
      (e) =>
        isDsecError(e, 'unavailable') &&
        e.details?.reason === 'edge_unauthenticated' &&
        e.details.status === 401 &&
        /^unauthenticated: bad request signature/.test(String(e.details.unverified)),
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
    for (const drop of [HEADER_TIME, HEADER_NONCE, HEADER_SIGNATURE, HEADER_BODY]) {
      const { headers } = signRequest(s.secret, EDGE, 'GET', path);
      delete headers[drop];
      const a = await raw(s.server.url, path, headers);
      assert.equal(a.status, 401, `without ${drop}`);
      assert.equal(code(a), 'unauthenticated');
    }
    const none = await raw(s.server.url, path, {});
    assert.equal(none.status, 401);
    assert.equal(none.headers[HEADER_PROOF], undefined, 'no proof on a refused request');
    const { headers } = signRequest(s.secret, EDGE, 'GET', path);
    const bad = await raw(s.server.url, path, { ...headers, [HEADER_TIME]: 'yesterday' });
    assert.equal(bad.status, 401);
    for (const body of ['sha256:short', 'sha256:' + 'A'.repeat(43) + '=', 'streamed', '']) {
      const signed = signRequest(s.secret, EDGE, 'GET', path);
      const a = await raw(s.server.url, path, { ...signed.headers, [HEADER_BODY]: body });
      assert.equal(a.status, 401, `body claim ${body}`);
      assert.equal(a.headers[HEADER_PROOF], undefined);
    }
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
    // And to its body: a signature over one body does not pass another's digest.
    const forBody = signRequest(s.secret, EDGE, 'GET', '/edge/v1/status', {
      body: Buffer.from('{}'),
    });
    const claimed = { ...forBody.headers, [HEADER_BODY]: bodyDigest(Buffer.from('{"x":1}')) };
    assert.equal((await raw(s.server.url, '/edge/v1/status', claimed)).status, 401);
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
      const { headers } = signRequest(s.secret, EDGE, 'GET', path, { nowMs: now + skew });
      const a = await raw(s.server.url, path, headers);
      assert.equal(a.status, 401, `skew ${skew}`);
      assert.equal(code(a), 'unauthenticated');
    }
    assert.equal(s.calls(), 0);
    // (A client behind the edge's clock is tested below: a fresh server refuses what was
    // signed before it started.)
    const within = signRequest(s.secret, EDGE, 'GET', path, { nowMs: now + 30_000 });
    assert.equal((await raw(s.server.url, path, within.headers)).status, 200);
  } finally {
    await s.close();
  }
});

test('a client behind the edge clock is accepted, except for what it signed before the edge started', () => {
  let now = 1_000_000;
  const secret = newEdgeSecret();
  const v = new RequestVerifier({ secret, edgeId: EDGE, now: () => now });
  const path = '/edge/v1/status';
  // Signed 30 s behind, right after the start: it may be a request the previous process took.
  const early = signRequest(secret, EDGE, 'GET', path, { nowMs: now - 30_000 });
  assert.throws(
    () => v.verify('GET', path, early.headers),
    (e) => isDsecError(e, 'unauthenticated') && /before the edge's server started/.test(e.message),
  );
  now += 40_000;
  const behind = signRequest(secret, EDGE, 'GET', path, { nowMs: now - 30_000 });
  v.verify('GET', path, behind.headers);
  assert.equal(v.rememberedNonces, 1);
});

test('nonces are forgotten once a replay would be stale anyway', () => {
  let now = 1_000_000;
  const secret = newEdgeSecret();
  const v = new RequestVerifier({ secret, edgeId: EDGE, now: () => now });
  const first = signRequest(secret, EDGE, 'GET', '/edge/v1/status', { nowMs: now });
  v.verify('GET', '/edge/v1/status', first.headers);
  assert.equal(v.rememberedNonces, 1);
  assert.throws(
    () => v.verify('GET', '/edge/v1/status', first.headers),
    (e) => isDsecError(e, 'unauthenticated'),
  );
  now += 2 * MAX_CLOCK_SKEW_MS + 1;
  const later = signRequest(secret, EDGE, 'GET', '/edge/v1/status', { nowMs: now });
  v.verify('GET', '/edge/v1/status', later.headers);
  assert.equal(v.rememberedNonces, 1, 'the first nonce was forgotten');
  // Replaying the first request now fails on its timestamp instead.
  assert.throws(
    () => v.verify('GET', '/edge/v1/status', first.headers),
    (e) => isDsecError(e, 'unauthenticated') && /timestamp/.test(e.message),
  );
});

test('a request signed a full skew ahead cannot be replayed at the moment its nonce is forgotten', () => {
  // Stale when more than the skew from the clock, forgotten when its memory ends: the two must
  // not meet at one millisecond (signed 60 s ahead, replayed exactly 120 s after arrival).
  let now = 1_000_000;
  const secret = newEdgeSecret();
  const v = new RequestVerifier({ secret, edgeId: EDGE, now: () => now });
  const path = '/edge/v1/sandboxes/sb-1/stop';
  const ahead = signRequest(secret, EDGE, 'POST', path, { nowMs: now + MAX_CLOCK_SKEW_MS });
  v.verify('POST', path, ahead.headers);
  for (const later of [
    2 * MAX_CLOCK_SKEW_MS - 1,
    2 * MAX_CLOCK_SKEW_MS,
    2 * MAX_CLOCK_SKEW_MS + 1,
  ]) {
    now = 1_000_000 + later;
    assert.throws(
      () => v.verify('POST', path, ahead.headers),
      (e) => isDsecError(e, 'unauthenticated'),
      `replayed ${later} ms after arrival`,
    );
  }
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
    seenProof = new SignedExchange(
      secret,
      EDGE,
      String(req.headers[HEADER_NONCE]),
      'GET',
      String(req.url),
    ).proof({ status: 200, contentType: 'application/json', upgrade: '', body: STREAMED });
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
    isDsecError(e, 'unavailable') && e.details?.reason === 'edge_unauthenticated';
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

test('a proof is bound to every part of its exchange and of its answer', () => {
  const secret = newEdgeSecret();
  const x = new SignedExchange(secret, EDGE, 'n'.repeat(22), 'get', '/edge/v1/sandboxes/a');
  const head = {
    status: 200,
    contentType: 'application/json',
    upgrade: '',
    body: bodyDigest(Buffer.from('{}')),
  };
  const proof = x.proof(head);
  assert.equal(
    new SignedExchange(secret, EDGE, 'n'.repeat(22), 'GET', '/edge/v1/sandboxes/a').proof(head),
    proof,
    'methods compare upper-cased',
  );
  const others = [
    new SignedExchange(newEdgeSecret(), EDGE, 'n'.repeat(22), 'GET', '/edge/v1/sandboxes/a'),
    new SignedExchange(secret, 'edge-other', 'n'.repeat(22), 'GET', '/edge/v1/sandboxes/a'),
    new SignedExchange(secret, EDGE, 'm'.repeat(22), 'GET', '/edge/v1/sandboxes/a'),
    new SignedExchange(secret, EDGE, 'n'.repeat(22), 'POST', '/edge/v1/sandboxes/a'),
    new SignedExchange(secret, EDGE, 'n'.repeat(22), 'GET', '/edge/v1/sandboxes/b'),
  ];
  for (const o of others) assert.notEqual(o.proof(head), proof);
  for (const changed of [
    { ...head, status: 201 },
    { ...head, contentType: 'text/plain' },
    { ...head, upgrade: 'dsec-edge-pty' },
    { ...head, body: STREAMED },
    { ...head, body: bodyDigest(Buffer.from('{ }')) },
  ])
    assert.notEqual(x.proof(changed), proof);
  // A field's newline cannot move text into the next field: the edge ID, nonce and
  // method are validated; a path or content type cannot hold a newline on the wire.
  assert.notEqual(x.bodyMac('answer', head.body), x.bodyMac('request', head.body));
  assert.notEqual(x.bodyMac('answer', head.body, ''), x.bodyMac('answer', head.body, 'err'));
});

test('frame MACs fail on a changed, dropped, repeated or foreign frame', () => {
  const secret = newEdgeSecret();
  const x = new SignedExchange(secret, EDGE, 'n'.repeat(22), 'POST', '/edge/v1/x');
  const frames = [Buffer.from('one'), Buffer.from('two'), Buffer.from('three')];
  const sent = (() => {
    const mac = x.sealer('answer');
    return frames.map((p) => mac.next(0, p));
  })();
  const check = (order: number[], sealer: FrameMac = x.sealer('answer'), type = 0) =>
    order.every((i) => sealer.check(type, frames[i]!, sent[i]!));
  assert.ok(check([0, 1, 2]));
  assert.ok(!check([1, 2]), 'dropped');
  assert.ok(!check([0, 0, 1]), 'repeated');
  assert.ok(!check([0, 2, 1]), 'reordered');
  assert.ok(!check([0], x.sealer('request')), 'the other direction');
  assert.ok(
    !check(
      [0],
      new SignedExchange(secret, EDGE, 'm'.repeat(22), 'POST', '/edge/v1/x').sealer('answer'),
    ),
    'another exchange',
  );
  assert.ok(!check([0], x.sealer('answer'), 1), 'another type');
  assert.ok(!x.sealer('answer').check(0, Buffer.from('onf'), sent[0]!), 'changed');
});
