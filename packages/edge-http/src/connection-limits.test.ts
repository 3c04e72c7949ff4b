import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import tls from 'node:tls';
import { FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';
import { makeTestCertificate } from './testing.js';

// SECURITY J38 on the edge protocol listener: anyone who reaches its port can connect, signed
// or not. Idle connections make room for new ones, so they neither pile up without bound nor
// lock the apiservers out.

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test('idle connections are bounded and cannot lock a signed client out', async (t) => {
  const secret = newEdgeSecret();
  const server = await serveEdge({
    edge: new FakeEdge({ edgeId: 'edge-c' }),
    secret,
    connectionLimits: { maxConnections: 30 },
  });
  const edge = new RemoteEdge({ edgeId: 'edge-c', url: server.url, secret });
  const sockets: net.Socket[] = [];
  t.after(async () => {
    for (const s of sockets) s.destroy();
    edge.close();
    await server.close();
  });
  const { port } = new URL(server.url);
  for (let i = 0; i < 40; i++) {
    const s = net.connect(Number(port), '127.0.0.1');
    s.on('error', () => {});
    sockets.push(s);
    await new Promise<void>((r) => s.once('connect', () => r()));
    // An unsigned request, refused with 401; the connection then idles.
    s.write('GET /edge/v1/status HTTP/1.1\r\nHost: x\r\n\r\n');
    await new Promise<void>((r) => s.once('data', () => r()));
  }
  await sleep(200);
  const open = sockets.filter((s) => s.readyState === 'open').length;
  assert.ok(open <= 30, `${open} idle connections held open at a cap of 30`);
  assert.equal((await edge.status(AbortSignal.timeout(10_000))).edgeId, 'edge-c');
});

/*
 * A TLS edge's front listener looks at each connection's first byte before the HTTPS server (and
 * its ConnectionGuard) sees it. Bounded with Node's own `maxConnections` at the guard's cap, a
 * full listener dropped every new connection before the guard could make room: connections that
 * never send a byte (the guard never saw them) or idle after a handshake locked the apiservers
 * out, the lockout of SECURITY J38 back on every TLS edge.
 */
for (const how of [
  'send nothing',
  'send plaintext and hold on',
  'idle after a handshake and a request',
] as const) {
  test(`TLS: connections that ${how} cannot lock a signed client out`, async (t) => {
    const dir = await mkdtemp(join(tmpdir(), 'dsec-edge-conn-tls-'));
    const cert = await makeTestCertificate(dir, 'edge');
    const secret = newEdgeSecret();
    const server = await serveEdge({
      edge: new FakeEdge({ edgeId: 'edge-c' }),
      secret,
      tls: { cert: cert.cert, key: cert.key },
      connectionLimits: { maxConnections: 30 },
    });
    const edge = new RemoteEdge({
      edgeId: 'edge-c',
      url: server.url,
      secret,
      tls: { pinSha256: [cert.sha256] },
    });
    const sockets: net.Socket[] = [];
    t.after(async () => {
      for (const s of sockets) s.destroy();
      edge.close();
      await server.close();
      await rm(dir, { recursive: true, force: true });
    });
    const port = Number(new URL(server.url).port);
    for (let i = 0; i < 40; i++) {
      if (how !== 'idle after a handshake and a request') {
        // It never ends its side: a refused plaintext connection is kept until it does (5 s).
        const s = net.connect({ port, host: '127.0.0.1', allowHalfOpen: true });
        s.on('error', () => {});
        // Read what comes, so a close is seen.
        s.resume();
        sockets.push(s);
        await new Promise<void>((r) => s.once('connect', () => r()));
        if (how === 'send plaintext and hold on') s.write('GET /edge/v1/status HTTP/1.1\r\n');
        continue;
      }
      const s = tls.connect({ port, host: '127.0.0.1', rejectUnauthorized: false });
      s.on('error', () => {});
      sockets.push(s);
      const answered = await new Promise<boolean>((r) => {
        s.once('secureConnect', () => {
          s.write('GET /edge/v1/status HTTP/1.1\r\nHost: x\r\n\r\n');
          s.once('data', () => r(true));
        });
        s.once('close', () => r(false));
      });
      if (!answered) break;
    }
    await sleep(200);
    // (A refused plaintext one reads as ended here while the edge still holds it.)
    const open = sockets.filter((s) => !s.destroyed && s.readyState === 'open').length;
    assert.ok(open <= 30, `${open} of the attacker's connections held open at a cap of 30`);
    assert.equal((await edge.status(AbortSignal.timeout(10_000))).edgeId, 'edge-c');
  });
}

test('a flood of unsigned requests costs no log line each: refusals are logged at most once a window, with a count', async (t) => {
  const lines: { obj: Record<string, unknown>; msg: string }[] = [];
  const logger = {
    info: () => undefined,
    warn: (obj: object, msg: string) =>
      void lines.push({ obj: obj as Record<string, unknown>, msg }),
    error: () => undefined,
  };
  const server = await serveEdge({
    edge: new FakeEdge({ edgeId: 'edge-d' }),
    secret: newEdgeSecret(),
    logger,
  });
  t.after(() => server.close());
  const { port } = new URL(server.url);
  const s = net.connect(Number(port), '127.0.0.1');
  s.on('error', () => {});
  t.after(() => s.destroy());
  await new Promise<void>((r) => s.once('connect', () => r()));
  let answers = 0;
  s.on('data', (d: Buffer) => (answers += d.toString('latin1').split('HTTP/1.1 401').length - 1));
  for (let i = 0; i < 200; i++) s.write('GET /edge/v1/status HTTP/1.1\r\nHost: x\r\n\r\n');
  while (answers < 200) await sleep(20);
  const refused = lines.filter((l) => l.msg === 'refused');
  assert.ok(refused.length >= 1 && refused.length <= 2, `${refused.length} lines for 200 refusals`);
});
