import { after, before, beforeEach, test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { DsecError, isDsecError } from '@dsec/core';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';
import { DSecClient } from './index.js';
import type { FnCallMapItem } from './index.js';

// client.fncall against the real apiserver over an in-process FnCall double (stdin echoed).
let server: TestServer;
let client: DSecClient;

before(async () => {
  server = await startTestServer();
});
after(async () => {
  client?.close();
  await server.close();
});
beforeEach(() => {
  client?.close();
  client = new DSecClient({
    url: server.url,
    apiKey: server.key,
    retry: { baseDelayMs: 1, maxDelayMs: 2 },
  });
  server.requests.length = 0;
  server.edge.fncallDouble.onCall = undefined;
  server.edge.fncallDouble.calls.length = 0;
});

const call = (stdin: string) => ({
  language: 'python',
  code: 'print(sum(map(int, input().split())))',
  stdin,
});

test('run sends the request as given and answers the result', async () => {
  server.edge.fncallDouble.onCall = () => ({
    result: { exitCode: 1, stderr: 'Traceback', outcome: 'ok' },
  });
  const r = await client.fncall.run({ ...call('1 2\n'), timeoutMs: 1500, args: ['-v'] });
  assert.equal(r.exitCode, 1);
  assert.equal(r.stdout, '1 2\n');
  assert.equal(r.stderr, 'Traceback');
  assert.equal(r.edgeId, 'edge-a');
  assert.deepEqual(
    server.requests.map((q) => [q.method, q.path, q.body]),
    [['POST', '/v1/fncall', { ...call('1 2\n'), timeoutMs: 1500, args: ['-v'] }]],
  );
});

test('run resends a refused call and reports a bad request with its field', async () => {
  let refusals = 2;
  server.edge.fncallDouble.onCall = () =>
    refusals-- > 0 ? { error: new DsecError('capacity_exhausted', 'pool full') } : undefined;
  const r = await client.fncall.run(call('x'));
  assert.equal(r.stdout, 'x');
  assert.equal(server.edge.fncallDouble.calls.length, 3);
  await assert.rejects(
    client.fncall.run({ ...call('x'), language: 'no such' }),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'language',
  );
});

test('map yields every call once, in completion order, errors as items', async () => {
  server.edge.fncallDouble.onCall = (req) => {
    const n = Number(req.stdin);
    if (n === 3) return { error: new DsecError('invalid_argument', 'bad runtime') };
    return { delayMs: (10 - n) * 5 };
  };
  const calls = Array.from({ length: 10 }, (_, i) => call(String(i)));
  const items: FnCallMapItem[] = [];
  for await (const item of client.fncall.map(calls, { concurrency: 10 })) items.push(item);
  assert.deepEqual(
    items.map((i) => i.index),
    [3, 9, 8, 7, 6, 5, 4, 2, 1, 0],
  );
  const failed = items[0]!;
  assert.ok(isDsecError(failed.error, 'invalid_argument'));
  for (const item of items.slice(1)) assert.equal(item.result?.stdout, String(item.index));
  const batch = server.requests.filter((q) => q.path === '/v1/fncall/batch');
  assert.equal(batch.length, 1);
  assert.equal((batch[0]!.body as { concurrency: number }).concurrency, 10);
});

test('map splits calls that do not fit one request body into further batches', async () => {
  const big = 'x'.repeat(300 * 1024);
  const calls = Array.from({ length: 7 }, (_, i) => ({ ...call(String(i)), code: big }));
  const seen: number[] = [];
  for await (const item of client.fncall.map(calls, { concurrency: 4 })) {
    assert.equal(item.result?.stdout, String(item.index));
    seen.push(item.index);
  }
  assert.deepEqual(
    seen.sort((a, b) => a - b),
    [0, 1, 2, 3, 4, 5, 6],
  );
  // 900 KiB per body: three calls of 300 KiB do not fit, two do.
  assert.equal(server.requests.filter((q) => q.path === '/v1/fncall/batch').length, 4);
});

test('leaving a map early aborts the calls still running', async () => {
  let aborted = 0;
  server.edge.fncallDouble.onCall = (req) => (req.stdin === '0' ? undefined : { delayMs: 30_000 });
  const run = server.edge.fncallDouble.run.bind(server.edge.fncallDouble);
  server.edge.fncallDouble.run = async (req, options) => {
    try {
      return await run(req, options);
    } catch (err) {
      if (isDsecError(err, 'aborted')) aborted++;
      throw err;
    }
  };
  try {
    const calls = Array.from({ length: 4 }, (_, i) => call(String(i)));
    for await (const item of client.fncall.map(calls, { concurrency: 4 })) {
      assert.equal(item.index, 0);
      break;
    }
    for (let i = 0; i < 200 && aborted < 3; i++) await new Promise((r) => setTimeout(r, 10));
    assert.equal(aborted, 3);
  } finally {
    server.edge.fncallDouble.run = run;
  }
});

test('map sends again the calls of a batch whose stream broke before they finished', async () => {
  // A server whose first batch answers two calls, then drops the connection.
  const bodies: { calls: { stdin: string }[] }[] = [];
  const raw = http.createServer((req, res) => {
    let text = '';
    req.on('data', (c: Buffer) => (text += c.toString()));
    req.on('end', () => {
      const body = JSON.parse(text) as { calls: { stdin: string }[] };
      bodies.push(body);
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      const line = (index: number) =>
        `${JSON.stringify({
          index,
          result: {
            exitCode: 0,
            stdout: body.calls[index]!.stdin,
            stderr: '',
            truncated: false,
            outcome: 'ok',
            durationMs: 1,
          },
        })}\n`;
      if (bodies.length === 1) {
        res.write(line(0) + line(2), () => res.destroy());
        return;
      }
      res.end(body.calls.map((_, i) => line(i)).join(''));
    });
  });
  await new Promise<void>((r) => raw.listen(0, '127.0.0.1', r));
  const { port } = raw.address() as AddressInfo;
  const direct = new DSecClient({
    url: `http://127.0.0.1:${port}`,
    apiKey: 'k',
    retry: { baseDelayMs: 1, maxDelayMs: 2 },
  });
  try {
    const calls = ['a', 'b', 'c', 'd'].map((s) => call(s));
    const got: [number, string | undefined][] = [];
    for await (const item of direct.fncall.map(calls)) got.push([item.index, item.result?.stdout]);
    assert.deepEqual(got, [
      [0, 'a'],
      [2, 'c'],
      [1, 'b'],
      [3, 'd'],
    ]);
    assert.deepEqual(
      bodies.map((b) => b.calls.map((c) => c.stdin)),
      [
        ['a', 'b', 'c', 'd'],
        ['b', 'd'],
      ],
    );
  } finally {
    direct.close();
    await new Promise((r) => raw.close(r));
  }
});

test('map sends again calls the platform refused for now; other errors are final', async () => {
  const refusals = new Map([
    ['1', 2],
    ['2', 9],
  ]);
  server.edge.fncallDouble.onCall = (req) => {
    if (req.stdin === '3') return { error: new DsecError('invalid_argument', 'bad') };
    const left = refusals.get(req.stdin ?? '') ?? 0;
    if (left === 0) return undefined;
    refusals.set(req.stdin!, left - 1);
    return { error: new DsecError('capacity_exhausted', 'pool full') };
  };
  const items = new Map<number, FnCallMapItem>();
  for await (const item of client.fncall.map(['0', '1', '2', '3'].map((s) => call(s)))) {
    assert.ok(!items.has(item.index), `index ${item.index} yielded twice`);
    items.set(item.index, item);
  }
  assert.equal(items.get(0)?.result?.stdout, '0');
  // Refused twice, then run: the caller sees only the result.
  assert.equal(items.get(1)?.result?.stdout, '1');
  // Refused every time: after the resends, the last refusal is the item's error.
  assert.ok(isDsecError(items.get(2)?.error, 'capacity_exhausted'));
  assert.ok(isDsecError(items.get(3)?.error, 'invalid_argument'));
  const sent = server.edge.fncallDouble.calls.map((c) => c.req.stdin);
  assert.equal(sent.filter((s) => s === '2').length, 4);
  assert.equal(sent.filter((s) => s === '3').length, 1);
});

test('with retry: false map sends each call once: a refusal is the item’s error', async () => {
  const once = new DSecClient({ url: server.url, apiKey: server.key, retry: false });
  try {
    server.edge.fncallDouble.onCall = (req) =>
      req.stdin === '1' ? { error: new DsecError('capacity_exhausted', 'pool full') } : undefined;
    const items = new Map<number, FnCallMapItem>();
    for await (const item of once.fncall.map(['0', '1'].map((s) => call(s))))
      items.set(item.index, item);
    assert.equal(items.get(0)?.result?.stdout, '0');
    assert.ok(isDsecError(items.get(1)?.error, 'capacity_exhausted'));
    assert.deepEqual(server.edge.fncallDouble.calls.map((c) => c.req.stdin).sort(), ['0', '1']);
  } finally {
    once.close();
  }
});
