import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { HttpTransport } from './transport.js';

/** Answers every request with what it received: the request target and the authorization header. */
let server: http.Server;
let origin: string;

before(async () => {
  server = http.createServer((req, res) => {
    req.resume();
    res.setHeader('content-type', 'application/json');
    res.end(JSON.stringify({ url: req.url, authorization: req.headers.authorization ?? null }));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  origin = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
after(async () => {
  server.closeAllConnections();
  await new Promise((resolve) => server.close(resolve));
});

async function sent(
  base: string,
  path: string,
  apiKey?: string,
): Promise<{ url: string; authorization: string | null }> {
  const t = new HttpTransport({ url: base, apiKey, retry: false });
  try {
    return await t.json({ method: 'GET', path, timeoutMs: 5000 });
  } finally {
    t.close();
  }
}

test('plain paths go out as they are, under the base path, with the key', async () => {
  assert.deepEqual(
    await sent(`${origin}/prefix/`, '/v1/sandboxes/sbx-a_B~1/commands?x=1&y=%2F', 'k1'),
    {
      url: '/prefix/v1/sandboxes/sbx-a_B~1/commands?x=1&y=%2F',
      authorization: 'Bearer k1',
    },
  );
  assert.deepEqual(await sent(origin, '/v1/whoami'), { url: '/v1/whoami', authorization: null });
});

test('paths URL would rewrite are still normalised as URL does (dot segments, quotes, spaces)', async () => {
  assert.equal((await sent(`${origin}/prefix`, '/v1/a/../b')).url, '/prefix/v1/b');
  assert.equal((await sent(origin, '/v1/a"b c')).url, '/v1/a%22b%20c');
  assert.equal((await sent(origin, '/v1/x/.')).url, '/v1/x/');
});
