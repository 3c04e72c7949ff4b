import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { getEventListeners } from 'node:events';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { isDsecError } from '@dsec/core';
import { DSecClient } from './index.js';

// One signal shared by many concurrent calls, as `dsec sandbox rm ID…` (110 IDs) and
// rollout loops do: Node warns (MaxListenersExceededWarning) past 10 listeners on it.
const CALLS = 110;

/** Holds every request until `release()`; `arrived` resolves once `CALLS` are waiting. */
let server: http.Server;
let url: string;
let held: http.ServerResponse[] = [];
let allArrived: () => void = () => undefined;

before(async () => {
  server = http.createServer((req, res) => {
    req.resume();
    held.push(res);
    if (held.length === CALLS) allArrived();
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
after(async () => {
  server.closeAllConnections();
  await new Promise((resolve) => server.close(resolve));
});

function arrived(): Promise<void> {
  held = [];
  return new Promise((resolve) => (allArrived = resolve));
}

function listeners(signal: AbortSignal): number {
  return getEventListeners(signal, 'abort').length;
}

/** Collects the process warnings emitted while `fn` runs (they are emitted on a later tick). */
async function warningsDuring(fn: () => Promise<void>): Promise<string[]> {
  const seen: string[] = [];
  const onWarning = (w: Error) => seen.push(`${w.name}: ${w.message}`);
  process.on('warning', onWarning);
  try {
    await fn();
    await new Promise((resolve) => setImmediate(resolve));
  } finally {
    process.off('warning', onWarning);
  }
  return seen;
}

test(`${CALLS} concurrent calls on one signal keep one abort listener on it, and none afterwards`, async () => {
  const client = new DSecClient({ url, apiKey: 'k' });
  const signal = new AbortController().signal;
  const warnings = await warningsDuring(async () => {
    const waiting = arrived();
    const calls = Array.from({ length: CALLS }, (_, i) =>
      client.sandbox(`sb-${i}`).stop({ signal }),
    );
    await waiting;
    assert.equal(listeners(signal), 1, 'one listener however many requests are in flight');
    for (const res of held) res.writeHead(204).end();
    await Promise.all(calls);
    assert.equal(listeners(signal), 0, 'the listener leaves with the last request');
  });
  client.close();
  assert.deepEqual(warnings, []);
});

test('aborting the shared signal rejects every call in flight with `aborted`', async () => {
  const client = new DSecClient({ url, apiKey: 'k' });
  const controller = new AbortController();
  const { signal } = controller;
  const waiting = arrived();
  const calls = Array.from({ length: CALLS }, (_, i) =>
    client
      .sandbox(`sb-${i}`)
      .stop({ signal })
      .then(
        () => 'resolved',
        (e: unknown) => (isDsecError(e, 'aborted') ? 'aborted' : `other: ${String(e)}`),
      ),
  );
  await waiting;
  controller.abort();
  assert.deepEqual(new Set(await Promise.all(calls)), new Set(['aborted']));
  assert.equal(listeners(signal), 0);
  // A signal that aborted once can be passed again: the call fails at once, nothing is left on it.
  await assert.rejects(client.sandbox('sb-x').stop({ signal }), (e) => isDsecError(e, 'aborted'));
  assert.equal(listeners(signal), 0);
  client.close();
});

test('a call on a signal keeps working after earlier calls on it finished (the listener is re-added)', async () => {
  const client = new DSecClient({ url, apiKey: 'k' });
  const controller = new AbortController();
  const { signal } = controller;
  for (let round = 0; round < 2; round++) {
    const waiting = arrived();
    const calls = Array.from({ length: CALLS }, (_, i) =>
      client.sandbox(`sb-${i}`).stop({ signal }),
    );
    await waiting;
    assert.equal(listeners(signal), 1);
    if (round === 0) {
      for (const res of held) res.writeHead(204).end();
      await Promise.all(calls);
      assert.equal(listeners(signal), 0);
    } else {
      controller.abort();
      const results = await Promise.allSettled(calls);
      assert.ok(results.every((r) => r.status === 'rejected' && isDsecError(r.reason, 'aborted')));
    }
  }
  client.close();
});

/** A server that is not DSec (a proxy in front of it, an older server): answers as `reply` says. */
async function withStub(
  reply: (req: http.IncomingMessage, res: http.ServerResponse) => void,
  fn: (url: string, hits: () => number) => Promise<void>,
): Promise<void> {
  let hits = 0;
  const stub = http.createServer((req, res) => {
    hits++;
    req.resume();
    req.on('end', () => reply(req, res));
  });
  await new Promise<void>((resolve) => stub.listen(0, '127.0.0.1', resolve));
  try {
    await fn(`http://127.0.0.1:${(stub.address() as AddressInfo).port}`, () => hits);
  } finally {
    stub.closeAllConnections();
    await new Promise((resolve) => stub.close(resolve));
  }
}

test('a body-less 502 from a proxy is unavailable, and resent only for a safe call', async () => {
  await withStub(
    (_req, res) => res.writeHead(502).end(),
    async (stubUrl, hits) => {
      const client = new DSecClient({
        url: stubUrl,
        apiKey: 'k',
        retry: { maxRetries: 2, baseDelayMs: 1 },
      });
      await assert.rejects(client.listSandboxes(), (e) => isDsecError(e, 'unavailable'));
      assert.equal(hits(), 3, 'a GET is safe: the first try and 2 retries');
      await assert.rejects(client.sandbox('sb-1').runShell('true'), (e) =>
        isDsecError(e, 'unavailable'),
      );
      assert.equal(hits(), 4, 'a command without a requestId is sent once');
      client.close();
    },
  );
});

test('a server that answers a streamed command with plain JSON still feeds the callbacks', async () => {
  const result = {
    commandId: 'c',
    exitCode: 0,
    outcome: 'exited',
    stdout: 'all\n',
    stderr: 'err\n',
    truncated: false,
    stdoutBytes: 4,
    stderrBytes: 4,
    durationMs: 1,
  };
  await withStub(
    (_req, res) =>
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(result)),
    async (stubUrl) => {
      const client = new DSecClient({ url: stubUrl, apiKey: 'k' });
      let out = '';
      let err = '';
      const got = await client.sandbox('sb-1').runShell('x', {
        onStdout: (s) => (out += s),
        onStderr: (s) => (err += s),
      });
      assert.deepEqual([out, err, got.exitCode], ['all\n', 'err\n', 0]);
      client.close();
    },
  );
});

test('an NDJSON stream that ends without its result is unavailable', async () => {
  await withStub(
    (_req, res) =>
      res
        .writeHead(200, { 'content-type': 'application/x-ndjson' })
        .end(`${JSON.stringify({ type: 'stdout', data: Buffer.from('x').toString('base64') })}\n`),
    async (stubUrl) => {
      const client = new DSecClient({ url: stubUrl, apiKey: 'k' });
      let out = '';
      await assert.rejects(
        client.sandbox('sb-1').runShell('x', { onStdout: (s) => (out += s) }),
        (e) => isDsecError(e, 'unavailable'),
      );
      assert.equal(out, 'x');
      client.close();
    },
  );
});
