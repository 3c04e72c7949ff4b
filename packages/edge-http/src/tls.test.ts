import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import http from 'node:http';
import https from 'node:https';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Duplex, Readable } from 'node:stream';
import tls from 'node:tls';
import type { TLSSocket } from 'node:tls';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import type { DsecError } from '@dsec/core';
import type { EdgeApi, FileInfo, PtySession, SandboxIoApi } from '@dsec/core';
import { edgeApiConformance } from '@dsec/core/testing';
import { addFnCall, FakeEdge } from '@dsec/apiserver/testing';
import {
  certificateSha256,
  newEdgeSecret,
  normalizeFingerprint,
  RemoteEdge,
  serveEdge,
} from './index.js';
import { makeTestCertificate, type TestCertificate } from './testing.js';

/*
 * Issue 24, point 7: optional TLS between apiservers and edges, with the
 * edge's certificate pinned. Certificates are made by Debian's openssl,
 * as an operator would make them.
 */

const EDGE = 'edge-tls';
const ids = new SandboxIdCodec('edge-http-tls-unit-secret');
let dir: string;
let right: TestCertificate;
let wrong: TestCertificate;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-edge-tls-'));
  right = await makeTestCertificate(dir, 'edge-right');
  wrong = await makeTestCertificate(dir, 'edge-wrong');
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

const certificateRefused = (e: unknown) => {
  assert.ok(isDsecError(e, 'unavailable'), String(e));
  assert.equal(e.details?.reason, 'edge_certificate', e.message);
  return true;
};

edgeApiConformance('RemoteEdge → serveEdge(FakeEdge) over pinned TLS', async () => {
  const secret = newEdgeSecret();
  const fake = addFnCall(
    new FakeEdge({ edgeId: EDGE, capacity: { memoryMb: 4096, cpuCores: 4, sandboxes: 3 } }),
  );
  fake.fncallDouble.pools = [
    { language: 'python', network: false, idle: 1, busy: 0, starting: 0, max: 4 },
  ];
  const server = await serveEdge({ edge: fake, secret, tls: { cert: right.cert, key: right.key } });
  assert.match(server.url, /^https:\/\/127\.0\.0\.1:\d+$/);
  const edge = new RemoteEdge({
    edgeId: EDGE,
    url: server.url,
    secret,
    tls: { pinSha256: [right.sha256] },
  });
  return {
    edge,
    capacitySandboxes: 3,
    mintId: () => ids.mint(EDGE),
    image: 'base',
    io: false,
    events: false,
    fncall: { language: 'python', echoCode: 'import sys; sys.stdout.write(sys.stdin.read())' },
    cleanup: async () => {
      edge.close();
      await server.close();
    },
  };
});

test('fingerprints: openssl and node:crypto agree; any case, colons or the openssl prefix', () => {
  assert.equal(certificateSha256(right.cert), right.sha256);
  const hex = right.sha256.replaceAll(':', '');
  for (const form of [
    right.sha256,
    right.sha256.toLowerCase(),
    hex,
    hex.toLowerCase(),
    `sha256 Fingerprint=${right.sha256}`,
    `  SHA256 Fingerprint=${hex}\n`,
  ])
    assert.equal(normalizeFingerprint(form), right.sha256, form);
  for (const bad of [
    '',
    'AB:CD',
    hex.slice(2),
    `${hex}00`,
    `sha1 Fingerprint=${hex}`,
    'Z'.repeat(64),
  ])
    assert.throws(
      () => normalizeFingerprint(bad),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'tls.pinSha256',
      bad,
    );
  assert.throws(
    () => certificateSha256('not a certificate'),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('a client option that cannot pin is refused where it is made', () => {
  const secret = newEdgeSecret();
  const make = (url: string, pinSha256: string[]) =>
    new RemoteEdge({ edgeId: EDGE, url, secret, tls: { pinSha256 } });
  assert.throws(
    () => make('http://127.0.0.1:1', [right.sha256]),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'url',
  );
  assert.throws(
    () => make('https://127.0.0.1:1', []),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'tls.pinSha256',
  );
  assert.throws(
    () => make('https://127.0.0.1:1', ['00:11']),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'tls.pinSha256',
  );
});

/** A FakeEdge with an in-sandbox interface just big enough for files, a terminal and a port. */
function ioEdge(): EdgeApi {
  const fake = new FakeEdge({ edgeId: EDGE });
  const io: Partial<SandboxIoApi> = {
    writeFile: async (_id, path, body) => {
      let size = 0;
      for await (const c of body as Readable) size += (c as Buffer).length;
      const info: FileInfo = {
        name: path.split('/').pop() ?? '',
        path,
        type: 'file',
        size,
        mode: 0o644,
        mtime: new Date(0).toISOString(),
        uid: 0,
        gid: 0,
      };
      return info;
    },
    readFile: async () => Readable.from([Buffer.from('over TLS\n')]),
    openPty: async () => {
      const listeners: ((c: Buffer) => void)[] = [];
      let exit!: (v: { exitCode: number }) => void;
      const session: PtySession = {
        onOutput: (cb) => listeners.push(cb),
        write: (d) => listeners.forEach((l) => l(Buffer.from(`echo:${d.toString()}`))),
        resize: () => undefined,
        end: () => exit({ exitCode: 0 }),
        kill: () => exit({ exitCode: 137 }),
        exited: new Promise((r) => (exit = r)),
      };
      return session;
    },
    connectPort: async (_id, port) => {
      if (port === 81) {
        // Nothing listens: the sandbox side fails once the client is connected.
        const refused = new Duplex({ read: () => undefined, write: (_c, _e, cb) => cb() });
        setTimeout(() => refused.destroy(new Error('connect ECONNREFUSED 127.0.0.1:81')), 20);
        return refused;
      }
      // Upper-cases what it got, once its input ends (a half-close passed on).
      const got: Buffer[] = [];
      const svc: Duplex = new Duplex({
        read: () => undefined,
        write: (chunk: Buffer, _enc, cb) => {
          got.push(chunk);
          cb();
        },
        final: (cb) => {
          svc.push(Buffer.concat(got).toString().toUpperCase());
          svc.push(null);
          cb();
        },
      });
      return svc;
    },
  };
  return {
    edgeId: EDGE,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
    io: io as SandboxIoApi,
  };
}

async function readAll(stream: Readable): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString();
}

test('the right pin: files, a terminal and a port all work over TLS 1.3', async () => {
  const secret = newEdgeSecret();
  const server = await serveEdge({
    edge: ioEdge(),
    secret,
    tls: { cert: right.cert, key: right.key },
  });
  // Pins in any accepted form; one of several (a rotation) is enough.
  const remote = new RemoteEdge({
    edgeId: EDGE,
    url: server.url,
    secret,
    tls: { pinSha256: [wrong.sha256, right.sha256.replaceAll(':', '').toLowerCase()] },
  });
  try {
    assert.equal((await remote.status()).edgeId, EDGE);
    const info = await remote.io.writeFile('sb', '/x', Readable.from([Buffer.alloc(100_000, 1)]));
    assert.equal(info.size, 100_000);
    assert.equal(await readAll(await remote.io.readFile('sb', '/x')), 'over TLS\n');
    const pty = await remote.io.openPty('sb');
    let seen = '';
    const echoed = new Promise<void>((resolve) =>
      pty.onOutput((c) => {
        seen += c.toString();
        if (seen.includes('echo:ls')) resolve();
      }),
    );
    pty.write(Buffer.from('ls'));
    await echoed;
    pty.end();
    assert.deepEqual(await pty.exited, { exitCode: 0, signal: undefined });
    const port = await remote.io.connectPort('sb', 80);
    const answer: Buffer[] = [];
    const ended = new Promise<void>((r) => port.on('end', r));
    port.on('data', (c: Buffer) => answer.push(c));
    port.write('hello ');
    port.end('tls');
    await ended;
    assert.equal(Buffer.concat(answer).toString(), 'HELLO TLS');
    // A port whose sandbox side fails is unavailable over TLS too (a TLS socket cannot
    // be reset: the edge drops it), and the edge goes on serving.
    const dead = await remote.io.connectPort('sb', 81);
    await assert.rejects(
      new Promise((resolve, reject) => {
        dead.on('error', reject);
        dead.on('end', resolve);
        dead.write('GET / HTTP/1.0\r\n\r\n');
        dead.resume();
      }),
      (e) => isDsecError(e, 'unavailable'),
    );
    assert.equal((await remote.status()).edgeId, EDGE);
  } finally {
    remote.close();
    await server.close();
  }
});

test('a wrong pin is refused before a byte of a request reaches the server', async () => {
  const secret = newEdgeSecret();
  // The real edge, and an impostor with a certificate of its own (also for 127.0.0.1).
  const edge = await serveEdge({
    edge: ioEdge(),
    secret,
    tls: { cert: right.cert, key: right.key },
  });
  let requests = 0;
  let handshakes = 0; // TCP connections: the client may hang up before the server's handshake ends
  const impostor = https.createServer({ cert: wrong.cert, key: wrong.key }, (_req, res) => {
    requests++;
    res.end('{}');
  });
  impostor.on('connection', () => handshakes++);
  impostor.on('upgrade', (_req, socket) => {
    requests++;
    socket.destroy();
  });
  await new Promise<void>((r) => impostor.listen(0, '127.0.0.1', r));
  const impostorUrl = `https://127.0.0.1:${(impostor.address() as AddressInfo).port}`;
  try {
    // The edge's own certificate, pinned as someone else's: refused too.
    const misPinned = new RemoteEdge({
      edgeId: EDGE,
      url: edge.url,
      secret,
      tls: { pinSha256: [wrong.sha256] },
    });
    await assert.rejects(misPinned.status(), certificateRefused);
    await assert.rejects(misPinned.io.openPty('sb'), certificateRefused);
    misPinned.close();
    const fooled = new RemoteEdge({
      edgeId: EDGE,
      url: impostorUrl,
      secret,
      tls: { pinSha256: [right.sha256] },
    });
    await assert.rejects(
      fooled.status(),
      (e) => certificateRefused(e) && (e as DsecError).details?.sha256 === wrong.sha256,
    );
    await assert.rejects(
      fooled.io.writeFile('sb', '/secret', Buffer.from('reference answer')),
      certificateRefused,
    );
    await assert.rejects(fooled.io.connectPort('sb', 80), certificateRefused);
    await assert.rejects(fooled.io.openPty('sb'), certificateRefused);
    fooled.close();
    assert.ok(handshakes >= 4, `handshakes: ${handshakes}`);
    assert.equal(requests, 0, 'no request reached the impostor');
  } finally {
    await edge.close();
    impostor.closeAllConnections();
    await new Promise<void>((r) => impostor.close(() => r()));
  }
});

test('a plaintext client to a TLS edge fails cleanly; the edge keeps serving', async () => {
  const secret = newEdgeSecret();
  const server = await serveEdge({
    edge: ioEdge(),
    secret,
    tls: { cert: right.cert, key: right.key },
  });
  const plain = new RemoteEdge({
    edgeId: EDGE,
    url: server.url.replace('https:', 'http:'),
    secret,
  });
  const pinned = new RemoteEdge({
    edgeId: EDGE,
    url: server.url,
    secret,
    tls: { pinSha256: [right.sha256] },
  });
  try {
    for (const call of [() => plain.status(), () => plain.io.openPty('sb')]) {
      await assert.rejects(call(), (e) => {
        assert.ok(isDsecError(e, 'unavailable'), String(e));
        assert.equal(e.details?.reason, 'edge_unauthenticated');
        assert.equal(e.details?.status, 400);
        assert.match(String(e.details?.unverified), /serves TLS only/);
        return true;
      });
    }
    // Raw bytes that are neither TLS nor HTTP get the same answer, and the edge is fine.
    const garbage = await new Promise<string>((resolve, reject) => {
      const url = new URL(server.url);
      const req = http.request({ host: url.hostname, port: url.port, path: '/' }, (res) => {
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('end', () => resolve(`${res.statusCode} ${Buffer.concat(chunks).toString()}`));
      });
      req.on('error', reject);
      req.end();
    });
    assert.match(garbage, /^400 .*serves TLS only/);
    assert.equal((await pinned.status()).edgeId, EDGE);
  } finally {
    plain.close();
    pinned.close();
    await server.close();
  }
});

test('a pinned client to a plaintext edge fails cleanly', async () => {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge: ioEdge(), secret });
  const pinned = new RemoteEdge({
    edgeId: EDGE,
    url: server.url.replace('http:', 'https:'),
    secret,
    tls: { pinSha256: [right.sha256] },
  });
  try {
    await assert.rejects(pinned.status(), (e) => isDsecError(e, 'unavailable'));
    await assert.rejects(pinned.io.openPty('sb'), (e) => isDsecError(e, 'unavailable'));
  } finally {
    pinned.close();
    await server.close();
  }
});

test('only TLS 1.3, and every connection a full handshake (no session resumed unchecked)', async () => {
  // A TLS server with the pinned certificate that closes every connection
  // after one answer (it cannot prove one: the client refuses each, which
  // is beside the point here) and would resume any session offered.
  const handshakes: { protocol: string | null; reused: boolean }[] = [];
  const server = https.createServer({ cert: right.cert, key: right.key }, (_req, res) => {
    res.writeHead(500, { connection: 'close' }).end('{}');
  });
  server.on('secureConnection', (socket: TLSSocket) =>
    handshakes.push({ protocol: socket.getProtocol(), reused: socket.isSessionReused() }),
  );
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const url = `https://127.0.0.1:${(server.address() as AddressInfo).port}`;
  const remote = new RemoteEdge({
    edgeId: EDGE,
    url,
    secret: newEdgeSecret(),
    tls: { pinSha256: [right.sha256] },
  });
  try {
    for (let i = 0; i < 3; i++)
      await assert.rejects(remote.status(), (e) => isDsecError(e, 'unavailable'));
    await assert.rejects(remote.io.openPty('sb'), (e) => isDsecError(e, 'unavailable'));
    assert.equal(handshakes.length, 4);
    assert.ok(
      handshakes.every((h) => h.protocol === 'TLSv1.3' && !h.reused),
      JSON.stringify(handshakes),
    );
  } finally {
    remote.close();
    server.closeAllConnections();
    await new Promise<void>((r) => server.close(() => r()));
  }
  // The edge refuses anything older than TLS 1.3.
  const secret = newEdgeSecret();
  const edge = await serveEdge({
    edge: ioEdge(),
    secret,
    tls: { cert: right.cert, key: right.key },
  });
  try {
    const u = new URL(edge.url);
    const old = await new Promise<string>((resolve) => {
      const socket = tls.connect({
        host: u.hostname,
        port: Number(u.port),
        maxVersion: 'TLSv1.2',
        rejectUnauthorized: false,
      });
      socket.once('secureConnect', () => {
        socket.destroy();
        resolve('connected');
      });
      socket.once('error', (err: NodeJS.ErrnoException) => resolve(`refused: ${err.code}`));
    });
    assert.match(old, /^refused/);
  } finally {
    await edge.close();
  }
});
