/**
 * Issue 24 item 9: no header, cookie or query parameter that carries the
 * caller's key (or any DSec key) reaches a sandbox's web server, through the
 * native port route or the E2B host-routed form, on plain requests and on
 * WebSocket upgrades. The sandbox's server here is an echo of the raw
 * request it got (an attacker's server would log it the same way), behind a
 * scripted edge whose port tunnel is a loopback connection to it.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import { connect, createServer } from 'node:net';
import type { AddressInfo, Server, Socket } from 'node:net';
import { ApiMetrics, SandboxService } from '@dsec/apiserver';
import { createTestApi, ScriptedEdge } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { PowerOfKPlacer } from '@dsec/placement';
import { toE2bSandboxId } from './ids.js';
import { registerE2bRoutes } from './register.js';

/** A web server that answers every request with the raw request head it received. */
async function echoServer(): Promise<{ server: Server; port: number; heads: string[] }> {
  const heads: string[] = [];
  const server = createServer((socket: Socket) => {
    let got = '';
    socket.on('data', (chunk: Buffer) => {
      got += chunk.toString('latin1');
      const end = got.indexOf('\r\n\r\n');
      if (end < 0) return;
      const head = got.slice(0, end);
      heads.push(head);
      socket.end(
        `HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: ${Buffer.byteLength(head, 'latin1')}\r\nconnection: close\r\n\r\n${head}`,
        'latin1',
      );
    });
    socket.on('error', () => undefined);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { server, port: (server.address() as AddressInfo).port, heads };
}

interface Setup {
  api: TestApi;
  url: URL;
  key: string;
  /** Another valid key of the same project: a platform credential too. */
  otherKey: string;
  sandboxId: string;
  heads: string[];
}

async function withProxies(fn: (s: Setup) => Promise<void>): Promise<void> {
  const echo = await echoServer();
  const edge = new ScriptedEdge();
  edge.io.connectPort = async () => connect(echo.port, '127.0.0.1');
  const api = await createTestApi({ edges: [edge], allowedHosts: ['sbx.test', '*.sbx.test'] });
  const service = new SandboxService({
    iam: api.iam,
    edges: api.edges,
    watcher: api.watcher,
    placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
    ids: api.ids,
    metrics: new ApiMetrics(),
  });
  registerE2bRoutes(api.app, { service, iam: api.iam, sandboxDomain: 'sbx.test' });
  const url = new URL(await api.app.listen({ port: 0, host: '127.0.0.1' }));
  try {
    const admin = await api.iam.authenticate(api.rootKey);
    const { key: otherKey } = await api.iam.createKey(admin, { projectId: admin.projectId });
    const created = await api.app.inject({
      method: 'POST',
      url: '/v1/sandboxes',
      headers: { authorization: `Bearer ${api.rootKey}`, 'content-type': 'application/json' },
      payload: JSON.stringify({ image: 'busybox' }),
    });
    assert.equal(created.statusCode, 201, created.body);
    const sandboxId = (JSON.parse(created.body) as { id: string }).id;
    await fn({ api, url, key: api.rootKey, otherKey, sandboxId, heads: echo.heads });
  } finally {
    await api.close();
    echo.server.close();
  }
}

/** Every form in which a key may sit in text: as is, percent-encoded, base64 of it or of `user:key`. */
function keyForms(key: string): string[] {
  const b64 = (s: string) => [
    Buffer.from(s).toString('base64').replace(/=+$/, ''),
    Buffer.from(s).toString('base64url'),
  ];
  return [
    key,
    encodeURIComponent(key).replaceAll('_', '%5F'),
    encodeURIComponent(encodeURIComponent(key).replaceAll('_', '%5F')),
    ...b64(key),
    ...b64(`user:${key}`),
  ];
}

function assertNoCredential(head: string, keys: string[], what: string): void {
  for (const key of keys) {
    for (const form of keyForms(key)) {
      // The first 40 characters of an encoded form are enough to tell it is there.
      assert.ok(!head.includes(form.slice(0, 40)), `${what}: the sandbox got ${form}\n${head}`);
    }
  }
  assert.doesNotMatch(head, /dsk_[A-Za-z0-9_-]{43}/, `${what}: a DSec key reached the sandbox`);
  assert.doesNotMatch(head, /^x-dsec-/im, `${what}: a platform header reached the sandbox`);
}

/** The key in every place a client or a browser may put one, plus benign headers that must pass. */
function credentialHeaders(key: string, other: string): Record<string, string> {
  const basic = (s: string) => `Basic ${Buffer.from(s).toString('base64')}`;
  return {
    'x-api-key': key,
    'x-access-token': key,
    'e2b-traffic-access-token': key,
    'proxy-authorization': basic(`user:${key}`),
    'x-forwarded-authorization': `Bearer ${key}`,
    'x-custom-token': other,
    'x-dsec-edge-signature': 'forged',
    cookie: `theme=dark; session=${key}; enc=${encodeURIComponent(key).replaceAll('_', '%5F')}; b64=${Buffer.from(key).toString('base64url')}`,
    referer: `http://app.example/?key=${key}`,
    'x-benign': 'kept',
  };
}

function request(
  base: URL,
  path: string,
  headers: Record<string, string>,
): Promise<{ status: number; body: string; upgraded: boolean }> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: base.hostname, port: base.port, path, method: 'GET', headers },
      (res) => {
        let body = '';
        res.setEncoding('latin1');
        res.on('data', (c: string) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body, upgraded: false }));
      },
    );
    req.on('upgrade', (res, socket) => {
      socket.destroy();
      resolve({ status: res.statusCode ?? 0, body: '', upgraded: true });
    });
    req.on('error', reject);
    req.end();
  });
}

const QUERY = (key: string) =>
  `?x=1&token=${key}&enc=${encodeURIComponent(key).replaceAll('_', '%5F')}&b=${Buffer.from(`u:${key}`).toString('base64url')}`;

test('native port route: no form of the caller’s key, or any DSec key, reaches the sandbox', async () => {
  await withProxies(async ({ url, key, otherKey, sandboxId, heads }) => {
    const res = await request(url, `/v1/sandboxes/${sandboxId}/ports/8080/app${QUERY(key)}`, {
      authorization: `Bearer ${key}`,
      ...credentialHeaders(key, otherKey),
    });
    assert.equal(res.status, 200, res.body);
    assert.equal(heads.length, 1);
    const head = heads[0]!;
    assertNoCredential(head, [key, otherKey], 'native');
    // What carries no credential still goes through.
    assert.match(head, /^GET \/app\?x=1 HTTP\/1\.1$/m);
    assert.match(head, /^x-benign: kept$/im);
    assert.match(head, /^cookie: theme=dark$/im);
    assert.match(head, /^host: 127\.0\.0\.1:8080$/im);
  });
});

test('E2B host-routed form: no form of the key reaches the sandbox, whichever header carried it', async () => {
  await withProxies(async ({ url, key, otherKey, sandboxId, heads }) => {
    const host = `8080-${toE2bSandboxId(sandboxId)}.sbx.test`;
    // The key authenticates in X-Access-Token (the SDK's way) and sits in Authorization too.
    for (const authorization of [
      `Bearer ${key}`,
      `Basic ${Buffer.from(`user:${key}`).toString('base64')}`,
    ]) {
      const res = await request(url, `/app${QUERY(key)}`, {
        host,
        authorization,
        ...credentialHeaders(key, otherKey),
      });
      assert.equal(res.status, 200, res.body);
      assertNoCredential(heads.at(-1)!, [key, otherKey], `e2b (${authorization.split(' ')[0]})`);
    }
    // The key only in Authorization: still kept out; a web app's own Authorization goes through.
    const own = await request(url, '/app', {
      host,
      'x-access-token': key,
      authorization: 'Bearer app-session-token',
    });
    assert.equal(own.status, 200);
    assert.match(heads.at(-1)!, /^authorization: Bearer app-session-token$/im);
    const viaBearer = await request(url, '/app', { host, authorization: `Bearer ${key}` });
    assert.equal(viaBearer.status, 200);
    assertNoCredential(heads.at(-1)!, [key], 'e2b (key only in Authorization)');
    // The header form of the address.
    const viaHeader = await request(url, `/app${QUERY(key)}`, {
      'e2b-sandbox-id': toE2bSandboxId(sandboxId),
      'e2b-sandbox-port': '8080',
      ...credentialHeaders(key, otherKey),
    });
    assert.equal(viaHeader.status, 200, viaHeader.body);
    const head = heads.at(-1)!;
    assertNoCredential(head, [key, otherKey], 'e2b (E2b-Sandbox-Id)');
    assert.doesNotMatch(head, /^e2b-sandbox-/im);
    assert.match(head, /^x-benign: kept$/im);
  });
});

test('a key in the path is refused, not forwarded', async () => {
  await withProxies(async ({ url, key, sandboxId, heads }) => {
    const res = await request(url, `/v1/sandboxes/${sandboxId}/ports/8080/k/${key}`, {
      authorization: `Bearer ${key}`,
    });
    assert.equal(res.status, 400);
    const body = JSON.parse(res.body) as { error: { code: string; field: string } };
    assert.equal(body.error.code, 'invalid_argument');
    assert.equal(body.error.field, 'path');
    const e2b = await request(url, `/k/${key}`, {
      host: `8080-${toE2bSandboxId(sandboxId)}.sbx.test`,
      'x-access-token': key,
    });
    assert.equal(e2b.status, 400);
    assert.equal(heads.length, 0);
  });
});

test('WebSocket upgrades through either proxy never hand the sandbox a key', async () => {
  await withProxies(async ({ url, key, otherKey, sandboxId, heads }) => {
    const upgrade = {
      connection: 'Upgrade',
      upgrade: 'websocket',
      'sec-websocket-version': '13',
      'sec-websocket-key': Buffer.from('0123456789abcdef').toString('base64'),
      ...credentialHeaders(key, otherKey),
    };
    const native = await request(url, `/v1/sandboxes/${sandboxId}/ports/8080/ws${QUERY(key)}`, {
      ...upgrade,
      authorization: `Bearer ${key}`,
    });
    const hosted = await request(url, `/ws${QUERY(key)}`, {
      ...upgrade,
      host: `8080-${toE2bSandboxId(sandboxId)}.sbx.test`,
    });
    // Whether an upgrade is served or refused, what reached the sandbox carries no key.
    for (const r of [native, hosted]) assert.ok(r.upgraded || r.status >= 400, JSON.stringify(r));
    for (const head of heads) assertNoCredential(head, [key, otherKey], 'upgrade');
  });
});
