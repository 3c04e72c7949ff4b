import { test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import type { Readable } from 'node:stream';
import type { CommandResult, CommandSpec, RunCommandOptions, SandboxIoApi } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';
import type { TestApi } from './testing/index.js';
import { MAX_STREAM_BUFFER_BYTES } from './routes/io-common.js';

// SECURITY F32: slow headers, slow bodies, many slow clients, clients that never read.

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/**
 * An edge whose commands print `chunks` chunks of `chunkBytes`, one per
 * `intervalMs` (forever when `chunks` is Infinity, until aborted), and whose
 * file writes count the bytes of the upload.
 */
class ChattyEdge extends FakeEdge {
  chunks = 3;
  chunkBytes = 16;
  intervalMs = 0;
  emitted = 0;
  aborted: unknown;
  readonly io = {
    writeFile: async (_id: string, path: string, body: Readable | Buffer) => {
      let size = 0;
      if (Buffer.isBuffer(body)) size = body.length;
      else for await (const c of body) size += (c as Buffer).length;
      return { path, size };
    },
  } as unknown as SandboxIoApi;

  override async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    await this.getSandbox(id);
    const chunk = Buffer.alloc(this.chunkBytes, 'x');
    for (let i = 0; i < this.chunks; i++) {
      if (options.signal?.aborted) {
        this.aborted = options.signal.reason;
        throw options.signal.reason;
      }
      options.onStdout?.(chunk);
      this.emitted += chunk.length;
      await (this.intervalMs > 0 ? sleep(this.intervalMs) : new Promise(setImmediate));
    }
    return super.runCommand(id, command, {});
  }
}

async function listening(
  t: { after: (fn: () => Promise<void>) => void },
  transport: Parameters<typeof createTestApi>[0] extends infer O
    ? O extends { transport?: infer T }
      ? T
      : never
    : never,
  edge = new ChattyEdge({ edgeId: 'edge-a' }),
): Promise<{ a: TestApi; port: number; base: string; edge: ChattyEdge }> {
  const a = await createTestApi({ edges: [edge], transport });
  t.after(() => a.close());
  await a.app.listen({ host: '127.0.0.1', port: 0 });
  const port = (a.app.server.address() as AddressInfo).port;
  return { a, port, base: `http://127.0.0.1:${port}`, edge };
}

/** A raw client: sends `first`, then `trickle` one piece per `everyMs`; resolves when the server closes it. */
function rawClient(
  port: number,
  first: string,
  trickle: string[] = [],
  everyMs = 100,
): { closed: Promise<string>; socket: net.Socket } {
  const socket = net.connect(port, '127.0.0.1');
  let received = '';
  socket.setEncoding('latin1');
  socket.on('data', (d: string) => (received += d));
  socket.on('error', () => {});
  socket.write(first);
  let i = 0;
  const timer = setInterval(() => {
    if (socket.destroyed || socket.writableEnded) return clearInterval(timer);
    socket.write(trickle[i++ % Math.max(trickle.length, 1)] ?? '');
  }, everyMs);
  const closed = new Promise<string>((resolve) =>
    socket.on('close', () => {
      clearInterval(timer);
      resolve(received);
    }),
  );
  return { closed, socket };
}

/** Resolves to the value, or rejects when it takes longer than `ms` (a generous bound). */
function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  return Promise.race([
    p,
    sleep(ms).then(() => {
      throw new Error(`${what}: not within ${ms} ms`);
    }),
  ]);
}

async function createSandbox(base: string, key: string): Promise<string> {
  const res = await fetch(`${base}/v1/sandboxes`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
    body: '{"image":"base"}',
  });
  assert.equal(res.status, 201);
  return ((await res.json()) as { id: string }).id;
}

test('slow headers: 408 and closed within the headers timeout; others are served meanwhile', async (t) => {
  const { port, base } = await listening(t, { headersTimeoutMs: 300, requestTimeoutMs: 5_000 });
  const slow = rawClient(port, 'GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n', ['X-Slow: 1\r\n']);
  await sleep(150);
  const ok = await within(fetch(`${base}/healthz`), 2_000, 'healthz beside a slow client');
  assert.equal(ok.status, 200);
  const answer = await within(slow.closed, 5_000, 'slow-header client closed');
  assert.match(answer, /^HTTP\/1\.1 408 /);
  assert.match(answer, /"invalid_argument"/);
});

test('slow body: a JSON body trickled past the request timeout gets 408', async (t) => {
  const { a, port } = await listening(t, { headersTimeoutMs: 300, requestTimeoutMs: 800 });
  const slow = rawClient(
    port,
    'POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n' +
      `Authorization: Bearer ${a.rootKey}\r\nContent-Length: 1000\r\n\r\n{`,
    [' '],
  );
  const answer = await within(slow.closed, 6_000, 'slow-body client closed');
  assert.match(answer, /^HTTP\/1\.1 408 /);
});

test('50 slow-header clients do not stop a normal client; all of them are cut off', async (t) => {
  const { a, base, port } = await listening(t, { headersTimeoutMs: 400, requestTimeoutMs: 5_000 });
  const slow = Array.from({ length: 50 }, (_, i) =>
    rawClient(port, `GET /v1/whoami HTTP/1.1\r\nHost: 127.0.0.1\r\nX-N: ${i}\r\n`, [
      'X-More: y\r\n',
    ]),
  );
  await sleep(100);
  for (let i = 0; i < 5; i++) {
    const res = await within(
      fetch(`${base}/v1/whoami`, { headers: { authorization: `Bearer ${a.rootKey}` } }),
      2_000,
      'whoami beside 50 slow clients',
    );
    assert.equal(res.status, 200);
    await res.arrayBuffer();
  }
  const answers = await within(
    Promise.all(slow.map((s) => s.closed)),
    8_000,
    '50 slow clients closed',
  );
  for (const answer of answers) assert.match(answer, /^HTTP\/1\.1 408 /);
});

test('a streamed upload may outlast the request timeout; a streamed response too', async (t) => {
  const { a, base, port, edge } = await listening(t, {
    headersTimeoutMs: 300,
    requestTimeoutMs: 500,
  });
  const id = await createSandbox(base, a.rootKey);

  // A chunked upload that lasts ~1.5 s, three times the request timeout.
  const pieces = [...Array.from({ length: 15 }, () => '4\r\nabcd\r\n'), '0\r\n\r\n'];
  const socket = net.connect(port, '127.0.0.1');
  socket.setEncoding('latin1');
  let received = '';
  socket.on('data', (d: string) => (received += d));
  const closed = new Promise<void>((r) => socket.on('close', () => r()));
  socket.write(
    `PUT /v1/sandboxes/${id}/files?path=/tmp/f HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n` +
      `Authorization: Bearer ${a.rootKey}\r\nContent-Type: application/octet-stream\r\n` +
      'Transfer-Encoding: chunked\r\n\r\n',
  );
  for (const p of pieces) {
    await sleep(100);
    socket.write(p);
  }
  await within(closed, 5_000, 'upload answered');
  assert.match(received, /^HTTP\/1\.1 200 /);
  assert.match(received, /"size":60/);

  // An NDJSON output stream that lasts ~1.5 s: the request was complete long before.
  edge.chunks = 15;
  edge.intervalMs = 100;
  const res = await fetch(`${base}/v1/sandboxes/${id}/commands`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${a.rootKey}`,
      'content-type': 'application/json',
      accept: 'application/x-ndjson',
    },
    body: '{"argv":["x"]}',
  });
  assert.equal(res.status, 200);
  const events = (await res.text())
    .trim()
    .split('\n')
    .map((l) => (JSON.parse(l) as { type: string }).type);
  assert.equal(events.filter((e) => e === 'stdout').length, 15);
  assert.equal(events.at(-1), 'result');
});

test('a client that never reads a large stream: output is cut off at the buffer cap, others are served', async (t) => {
  const { a, base, port, edge } = await listening(t, { headersTimeoutMs: 300 });
  const id = await createSandbox(base, a.rootKey);
  edge.chunks = Infinity;
  edge.chunkBytes = 64 * 1024;

  const body = '{"argv":["yes"],"timeoutMs":5000}';
  const socket = net.connect(port, '127.0.0.1');
  socket.on('error', () => {});
  await new Promise<void>((r) => socket.once('connect', () => r()));
  socket.write(
    `POST /v1/sandboxes/${id}/commands HTTP/1.1\r\nHost: 127.0.0.1\r\n` +
      `Authorization: Bearer ${a.rootKey}\r\nContent-Type: application/json\r\n` +
      `Accept: application/x-ndjson\r\nContent-Length: ${body.length}\r\n\r\n${body}`,
  );
  socket.pause(); // never reads: the kernel buffers fill, then the server's

  // The stream stops the command once the unread backlog passes the cap.
  const deadline = Date.now() + 10_000;
  while (edge.aborted === undefined && Date.now() < deadline) await sleep(50);
  assert.match(String(edge.aborted), /not reading/);
  // Base64 inflates by 4/3; kernel socket buffers add a few MiB at most.
  assert.ok(
    edge.emitted < 4 * MAX_STREAM_BUFFER_BYTES,
    `emitted ${edge.emitted} bytes to a client that reads nothing`,
  );
  const emittedAtAbort = edge.emitted;

  // The server stays responsive, and produces nothing more for the stalled client.
  for (let i = 0; i < 5; i++) {
    const res = await within(fetch(`${base}/healthz`), 2_000, 'healthz beside a stalled reader');
    assert.equal(res.status, 200);
    await res.arrayBuffer();
  }
  await sleep(200);
  assert.equal(edge.emitted, emittedAtAbort);
  socket.destroy(); // before the server closes: its close waits for open requests
});
