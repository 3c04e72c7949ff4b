/**
 * E2B's `allowPublicTraffic`: off by default (port traffic needs the key or
 * the traffic token), on request a sandbox's ports take traffic with no key.
 * Attacks: no key on a private sandbox, a forged or another sandbox's ID, a
 * public sandbox's envd port, another project's key, a key sent anyway (it
 * must not reach the sandbox). The sandbox's web server is an echo of the
 * request head it got, behind a scripted edge whose port tunnel is a
 * loopback connection to it.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import { connect, createServer } from 'node:net';
import type { AddressInfo, Socket } from 'node:net';
import { ApiMetrics, SandboxService } from '@dsec/apiserver';
import { createTestApi, ScriptedEdge } from '@dsec/apiserver/testing';
import { PowerOfKPlacer } from '@dsec/placement';
import { registerE2bRoutes } from './register.js';

function request(
  base: URL,
  host: string,
  headers: Record<string, string> = {},
  path = '/app',
): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: base.hostname, port: base.port, path, method: 'GET', headers: { host, ...headers } },
      (res) => {
        let body = '';
        res.setEncoding('latin1');
        res.on('data', (c: string) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
      },
    );
    req.on('error', reject);
    req.end();
  });
}

test('public ports: keyless traffic only to a sandbox made with allowPublicTraffic, never to envd or another sandbox', async () => {
  const heads: string[] = [];
  const echo = createServer((socket: Socket) => {
    let got = '';
    socket.on('data', (chunk: Buffer) => {
      got += chunk.toString('latin1');
      const end = got.indexOf('\r\n\r\n');
      if (end < 0) return;
      const head = got.slice(0, end);
      heads.push(head);
      socket.end(
        `HTTP/1.1 200 OK\r\ncontent-length: ${Buffer.byteLength(head, 'latin1')}\r\nconnection: close\r\n\r\n${head}`,
        'latin1',
      );
    });
    socket.on('error', () => undefined);
  });
  await new Promise<void>((resolve) => echo.listen(0, '127.0.0.1', resolve));
  const echoPort = (echo.address() as AddressInfo).port;
  const edge = new ScriptedEdge();
  let tunnels = 0;
  edge.io.connectPort = async () => {
    tunnels++;
    return connect(echoPort, '127.0.0.1');
  };
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
    const create = async (body: Record<string, unknown>, key = api.rootKey) => {
      const r = await api.app.inject({
        method: 'POST',
        url: '/v2/sandboxes',
        headers: { 'x-api-key': key, 'content-type': 'application/json' },
        payload: JSON.stringify({ templateID: 'busybox', ...body }),
      });
      assert.equal(r.statusCode, 201, r.body);
      return JSON.parse(r.body) as { sandboxID: string; trafficAccessToken: string | null };
    };
    const pub = await create({ network: { allowPublicTraffic: true } });
    const priv = await create({});
    assert.equal(pub.trafficAccessToken, null);
    assert.equal(priv.trafficAccessToken, api.rootKey, 'a private sandbox needs the token');

    // Public: no key needed; an app's own Authorization passes on.
    const open = await request(url, `8080-${pub.sandboxID}.sbx.test`, {
      authorization: 'Bearer app-session-1',
    });
    assert.equal(open.status, 200, open.body);
    assert.match(open.body, /^GET \/app HTTP\/1\.1/);
    assert.match(open.body, /authorization: Bearer app-session-1/i);

    // Private: no key is refused before any tunnel opens; it is looked up once, not per request.
    const before = tunnels;
    let lookups = 0;
    const getSandbox = edge.getSandbox.bind(edge);
    edge.getSandbox = (id, signal) => {
      lookups++;
      return getSandbox(id, signal);
    };
    for (let i = 0; i < 3; i++) {
      const shut = await request(url, `8080-${priv.sandboxID}.sbx.test`);
      assert.equal(shut.status, 401);
    }
    assert.equal(lookups, 1);
    assert.equal(tunnels, before);

    // A public sandbox's envd still needs the key (files, commands).
    const envd = await request(
      url,
      `49983-${pub.sandboxID}.sbx.test`,
      {},
      '/files?path=/etc/passwd',
    );
    assert.equal(envd.status, 401);
    const health = await request(url, `49983-${pub.sandboxID}.sbx.test`, {}, '/health');
    assert.equal(health.status, 401);

    // Forged IDs: one character changed, or another sandbox's ID with the public one's port.
    const forged = pub.sandboxID.slice(0, -2) + (pub.sandboxID.endsWith('aa') ? 'bb' : 'aa');
    assert.equal((await request(url, `8080-${forged}.sbx.test`)).status, 401);
    assert.equal(tunnels, before);

    // With the key the public sandbox answers too, and the key never reaches it.
    const keyed = await request(url, `8080-${pub.sandboxID}.sbx.test`, {
      'e2b-traffic-access-token': api.rootKey,
    });
    assert.equal(keyed.status, 200);
    assert.ok(!keyed.body.includes(api.rootKey), 'the key reached the sandbox');

    // Another project's key is another project's: the sandbox is not found to it
    const admin = await api.iam.authenticate(api.rootKey);
    const other = await api.iam.createProject(admin, { name: 'other' });
    const { key: otherKey } = await api.iam.createKey(admin, { projectId: other.id });
    const foreign = await request(url, `8080-${pub.sandboxID}.sbx.test`, { 'x-api-key': otherKey });
    // (answered as for any sandbox that is not there: E2B's proxy's 502).
    assert.equal(foreign.status, 502);
    assert.match(foreign.body, /sandbox_not_found/);
    // A forged DSec-shaped bearer is a key, checked as such.
    const fake = await request(url, `8080-${pub.sandboxID}.sbx.test`, {
      authorization: `Bearer dsk_${'A'.repeat(43)}`,
    });
    assert.equal(fake.status, 401);
  } finally {
    await api.close();
    echo.close();
  }
});
