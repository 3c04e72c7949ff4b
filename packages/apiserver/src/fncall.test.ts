import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { setTimeout } from 'node:timers/promises';
import { DsecError } from '@dsec/core';
import type { FnCallResult } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';
import { addFnCall } from './testing/fncall-double.js';
import type { TestApi } from './testing/index.js';
import type { ApiServerOptions } from './server.js';

/** HTTP API of FnCall (issue 14) over in-process edges with a FnCall double. */

const apis: TestApi[] = [];
after(async () => {
  for (const a of apis) await a.close();
});

async function setup(edges: FakeEdge[]) {
  const api = await createTestApi({ edges });
  apis.push(api);
  const post = async (url: string, body: unknown, key = api.rootKey) =>
    api.app.inject({
      method: 'POST',
      url,
      headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
      payload: JSON.stringify(body),
    });
  return { api, post };
}

const call = { language: 'python', code: 'print(sum(map(int, input().split())))', stdin: '1 2\n' };

/** A second server over a test API's IAM and edges, with options createTestApi has no hook for. */
async function serverOver(api: TestApi, options: Partial<ApiServerOptions> = {}) {
  const { buildApiServer } = await import('./server.js');
  const { PowerOfKPlacer } = await import('@dsec/placement');
  const watcher = options.watcher ?? api.watcher;
  return buildApiServer({
    iam: api.iam,
    edges: api.edges,
    watcher,
    placer: new PowerOfKPlacer({ view: () => watcher.view() }),
    ids: api.ids,
    ...options,
  });
}

test('POST /v1/fncall answers the result and names the edge', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  edge.fncallDouble.onCall = (req) => ({
    result: {
      stdout: `${(req.stdin ?? '')
        .split(' ')
        .map(Number)
        .reduce((a, b) => a + b, 0)}\n`,
    },
  });
  const { api, post } = await setup([edge]);
  const res = await post('/v1/fncall', { ...call, args: ['x'], timeoutMs: 2000 });
  assert.equal(res.statusCode, 200);
  assert.ok(res.headers['x-request-id']);
  const result = res.json<FnCallResult>();
  assert.equal(result.stdout, '3\n');
  assert.equal(result.outcome, 'ok');
  assert.equal(result.edgeId, 'edge-a');
  // The edge gets the request as parsed, and the caller's project.
  assert.deepEqual(edge.fncallDouble.calls, [
    { req: { ...call, args: ['x'], timeoutMs: 2000 }, projectId: api.rootProjectId },
  ]);
});

test('requests are checked: unknown fields, bad runtime names, escaping file paths, no key', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const { api, post } = await setup([edge]);
  const cases: [unknown, string][] = [
    [{ ...call, extra: 1 }, 'extra'],
    [{ ...call, language: 'Py thon' }, 'language'],
    [{ ...call, files: { '../etc/passwd': 'x' } }, 'files.../etc/passwd'],
    [{ ...call, timeoutMs: 300_001 }, 'timeoutMs'],
    [{ ...call, gpu: { mode: 'all' } }, 'gpu.mode'],
    [{ code: 'x' }, 'language'],
  ];
  for (const [body, field] of cases) {
    const res = await post('/v1/fncall', body);
    assert.equal(res.statusCode, 400, JSON.stringify(body));
    assert.equal(res.json<{ error: { code: string; field: string } }>().error.field, field);
  }
  const batch = await post('/v1/fncall/batch', { calls: [call, { ...call, language: '' }] });
  assert.equal(batch.statusCode, 400);
  assert.equal(batch.json<{ error: { field: string } }>().error.field, 'calls.1.language');
  const anon = await api.app.inject({ method: 'POST', url: '/v1/fncall', payload: call });
  assert.equal(anon.statusCode, 401);
  assert.equal(edge.fncallDouble.calls.length, 0);
});

test('routing: warm edges first, edgeSelector honoured, refusals retried elsewhere', async () => {
  const cold = addFnCall(new FakeEdge({ edgeId: 'edge-cold' }));
  const warm = addFnCall(new FakeEdge({ edgeId: 'edge-warm' }));
  const pools = (idle: number) => [
    { language: 'python', network: false, idle, busy: 0, starting: 0, max: 4 },
  ];
  cold.fncallDouble.pools = pools(0);
  warm.fncallDouble.pools = pools(4);
  const { post } = await setup([cold, warm]);
  for (let i = 0; i < 5; i++) {
    const r = (await post('/v1/fncall', call)).json<FnCallResult>();
    assert.equal(r.edgeId, 'edge-warm');
  }
  // The warm edge refuses: the call goes to the other one.
  warm.fncallDouble.onCall = () => ({ error: new DsecError('capacity_exhausted', 'pool full') });
  const moved = await post('/v1/fncall', call);
  assert.equal(moved.statusCode, 200);
  assert.equal(moved.json<FnCallResult>().edgeId, 'edge-cold');
  // Both refuse: the last refusal is the answer.
  cold.fncallDouble.onCall = () => ({ error: new DsecError('unavailable', 'pool broken') });
  const refused = await post('/v1/fncall', call);
  assert.equal(refused.statusCode, 503);
  assert.equal(refused.json<{ error: { code: string } }>().error.code, 'unavailable');
  // Any other error is the call's answer at once, without trying elsewhere.
  warm.fncallDouble.onCall = () => ({ error: new DsecError('invalid_argument', 'no runtime') });
  const [coldBefore, warmBefore] = [cold.fncallDouble.calls.length, warm.fncallDouble.calls.length];
  const bad = await post('/v1/fncall', call);
  assert.equal(bad.statusCode, 400);
  assert.equal(warm.fncallDouble.calls.length, warmBefore + 1);
  assert.equal(cold.fncallDouble.calls.length, coldBefore);
});

test('edgeSelector picks labelled edges; no edge with FnCall is `unavailable`', async () => {
  const plain = new FakeEdge({ edgeId: 'edge-plain' });
  const { post } = await setup([plain]);
  const none = await post('/v1/fncall', call);
  assert.equal(none.statusCode, 503);
  assert.equal(none.json<{ error: { code: string } }>().error.code, 'unavailable');

  const a = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const b = addFnCall(new FakeEdge({ edgeId: 'edge-b' }));
  const labelled = b.status.bind(b);
  b.status = async (signal) => ({ ...(await labelled(signal)), labels: { pool: 'gpu' } });
  const two = await setup([a, b]);
  for (let i = 0; i < 4; i++) {
    const r = await two.post('/v1/fncall', { ...call, edgeSelector: { pool: 'gpu' } });
    assert.equal(r.json<FnCallResult>().edgeId, 'edge-b');
  }
  const nowhere = await two.post('/v1/fncall', { ...call, edgeSelector: { pool: 'tpu' } });
  assert.equal(nowhere.statusCode, 503);
  assert.equal(a.fncallDouble.calls.length, 0);
});

test('POST /v1/fncall/batch streams one NDJSON line per call, in completion order', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  // Calls finish in the reverse of the request order (call 2 fails at once): each waits for the
  // one after it, then for a timer, by which time that one's line is written (a microtask).
  const done = new Map<number, { promise: Promise<void>; resolve: () => void }>();
  for (const n of [0, 1, 3, 4]) {
    let resolve = () => {};
    const promise = new Promise<void>((r) => (resolve = r));
    done.set(n, { promise, resolve });
  }
  const next = new Map([
    [0, 1],
    [1, 3],
    [3, 4],
  ]);
  edge.fncallDouble.onCall = (req) => {
    const n = Number(req.stdin);
    if (n === 2) return { error: new DsecError('invalid_argument', 'no such runtime') };
    const before = next.has(n) ? done.get(next.get(n)!)!.promise : Promise.resolve();
    const after = before.then(() => setTimeout(5)).then(() => done.get(n)!.resolve());
    return { after, result: { stdout: `out ${n}` } };
  };
  const { post } = await setup([edge]);
  const calls = [0, 1, 2, 3, 4].map((n) => ({ ...call, stdin: String(n) }));
  const res = await post('/v1/fncall/batch', { calls, concurrency: 5 });
  assert.equal(res.statusCode, 200);
  assert.match(String(res.headers['content-type']), /^application\/x-ndjson/);
  const lines = res.body
    .trim()
    .split('\n')
    .map(
      (l) =>
        JSON.parse(l) as {
          index: number;
          result?: FnCallResult;
          error?: { code: string; message: string };
        },
    );
  assert.deepEqual(
    lines.map((l) => l.index),
    [2, 4, 3, 1, 0],
  );
  assert.deepEqual(lines[0], {
    index: 2,
    error: { code: 'invalid_argument', message: 'no such runtime' },
  });
  for (const l of lines.slice(1)) assert.equal(l.result?.stdout, `out ${l.index}`);
});

test('batch concurrency bounds the calls in flight', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  let inFlight = 0;
  let most = 0;
  const run = edge.fncallDouble.run.bind(edge.fncallDouble);
  edge.fncallDouble.run = async (req, options) => {
    most = Math.max(most, ++inFlight);
    try {
      await new Promise((r) => setImmediate(r));
      return await run(req, options);
    } finally {
      inFlight--;
    }
  };
  const { post } = await setup([edge]);
  const calls = Array.from({ length: 20 }, (_, i) => ({ ...call, stdin: String(i) }));
  const res = await post('/v1/fncall/batch', { calls, concurrency: 3 });
  assert.equal(res.body.trim().split('\n').length, 20);
  assert.equal(most, 3);
});

test('a cordoned edge gets no calls, however warm; with only cordoned edges a call is refused', async () => {
  const warm = addFnCall(new FakeEdge({ edgeId: 'edge-warm' }));
  const cold = addFnCall(new FakeEdge({ edgeId: 'edge-cold' }));
  warm.fncallDouble.pools = [
    { language: 'python', network: false, idle: 4, busy: 0, starting: 0, max: 4 },
  ];
  const api = await createTestApi({ edges: [warm, cold] });
  apis.push(api);
  let cordoned = new Set(['edge-warm']);
  // What RegistryFleet does with the registry's cordons.
  const watcher = {
    view: () => {
      const view = api.watcher.view();
      return {
        ...view,
        edges: view.edges.map((e) => (cordoned.has(e.edgeId) ? { ...e, cordoned: true } : e)),
      };
    },
  };
  const app = await serverOver(api, { watcher });
  try {
    const post = () =>
      app.inject({
        method: 'POST',
        url: '/v1/fncall',
        headers: { authorization: `Bearer ${api.rootKey}` },
        payload: call,
      });
    for (let i = 0; i < 3; i++)
      assert.equal((await post()).json<FnCallResult>().edgeId, 'edge-cold');
    cordoned = new Set(['edge-warm', 'edge-cold']);
    assert.equal((await post()).statusCode, 503);
    assert.equal(warm.fncallDouble.calls.length, 0);
  } finally {
    await app.close();
  }
});

test('quota admission refuses a batch before its stream starts', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const api = await createTestApi({ edges: [edge] });
  apis.push(api);
  const admitted: number[] = [];
  const app = await serverOver(api, {
    admitFnCalls: async (_principal, _projectId, calls) => {
      admitted.push(calls);
      if (calls > 2) throw new DsecError('quota_exceeded', 'calls per second quota');
    },
  });
  try {
    const post = (url: string, body: unknown) =>
      app.inject({
        method: 'POST',
        url,
        headers: { authorization: `Bearer ${api.rootKey}` },
        payload: body as Record<string, unknown>,
      });
    assert.equal((await post('/v1/fncall', call)).statusCode, 200);
    const refused = await post('/v1/fncall/batch', { calls: [call, call, call] });
    assert.equal(refused.statusCode, 429);
    assert.equal(refused.json<{ error: { code: string } }>().error.code, 'quota_exceeded');
    assert.deepEqual(admitted, [1, 3]);
    assert.equal(edge.fncallDouble.calls.length, 1);
  } finally {
    await app.close();
  }
});

test("by default a project's fncallsPerSecond quota admits calls, batches included", async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const { post } = await setup([edge]);
  const project = await post('/v1/projects', { name: 'graders', quota: { fncallsPerSecond: 3 } });
  assert.equal(project.statusCode, 201, project.body);
  const key = await post('/v1/keys', { projectId: project.json<{ id: string }>().id });
  const secret = key.json<{ key: string }>().key;
  // A burst of one second's worth (3) passes; the next call is refused, and says when to retry.
  const batch = await post('/v1/fncall/batch', { calls: [call, call, call] }, secret);
  assert.equal(batch.statusCode, 200);
  const refused = await post('/v1/fncall', call, secret);
  assert.equal(refused.statusCode, 429);
  const error = refused.json<{ error: { code: string; details: Record<string, unknown> } }>().error;
  assert.equal(error.code, 'quota_exceeded');
  assert.equal(error.details.resource, 'fncallsPerSecond');
  assert.ok(Number(error.details.retryAfterMs) > 0);
  // The root project has no such quota.
  assert.equal((await post('/v1/fncall', call)).statusCode, 200);
  assert.equal(edge.fncallDouble.calls.length, 4);
});

test('with fncallQuotaShares an apiserver admits its share of the quota', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const { api, post } = await setup([edge]);
  const project = await post('/v1/projects', { name: 'shared', quota: { fncallsPerSecond: 6 } });
  const key = await post('/v1/keys', { projectId: project.json<{ id: string }>().id });
  const secret = key.json<{ key: string }>().key;
  // One of three apiservers: 6 / 3 = 2 calls per second, a burst of 2.
  const app = await serverOver(api, { fncallQuotaShares: 3 });
  try {
    const codes: number[] = [];
    for (let i = 0; i < 3; i++) {
      const r = await app.inject({
        method: 'POST',
        url: '/v1/fncall',
        headers: { authorization: `Bearer ${secret}` },
        payload: call,
      });
      codes.push(r.statusCode);
    }
    assert.deepEqual(codes, [200, 200, 429]);
  } finally {
    await app.close();
  }
});

test('an edge the watcher marks down is still tried, after the healthy ones', async () => {
  const only = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  const { api, post } = await setup([only]);
  // A missed probe (a busy event loop) marks the only edge down; its calls still run.
  only.healthy = false;
  await api.watcher.refresh();
  assert.equal(api.watcher.view().edges[0]?.healthy, false);
  const r = await post('/v1/fncall', call);
  assert.equal(r.statusCode, 200);
  assert.equal(r.json<FnCallResult>().edgeId, 'edge-a');
});

test('a scoped key calls FnCall only with fncall:run (403, audited), single calls and batches', async () => {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  edge.fncallDouble.onCall = () => ({ result: { stdout: 'ran\n' } });
  const { api, post } = await setup([edge]);
  const mint = async (scopes: string[]) => {
    const res = await post('/v1/keys', { projectId: api.rootProjectId, role: 'member', scopes });
    assert.equal(res.statusCode, 201, res.body);
    return res.json<{ id: string; key: string }>();
  };
  // A runtime key for task images: it may start task sandboxes, not run code on the runtimes.
  const runtime = await mint(['images:run:task-*']);
  for (const [url, body] of [
    ['/v1/fncall', call],
    ['/v1/fncall/batch', { calls: [call, call] }],
  ] as const) {
    const res = await post(url, body, runtime.key);
    assert.equal(res.statusCode, 403, res.body);
    assert.equal(res.json().error.code, 'permission_denied');
  }
  assert.equal(edge.fncallDouble.calls.length, 0, 'nothing reached the edge');
  const denied = (await api.iam.listAudit()).filter(
    (e) => e.action === 'fncall' && e.actorKeyId === runtime.id,
  );
  // Denials are audited aggregated (one row per minute and group, with its count).
  assert.equal(
    denied.reduce((n, e) => n + Number(e.details?.['count'] ?? 1), 0),
    2,
  );
  assert.ok(denied.every((e) => e.outcome === 'denied'));

  const caller = await mint(['fncall:run']);
  const ok = await post('/v1/fncall', call, caller.key);
  assert.equal(ok.statusCode, 200, ok.body);
  // Unscoped keys keep every restrictive right, this one included.
  assert.equal((await post('/v1/fncall', call)).statusCode, 200);
});
