/**
 * Review attacks on E2B's public ports (`allowPublicTraffic`) and the
 * lifecycle holds (`autoPause` without `autoResume`): anyone who can open a
 * connection must not resume a paused sandbox whose owner did not ask for
 * `autoResume`, whichever apiserver (or native call) paused it.
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
import { toDsecSandboxId } from './ids.js';

function request(base: URL, host: string): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: base.hostname, port: base.port, path: '/app', method: 'GET', headers: { host } },
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

test('public ports: keyless traffic never resumes a paused sandbox made without autoResume, whoever paused it', async () => {
  const echo = createServer((socket: Socket) => {
    socket.on('data', () =>
      socket.end('HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok'),
    );
    socket.on('error', () => undefined);
  });
  await new Promise<void>((resolve) => echo.listen(0, '127.0.0.1', resolve));
  const echoPort = (echo.address() as AddressInfo).port;
  const edge = new ScriptedEdge();
  let tunnels = 0;
  const resumes: string[] = [];
  // As the real edge: a call into a paused sandbox resumes it first.
  edge.io.connectPort = async (id) => {
    tunnels++;
    const info = await edge.getSandbox(id);
    if (info.state === 'paused') {
      resumes.push(id);
      await edge.resumeSandbox(id);
    }
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
    const create = async (body: Record<string, unknown>) => {
      const r = await api.app.inject({
        method: 'POST',
        url: '/v2/sandboxes',
        headers: { 'x-api-key': api.rootKey, 'content-type': 'application/json' },
        payload: JSON.stringify({ templateID: 'busybox', ...body }),
      });
      assert.equal(r.statusCode, 201, r.body);
      return (JSON.parse(r.body) as { sandboxID: string }).sandboxID;
    };
    const principal = await api.iam.authenticate(api.rootKey);
    const held = await create({ autoPause: true, network: { allowPublicTraffic: true } });
    const wakes = await create({
      autoPause: true,
      autoResume: { enabled: true },
      network: { allowPublicTraffic: true },
    });
    // Paused as another apiserver's timeout (or a native pause, or before a restart) pauses it:
    // this apiserver holds nothing about them.
    await service.pause(principal, toDsecSandboxId(held));
    await service.pause(principal, toDsecSandboxId(wakes));

    const refused = await request(url, `8080-${held}.sbx.test`);
    assert.notEqual(refused.status, 200, 'a keyless request resumed a sandbox without autoResume');
    assert.equal(tunnels, 0, 'a tunnel was opened into the paused sandbox');
    assert.equal(
      (await service.get(principal, toDsecSandboxId(held))).state,
      'paused',
      'the sandbox without autoResume was resumed by keyless traffic',
    );

    // With autoResume the next request resumes it, as E2B's do.
    const woken = await request(url, `8080-${wakes}.sbx.test`);
    assert.equal(woken.status, 200, woken.body);
    assert.deepEqual(resumes, [toDsecSandboxId(wakes)]);
  } finally {
    await api.close();
    echo.close();
  }
});
