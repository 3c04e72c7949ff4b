import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import type { SandboxInfo } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';
import type { TestApi } from './testing/index.js';

type TestContext = { after: (fn: () => Promise<void> | void) => void };

async function api(
  t: TestContext,
  options: Parameters<typeof createTestApi>[0] = {},
): Promise<TestApi> {
  const a = await createTestApi(options);
  t.after(() => a.close());
  return a;
}

async function call(
  app: FastifyInstance,
  method: 'GET' | 'POST' | 'DELETE',
  url: string,
  key: string | undefined,
  body?: unknown,
  headers: Record<string, string> = {},
) {
  const res = await app.inject({
    method,
    url,
    headers: { ...(key ? { authorization: `Bearer ${key}` } : {}), ...headers },
    ...(body === undefined ? {} : { payload: body as object }),
  });
  const json =
    res.body && res.headers['content-type']?.toString().includes('json') ? res.json() : undefined;
  return { status: res.statusCode, body: json, raw: res };
}

/** Creates a child project of root with an admin (or member) key; returns the raw key. */
async function tenant(
  a: TestApi,
  name: string,
  quota?: Record<string, number>,
  role: 'admin' | 'member' = 'admin',
) {
  const p = await call(a.app, 'POST', '/v1/projects', a.rootKey, {
    name,
    ...(quota ? { quota } : {}),
  });
  assert.equal(p.status, 201, JSON.stringify(p.body));
  const k = await call(a.app, 'POST', '/v1/keys', a.rootKey, { projectId: p.body.id, role });
  assert.equal(k.status, 201);
  return { projectId: p.body.id as string, key: k.body.key as string };
}

test('healthz, whoami and metrics', async (t) => {
  const a = await api(t);
  const h = await call(a.app, 'GET', '/healthz', undefined);
  assert.deepEqual(h.body, { ok: true, version: '0.1.0' });
  const w = await call(a.app, 'GET', '/v1/whoami', a.rootKey);
  assert.equal(w.body.projectId, a.rootProjectId);
  assert.equal(w.body.role, 'admin');
  // Without a key, or with a tenant's, no metrics: they show every tenant's load.
  assert.equal((await a.app.inject({ method: 'GET', url: '/metrics' })).statusCode, 401);
  const member = await tenant(a, 'metrics-tenant', {});
  const denied = await call(a.app, 'GET', '/metrics', member.key);
  assert.equal(denied.status, 403);
  assert.equal(denied.body.error.code, 'permission_denied');
  // A monitoring key: a root-project member with only `metrics:read`.
  const monitor = await call(a.app, 'POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    role: 'member',
    scopes: ['metrics:read'],
  });
  assert.equal(monitor.status, 201, JSON.stringify(monitor.body));
  assert.equal((await call(a.app, 'GET', '/metrics', monitor.body.key)).status, 200);
  const m = await a.app.inject({
    method: 'GET',
    url: '/metrics',
    headers: { authorization: `Bearer ${a.rootKey}` },
  });
  assert.equal(m.statusCode, 200);
  assert.match(
    m.body,
    /dsec_http_requests_total\{method="GET",route="\/v1\/whoami",status="200"\} 1/,
  );
  const nf = await call(a.app, 'GET', '/nope', undefined);
  assert.equal(nf.status, 404);
  assert.equal(nf.body.error.code, 'not_found');
});

test('create, get, list, run, delete; TTL passes through; quota is released', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team', { sandboxes: 1 });
  const c = await call(a.app, 'POST', '/v1/sandboxes', team.key, {
    image: 'base:1',
    ttlSeconds: 120,
    env: { A: 'b' },
  });
  assert.equal(c.status, 201, JSON.stringify(c.body));
  const sb = c.body as SandboxInfo;
  assert.match(sb.id, /^sb-/);
  assert.equal(sb.projectId, team.projectId);
  assert.equal(sb.state, 'running');
  assert.equal(sb.spec.memoryLimitMb, 512);
  assert.equal(sb.spec.backend, 'container');
  assert.equal(sb.spec.ttlSeconds, 120);
  assert.equal(Date.parse(sb.expiresAt) - Date.parse(sb.createdAt), 120_000);

  const g = await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, team.key);
  assert.equal(g.status, 200);
  assert.equal(g.body.id, sb.id);
  const l = await call(a.app, 'GET', '/v1/sandboxes', team.key);
  assert.deepEqual(
    l.body.sandboxes.map((s: SandboxInfo) => s.id),
    [sb.id],
  );
  const rootList = await call(a.app, 'GET', `/v1/sandboxes?projectId=${team.projectId}`, a.rootKey);
  assert.equal(rootList.body.sandboxes.length, 1);

  const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/commands`, team.key, {
    argv: ['echo', 'hi'],
    stdin: 'in',
  });
  assert.equal(r.status, 200, JSON.stringify(r.body));
  assert.equal(r.body.stdout, 'echo hi\n');
  assert.equal(r.body.stderr, 'in');
  assert.equal(r.body.exitCode, 0);

  // Quota of one sandbox: a second create is refused until the first is deleted.
  const second = await call(a.app, 'POST', '/v1/sandboxes', team.key, { image: 'base' });
  assert.equal(second.status, 429);
  assert.equal(second.body.error.code, 'quota_exceeded');
  const d = await call(a.app, 'DELETE', `/v1/sandboxes/${sb.id}`, team.key);
  assert.equal(d.status, 204);
  const after = await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, team.key);
  assert.equal(after.body.state, 'stopped');
  const third = await call(a.app, 'POST', '/v1/sandboxes', team.key, { image: 'base' });
  assert.equal(third.status, 201);

  const m = await a.app.inject({
    method: 'GET',
    url: '/metrics',
    headers: { authorization: `Bearer ${a.rootKey}` },
  });
  assert.match(m.body, /dsec_sandboxes_created_total\{backend="container"\} 2/);
  assert.match(m.body, /dsec_sandbox_create_failures_total\{code="quota_exceeded"\} 1/);
});

test('NDJSON streaming sends output chunks then the result', async (t) => {
  const a = await api(t);
  const c = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  const res = await a.app.inject({
    method: 'POST',
    url: `/v1/sandboxes/${c.body.id}/commands`,
    headers: { authorization: `Bearer ${a.rootKey}`, accept: 'application/x-ndjson' },
    payload: { shell: 'echo streamed', stdin: 'e' },
  });
  assert.equal(res.statusCode, 200);
  assert.match(String(res.headers['content-type']), /application\/x-ndjson/);
  const events = res.body
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as { type: string; data?: string; result?: { stdout: string } });
  const out = events
    .filter((e) => e.type === 'stdout')
    .map((e) => Buffer.from(e.data!, 'base64').toString())
    .join('');
  assert.equal(out, 'echo streamed\n');
  assert.ok(events.filter((e) => e.type === 'stdout').length >= 2);
  assert.ok(events.some((e) => e.type === 'stderr'));
  assert.equal(events.at(-1)?.type, 'result');
  assert.equal(events.at(-1)?.result?.stdout, 'echo streamed\n');

  // A stopped sandbox streams nothing: the error is a final event in the stream.
  await call(a.app, 'DELETE', `/v1/sandboxes/${c.body.id}`, a.rootKey);
  const res2 = await a.app.inject({
    method: 'POST',
    url: `/v1/sandboxes/${c.body.id}/commands`,
    headers: { authorization: `Bearer ${a.rootKey}`, accept: 'application/x-ndjson' },
    payload: { argv: ['true'] },
  });
  const last = JSON.parse(res2.body.trim().split('\n').at(-1)!) as {
    type: string;
    error: { code: string };
  };
  assert.deepEqual([last.type, last.error.code], ['error', 'sandbox_not_running']);
});

test('validation errors are 4xx and name the field', async (t) => {
  const a = await api(t);
  const c = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  const id = c.body.id as string;
  const cases: [string, unknown, string | undefined][] = [
    ['/v1/sandboxes', { image: 'base', memoryLimitMb: -1 }, 'memoryLimitMb'],
    ['/v1/sandboxes', { image: 'base', memoryLimitMb: 1.5 }, 'memoryLimitMb'],
    ['/v1/sandboxes', { image: 'base', bogus: 1 }, 'bogus'],
    ['/v1/sandboxes', { image: 'base', privileged: true }, 'privileged'],
    ['/v1/sandboxes', { image: 'base', cpuCoresLimit: '1' }, 'cpuCoresLimit'],
    ['/v1/sandboxes', { image: 'base', ttlSeconds: 10_000_000 }, 'ttlSeconds'],
    ['/v1/sandboxes', { image: 'base', toolkits: 'x' }, 'toolkits'],
    ['/v1/sandboxes', { image: 'a'.repeat(100_000) }, 'image'],
    ['/v1/sandboxes', { image: '../../etc' }, 'image'],
    ['/v1/sandboxes', { image: 'base', env: { A: 'x\u0000y' } }, 'env.A'],
    ['/v1/sandboxes', { image: 'base', env: { 'A=B': 'x' } }, 'env.A=B'],
    ['/v1/sandboxes', { image: 'base', initUser: 'root\u0000' }, 'initUser'],
    ['/v1/sandboxes', { image: 'base', requestId: 'has space' }, 'requestId'],
    ['/v1/sandboxes', { backend: 'container' }, 'image'],
    ['/v1/sandboxes', { image: 'base', labels: null }, 'labels'],
    ['/v1/sandboxes', [1, 2], undefined],
    ['/v1/sandboxes', 'just a string', undefined],
    [`/v1/sandboxes/${id}/commands`, { argv: ['ls', 'a\u0000b'] }, 'argv.1'],
    [`/v1/sandboxes/${id}/commands`, { argv: [] }, 'argv'],
    [`/v1/sandboxes/${id}/commands`, { argv: ['ls'], shell: 'ls' }, 'argv'],
    [`/v1/sandboxes/${id}/commands`, {}, 'argv'],
    [`/v1/sandboxes/${id}/commands`, { shell: 'ls', timeoutMs: 0 }, 'timeoutMs'],
    [`/v1/sandboxes/${id}/commands`, { shell: 'ls', maxOutputBytes: -5 }, 'maxOutputBytes'],
    [`/v1/sandboxes/${id}/commands`, { shell: 'ls', extra: 1 }, 'extra'],
    ['/v1/projects', { name: 'ok', quota: { memoryMb: -1 } }, 'quota.memoryMb'],
    ['/v1/projects', { name: 'ok', quota: { gpus: 1 } }, 'quota.gpus'],
    ['/v1/projects', { name: '../x' }, 'name'],
    ['/v1/keys', { projectId: a.rootProjectId, role: 'owner' }, 'role'],
  ];
  for (const [url, body, field] of cases) {
    const r = await call(a.app, 'POST', url, a.rootKey, body);
    assert.equal(
      r.status,
      400,
      `${url} ${JSON.stringify(body).slice(0, 80)} → ${r.status} ${JSON.stringify(r.body)}`,
    );
    assert.equal(r.body.error.code, 'invalid_argument');
    assert.equal(
      r.body.error.field,
      field,
      `${JSON.stringify(body).slice(0, 80)}: ${r.body.error.message}`,
    );
  }
  const q = await call(a.app, 'GET', '/v1/sandboxes?projectId=a&projectId=b', a.rootKey);
  assert.equal(q.status, 400);
  assert.equal(q.body.error.field, 'projectId');
});

test('transport abuse: big, broken, deep or non-JSON bodies are 4xx', async (t) => {
  const a = await api(t);
  const auth = { authorization: `Bearer ${a.rootKey}` };
  const big = await a.app.inject({
    method: 'POST',
    url: '/v1/sandboxes',
    headers: { ...auth, 'content-type': 'application/json' },
    payload: JSON.stringify({ image: 'base', env: { A: 'x'.repeat(2 * 1024 * 1024) } }),
  });
  assert.equal(big.statusCode, 413);
  assert.equal(big.json().error.code, 'payload_too_large');
  const bodies: [string, string][] = [
    ['{"image":', 'application/json'],
    ['[', 'application/json'],
    ['{"__proto__":{"x":1},"image":"base"}', 'application/json'],
    ['{"constructor":{"prototype":{"x":1}},"image":"base"}', 'application/json'],
    ['['.repeat(100_000) + ']'.repeat(100_000), 'application/json'],
    ['image=base', 'application/x-www-form-urlencoded'],
    ['image: base', 'text/plain'],
    ['', 'application/json'],
  ];
  for (const [payload, type] of bodies) {
    const r = await a.app.inject({
      method: 'POST',
      url: '/v1/sandboxes',
      headers: { ...auth, 'content-type': type },
      payload,
    });
    assert.ok(
      r.statusCode >= 400 && r.statusCode < 500,
      `${payload.slice(0, 30)} (${type}) → ${r.statusCode} ${r.body}`,
    );
    assert.equal(r.json().error.code, 'invalid_argument');
  }
  // DELETE with a JSON content type and no body is fine.
  const c = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  const d = await a.app.inject({
    method: 'DELETE',
    url: `/v1/sandboxes/${c.body.id}`,
    headers: { ...auth, 'content-type': 'application/json' },
  });
  assert.equal(d.statusCode, 204);
});

test('forged, edited and unknown IDs are 404', async (t) => {
  const a = await api(t);
  const c = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  const id = c.body.id as string;
  const edited = id.slice(0, -2) + (id.at(-2) === 'A' ? 'B' : 'A') + id.at(-1);
  const unknownOnEdge = a.ids.mint('edge-a');
  const unknownEdge = a.ids.mint('edge-zz');
  for (const bad of [
    edited,
    'sb-AAAA',
    'x',
    '..%2F..%2Fetc',
    'sb-' + 'A'.repeat(250),
    unknownOnEdge,
    unknownEdge,
  ]) {
    for (const [method, url, body] of [
      ['GET', `/v1/sandboxes/${bad}`, undefined],
      ['DELETE', `/v1/sandboxes/${bad}`, undefined],
      ['POST', `/v1/sandboxes/${bad}/commands`, { argv: ['id'] }],
    ] as const) {
      const r = await call(a.app, method, url, a.rootKey, body);
      assert.equal(r.status, 404, `${method} ${url}`);
      assert.ok(['sandbox_not_found', 'not_found'].includes(r.body.error.code));
    }
  }
});

test('tenant A cannot see, delete or exec in tenant B (404), nor create in B', async (t) => {
  const a = await api(t);
  const A = await tenant(a, 'tenant-a', undefined, 'member');
  const B = await tenant(a, 'tenant-b', undefined, 'member');
  const sb = (await call(a.app, 'POST', '/v1/sandboxes', B.key, { image: 'base' }))
    .body as SandboxInfo;
  for (const [method, url, body] of [
    ['GET', `/v1/sandboxes/${sb.id}`, undefined],
    ['DELETE', `/v1/sandboxes/${sb.id}`, undefined],
    ['POST', `/v1/sandboxes/${sb.id}/commands`, { argv: ['id'] }],
  ] as const) {
    const r = await call(a.app, method, url, A.key, body);
    assert.equal(r.status, 404, `${method} ${url}`);
    assert.equal(r.body.error.code, 'sandbox_not_found');
  }
  const stream = await a.app.inject({
    method: 'POST',
    url: `/v1/sandboxes/${sb.id}/commands`,
    headers: { authorization: `Bearer ${A.key}`, accept: 'application/x-ndjson' },
    payload: { argv: ['id'] },
  });
  assert.equal(stream.statusCode, 404);
  assert.equal((await call(a.app, 'GET', '/v1/sandboxes', A.key)).body.sandboxes.length, 0);
  const listB = await call(a.app, 'GET', `/v1/sandboxes?projectId=${B.projectId}`, A.key);
  assert.equal(listB.status, 404);
  const createInB = await call(a.app, 'POST', '/v1/sandboxes', A.key, {
    image: 'base',
    projectId: B.projectId,
  });
  assert.equal(createInB.status, 404);
  assert.equal(createInB.body.error.field, 'projectId');
  const keyInB = await call(a.app, 'POST', '/v1/keys', A.key, { projectId: B.projectId });
  assert.equal(keyInB.status, 404);
  assert.equal((await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, B.key)).body.state, 'running');
  const edges = await call(a.app, 'GET', '/v1/edges', A.key);
  assert.equal(edges.status, 403);
  const rootEdges = await call(a.app, 'GET', '/v1/edges', a.rootKey);
  assert.equal(rootEdges.body.edges[0].edgeId, 'edge-a');
  assert.ok(
    (await a.iam.listAudit()).some((e) => e.action === 'sandbox.access' && e.outcome === 'denied'),
  );
});

test('GET /v1/edges says which edges are cordoned', async (t) => {
  const a = await api(t, {
    edges: [new FakeEdge({ edgeId: 'edge-a' }), new FakeEdge({ edgeId: 'edge-b' })],
    fleet: (watcher) => ({
      view: () => {
        const view = watcher.view();
        const edges = view.edges.map((e) => (e.edgeId === 'edge-b' ? { ...e, cordoned: true } : e));
        return { ...view, edges };
      },
    }),
  });
  const r = await call(a.app, 'GET', '/v1/edges', a.rootKey);
  assert.deepEqual(
    (r.body.edges as { edgeId: string; cordoned?: boolean }[]).map((e) => [e.edgeId, e.cordoned]),
    [
      ['edge-a', undefined],
      ['edge-b', true],
    ],
  );
});

test('missing, malformed, unknown and revoked keys are 401', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team', undefined, 'member');
  const revoke = await call(
    a.app,
    'DELETE',
    `/v1/keys/${(await call(a.app, 'GET', '/v1/whoami', team.key)).body.keyId}`,
    a.rootKey,
  );
  assert.equal(revoke.status, 204);
  for (const headers of [
    {},
    { authorization: 'Bearer' },
    { authorization: 'Basic abc' },
    { authorization: 'Bearer dsk_short' },
    { authorization: `Bearer dsk_${'A'.repeat(43)}` },
    { authorization: `Bearer ${team.key}` },
    { authorization: `Bearer ${a.rootKey}x` },
  ]) {
    const r = await a.app.inject({
      method: 'POST',
      url: '/v1/sandboxes',
      headers,
      payload: { image: 'base' },
    });
    assert.equal(r.statusCode, 401, JSON.stringify(headers));
    assert.equal(r.json().error.code, 'unauthenticated');
  }
});

test('nested projects: child quota ≤ parent; members cannot mint admins', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team', { sandboxes: 5, memoryMb: 4096 });
  const over = await call(a.app, 'POST', '/v1/projects', team.key, {
    name: 'sub',
    quota: { memoryMb: 8192 },
  });
  assert.equal(over.status, 403);
  assert.equal(over.body.error.field, 'quota.memoryMb');
  const sub = await call(a.app, 'POST', '/v1/projects', team.key, {
    name: 'sub',
    quota: { sandboxes: 2 },
  });
  assert.equal(sub.status, 201);
  assert.equal(sub.body.parentId, team.projectId);
  const subsub = await call(a.app, 'POST', '/v1/projects', team.key, {
    name: 'deeper',
    parentId: sub.body.id,
    quota: { sandboxes: 3 },
  });
  assert.equal(subsub.status, 403);
  const projects = await call(a.app, 'GET', '/v1/projects', team.key);
  assert.deepEqual(projects.body.projects.map((p: { name: string }) => p.name).sort(), [
    'sub',
    'team',
  ]);

  const member = (
    await call(a.app, 'POST', '/v1/keys', team.key, { projectId: sub.body.id, role: 'member' })
  ).body.key as string;
  const grant = await call(a.app, 'POST', '/v1/keys', member, {
    projectId: sub.body.id,
    role: 'admin',
  });
  assert.equal(grant.status, 403);
  assert.equal(grant.body.error.field, 'role');
  const mkProject = await call(a.app, 'POST', '/v1/projects', member, { name: 'nope' });
  assert.equal(mkProject.status, 403);
  const up = await call(a.app, 'POST', '/v1/keys', member, { projectId: team.projectId });
  assert.equal(up.status, 404);
});

test('20 concurrent creates at a quota of 5: exactly 5 succeed, the rest 429', async (t) => {
  const a = await api(t, {
    edges: [
      new FakeEdge({ edgeId: 'edge-a', createDelayMs: 5 }),
      new FakeEdge({ edgeId: 'edge-b', createDelayMs: 5 }),
    ],
  });
  const team = await tenant(a, 'team', { sandboxes: 5 });
  const sub = (await call(a.app, 'POST', '/v1/projects', team.key, { name: 'sub' })).body
    .id as string;
  const results = await Promise.all(
    Array.from({ length: 20 }, (_, i) =>
      // Half in the child project: the parent's quota counts its whole subtree.
      call(a.app, 'POST', '/v1/sandboxes', team.key, {
        image: 'base',
        ...(i % 2 ? { projectId: sub } : {}),
      }),
    ),
  );
  const statuses = results.map((r) => r.status).sort();
  assert.deepEqual(statuses, [...Array(5).fill(201), ...Array(15).fill(429)]);
  for (const r of results.filter((x) => x.status === 429))
    assert.equal(r.body.error.code, 'quota_exceeded');
  assert.equal((await a.iam.usage(team.projectId)).sandboxes, 5);
  const live = (await call(a.app, 'GET', '/v1/sandboxes', team.key)).body.sandboxes.length;
  assert.equal(live, 5);
});

test('idempotent create: same requestId, concurrent or repeated, makes one sandbox', async (t) => {
  const edge = new FakeEdge({ edgeId: 'edge-a', createDelayMs: 10 });
  const a = await api(t, { edges: [edge] });
  const body = { image: 'base', requestId: 'job-42:attempt.1' };
  const results = await Promise.all(
    Array.from({ length: 8 }, () => call(a.app, 'POST', '/v1/sandboxes', a.rootKey, body)),
  );
  const ids = new Set(results.map((r) => r.body.id));
  assert.deepEqual(
    results.map((r) => r.status),
    Array(8).fill(201),
  );
  assert.equal(ids.size, 1);
  const later = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, body);
  assert.equal(later.body.id, [...ids][0]);
  assert.equal(edge.createCalls, 1);
  assert.equal((await a.iam.usage(a.rootProjectId)).sandboxes, 1);
  const other = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, {
    ...body,
    requestId: 'job-43',
  });
  assert.notEqual(other.body.id, later.body.id);
});

test('a requestId reused with a different body is 409 conflict, not the first result', async (t) => {
  const edge = new FakeEdge({ edgeId: 'edge-a', createDelayMs: 10 });
  const a = await api(t, { edges: [edge] });
  const first = { image: 'base', memoryLimitMb: 256, requestId: 'job-7' };
  // In flight: the second body meets the first one's pending claim.
  const [made, racing] = await Promise.all([
    call(a.app, 'POST', '/v1/sandboxes', a.rootKey, first),
    call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { ...first, memoryLimitMb: 512 }),
  ]);
  assert.equal(made.status, 201);
  assert.equal(racing.status, 409);
  assert.equal(racing.body.error.code, 'conflict');
  assert.deepEqual(racing.body.error.details, { requestId: 'job-7' });
  // Done: a changed body still gets no one else's sandbox; the same body (keys in any order) does.
  const changed = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, {
    ...first,
    image: 'other',
  });
  assert.equal(changed.status, 409);
  assert.equal(changed.body.error.code, 'conflict');
  const same = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, {
    requestId: 'job-7',
    memoryLimitMb: 256,
    image: 'base',
  });
  assert.equal(same.status, 201);
  assert.equal(same.body.id, made.body.id);
  assert.equal(edge.createCalls, 1);
  assert.equal((await a.iam.usage(a.rootProjectId)).sandboxes, 1);
});

test('capacity exhausted on one edge: placed on another; all full → 503 and nothing held', async (t) => {
  // edge-a looks empty to the watcher but refuses: the view is stale, the edge decides.
  const a1 = new FakeEdge({ edgeId: 'edge-a' });
  const b1 = new FakeEdge({ edgeId: 'edge-b' });
  const a = await api(t, {
    edges: [a1, b1],
    placer: () => ({
      place: ({ exclude }) =>
        exclude?.has('edge-a') ? (exclude.has('edge-b') ? fail() : 'edge-b') : 'edge-a',
    }),
  });
  a1.failNextCreate = new DsecError('capacity_exhausted', 'full');
  const c = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  assert.equal(c.status, 201);
  assert.equal(c.body.edgeId, 'edge-b');
  assert.equal(a.ids.decode(c.body.id).edgeId, 'edge-b');

  a1.failNextCreate = new DsecError('capacity_exhausted', 'full');
  b1.failNextCreate = new DsecError('capacity_exhausted', 'full');
  const d = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  assert.equal(d.status, 503);
  assert.equal(d.body.error.code, 'capacity_exhausted');
  assert.equal((await a.iam.usage(a.rootProjectId)).sandboxes, 1);

  // A create the edge fails outright is rolled back: no reservation, no sandbox left running.
  a1.failNextCreate = new Error('disk on fire');
  const e = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
  assert.equal(e.status, 500);
  assert.equal(e.body.error.code, 'internal');
  assert.doesNotMatch(e.body.error.message, /fire/);
  assert.equal((await a.iam.usage(a.rootProjectId)).sandboxes, 1);
});

test('real placement: a full edge is skipped using the watcher view', async (t) => {
  const small = new FakeEdge({
    edgeId: 'edge-small',
    capacity: { memoryMb: 1024, cpuCores: 2, sandboxes: 1 },
  });
  const big = new FakeEdge({ edgeId: 'edge-big' });
  const a = await api(t, { edges: [small, big] });
  const placed: string[] = [];
  for (let i = 0; i < 6; i++) {
    const r = await call(a.app, 'POST', '/v1/sandboxes', a.rootKey, { image: 'base' });
    assert.equal(r.status, 201);
    placed.push(r.body.edgeId);
  }
  assert.ok(placed.filter((e) => e === 'edge-small').length <= 1);
});

test('IAM state survives an apiserver restart on the same file', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-api-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const iamPath = join(dir, 'iam.db');
  const first = await createTestApi({ iamPath });
  const team = await tenant(first, 'team', { sandboxes: 1 });
  await first.close();
  const second = await createTestApi({ iamPath });
  t.after(() => second.close());
  const w = await call(second.app, 'GET', '/v1/whoami', team.key);
  assert.equal(w.status, 200);
  assert.equal(w.body.projectId, team.projectId);
});

function fail(): never {
  throw new DsecError('capacity_exhausted', 'nothing left');
}
