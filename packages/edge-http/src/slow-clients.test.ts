import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import tls from 'node:tls';
import type { CommandResult, EdgeApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';
import { makeTestCertificate, type TestCertificate } from './testing.js';

/*
 * Anyone who reaches an edge's port can open connections before any
 * signature is checked. Each must bring a request head within the header
 * timeout, or be closed: Node's own header timeout does not cover the first
 * request of a connection (Node 20: a connection that sends nothing, or
 * half a request line, was held for good, plaintext or after a TLS
 * handshake; a TLS handshake was given 120 s), so a peer without the secret
 * held an edge's file descriptors as long as it liked.
 */

const EDGE = 'edge-slow';
const HEAD_MS = 300;
let dir: string;
let cert: TestCertificate;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-edge-slow-'));
  cert = await makeTestCertificate(dir, 'edge-slow');
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

/** Resolves 'closed' when the edge closes the socket, 'still open' after a generous wait. */
function closedByEdge(socket: net.Socket): Promise<string> {
  socket.on('error', () => undefined);
  socket.on('data', () => undefined);
  return new Promise((resolve) => {
    const timer = setTimeout(() => {
      socket.destroy();
      resolve('still open');
    }, 50 * HEAD_MS);
    socket.once('close', () => {
      clearTimeout(timer);
      resolve('closed');
    });
  });
}

/** An edge whose commands take `ms`, so a call outlasts the header timeout. */
function slowEdge(ms: number): EdgeApi {
  const fake = new FakeEdge({ edgeId: EDGE });
  return {
    edgeId: EDGE,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: async () => {
      await new Promise((r) => setTimeout(r, ms));
      const r: CommandResult = {
        commandId: 'cmd-slow',
        exitCode: 0,
        outcome: 'exited',
        stdout: 'slow\n',
        stderr: '',
        truncated: false,
        stdoutBytes: 5,
        stderrBytes: 0,
        durationMs: ms,
      };
      return r;
    },
  };
}

for (const secure of [false, true]) {
  test(`${secure ? 'TLS' : 'plaintext'}: a connection without a request head in time is closed`, async () => {
    const secret = newEdgeSecret();
    const server = await serveEdge({
      edge: slowEdge(4 * HEAD_MS),
      secret,
      headersTimeoutMs: HEAD_MS,
      ...(secure ? { tls: { cert: cert.cert, key: cert.key } } : {}),
    });
    const url = new URL(server.url);
    const port = Number(url.port);
    const raw = (bytes?: Buffer | string) => {
      const s = net.connect(port, url.hostname, () => {
        if (bytes !== undefined) s.write(bytes);
      });
      return s;
    };
    const overTls = (bytes?: string) => {
      const s = tls.connect({ port, host: url.hostname, rejectUnauthorized: false });
      s.once('secureConnect', () => {
        if (bytes !== undefined) s.write(bytes);
      });
      return s;
    };
    const halfHead = 'GET /edge/v1/status HTTP/1.1\r\n';
    const cases: [string, net.Socket][] = [
      ['nothing sent', raw()],
      [
        secure ? 'three bytes of a handshake' : 'half a request head',
        raw(secure ? Buffer.from([0x16, 3, 1]) : halfHead),
      ],
    ];
    if (secure) {
      cases.push(['a handshake, then nothing', overTls()]);
      cases.push(['a handshake, then half a request head', overTls(halfHead)]);
    }
    const remote = new RemoteEdge({
      edgeId: EDGE,
      url: server.url,
      secret,
      ...(secure ? { tls: { pinSha256: [cert.sha256] } } : {}),
    });
    try {
      const outcomes = await Promise.all(cases.map(([, s]) => closedByEdge(s)));
      assert.deepEqual(
        Object.fromEntries(cases.map(([what], i) => [what, outcomes[i]])),
        Object.fromEntries(cases.map(([what]) => [what, 'closed'])),
      );
      // A call that outlasts the header timeout, and an idle pooled socket reused after it, work.
      assert.equal((await remote.runCommand('sb', { argv: ['sleep'] })).stdout, 'slow\n');
      await new Promise((r) => setTimeout(r, 3 * HEAD_MS));
      assert.equal((await remote.status()).edgeId, EDGE);
    } finally {
      remote.close();
      for (const [, s] of cases) s.destroy();
      await server.close();
    }
  });
}
