import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import type { CommandResult, CommandSpec, RunCommandOptions } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';
import type { TestApi } from './testing/index.js';

// SECURITY J38 and F32 (issue 24, point 4): no request, authenticated or not, costs the node more
// than a bounded amount of database writes, connections or memory. Every test goes through the
// real HTTP path (a listening server, real sockets, other loopback addresses as other clients).

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

type TestContext = { after: (fn: () => Promise<void> | void) => void };

/** Every raw socket a test opened, destroyed when its server closes. */
const sockets = new Set<net.Socket>();

/** An edge whose commands print `chunks` chunks of `chunkBytes`, one per `intervalMs`, until aborted. */
class ChattyEdge extends FakeEdge {
  chunks = 3;
  chunkBytes = 16;
  intervalMs = 0;
  aborts: unknown[] = [];

  override async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    await this.getSandbox(id);
    const chunk = Buffer.alloc(this.chunkBytes, 'x');
    for (let i = 0; i < this.chunks; i++) {
      if (options.signal?.aborted) {
        this.aborts.push(options.signal.reason);
        throw options.signal.reason;
      }
      options.onStdout?.(chunk);
      await (this.intervalMs > 0 ? sleep(this.intervalMs) : new Promise(setImmediate));
    }
    return super.runCommand(id, command, {});
  }
}

async function listening(
  t: TestContext,
  options: Parameters<typeof createTestApi>[0] = {},
): Promise<{ a: TestApi; port: number; edge: ChattyEdge }> {
  const edge = new ChattyEdge({ edgeId: 'edge-a' });
  const a = await createTestApi({ edges: [edge], ...options });
  t.after(async () => {
    // Raw sockets first: a server's close waits for the connections still open.
    for (const s of sockets) s.destroy();
    sockets.clear();
    await a.close();
  });
  await a.app.listen({ host: '127.0.0.1', port: 0 });
  return { a, port: (a.app.server.address() as AddressInfo).port, edge };
}

interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: string;
}

/** One request on a fresh connection (closed after), from `localAddress` when given. */
function request(
  port: number,
  path: string,
  o: {
    method?: string;
    headers?: Record<string, string>;
    body?: string;
    localAddress?: string;
  } = {},
): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      {
        host: '127.0.0.1',
        port,
        path,
        method: o.method ?? 'GET',
        headers: { connection: 'close', ...o.headers },
        agent: false,
        ...(o.localAddress ? { localAddress: o.localAddress } : {}),
      },
      (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (d: string) => (body += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body }));
        res.on('error', reject);
      },
    );
    req.on('socket', (s) => sockets.add(s));
    req.on('error', reject);
    req.end(o.body);
  });
}

const bearer = (key: string) => ({ authorization: `Bearer ${key}` });
const bogusKey = () =>
  'dsk_' +
  Buffer.from(Array.from({ length: 32 }, () => Math.floor(Math.random() * 256))).toString(
    'base64url',
  );

/** Resolves to the value, or rejects when it takes longer than `ms` (a liveness bound, not a measurement). */
function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  return Promise.race([
    p,
    sleep(ms).then(() => {
      throw new Error(`${what}: not within ${ms} ms`);
    }),
  ]);
}

async function createSandbox(port: number, key: string): Promise<string> {
  const res = await request(port, '/v1/sandboxes', {
    method: 'POST',
    headers: { ...bearer(key), 'content-type': 'application/json' },
    body: '{"image":"base"}',
  });
  assert.equal(res.status, 201, res.body);
  return (JSON.parse(res.body) as { id: string }).id;
}

async function metricsText(port: number, key: string): Promise<string> {
  const res = await request(port, '/metrics', { headers: bearer(key) });
  assert.equal(res.status, 200, res.body);
  return res.body;
}

/** A metric's value in Prometheus text (NaN when absent). */
function metric(text: string, series: string): number {
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return Number.NaN;
}

/** Waits until `cond` holds (a liveness bound of `ms`, not a measurement). */
async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  await within(
    (async () => {
      while (!cond()) await sleep(20);
    })(),
    ms,
    what,
  );
}

// ---- failed authentication ---------------------------------------------------------------------

test('a flood of bogus keys: one audit row per source and minute, counted, then 429 with Retry-After', async (t) => {
  const { a, port } = await listening(t);
  await request(port, '/v1/whoami', { headers: bearer(a.rootKey) }); // a known key, used before
  const before = (await a.iam.listAudit({ limit: 10_000 })).length;
  const statuses: number[] = [];
  let limited: Answer | undefined;
  for (let i = 0; i < 200; i++) {
    const res = await request(port, '/v1/sandboxes', { headers: bearer(bogusKey()) });
    statuses.push(res.status);
    if (res.status === 429) limited ??= res;
  }
  // Past the per-address burst the answer is 429 `rate_limited`, cheap, with a Retry-After.
  assert.deepEqual([...new Set(statuses)].sort(), [401, 429]);
  assert.ok(limited);
  assert.equal(
    (JSON.parse(limited.body) as { error: { code: string } }).error.code,
    'rate_limited',
  );
  assert.ok(Number(limited.headers['retry-after']) >= 1, String(limited.headers['retry-after']));

  // The audit log grew by one row per reason for this source, not one per request.
  const all = await a.iam.listAudit({ limit: 10_000 }); // newest first
  const rows = all.slice(0, all.length - before);
  const auth = rows.filter((r) => r.action === 'auth');
  assert.ok(auth.length <= 4, `${auth.length} audit rows for 200 failed authentications`);
  assert.equal(
    auth.reduce((n, r) => n + Number(r.details?.['count'] ?? 1), 0),
    200,
  );
  for (const r of auth) assert.equal(r.target, '127.0.0.1');

  // Counted, by reason; the known key still works from the flooding address.
  const text = await metricsText(port, a.rootKey);
  const unknown = metric(text, 'dsec_auth_failures_total{reason="unknown"}');
  const rateLimited = metric(text, 'dsec_auth_failures_total{reason="rate_limited"}');
  assert.equal(unknown + rateLimited, 200, text.slice(0, 2000));
  assert.ok(unknown > 0 && rateLimited > 0);

  // Another address has its own budget.
  const other = await request(port, '/v1/sandboxes', {
    headers: bearer(bogusKey()),
    localAddress: '127.0.0.2',
  });
  assert.equal(other.status, 401);
});

test('malformed and missing keys share the per-address budget; /metrics is a door too', async (t) => {
  const { a, port } = await listening(t, { iamOptions: { authFailureBurst: 5 } });
  assert.equal((await request(port, '/v1/whoami', { headers: bearer(a.rootKey) })).status, 200);
  const answers = [];
  const doors: Record<string, string>[] = [
    {},
    { authorization: 'Bearer nope' },
    { authorization: 'Basic x' },
  ];
  for (const headers of doors) {
    for (let i = 0; i < 3; i++)
      answers.push((await request(port, '/v1/whoami', { headers })).status);
  }
  assert.deepEqual(answers, [401, 401, 401, 401, 401, 429, 429, 429, 429]);
  // /metrics on the public listener is a door too.
  assert.equal((await request(port, '/metrics', { headers: bearer(bogusKey()) })).status, 429);
  assert.equal((await request(port, '/v1/whoami', { headers: bearer(a.rootKey) })).status, 200);
});

// ---- connections -------------------------------------------------------------------------------

/** A raw keep-alive connection that sent `requests` GET /healthz and read their answers, then idles. */
async function idleConnection(
  port: number,
  requests: number,
  localAddress = '127.0.0.1',
): Promise<{ socket: net.Socket; closed: Promise<void> }> {
  const socket = net.connect({ port, host: '127.0.0.1', localAddress });
  sockets.add(socket);
  socket.on('error', () => {});
  socket.setEncoding('latin1');
  const closed = new Promise<void>((r) => socket.once('close', () => r()));
  await new Promise<void>((resolve, reject) => {
    socket.once('connect', resolve);
    socket.once('error', reject);
  });
  if (requests > 0) {
    let received = '';
    const answered = new Promise<void>((resolve, reject) => {
      socket.on('data', (d: string) => {
        received += d;
        if (received.split('"ok":true').length - 1 >= requests) resolve();
      });
      socket.once('close', () => reject(new Error(`closed after ${JSON.stringify(received)}`)));
    });
    socket.write('GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n'.repeat(requests));
    await answered;
  }
  return { socket, closed };
}

test('idle keep-alive connections at the cap cannot lock a new client out', async (t) => {
  // 10 000 idle connections in the finding; the same lockout at a cap of 60.
  const { port } = await listening(t, { transport: { maxConnections: 60 } });
  const idle: { socket: net.Socket; closed: Promise<void> }[] = [];
  for (let i = 0; i < 60; i++) idle.push(await idleConnection(port, 1));
  // Connected but silent (no request yet) count as idle too.
  const silent = await idleConnection(port, 0);
  const res = await within(request(port, '/healthz'), 10_000, 'a new client at the cap');
  assert.equal(res.status, 200);
  // The oldest idle connections made room.
  const open = () => idle.filter((c) => !c.socket.destroyed && c.socket.readyState === 'open');
  await within(
    (async () => {
      while (open().length > 59) await sleep(20);
    })(),
    10_000,
    'an idle connection evicted',
  );
  for (const c of idle) c.socket.destroy();
  silent.socket.destroy();
});

test('keep-alive is shortened under pressure: idle connections are closed until the pressure is gone', async (t) => {
  const { port } = await listening(t, {
    transport: { maxConnections: 40, keepAliveTimeoutMs: 600_000 },
    limits: { pressureKeepAliveMs: 200 },
  });
  const idle: { socket: net.Socket; closed: Promise<void> }[] = [];
  for (let i = 0; i < 30; i++) idle.push(await idleConnection(port, 1));
  const open = () => idle.filter((c) => c.socket.readyState === 'open').length;
  // Above half the cap (20) an idle connection lasts 200 ms, not 600 s: the longest idle go first.
  await within(
    (async () => {
      while (open() > 20) await sleep(20);
    })(),
    20_000,
    'idle connections closed down to the pressure mark',
  );
  const closedFirst = idle.slice(0, 10).filter((c) => c.socket.readyState !== 'open').length;
  assert.equal(closedFirst, 10, 'the longest idle were closed first');
  // Below the mark, keep-alive is as configured again.
  await sleep(600);
  assert.ok(open() >= 19, `${open()} left open`);
});

test('one address holding busy connections is refused past its cap; other addresses are served', async (t) => {
  const { a, port, edge } = await listening(t, {
    transport: { maxConnections: 1000 },
    limits: { maxConnectionsPerAddress: 8, maxRequestsPerKey: 1000 },
  });
  const id = await createSandbox(port, a.rootKey);
  edge.chunks = Infinity;
  edge.intervalMs = 50;
  // Eight streams from 127.0.0.3: busy, not idle, so nothing can be evicted.
  const body = '{"argv":["yes"],"timeoutMs":60000}';
  const busy = [];
  for (let i = 0; i < 8; i++) {
    const c = await idleConnection(port, 0, '127.0.0.3');
    c.socket.write(
      `POST /v1/sandboxes/${id}/commands HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${a.rootKey}\r\n` +
        `Content-Type: application/json\r\nAccept: application/x-ndjson\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
    );
    busy.push(c);
  }
  await sleep(300);
  const refused = await within(
    request(port, '/healthz', { localAddress: '127.0.0.3' }).catch((err: unknown) => ({
      status: 0,
      body: String(err),
      headers: {},
    })),
    10_000,
    'the ninth connection from one address',
  );
  assert.equal(refused.status, 503, refused.body);
  assert.equal((JSON.parse(refused.body) as { error: { code: string } }).error.code, 'unavailable');
  assert.equal((await request(port, '/healthz')).status, 200);
  for (const c of busy) c.socket.destroy();
});

// ---- streams -----------------------------------------------------------------------------------

/** Starts an NDJSON command stream on a raw socket that never reads. */
async function unreadStream(
  port: number,
  key: string,
  id: string,
  accept = 'application/x-ndjson',
): Promise<{ socket: net.Socket; closed: Promise<void> }> {
  const c = await idleConnection(port, 0);
  const body = '{"argv":["yes"],"timeoutMs":60000}';
  c.socket.write(
    `POST /v1/sandboxes/${id}/commands HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${key}\r\n` +
      `Content-Type: application/json\r\nAccept: ${accept}\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
  );
  c.socket.pause();
  return c;
}

test('a stream cut for not reading destroys its socket and frees its backlog', async (t) => {
  const { a, port, edge } = await listening(t, { transport: { headersTimeoutMs: 2_000 } });
  const id = await createSandbox(port, a.rootKey);
  edge.chunks = Infinity;
  edge.chunkBytes = 64 * 1024;
  const streams = [];
  for (let i = 0; i < 6; i++) streams.push(await unreadStream(port, a.rootKey, id));
  streams.push(await unreadStream(port, a.rootKey, id, 'application/octet-stream'));
  // Every command is stopped once its client is 8 MiB behind...
  await until(() => edge.aborts.length === 7, 30_000, 'every unread stream cut');
  for (const reason of edge.aborts) assert.match(String(reason), /not reading/);
  // ...and nothing it had queued stays: the server holds no byte for them, and their
  // connections are gone (a client that reads now finds the end, not a backlog and then an
  // open keep-alive connection).
  const text = await metricsText(port, a.rootKey);
  assert.equal(metric(text, 'dsec_stream_queued_bytes'), 0, text.slice(0, 3000));
  assert.equal(metric(text, 'dsec_streams_open'), 0);
  assert.equal(metric(text, 'dsec_streams_cut_total{reason="stream_buffer"}'), 7);
  for (const s of streams) s.socket.resume();
  await within(Promise.all(streams.map((s) => s.closed)), 30_000, 'cut connections closed');
});

test('the queued-output budget cuts the biggest backlog first; a reading client is untouched', async (t) => {
  const { a, port, edge } = await listening(t, {
    limits: { outputBudgetBytes: 3 * 1024 * 1024, streamBufferBytes: 64 * 1024 * 1024 },
  });
  const id = await createSandbox(port, a.rootKey);
  edge.chunks = Infinity;
  edge.chunkBytes = 64 * 1024;
  const stalled = await unreadStream(port, a.rootKey, id);
  await until(() => edge.aborts.length === 1, 30_000, 'the stalled stream cut at the budget');
  assert.match(String(edge.aborts[0]), /not reading/);
  stalled.socket.resume();
  await within(stalled.closed, 30_000, 'the stalled connection closed');
  // A client that reads gets its whole stream.
  edge.chunks = 200;
  const res = await request(port, `/v1/sandboxes/${id}/commands`, {
    method: 'POST',
    headers: {
      ...bearer(a.rootKey),
      'content-type': 'application/json',
      accept: 'application/x-ndjson',
    },
    body: '{"argv":["x"]}',
  });
  const events = res.body.trim().split('\n');
  assert.equal(events.length, 201);
  assert.match(events.at(-1)!, /"type":"result"/);
  const text = await metricsText(port, a.rootKey);
  assert.equal(metric(text, 'dsec_streams_cut_total{reason="output_budget"}'), 1);
});

test('concurrent streams per key are capped: 429 rate_limited past the cap, free again after', async (t) => {
  const { a, port, edge } = await listening(t, { limits: { maxStreamsPerKey: 3 } });
  const id = await createSandbox(port, a.rootKey);
  edge.chunks = Infinity;
  edge.intervalMs = 100;
  const open = [];
  for (let i = 0; i < 3; i++) open.push(await unreadStream(port, a.rootKey, id));
  await sleep(200);
  const streamed = {
    method: 'POST',
    headers: {
      ...bearer(a.rootKey),
      'content-type': 'application/json',
      accept: 'application/x-ndjson',
    },
    body: '{"argv":["x"]}',
  };
  const over = await within(
    request(port, `/v1/sandboxes/${id}/commands`, streamed),
    10_000,
    'a stream past the cap answered',
  );
  assert.equal(over.status, 429, over.body);
  assert.equal((JSON.parse(over.body) as { error: { code: string } }).error.code, 'rate_limited');
  assert.ok(Number(over.headers['retry-after']) >= 1);
  // Plain (non-streamed) calls of the same key are not streams.
  assert.equal(
    (await request(port, `/v1/sandboxes/${id}`, { headers: bearer(a.rootKey) })).status,
    200,
  );
  open[0]!.socket.destroy();
  await sleep(300);
  edge.chunks = 2;
  edge.intervalMs = 0;
  assert.equal((await request(port, `/v1/sandboxes/${id}/commands`, streamed)).status, 200);
  for (const s of open) s.socket.destroy();
});

test('requests of one key in flight are capped; another key is not affected', async (t) => {
  const { a, port, edge } = await listening(t, { limits: { maxRequestsPerKey: 2 } });
  const id = await createSandbox(port, a.rootKey);
  edge.chunks = Infinity;
  edge.intervalMs = 100;
  const held = [await unreadStream(port, a.rootKey, id), await unreadStream(port, a.rootKey, id)];
  await sleep(200);
  const over = await within(
    request(port, '/v1/whoami', { headers: bearer(a.rootKey) }),
    10_000,
    'a third request of the key',
  );
  assert.equal(over.status, 429, over.body);
  const e = (JSON.parse(over.body) as { error: { code: string; details: { limit: string } } })
    .error;
  assert.deepEqual([e.code, e.details.limit], ['rate_limited', 'requests_per_key']);
  const other = (
    await a.iam.createKey(await a.iam.authenticate(a.rootKey), {
      projectId: a.rootProjectId,
    })
  ).key;
  assert.equal((await request(port, '/v1/whoami', { headers: bearer(other) })).status, 200);
  for (const h of held) h.socket.destroy();
  await sleep(300);
  assert.equal((await request(port, '/v1/whoami', { headers: bearer(a.rootKey) })).status, 200);
});

// ---- Host header and URL shape -----------------------------------------------------------------

test('DNS rebinding: a Host header that names no allowed host is refused before any route', async (t) => {
  const { a, port } = await listening(t, {
    allowedHosts: ['api.example.com', '*.sandboxes.example.com'],
  });
  const refused = [
    'evil.example',
    `evil.example:${port}`,
    '127.0.0.1.evil.example',
    'localhost.evil.example',
    'example.com',
    'sandboxes.example.com.evil',
    'xapi.example.com',
  ];
  for (const host of refused) {
    const res = await request(port, '/v1/whoami', { headers: { host, ...bearer(a.rootKey) } });
    assert.equal(res.status, 400, `${host}: ${res.status} ${res.body}`);
    const e = (JSON.parse(res.body) as { error: { code: string; field?: string } }).error;
    assert.deepEqual([e.code, e.field], ['invalid_argument', 'host'], host);
    // Open routes too: a rebinding page would read them.
    assert.equal((await request(port, '/healthz', { headers: { host } })).status, 400, host);
  }
  const allowed = [
    `127.0.0.1:${port}`,
    `localhost:${port}`,
    'LOCALHOST',
    'ui.localhost',
    `[::1]:${port}`,
    '10.1.2.3',
    '[2001:db8::1]:443',
    'api.example.com',
    'API.example.com:7420',
    '8080-sbabc.sandboxes.example.com',
  ];
  for (const host of allowed) {
    const res = await request(port, '/v1/whoami', { headers: { host, ...bearer(a.rootKey) } });
    assert.equal(res.status, 200, `${host}: ${res.status} ${res.body}`);
  }
  // An upgrade (terminal, port) with a foreign host is refused too, and closed.
  const upgrade = await request(port, '/v1/sandboxes/x/pty', {
    headers: { host: 'evil.example', connection: 'upgrade', upgrade: 'websocket' },
  }).catch((err: unknown) => ({ status: 0, body: String(err), headers: {} }));
  assert.equal(upgrade.status, 400, upgrade.body);
});

test('a path parameter over 256 characters, a bad escape and an over-long URL get the DSec error shape', async (t) => {
  const { a, port } = await listening(t);
  const long = 'x'.repeat(300);
  for (const path of [`/v1/sandboxes/${long}`, `/v1/sandboxes/${long}/commands/abc`]) {
    const res = await request(port, path, { headers: bearer(a.rootKey) });
    assert.equal(res.status, 400, res.body);
    const e = (JSON.parse(res.body) as { error: { code: string; field?: string } }).error;
    assert.deepEqual([e.code, e.field], ['invalid_argument', 'path']);
    assert.ok(!res.body.includes(long), 'the URL echoed back');
    assert.ok(res.headers['x-request-id']);
  }
  const bad = await request(port, '/v1/sandboxes/%zz', { headers: bearer(a.rootKey) });
  assert.equal(bad.status, 400, bad.body);
  assert.equal(
    (JSON.parse(bad.body) as { error: { code: string } }).error.code,
    'invalid_argument',
  );
  const huge = await request(port, `/v1/sandboxes?labels=${'a'.repeat(9000)}`, {
    headers: bearer(a.rootKey),
  });
  assert.equal(huge.status, 400, huge.body);
  assert.equal(
    (JSON.parse(huge.body) as { error: { code: string } }).error.code,
    'invalid_argument',
  );
  // inject() takes the same path.
  const injected = await a.app.inject({ method: 'GET', url: `/v1/sandboxes/${long}` });
  assert.equal(injected.statusCode, 400);
  assert.equal(injected.json<{ error: { code: string } }>().error.code, 'invalid_argument');
});
