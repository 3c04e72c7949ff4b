/*
 * Volumes through the real HTTP path (docs/volumes.md), over fake edges that
 * keep volumes in memory: routes, per-project names, the volumeBytes quota
 * of the project and its ancestors, placement on the volume's edge, and
 * `volume_in_use`. The same volumes on a real node, with the host-side
 * attacks: edge/test/integration/volumes.test.ts.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createTestApi } from './testing/harness.js';
import { FakeEdge } from './testing/fake-edge.js';

const MiB = 2 ** 20;

interface Reply {
  status: number;
  body: {
    error?: { code: string; field?: string; details?: Record<string, unknown> };
    [k: string]: unknown;
  };
}

async function setup(t: { after: (fn: () => Promise<void>) => void }) {
  const edges = [new FakeEdge({ edgeId: 'edge-a' }), new FakeEdge({ edgeId: 'edge-b' })];
  const api = await createTestApi({ edges });
  t.after(() => api.close());
  const call = async (key: string, method: string, url: string, body?: unknown): Promise<Reply> => {
    const res = await api.app.inject({
      method: method as 'GET',
      url,
      headers: { authorization: `Bearer ${key}` },
      ...(body === undefined ? {} : { payload: body as object }),
    });
    return { status: res.statusCode, body: res.body ? res.json<Reply['body']>() : {} };
  };
  const project = async (name: string, parentId?: string, quota?: Record<string, number>) => {
    const p = await call(api.rootKey, 'POST', '/v1/projects', {
      name,
      ...(parentId ? { parentId } : {}),
      ...(quota ? { quota } : {}),
    });
    assert.equal(p.status, 201, JSON.stringify(p.body));
    const k = await call(api.rootKey, 'POST', '/v1/keys', { projectId: p.body.id, role: 'member' });
    assert.equal(k.status, 201, JSON.stringify(k.body));
    return { id: p.body.id as string, key: k.body.key as string };
  };
  const sandbox = (key: string, volumes: unknown, extra: Record<string, unknown> = {}) =>
    call(key, 'POST', '/v1/sandboxes', { image: 'base', volumes, ...extra });
  return { api, edges, call, project, sandbox };
}

test('volumes: create, list, get, mount, delete; names are per project', async (t) => {
  const { call, project, sandbox } = await setup(t);
  const a = await project('team-a');
  const b = await project('team-b');

  const made = await call(a.key, 'POST', '/v1/volumes', { name: 'data', sizeMb: 64 });
  assert.equal(made.status, 201, JSON.stringify(made.body));
  assert.equal(made.body.name, 'data');
  assert.equal(made.body.sizeMb, 64);
  assert.equal(made.body.state, 'ready');
  assert.equal(made.body.projectId, a.id);
  const again = await call(a.key, 'POST', '/v1/volumes', { name: 'data', sizeMb: 64 });
  assert.equal(again.status, 409);
  assert.equal(again.body.error?.code, 'conflict');

  // B's "data" is another volume; A's is invisible to B by name, listing and project ID.
  assert.deepEqual((await call(b.key, 'GET', '/v1/volumes')).body.volumes, []);
  const bGet = await call(b.key, 'GET', '/v1/volumes/data');
  assert.equal(bGet.status, 404);
  assert.equal(bGet.body.error?.code, 'volume_not_found');
  assert.equal((await call(b.key, 'DELETE', '/v1/volumes/data')).status, 404);
  const other = await call(b.key, 'GET', `/v1/volumes?projectId=${a.id}`);
  assert.equal(other.status, 404);
  assert.equal(other.body.error?.code, 'not_found');
  const bMount = await sandbox(b.key, [{ name: 'data', path: '/data' }]);
  assert.equal(bMount.status, 404);
  assert.equal(bMount.body.error?.code, 'volume_not_found');
  assert.equal(bMount.body.error?.field, 'volumes.0.name');
  assert.equal(
    (await call(b.key, 'POST', '/v1/volumes', { name: 'data', sizeMb: 16 })).status,
    201,
  );
  assert.deepEqual(
    (
      (await call(a.key, 'GET', '/v1/volumes')).body.volumes as { name: string; sizeMb: number }[]
    ).map((v) => [v.name, v.sizeMb]),
    [['data', 64]],
  );

  // Mounted: the sandbox runs on the volume's edge, and a delete is refused.
  const edgeId = made.body.edgeId as string;
  const ids: string[] = [];
  for (let i = 0; i < 6; i++) {
    const sb = await sandbox(a.key, [{ name: 'data', path: '/data' }]);
    assert.equal(sb.status, 201, JSON.stringify(sb.body));
    assert.equal(sb.body.edgeId, edgeId, 'placed on the volume’s edge');
    ids.push(sb.body.id as string);
  }
  const got = await call(a.key, 'GET', '/v1/volumes/data');
  assert.deepEqual([...(got.body.mountedBy as string[])].sort(), [...ids].sort());
  const busy = await call(a.key, 'DELETE', '/v1/volumes/data');
  assert.equal(busy.status, 409);
  assert.equal(busy.body.error?.code, 'volume_in_use');
  for (const id of ids)
    assert.equal((await call(a.key, 'DELETE', `/v1/sandboxes/${id}`)).status, 204);
  assert.equal((await call(a.key, 'DELETE', '/v1/volumes/data')).status, 204);
  assert.equal((await call(a.key, 'GET', '/v1/volumes/data')).status, 404);
  assert.equal((await sandbox(a.key, [{ name: 'data', path: '/data' }])).status, 404);
});

test('volumes: bad names, sizes and mount paths are refused with the field named', async (t) => {
  const { call, project, sandbox } = await setup(t);
  const a = await project('team-a');
  for (const name of ['a/b', '..', 'a..b', '', 'x'.repeat(64), 'Data', '-x', 'a b', 'a\u0000b']) {
    const r = await call(a.key, 'POST', '/v1/volumes', { name, sizeMb: 16 });
    assert.equal(r.status, 400, name);
    assert.equal(r.body.error?.field, 'name', name);
  }
  for (const sizeMb of [0, 15, 2 ** 21, 1.5, -1]) {
    const r = await call(a.key, 'POST', '/v1/volumes', { name: 'ok', sizeMb });
    assert.equal(r.status, 400, String(sizeMb));
    assert.equal(r.body.error?.field, 'sizeMb');
  }
  assert.equal(
    (await call(a.key, 'POST', '/v1/volumes', { name: 'ok', sizeMb: 16, x: 1 })).status,
    400,
  );
  // A name with a slash or dots never reaches a handler as one name.
  assert.equal((await call(a.key, 'GET', '/v1/volumes/..%2F..%2Fetc')).status, 400);
  assert.equal((await call(a.key, 'DELETE', '/v1/volumes/a..b')).status, 400);
  assert.equal((await call(a.key, 'POST', '/v1/volumes', { name: 'ok', sizeMb: 16 })).status, 201);
  const paths: [string, string][] = [
    ['/proc', 'volumes.0.path'],
    ['/proc/self', 'volumes.0.path'],
    ['/dev', 'volumes.0.path'],
    ['/dev/shm', 'volumes.0.path'],
    ['/sys', 'volumes.0.path'],
    ['/', 'volumes.0.path'],
    ['/a/../proc', 'volumes.0.path'],
    ['/a/./b', 'volumes.0.path'],
    ['/a//b', 'volumes.0.path'],
    ['/data/', 'volumes.0.path'],
    ['data', 'volumes.0.path'],
    [`/${'x'.repeat(600)}`, 'volumes.0.path'],
  ];
  for (const [path, field] of paths) {
    const r = await sandbox(a.key, [{ name: 'ok', path }]);
    assert.equal(r.status, 400, path);
    assert.equal(r.body.error?.field, field, path);
  }
  const twice = await sandbox(a.key, [
    { name: 'ok', path: '/a' },
    { name: 'ok', path: '/b' },
  ]);
  assert.equal(twice.status, 400);
  assert.equal(twice.body.error?.field, 'volumes.1.name');
  await call(a.key, 'POST', '/v1/volumes', { name: 'two', sizeMb: 16 });
  const nested = await sandbox(a.key, [
    { name: 'ok', path: '/a' },
    { name: 'two', path: '/a/b' },
  ]);
  assert.equal(nested.status, 400);
  assert.equal(nested.body.error?.field, 'volumes.1.path');
  const many = await sandbox(
    a.key,
    Array.from({ length: 17 }, (_, i) => ({ name: `v${i}`, path: `/v${i}` })),
  );
  assert.equal(many.status, 400);
});

test('volumes: sizes count against the volumeBytes quota of the project and its ancestors', async (t) => {
  const { call, project } = await setup(t);
  const parent = await project('org', undefined, { volumeBytes: 64 * MiB });
  const child = await project('team', parent.id);
  const other = await project('team-2', parent.id);
  assert.equal(
    (await call(child.key, 'POST', '/v1/volumes', { name: 'a', sizeMb: 32 })).status,
    201,
  );
  assert.equal(
    (await call(other.key, 'POST', '/v1/volumes', { name: 'b', sizeMb: 16 })).status,
    201,
  );
  const over = await call(child.key, 'POST', '/v1/volumes', { name: 'c', sizeMb: 32 });
  assert.equal(over.status, 429);
  assert.equal(over.body.error?.code, 'quota_exceeded');
  assert.equal(over.body.error?.details?.resource, 'volumeBytes');
  assert.equal(over.body.error?.details?.projectId, parent.id);
  // Nothing of the refused create is left: not listed, not on an edge.
  assert.deepEqual(
    ((await call(child.key, 'GET', '/v1/volumes')).body.volumes as { name: string }[]).map(
      (v) => v.name,
    ),
    ['a'],
  );
  assert.equal(
    (await call(child.key, 'POST', '/v1/volumes', { name: 'c', sizeMb: 16 })).status,
    201,
  );
  assert.equal((await call(child.key, 'DELETE', '/v1/volumes/a')).status, 204);
  assert.equal(
    (await call(child.key, 'POST', '/v1/volumes', { name: 'd', sizeMb: 32 })).status,
    201,
  );
  // Concurrent creates never overshoot the limit.
  const burst = await Promise.all(
    Array.from({ length: 8 }, (_, i) =>
      call(other.key, 'POST', '/v1/volumes', { name: `x${i}`, sizeMb: 16 }),
    ),
  );
  assert.equal(burst.filter((r) => r.status === 201).length, 0, 'the parent is full');
  assert.ok(burst.every((r) => r.body.error?.code === 'quota_exceeded'));
});

test('volumes: no healthy edge makes no record; a sandbox pinned to a down edge goes nowhere else', async (t) => {
  const { api, edges, call, project, sandbox } = await setup(t);
  const a = await project('team-a');
  for (const e of edges) e.healthy = false;
  await api.watcher.refresh();
  const none = await call(a.key, 'POST', '/v1/volumes', { name: 'data', sizeMb: 16 });
  assert.equal(none.status, 503);
  for (const e of edges) e.healthy = true;
  await api.watcher.refresh();
  const made = await call(a.key, 'POST', '/v1/volumes', { name: 'data', sizeMb: 16 });
  assert.equal(made.status, 201);
  const home = edges.find((e) => e.edgeId === made.body.edgeId)!;
  home.healthy = false;
  const sb = await sandbox(a.key, [{ name: 'data', path: '/data' }]);
  assert.equal(sb.status, 503, 'a pinned sandbox goes nowhere else');
  home.healthy = true;
  assert.equal((await call(a.key, 'DELETE', '/v1/volumes/data')).status, 204);
});
