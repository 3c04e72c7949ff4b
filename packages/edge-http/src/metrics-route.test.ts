import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { EdgeApi } from '@dsec/core';
import { newEdgeSecret, signRequest } from './auth.js';
import { serveEdge } from './server.js';

/** The metrics route touches no edge method. */
const edge = { edgeId: 'e1' } as unknown as EdgeApi;

test('GET /edge/v1/metrics answers signed requests with the Prometheus text, others with 401', async (t) => {
  const secret = newEdgeSecret();
  const server = await serveEdge({
    edge,
    secret,
    metrics: async () => 'dsec_command_outcomes_total{outcome="exited"} 3\n',
  });
  t.after(() => server.close());
  const path = '/edge/v1/metrics';

  const unsigned = await fetch(server.url + path);
  assert.equal(unsigned.status, 401);
  assert.equal(
    ((await unsigned.json()) as { error: { code: string } }).error.code,
    'unauthenticated',
  );

  const { headers } = signRequest(secret, 'e1', 'GET', path);
  const signed = await fetch(server.url + path, { headers });
  assert.equal(signed.status, 200);
  assert.match(signed.headers.get('content-type') ?? '', /^text\/plain; version=0\.0\.4/);
  assert.equal(await signed.text(), 'dsec_command_outcomes_total{outcome="exited"} 3\n');
});

test('without `metrics`, the route does not exist', async (t) => {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret });
  t.after(() => server.close());
  const path = '/edge/v1/metrics';
  const res = await fetch(server.url + path, {
    headers: signRequest(secret, 'e1', 'GET', path).headers,
  });
  assert.equal(res.status, 404);
  await res.text();
});
