import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { FastifyInstance } from 'fastify';
import type { EdgeApi, SandboxInfo, SnapshotInfo } from '@dsec/core';
import { createTestApi, FAKE_MEMORY_BYTES, FakeEdge } from './testing/index.js';
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
  key: string,
  body?: unknown,
) {
  const res = await app.inject({
    method,
    url,
    headers: { authorization: `Bearer ${key}` },
    ...(body === undefined ? {} : { payload: body as object }),
  });
  const json =
    res.body && res.headers['content-type']?.toString().includes('json') ? res.json() : undefined;
  return { status: res.statusCode, body: json };
}

/** A child project of root with a key (optionally scoped); returns the raw key. */
async function tenant(
  a: TestApi,
  name: string,
  options: { quota?: Record<string, number>; scopes?: string[] } = {},
) {
  const p = await call(a.app, 'POST', '/v1/projects', a.rootKey, {
    name,
    ...(options.quota ? { quota: options.quota } : {}),
  });
  assert.equal(p.status, 201, JSON.stringify(p.body));
  const k = await call(a.app, 'POST', '/v1/keys', a.rootKey, {
    projectId: p.body.id,
    role: 'admin',
    ...(options.scopes ? { scopes: options.scopes } : {}),
  });
  assert.equal(k.status, 201, JSON.stringify(k.body));
  return { projectId: p.body.id as string, key: k.body.key as string };
}

async function create(a: TestApi, key: string, body: Record<string, unknown> = {}) {
  const r = await call(a.app, 'POST', '/v1/sandboxes', key, { image: 'base', ...body });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  return r.body as SandboxInfo;
}

const code = (r: { body: { error?: { code: string; field?: string } } }) => [
  r.body.error?.code,
  r.body.error?.field,
];

test('pause and resume: no-ops when repeated, memory shown, quota held while paused', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team');
  const sb = await create(a, team.key, { ttlSeconds: 600 });
  const moved: [string, number][] = [];
  const setExpiry = a.iam.setReservationExpiry.bind(a.iam);
  a.iam.setReservationExpiry = async (id, at) => {
    moved.push([id, Number(at)]);
    return setExpiry(id, at);
  };

  const p1 = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/pause`, team.key);
  assert.equal(p1.status, 200);
  assert.equal(p1.body.state, 'paused');
  const p2 = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/pause`, team.key);
  assert.equal(p2.status, 200);
  assert.equal(p2.body.pausedAt, p1.body.pausedAt, 'a second pause is a no-op');
  const got = await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, team.key);
  assert.equal(got.body.state, 'paused');
  assert.equal(got.body.memoryBytes, FAKE_MEMORY_BYTES.paused);
  // Paused, the sandbox may live until the paused TTL runs out plus the running time it had left.
  const info = p1.body as SandboxInfo;
  const left = Date.parse(info.expiresAt) - Date.parse(info.pausedAt!);
  assert.deepEqual(moved[0], [sb.id, Date.parse(info.pausedExpiresAt!) + left]);

  const r1 = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/resume`, team.key);
  assert.equal(r1.status, 200);
  assert.equal(r1.body.state, 'running');
  assert.equal(r1.body.pausedAt, undefined);
  const r2 = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/resume`, team.key);
  assert.equal(r2.body.state, 'running');
  assert.deepEqual(moved.at(-1), [sb.id, Date.parse(r2.body.expiresAt)]);
  const running = await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, team.key);
  assert.equal(running.body.memoryBytes, FAKE_MEMORY_BYTES.running);
  assert.equal((await a.iam.usage(team.projectId)).sandboxes, 1);
});

test('timeout moves the deadline and the quota reservation with it', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team');
  const sb = await create(a, team.key, { ttlSeconds: 60 });
  const moved: [string, number][] = [];
  const setExpiry = a.iam.setReservationExpiry.bind(a.iam);
  a.iam.setReservationExpiry = async (id, at) => {
    moved.push([id, Number(at)]);
    return setExpiry(id, at);
  };
  const before = Date.now();
  const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/timeout`, team.key, {
    seconds: 7200,
  });
  assert.equal(r.status, 200);
  const at = Date.parse(r.body.expiresAt);
  assert.ok(at >= before + 7_200_000 && at <= Date.now() + 7_200_000);
  assert.deepEqual(moved, [[sb.id, at]]);
  assert.equal(
    (await call(a.app, 'GET', `/v1/sandboxes/${sb.id}`, team.key)).body.expiresAt,
    r.body.expiresAt,
  );
  for (const body of [
    { seconds: 0 },
    { seconds: 604_801 },
    { seconds: 1.5 },
    {},
    { seconds: 5, x: 1 },
  ]) {
    const bad = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/timeout`, team.key, body);
    assert.equal(bad.status, 400, JSON.stringify(body));
    assert.equal(bad.body.error.code, 'invalid_argument');
  }
});

test('stopped sandboxes are sandbox_not_running; foreign ones sandbox_not_found', async (t) => {
  const a = await api(t);
  const team = await tenant(a, 'team');
  const other = await tenant(a, 'other');
  const sb = await create(a, team.key);
  const paths = ['pause', 'resume', 'timeout', 'snapshot', 'fork'] as const;
  const bodies = {
    pause: undefined,
    resume: undefined,
    timeout: { seconds: 60 },
    snapshot: { name: 'x' },
    fork: { count: 1 },
  };
  for (const p of paths) {
    const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/${p}`, other.key, bodies[p]);
    assert.deepEqual([r.status, ...code(r)], [404, 'sandbox_not_found', undefined], p);
  }
  assert.equal((await call(a.app, 'DELETE', `/v1/sandboxes/${sb.id}`, team.key)).status, 204);
  for (const p of paths) {
    const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/${p}`, team.key, bodies[p]);
    assert.deepEqual([r.status, ...code(r)], [409, 'sandbox_not_running', undefined], p);
  }
});

test('an edge without the lifecycle methods answers unavailable', async (t) => {
  const fake = new FakeEdge({ edgeId: 'edge-old' });
  // An edge from before issue 11: everything but the lifecycle methods.
  const old: EdgeApi = {
    edgeId: fake.edgeId,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
  };
  const a = await api(t, { edges: [old as FakeEdge] });
  const sb = await create(a, a.rootKey);
  for (const [p, body] of [
    ['pause', undefined],
    ['resume', undefined],
    ['timeout', { seconds: 60 }],
    ['snapshot', { name: 'snap' }],
    ['fork', { count: 2 }],
  ] as const) {
    const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/${p}`, a.rootKey, body);
    assert.deepEqual([r.status, r.body.error.code], [503, 'unavailable'], p);
    assert.match(r.body.error.message, /edge-old/);
  }
});

test('snapshot: an image create accepts, scrub recorded; bad requests name the field', async (t) => {
  const a = await api(t);
  const edge = a.edges.get('edge-a')!;
  const sb = await create(a, a.rootKey, { workspace: 'ws', toolkits: ['tk'] });
  const r = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/snapshot`, a.rootKey, {
    name: 'task-1:v1',
    scrub: ['/srv/answer.txt', '/build/**'],
  });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  const snap = r.body as SnapshotInfo;
  assert.deepEqual(Object.keys(snap).sort(), [
    'freezeMs',
    'image',
    'layer',
    'parents',
    'scrub',
    'totalMs',
  ]);
  assert.equal(snap.image, 'task-1:v1');
  assert.deepEqual(snap.parents, ['base', 'ws', 'tk']);
  assert.deepEqual(snap.scrub, ['/srv/answer.txt', '/build/**']);
  assert.deepEqual(edge.images.get(`${a.rootProjectId}/task-1:v1`)?.scrub, snap.scrub);
  const child = await create(a, a.rootKey, { image: snap.image });
  assert.equal(child.spec.image, 'task-1:v1');
  const again = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/snapshot`, a.rootKey, {
    name: 'task-1:v1',
  });
  assert.deepEqual([again.status, ...code(again)], [409, 'conflict', 'name']);
  for (const [body, field] of [
    [{}, 'name'],
    [{ name: 'Bad Name' }, 'name'],
    [{ name: 'ok', scrub: ['relative/path'] }, 'scrub.0'],
    [{ name: 'ok', scrub: ['/a', '/b/../etc/passwd'] }, 'scrub.1'],
    [{ name: 'ok', extra: true }, 'extra'],
  ] as const) {
    const bad = await call(a.app, 'POST', `/v1/sandboxes/${sb.id}/snapshot`, a.rootKey, body);
    assert.deepEqual(
      [bad.status, ...code(bad)],
      [400, 'invalid_argument', field],
      JSON.stringify(body),
    );
  }
});

test('fork: K sandboxes from one snapshot with the source spec; a failure rolls back', async (t) => {
  const edge = new FakeEdge({ edgeId: 'edge-a' });
  const a = await api(t, { edges: [edge] });
  const team = await tenant(a, 'team', { quota: { sandboxes: 4 } });
  const src = await create(a, team.key, {
    workspace: 'ws',
    toolkits: ['tk'],
    memoryLimitMb: 256,
    labels: { job: 'rl-1' },
    env: { A: '1' },
  });
  const r = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/fork`, team.key, { count: 3 });
  assert.equal(r.status, 201, JSON.stringify(r.body));
  const { ids, image } = r.body as { ids: string[]; image: string };
  assert.equal(ids.length, 3);
  assert.equal(new Set(ids).size, 3);
  assert.equal(edge.images.size, 1, 'one snapshot for all the forks');
  assert.ok(edge.images.has(`${team.projectId}/${image}`));
  for (const id of ids) {
    const f = (await call(a.app, 'GET', `/v1/sandboxes/${id}`, team.key)).body as SandboxInfo;
    assert.equal(f.state, 'running');
    assert.equal(f.projectId, team.projectId);
    const { workspace: _workspace, ...rest } = src.spec;
    assert.deepEqual(f.spec, { ...rest, image, toolkits: [] });
  }
  assert.equal((await a.iam.usage(team.projectId)).sandboxes, 4);

  // The quota has room for no more: the second fork fails and leaves nothing behind.
  const before = (await edge.listSandboxes({})).filter((s) => s.state === 'running').length;
  await call(a.app, 'DELETE', `/v1/sandboxes/${ids[0]}`, team.key);
  const full = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/fork`, team.key, { count: 2 });
  assert.deepEqual([full.status, full.body.error.code], [429, 'quota_exceeded']);
  assert.equal((await a.iam.usage(team.projectId)).sandboxes, 3);
  const after = (await edge.listSandboxes({})).filter((s) => s.state === 'running').length;
  assert.equal(after, before - 1, 'the fork that was made is stopped again');

  for (const count of [0, 65, 'two']) {
    const bad = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/fork`, team.key, { count });
    assert.deepEqual([bad.status, ...code(bad)], [400, 'invalid_argument', 'count']);
  }
});

test('whole-job operations act on every live sandbox carrying the labels, and nothing else', async (t) => {
  const fake = new FakeEdge({ edgeId: 'edge-b' });
  const old: EdgeApi = {
    edgeId: fake.edgeId,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
  };
  const a = await api(t, { edges: [new FakeEdge({ edgeId: 'edge-a' })] });
  const team = await tenant(a, 'team');
  const other = await tenant(a, 'other');
  const job = [
    await create(a, team.key, { labels: { job: 'x', rank: '0' } }),
    await create(a, team.key, { labels: { job: 'x', rank: '1' } }),
  ];
  const otherJob = await create(a, team.key, { labels: { job: 'y' } });
  const foreign = await create(a, other.key, { labels: { job: 'x' } });
  const ended = await create(a, team.key, { labels: { job: 'x' } });
  await call(a.app, 'DELETE', `/v1/sandboxes/${ended.id}`, team.key);

  const ls = await call(a.app, 'GET', '/v1/sandboxes?label=job=x', team.key);
  assert.deepEqual(
    (ls.body.sandboxes as SandboxInfo[]).map((s) => s.id).sort(),
    [...job.map((s) => s.id), ended.id].sort(),
  );
  const two = await call(a.app, 'GET', '/v1/sandboxes?label=job=x&label=rank=1', team.key);
  assert.deepEqual(
    (two.body.sandboxes as SandboxInfo[]).map((s) => s.id),
    [job[1]!.id],
  );
  const badLs = await call(a.app, 'GET', '/v1/sandboxes?label=nokey', team.key);
  assert.deepEqual([badLs.status, ...code(badLs)], [400, 'invalid_argument', 'label']);

  const sorted = (r: { body: { sandboxes: { id: string; state: string }[] } }) =>
    [...r.body.sandboxes].sort((p, q) => p.id.localeCompare(q.id));
  const expect = (state: string) =>
    job.map((s) => ({ id: s.id, state })).sort((p, q) => p.id.localeCompare(q.id));
  const paused = await call(a.app, 'POST', '/v1/sandboxes:pause', team.key, {
    labels: { job: 'x' },
  });
  assert.equal(paused.status, 200, JSON.stringify(paused.body));
  assert.deepEqual(sorted(paused), expect('paused'));
  assert.deepEqual(paused.body.failed, []);
  const state = async (key: string, id: string) =>
    (await call(a.app, 'GET', `/v1/sandboxes/${id}`, key)).body.state as string;
  assert.equal(await state(team.key, otherJob.id), 'running');
  assert.equal(await state(other.key, foreign.id), 'running');
  // Again: a no-op for each.
  assert.deepEqual(
    sorted(await call(a.app, 'POST', '/v1/sandboxes:pause', team.key, { labels: { job: 'x' } })),
    expect('paused'),
  );
  assert.deepEqual(
    sorted(await call(a.app, 'POST', '/v1/sandboxes:resume', team.key, { labels: { job: 'x' } })),
    expect('running'),
  );

  const before = Date.now();
  const ext = await call(a.app, 'POST', '/v1/sandboxes:extend', team.key, {
    labels: { job: 'x' },
    seconds: 9000,
  });
  assert.deepEqual(sorted(ext), expect('running'));
  for (const s of job) {
    const info = (await call(a.app, 'GET', `/v1/sandboxes/${s.id}`, team.key)).body as SandboxInfo;
    assert.ok(Date.parse(info.expiresAt) >= before + 9_000_000);
  }
  const stopped = await call(a.app, 'POST', '/v1/sandboxes:stop', team.key, {
    labels: { job: 'x' },
  });
  assert.deepEqual(sorted(stopped), expect('stopped'));
  assert.equal((await a.iam.usage(team.projectId)).sandboxes, 1, 'only job y holds quota');
  assert.equal(await state(other.key, foreign.id), 'running');
  const none = await call(a.app, 'POST', '/v1/sandboxes:stop', team.key, { labels: { job: 'x' } });
  assert.deepEqual(none.body, { sandboxes: [], failed: [] });

  for (const [path, body, field] of [
    ['pause', { labels: {} }, 'labels'],
    ['pause', {}, 'labels'],
    ['extend', { labels: { job: 'y' } }, 'seconds'],
    ['pause', { labels: { job: 'y' }, seconds: 5 }, 'seconds'],
    ['stop', { labels: { job: 'y' }, all: true }, 'all'],
  ] as const) {
    const bad = await call(a.app, 'POST', `/v1/sandboxes:${path}`, team.key, body);
    assert.deepEqual(
      [bad.status, ...code(bad)],
      [400, 'invalid_argument', field],
      JSON.stringify(body),
    );
  }

  // Sandboxes on an edge that cannot pause are reported one by one, the rest still paused.
  a.edges.set('edge-b', old as FakeEdge);
  const onOld = await old.createSandbox({
    id: a.ids.mint('edge-b'),
    projectId: team.projectId,
    spec: { ...otherJob.spec },
  });
  const mixed = await call(a.app, 'POST', '/v1/sandboxes:pause', team.key, {
    labels: { job: 'y' },
  });
  assert.deepEqual(mixed.body.sandboxes, [{ id: otherJob.id, state: 'paused' }]);
  assert.deepEqual(
    (mixed.body.failed as { id: string; code: string }[]).map((f) => [f.id, f.code]),
    [[onOld.id, 'unavailable']],
  );
});

test('builder and runtime keys: snapshot without running the result, and the reverse', async (t) => {
  const a = await api(t);
  const builder = await tenant(a, 'builders', {
    scopes: ['sandboxes:snapshot', 'images:run:base*'],
  });
  const runtimeKey = await call(a.app, 'POST', '/v1/keys', a.rootKey, {
    projectId: builder.projectId,
    scopes: ['images:run:task-*'],
  });
  assert.deepEqual(runtimeKey.body.scopes, ['images:run:task-*']);
  const runtime = runtimeKey.body.key as string;
  const who = await call(a.app, 'GET', '/v1/whoami', runtime);
  assert.deepEqual(who.body.scopes, ['images:run:task-*']);
  assert.equal((await call(a.app, 'GET', '/v1/whoami', a.rootKey)).body.scopes, undefined);

  const src = await create(a, builder.key, { image: 'base-py' });
  const snap = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/snapshot`, builder.key, {
    name: 'task-7',
  });
  assert.equal(snap.status, 201, JSON.stringify(snap.body));
  const image = snap.body.image as string;

  // The builder cannot run what it built, not even by naming it after what it may run...
  for (const name of ['base-x', 'base-py:v2']) {
    const own = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/snapshot`, builder.key, {
      name,
    });
    assert.deepEqual([own.status, ...code(own)], [403, 'permission_denied', 'name'], name);
  }
  const run1 = await call(a.app, 'POST', '/v1/sandboxes', builder.key, { image });
  assert.deepEqual([run1.status, ...code(run1)], [403, 'permission_denied', 'image']);
  const run2 = await call(a.app, 'POST', '/v1/sandboxes', builder.key, {
    image: 'base',
    toolkits: ['tk-1', 'base-tools'],
  });
  assert.deepEqual([run2.status, ...code(run2)], [403, 'permission_denied', 'toolkits.0']);
  // ...the runtime can, and cannot snapshot, fork, or run the builder's base.
  const child = await create(a, runtime, { image });
  assert.equal(child.spec.image, image);
  for (const [p, body] of [
    ['snapshot', { name: 'task-8' }],
    ['fork', { count: 1 }],
  ] as const) {
    const r = await call(a.app, 'POST', `/v1/sandboxes/${child.id}/${p}`, runtime, body);
    assert.deepEqual([r.status, ...code(r)], [403, 'permission_denied', undefined], p);
  }
  const base = await call(a.app, 'POST', '/v1/sandboxes', runtime, { image: 'base' });
  assert.deepEqual([base.status, ...code(base)], [403, 'permission_denied', 'image']);
  // Forking needs the snapshot scope and the right to run the source's layers.
  const forked = await call(a.app, 'POST', `/v1/sandboxes/${src.id}/fork`, builder.key, {
    count: 1,
  });
  assert.equal(forked.status, 201, JSON.stringify(forked.body));
  // An unscoped key does both; a scoped key cannot mint a wider one.
  await create(a, a.rootKey, { image });
  const wider = await call(a.app, 'POST', '/v1/keys', runtime, {
    projectId: builder.projectId,
    scopes: ['sandboxes:snapshot'],
  });
  assert.deepEqual([wider.status, ...code(wider)], [403, 'permission_denied', 'scopes']);
  const badScope = await call(a.app, 'POST', '/v1/keys', a.rootKey, {
    projectId: builder.projectId,
    scopes: ['images:delete'],
  });
  assert.deepEqual([badScope.status, ...code(badScope)], [400, 'invalid_argument', 'scopes.0']);
  const denials = (await a.iam.listAudit({ limit: 50 })).filter((e) => e.outcome === 'denied');
  assert.ok(denials.some((e) => e.action === 'sandbox.snapshot'));
  assert.ok(denials.some((e) => e.action === 'sandbox.create'));
});
