import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import { request } from 'node:http';
import type { Socket } from 'node:net';
import { WebSocket } from 'ws';
import type { PtySession } from '@dsec/core';
import { startTestServer } from '../testing/index.js';
import type { TestServer } from '../testing/index.js';

/*
 * The browser terminal: `Upgrade: websocket` on the terminal route, the key
 * in the first message. The edge's PTY is a double that echoes keystrokes
 * upper-cased and exits on "exit".
 */

let server: TestServer;
let sandboxId: string;
const opened: { rows?: number; cols?: number; env?: Record<string, string> }[] = [];
const resizes: [number, number][] = [];
let killed = 0;

function fakePty(): PtySession {
  const out = new EventEmitter();
  let resolveExit!: (v: { exitCode: number }) => void;
  const exited = new Promise<{ exitCode: number }>((r) => (resolveExit = r));
  return {
    onOutput: (cb) => void out.on('data', cb),
    write: (data) => {
      const s = data.toString('utf8');
      if (s === 'exit') resolveExit({ exitCode: 7 });
      else out.emit('data', Buffer.from(s.toUpperCase()));
    },
    resize: (rows, cols) => void resizes.push([rows, cols]),
    end: () => resolveExit({ exitCode: 0 }),
    kill: () => void killed++,
    exited,
  };
}

before(async () => {
  server = await startTestServer();
  server.edge.io.openPty = async (_id, options) => {
    opened.push({ rows: options?.rows, cols: options?.cols, env: options?.env });
    return fakePty();
  };
  const res = await fetch(`${server.url}/v1/sandboxes`, {
    method: 'POST',
    headers: { authorization: `Bearer ${server.key}`, 'content-type': 'application/json' },
    body: JSON.stringify({ image: 'busybox:latest' }),
  });
  assert.equal(res.status, 201, await res.clone().text());
  sandboxId = ((await res.json()) as { id: string }).id;
});
after(() => server.close());

function wsUrl(id: string, query = ''): string {
  return `${server.url.replace(/^http/, 'ws')}/v1/sandboxes/${encodeURIComponent(id)}/pty${query}`;
}

/** Collects text (parsed JSON) and binary messages until the socket closes. */
function record(ws: WebSocket) {
  const texts: { type: string; [k: string]: unknown }[] = [];
  let binary = '';
  const waiters: (() => void)[] = [];
  ws.on('message', (data: Buffer, isBinary) => {
    if (isBinary) binary += data.toString('utf8');
    else texts.push(JSON.parse(data.toString('utf8')));
    for (const w of waiters.splice(0)) w();
  });
  const closed = new Promise<{ code: number; reason: string }>((resolve) =>
    ws.once('close', (code, reason) => resolve({ code, reason: reason.toString() })),
  );
  const until = async (pred: () => boolean): Promise<void> => {
    while (!pred()) await new Promise<void>((r) => waiters.push(r));
  };
  return { texts, binary: () => binary, closed, until };
}

test('a WebSocket terminal opens with the key in its first message and carries bytes both ways', async () => {
  const ws = new WebSocket(wsUrl(sandboxId, '?rows=30&cols=100&term=xterm-256color'));
  const r = record(ws);
  await new Promise((resolve) => ws.once('open', resolve));
  ws.send(JSON.stringify({ type: 'auth', key: server.key }));
  await r.until(() => r.texts.some((t) => t.type === 'ready'));
  assert.deepEqual(opened.at(-1), { rows: 30, cols: 100, env: { TERM: 'xterm-256color' } });
  ws.send(Buffer.from('echo hi'), { binary: true });
  await r.until(() => r.binary() === 'ECHO HI');
  ws.send(JSON.stringify({ type: 'resize', rows: 40, cols: 120 }));
  ws.send(JSON.stringify({ type: 'resize', rows: 0, cols: 120 })); // out of range: ignored
  ws.send(Buffer.from('exit'), { binary: true });
  await r.until(() => r.texts.some((t) => t.type === 'exit'));
  assert.deepEqual(r.texts.at(-1), { type: 'exit', exitCode: 7 });
  assert.equal((await r.closed).code, 1000);
  assert.deepEqual(resizes, [[40, 120]]);
});

test('a wrong key, or a first message that is not auth, closes the socket with an API error', async () => {
  for (const first of [JSON.stringify({ type: 'auth', key: 'dsk_wrong_key_123' }), 'hello']) {
    const before = opened.length;
    const ws = new WebSocket(wsUrl(sandboxId));
    const r = record(ws);
    await new Promise((resolve) => ws.once('open', resolve));
    ws.send(first);
    const { code } = await r.closed;
    assert.equal(code, 1008, first);
    assert.equal(r.texts[0]?.type, 'error');
    assert.equal((r.texts[0]?.error as { code: string }).code, 'unauthenticated');
    assert.equal(opened.length, before, 'no terminal opened');
  }
});

test('an unknown sandbox is sandbox_not_found, and closing the socket kills the terminal', async () => {
  const ws = new WebSocket(wsUrl('sb-nope'));
  const r = record(ws);
  await new Promise((resolve) => ws.once('open', resolve));
  ws.send(JSON.stringify({ type: 'auth', key: server.key }));
  assert.equal((await r.closed).code, 1011);
  assert.match((r.texts[0]?.error as { code: string }).code, /not_found/);

  const killedBefore = killed;
  const ws2 = new WebSocket(wsUrl(sandboxId));
  const r2 = record(ws2);
  await new Promise((resolve) => ws2.once('open', resolve));
  ws2.send(JSON.stringify({ type: 'auth', key: server.key }));
  await r2.until(() => r2.texts.some((t) => t.type === 'ready'));
  ws2.close();
  await r2.closed;
  while (killed === killedBefore) await new Promise((r) => setTimeout(r, 10));
  assert.equal(killed, killedBefore + 1);
});

test('the handshake is refused with an HTTP error for bad paths and queries', async () => {
  for (const url of [
    `${server.url.replace(/^http/, 'ws')}/v1/nothing`,
    wsUrl(sandboxId, '?rows=abc'),
  ]) {
    const ws = new WebSocket(url);
    const status = await new Promise<number>((resolve) => {
      ws.once('unexpected-response', (_req, res) => {
        resolve(res.statusCode ?? 0);
        res.resume();
      });
      ws.once('error', () => undefined);
    });
    assert.ok(status === 404 || status === 400, `${url}: ${status}`);
  }
});

test('the dsec-pty upgrade is still answered by its own handler', async () => {
  const status = await new Promise<number>((resolve, reject) => {
    const req = request(`${server.url}/v1/sandboxes/sb-nope/pty`, {
      headers: {
        connection: 'Upgrade',
        upgrade: 'dsec-pty',
        authorization: `Bearer ${server.key}`,
      },
    });
    req.on('response', (res) => {
      resolve(res.statusCode ?? 0);
      res.resume();
    });
    req.on('upgrade', () => resolve(101));
    req.on('error', reject);
    req.end();
  });
  assert.equal(status, 404);
});

test('dsec-pty: a large frame in small pieces arrives whole and is copied a bounded number of times', async () => {
  // A client decides how its bytes are cut. The frame reader used to join everything gathered
  // so far on every piece: a 1 MiB frame sent 16 bytes at a time cost 48 s of the apiserver's
  // event loop, and a client trickling at a few hundred KB/s kept the loop busy for good.
  const got: Buffer[] = [];
  const opens = server.edge.io.openPty;
  server.edge.io.openPty = async () => ({
    ...fakePty(),
    write: (d) => void got.push(Buffer.from(d)),
  });
  const { socket, head } = await new Promise<{ socket: Socket; head: Buffer }>(
    (resolve, reject) => {
      const req = request(`${server.url}/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty`, {
        headers: {
          connection: 'Upgrade',
          upgrade: 'dsec-pty',
          authorization: `Bearer ${server.key}`,
        },
      });
      req.on('upgrade', (_res, s, h) => resolve({ socket: s, head: h }));
      req.on('response', (res) => reject(new Error(`HTTP ${res.statusCode}`)));
      req.on('error', reject);
      req.end();
    },
  );
  assert.equal(head.length, 0);
  socket.on('data', () => undefined);
  socket.setNoDelay(true);
  const payload = Buffer.alloc(1 << 20, 0x61);
  const whole = Buffer.alloc(5 + payload.length);
  whole.writeUInt32BE(payload.length, 1); // type 0: data
  payload.copy(whole, 5);
  const concat = Buffer.concat;
  let copied = 0;
  Buffer.concat = (list: readonly Uint8Array[], totalLength?: number) => {
    const out = concat(list, totalLength);
    copied += out.length;
    return out;
  };
  try {
    for (let at = 0; at < whole.length; at += 4096) {
      if (!socket.write(whole.subarray(at, at + 4096)))
        await new Promise((r) => socket.once('drain', r));
    }
    while (got.length === 0) await new Promise((r) => setTimeout(r, 10));
  } finally {
    Buffer.concat = concat;
    server.edge.io.openPty = opens;
    socket.destroy();
  }
  assert.equal(got.length, 1);
  assert.ok(got[0]!.equals(payload), 'the frame arrives whole, as one write');
  assert.ok(copied <= 4 * whole.length, `${copied} bytes copied for a ${whole.length}-byte frame`);
});
