import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import { WebSocket } from 'ws';
import type { PtySession } from '@dsec/core';
import { PTY_UPGRADE } from './routes/ports.js';
import { createTestApi, ScriptedEdge, TEST_LAYERS } from './testing/index.js';
import type { TestApi } from './testing/index.js';

// Review of issue 24 point 4 (SECURITY J38): the doors bounds.test.ts does not walk through.
// Terminals (WebSocket and `Upgrade: dsec-pty`) are streams like any other: a client that
// never reads is cut, and a key's terminals count against its stream cap. A WebSocket that
// has not authenticated yet holds no busy connection: it cannot lock other clients out.

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
type TestContext = { after: (fn: () => Promise<void> | void) => void };

/** Every raw socket or WebSocket a test opened, destroyed when its server closes. */
const sockets = new Set<{ destroy(): void }>();

/** A terminal double: once open it prints `chunkBytes` per tick, `chunks` times, then idles. */
class PtyEdge extends ScriptedEdge {
  chunks = 0;
  chunkBytes = 64 * 1024;
  killed = 0;
  opened = 0;
  constructor() {
    super();
    this.io.openPty = async () => {
      this.opened++;
      return this.#pty();
    };
  }

  #pty(): PtySession {
    let out: ((chunk: Buffer) => void) | undefined;
    let dead = false;
    let exit!: (v: { exitCode: number }) => void;
    const exited = new Promise<{ exitCode: number }>((r) => (exit = r));
    const chunk = Buffer.alloc(this.chunkBytes, 'y');
    const pump = async () => {
      for (let i = 0; i < this.chunks && !dead; i++) {
        out?.(chunk);
        await new Promise(setImmediate);
      }
    };
    return {
      onOutput: (cb) => {
        out = cb;
        void pump();
      },
      write: () => undefined,
      resize: () => undefined,
      end: () => exit({ exitCode: 0 }),
      kill: () => {
        if (dead) return;
        dead = true;
        this.killed++;
        exit({ exitCode: 137 });
      },
      exited,
    };
  }
}

async function listening(
  t: TestContext,
  options: Parameters<typeof createTestApi>[0] = {},
): Promise<{ a: TestApi; port: number; edge: PtyEdge; id: string }> {
  const edge = new PtyEdge();
  const a = await createTestApi({ edges: [edge], imagesList: async () => TEST_LAYERS, ...options });
  t.after(async () => {
    for (const s of sockets) s.destroy();
    sockets.clear();
    await a.close();
  });
  await a.app.listen({ host: '127.0.0.1', port: 0 });
  const port = (a.app.server.address() as AddressInfo).port;
  const res = await fetch(`http://127.0.0.1:${port}/v1/sandboxes`, {
    method: 'POST',
    headers: { authorization: `Bearer ${a.rootKey}`, 'content-type': 'application/json' },
    body: JSON.stringify({ image: 'busybox:latest' }),
  });
  assert.equal(res.status, 201, await res.clone().text());
  const id = ((await res.json()) as { id: string }).id;
  return { a, port, edge, id };
}

/** Resolves to the value, or rejects when it takes longer than `ms` (a liveness bound). */
async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  await within(
    (async () => {
      while (!cond()) await sleep(20);
    })(),
    ms,
    what,
  );
}

async function get(port: number, path: string, key: string, localAddress?: string) {
  return new Promise<{ status: number; body: string }>((resolve, reject) => {
    const req = http.request(
      {
        host: '127.0.0.1',
        port,
        path,
        headers: { authorization: `Bearer ${key}`, connection: 'close' },
        agent: false,
        ...(localAddress ? { localAddress } : {}),
      },
      (res) => {
        let body = '';
        res.setEncoding('utf8');
        res.on('data', (d: string) => (body += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
        res.on('error', reject);
      },
    );
    req.on('socket', (s) => sockets.add(s));
    req.on('error', reject);
    req.end();
  });
}

function metric(text: string, series: string): number {
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return Number.NaN;
}

/** A browser terminal, authenticated; resolves once the server said `ready`. */
async function wsTerminal(
  port: number,
  id: string,
  key: string,
): Promise<{ ws: WebSocket; first: Promise<{ type: string; error?: { code: string } }> }> {
  const ws = new WebSocket(`ws://127.0.0.1:${port}/v1/sandboxes/${encodeURIComponent(id)}/pty`);
  sockets.add({ destroy: () => ws.terminate() });
  ws.on('error', () => undefined);
  const first = new Promise<{ type: string; error?: { code: string } }>((resolve) =>
    ws.on('message', (data: Buffer, isBinary) => {
      if (!isBinary) resolve(JSON.parse(data.toString('utf8')) as { type: string });
    }),
  );
  await new Promise((resolve) => ws.once('open', resolve));
  ws.send(JSON.stringify({ type: 'auth', key }));
  return { ws, first };
}

/** A raw `Upgrade: dsec-pty` terminal that reads nothing after the handshake. */
async function rawTerminal(port: number, id: string, key: string): Promise<net.Socket> {
  const socket = net.connect(port, '127.0.0.1');
  sockets.add(socket);
  socket.on('error', () => undefined);
  await new Promise((resolve) => socket.once('connect', resolve));
  socket.write(
    `GET /v1/sandboxes/${encodeURIComponent(id)}/pty HTTP/1.1\r\nHost: 127.0.0.1\r\n` +
      `Authorization: Bearer ${key}\r\nConnection: Upgrade\r\nUpgrade: ${PTY_UPGRADE}\r\n\r\n`,
  );
  let head = '';
  await new Promise<void>((resolve) => {
    const onData = (d: Buffer) => {
      head += d.toString('latin1');
      if (head.includes('\r\n\r\n')) {
        socket.off('data', onData);
        socket.pause();
        resolve();
      }
    };
    socket.on('data', onData);
  });
  assert.match(head, /^HTTP\/1\.1 101 /);
  return socket;
}

test('a WebSocket terminal whose client never reads is cut: the terminal ends, nothing stays queued', async (t) => {
  const { a, port, edge, id } = await listening(t);
  // 96 MiB of output against the 8 MiB a stream may queue.
  edge.chunks = 1536;
  const { ws, first } = await wsTerminal(port, id, a.rootKey);
  assert.equal((await first).type, 'ready');
  // The client stops reading: its socket is paused, the kernel's buffers fill, then the server's.
  (ws as unknown as { _socket: net.Socket })._socket.pause();
  await until(() => edge.killed === 1, 60_000, 'the unread terminal killed');
  const text = (await get(port, '/metrics', a.rootKey)).body;
  assert.equal(metric(text, 'dsec_streams_cut_total{reason="stream_buffer"}'), 1, text);
  assert.equal(metric(text, 'dsec_stream_queued_bytes'), 0);
  assert.equal(metric(text, 'dsec_streams_open'), 0);
});

test('a dsec-pty terminal whose client never reads is cut: the terminal ends, its socket goes', async (t) => {
  const { a, port, edge, id } = await listening(t);
  edge.chunks = 1536;
  const socket = await rawTerminal(port, id, a.rootKey);
  await until(() => edge.killed === 1, 60_000, 'the unread terminal killed');
  const closed = new Promise((resolve) => socket.once('close', resolve));
  socket.resume();
  await within(closed, 30_000, 'the cut connection closed');
  const text = (await get(port, '/metrics', a.rootKey)).body;
  assert.equal(metric(text, 'dsec_streams_cut_total{reason="stream_buffer"}'), 1, text);
  assert.equal(metric(text, 'dsec_stream_queued_bytes'), 0);
});

test('a terminal that reads gets all of its output, and terminals count against the stream cap', async (t) => {
  const { a, port, edge, id } = await listening(t, { limits: { maxStreamsPerKey: 2 } });
  // 64 MiB read by a client that keeps up: never cut.
  edge.chunks = 1024;
  const { ws, first } = await wsTerminal(port, id, a.rootKey);
  let bytes = 0;
  ws.on('message', (data: Buffer, isBinary) => {
    if (isBinary) bytes += data.length;
  });
  assert.equal((await first).type, 'ready');
  await until(() => bytes === 1024 * 64 * 1024, 120_000, 'all 64 MiB read');
  assert.equal(edge.killed, 0);
  // One open terminal plus one more fills a cap of 2; the third is refused before it opens.
  edge.chunks = 0;
  const second = await wsTerminal(port, id, a.rootKey);
  assert.equal((await second.first).type, 'ready');
  const opened = edge.opened;
  const third = await wsTerminal(port, id, a.rootKey);
  const refused = await third.first;
  assert.equal(refused.type, 'error');
  assert.equal(refused.error?.code, 'rate_limited');
  const raw = net.connect(port, '127.0.0.1');
  sockets.add(raw);
  raw.write(
    `GET /v1/sandboxes/${encodeURIComponent(id)}/pty HTTP/1.1\r\nHost: 127.0.0.1\r\n` +
      `Authorization: Bearer ${a.rootKey}\r\nConnection: Upgrade\r\nUpgrade: ${PTY_UPGRADE}\r\n\r\n`,
  );
  let answer = '';
  raw.on('data', (d: Buffer) => (answer += d.toString('latin1')));
  await within(new Promise((r) => raw.once('close', r)), 10_000, 'the refused upgrade closed');
  assert.match(answer, /^HTTP\/1\.1 429 /);
  assert.equal(edge.opened, opened, 'no terminal opened past the cap');
  // Closing one frees its slot.
  ws.close();
  await until(() => edge.killed >= 1, 10_000, 'the closed terminal killed');
  const again = await wsTerminal(port, id, a.rootKey);
  assert.equal((await again.first).type, 'ready');
});

/** A WebSocket handshake on the terminal route that never sends its key. */
async function unauthenticatedWs(port: number, localAddress: string): Promise<net.Socket> {
  const socket = net.connect({ port, host: '127.0.0.1', localAddress });
  sockets.add(socket);
  socket.on('error', () => undefined);
  await new Promise((resolve) => socket.once('connect', resolve));
  socket.write(
    'GET /v1/sandboxes/sb-x/pty HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n' +
      'Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n' +
      'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n',
  );
  let head = '';
  await new Promise<void>((resolve) => {
    socket.on('data', (d: Buffer) => {
      head += d.toString('latin1');
      if (head.includes('\r\n\r\n')) resolve();
    });
  });
  assert.match(head, /^HTTP\/1\.1 101 /);
  return socket;
}

test('WebSockets that never authenticate cannot lock other clients out (total and per-address caps)', async (t) => {
  const { a, port, id } = await listening(t, {
    transport: { maxConnections: 30 },
    limits: { maxConnectionsPerAddress: 20 },
  });
  // One address fills its own cap with handshakes that never send a key...
  const held: net.Socket[] = [];
  for (let i = 0; i < 20; i++) held.push(await unauthenticatedWs(port, '127.0.0.2'));
  // ...and another the rest of the server's.
  for (let i = 0; i < 10; i++) held.push(await unauthenticatedWs(port, '127.0.0.3'));
  // A real client on yet another address is served: a silent WebSocket made room.
  const other = await within(get(port, '/healthz', a.rootKey, '127.0.0.4'), 10_000, 'another');
  assert.equal(other.status, 200, other.body);
  // And on the flooding address itself, once the server has room again.
  const same = await within(get(port, '/healthz', a.rootKey, '127.0.0.2'), 10_000, 'same');
  assert.equal(same.status, 200, same.body);
  // An authenticated terminal is busy: it is not what makes room.
  const busy = await wsTerminal(port, id, a.rootKey);
  assert.equal((await busy.first).type, 'ready');
  for (let i = 0; i < 40; i++) await unauthenticatedWs(port, '127.0.0.5').catch(() => undefined);
  assert.equal(busy.ws.readyState, WebSocket.OPEN);
});

/** Sends an upgrade request and reads the answer's head, then never closes its side. */
async function refusedUpgrade(
  port: number,
  localAddress: string,
  request: string,
): Promise<{ socket: net.Socket; head: string }> {
  const socket = net.connect({ port, host: '127.0.0.1', localAddress });
  sockets.add(socket);
  socket.on('error', () => undefined);
  await new Promise((resolve) => socket.once('connect', resolve));
  socket.write(request);
  let head = '';
  await new Promise<void>((resolve) => {
    socket.on('data', (d: Buffer) => {
      head += d.toString('latin1');
      if (head.includes('\r\n\r\n')) resolve();
    });
    socket.once('end', () => resolve());
  });
  return { socket, head };
}

test('refused upgrades are closed by the server: a client that never closes its side holds nothing', async (t) => {
  const { a, port, id } = await listening(t, {
    transport: { maxConnections: 1000 },
    limits: { maxConnectionsPerAddress: 12 },
  });
  const ws =
    'Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n' +
    'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n';
  const refusals = [
    // No such upgrade route (WebSocket, and any other protocol).
    `GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n${ws}`,
    'GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n',
    // A terminal query out of range.
    `GET /v1/sandboxes/${id}/pty?rows=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n${ws}`,
    // A Host this server does not answer to (the request gate).
    `GET /v1/sandboxes/${id}/pty HTTP/1.1\r\nHost: evil.example\r\n${ws}`,
    // A dsec-pty terminal with a wrong key.
    `GET /v1/sandboxes/${id}/pty HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer dsk_${'A'.repeat(43)}\r\n` +
      `Connection: Upgrade\r\nUpgrade: ${PTY_UPGRADE}\r\n\r\n`,
    // A dsec-pty terminal for an unknown sandbox.
    `GET /v1/sandboxes/sb-nope/pty HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${a.rootKey}\r\n` +
      `Connection: Upgrade\r\nUpgrade: ${PTY_UPGRADE}\r\n\r\n`,
  ];
  for (const [i, r] of refusals.entries()) {
    const held = [];
    for (let j = 0; j < 12; j++) held.push(await refusedUpgrade(port, `127.0.1.${i + 1}`, r));
    for (const h of held) assert.match(h.head, /^HTTP\/1\.1 [45]\d\d /, r);
    // The server closes each after its answer, though the client keeps its side open...
    await within(
      Promise.all(
        held.map(
          (h) =>
            new Promise<void>((resolve) => {
              if (h.socket.readableEnded) resolve();
              else h.socket.once('end', () => resolve());
            }),
        ),
      ),
      10_000,
      `refusals closed by the server: ${r.split('\r\n')[0]}`,
    );
    // ...so the address has its room back, and the server holds none of them.
    const res = await within(get(port, '/healthz', a.rootKey, `127.0.1.${i + 1}`), 10_000, r);
    assert.equal(res.status, 200, `${r.split('\r\n')[0]}: ${res.body}`);
    const text = (await get(port, '/metrics', a.rootKey)).body;
    assert.ok(
      metric(text, 'dsec_http_connections') < held.length,
      `${r.split('\r\n')[0]}: ${text}`,
    );
  }
});

test('slow bodies of requests refused before their body (no key, a bogus key, no route) hold no busy connection', async (t) => {
  const { a, port } = await listening(t, {
    transport: { maxConnections: 1000 },
    limits: { maxConnectionsPerAddress: 10 },
  });
  const heads = [
    'POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n',
    `POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer dsk_${'Q'.repeat(43)}\r\n`,
    'POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n',
    'PUT /v1/sandboxes/x/files?path=/a HTTP/1.1\r\nHost: 127.0.0.1\r\n',
  ];
  for (const [i, head] of heads.entries()) {
    const address = `127.0.2.${i + 1}`;
    const held: net.Socket[] = [];
    for (let j = 0; j < 10; j++) {
      const s = net.connect({ port, host: '127.0.0.1', localAddress: address });
      sockets.add(s);
      s.on('error', () => undefined);
      await new Promise((resolve) => s.once('connect', resolve));
      // A body announced at 100 MB, of which a trickle ever comes.
      s.write(`${head}Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{`);
      held.push(s);
    }
    const timer = setInterval(() => {
      for (const s of held) if (!s.destroyed) s.write(' ');
    }, 100);
    try {
      const res = await within(get(port, '/healthz', a.rootKey, address), 10_000, head);
      assert.equal(res.status, 200, `${head.split('\r\n')[0]}: ${res.body}`);
    } finally {
      clearInterval(timer);
    }
  }
});
