import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { LayerInfo } from '@dsec/core';
import { createTestApi } from './testing/harness.js';
import { FakeEdge } from './testing/fake-edge.js';

test('GET /v1/images asks the store for plumbing records only with ?all, and refuses other flags', async (t) => {
  const asked: boolean[] = [];
  const api = await createTestApi({
    imagesList: async ({ all }) => {
      asked.push(all);
      return [] as LayerInfo[];
    },
  });
  t.after(() => api.close());
  const get = (url: string) =>
    api.app.inject({ method: 'GET', url, headers: { authorization: `Bearer ${api.rootKey}` } });
  assert.equal((await get('/v1/images')).statusCode, 200);
  assert.equal((await get('/v1/images?all=true')).statusCode, 200);
  assert.equal((await get('/v1/images?all=0')).statusCode, 200);
  assert.deepEqual(asked, [false, true, false]);
  const bad = await get('/v1/images?all=yes');
  assert.equal(bad.statusCode, 400);
  assert.equal(bad.json<{ error: { field: string } }>().error.field, 'all');
});

/*
 * Issue 24 point 2 (SECURITY.md I37): image ownership through the real HTTP
 * path, over a fake edge that resolves layers as the real one does. The same
 * attacks against a real node: cluster/test/integration/image-ownership.test.ts.
 */

interface Reply {
  status: number;
  body: {
    error?: { code: string; field?: string; details?: Record<string, unknown> };
    [k: string]: unknown;
  };
}

async function owned(t: { after: (fn: () => Promise<void>) => void }) {
  const edge = new FakeEdge({ edgeId: 'edge-a', platformImages: ['base', 'tools'] });
  const api = await createTestApi({
    edges: [edge],
    imagesList: async () => edge.layers(),
    imagesRemove: (ref, project) => edge.removeLayer(ref, project),
  });
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
    const k = await call(api.rootKey, 'POST', '/v1/keys', { projectId: p.body.id, role: 'admin' });
    return { id: p.body.id as string, key: k.body.key as string };
  };
  const create = (key: string, image: string, more: Record<string, unknown> = {}) =>
    call(key, 'POST', '/v1/sandboxes', { image, ...more });
  const sandbox = async (key: string, image = 'base') => {
    const r = await create(key, image);
    assert.equal(r.status, 201, JSON.stringify(r.body));
    return r.body.id as string;
  };
  const snapshot = (key: string, id: string, name: string) =>
    call(key, 'POST', `/v1/sandboxes/${id}/snapshot`, { name });
  const listed = async (key: string, query = '') => {
    const r = await call(key, 'GET', `/v1/images${query}`);
    assert.equal(r.status, 200, JSON.stringify(r.body));
    return (r.body.layers as LayerInfo[]).map((l) => `${l.project ?? '-'}/${l.name}`);
  };
  return { api, edge, call, project, create, sandbox, snapshot, listed };
}

function absent(r: Reply, field: string) {
  assert.deepEqual(
    [r.status, r.body.error?.code, r.body.error?.field],
    [404, 'image_not_found', field],
  );
}

test("images: B cannot list, run, stack or delete A's snapshot; each answer is as for no layer", async (t) => {
  const { call, project, create, sandbox, snapshot, listed } = await owned(t);
  const a = await project('a');
  const b = await project('b');
  const src = await sandbox(a.key);
  const snap = await snapshot(a.key, src, 'a-secret');
  assert.equal(snap.status, 201, JSON.stringify(snap.body));
  assert.equal((snap.body.layer as LayerInfo).project, a.id);

  assert.deepEqual(await listed(a.key), [`${a.id}/a-secret`, '-/base', '-/tools']);
  assert.deepEqual(await listed(b.key), ['-/base', '-/tools']);
  assert.deepEqual(await listed(b.key, '?all=true'), ['-/base', '-/tools']);
  const foreign = await call(b.key, 'GET', `/v1/images?projectId=${a.id}`);
  assert.deepEqual([foreign.status, foreign.body.error?.code], [404, 'not_found']);
  absent(await create(b.key, 'a-secret'), 'image');
  absent(await create(b.key, 'a-secret:latest'), 'image');
  absent(await create(b.key, 'base', { workspace: 'a-secret' }), 'workspace');
  absent(await create(b.key, 'base', { toolkits: ['tools', 'a-secret'] }), 'toolkits.1');
  absent(await call(b.key, 'DELETE', '/v1/images/a-secret'), 'ref');
  // The same name in B's own namespace is no conflict (that would tell B it exists).
  const bsrc = await sandbox(b.key);
  assert.equal((await snapshot(b.key, bsrc, 'a-secret')).status, 201);
  assert.deepEqual(await listed(a.key), [`${a.id}/a-secret`, '-/base', '-/tools']);
  // Deleting is per owner: B's goes, A's stays.
  assert.equal((await call(b.key, 'DELETE', '/v1/images/a-secret')).status, 204);
  assert.equal((await create(a.key, 'a-secret')).status, 201);
  absent(await create(b.key, 'a-secret'), 'image');
});

test("images: B taking A's next name first changes nothing for A; A's scoped key runs only A's view", async (t) => {
  const { api, edge, call, project, create, sandbox, snapshot } = await owned(t);
  const a = await project('a');
  const b = await project('b');
  const a1 = await project('a1', a.id);
  const runtime = await call(a.key, 'POST', '/v1/keys', {
    projectId: a.id,
    scopes: ['images:run:a-task-*'],
  });
  const rt = runtime.body.key as string;
  const bsrc = await sandbox(b.key);
  for (const name of ['a-task-2', 'a-task-3'])
    assert.equal((await snapshot(b.key, bsrc, name)).status, 201);
  const asrc = await sandbox(a.key);
  assert.equal((await snapshot(a.key, asrc, 'a-task-2')).status, 201, 'no conflict with B');
  assert.equal((await create(rt, 'a-task-2')).status, 201);
  const root = api.rootProjectId;
  assert.deepEqual(edge.creates.at(-1)?.layerView, [root, a.id], 'A’s view, not B’s');
  absent(await create(rt, 'a-task-3'), 'image');
  // Starting a sandbox in a child, the scoped key still sees only its own project's view.
  const a1src = await sandbox(a1.key);
  assert.equal((await snapshot(a1.key, a1src, 'a-task-9')).status, 201);
  absent(await create(rt, 'a-task-9', { projectId: a1.id }), 'image');
  assert.deepEqual(edge.creates.at(-1)?.layerView, [root, a.id]);
  // An unscoped key of A starting a sandbox in A1 sees A1's view.
  assert.equal((await create(a.key, 'a-task-9', { projectId: a1.id })).status, 201);
  assert.deepEqual(edge.creates.at(-1)?.layerView, [root, a.id, a1.id]);
});

test('images: a child sees its ancestors’ layers, not its siblings’; a higher name is taken', async (t) => {
  const { call, project, create, sandbox, snapshot, listed } = await owned(t);
  const a = await project('a');
  const a1 = await project('a1', a.id);
  const a2 = await project('a2', a.id);
  assert.equal((await snapshot(a.key, await sandbox(a.key), 'team-env')).status, 201);
  assert.equal((await create(a1.key, 'team-env')).status, 201);
  assert.equal((await snapshot(a1.key, await sandbox(a1.key), 'a1-only')).status, 201);
  absent(await create(a2.key, 'a1-only'), 'image');
  assert.deepEqual(await listed(a2.key), ['-/base', `${a.id}/team-env`, '-/tools']);
  assert.ok(!(await listed(a.key)).includes(`${a1.id}/a1-only`));
  assert.ok((await listed(a.key, `?projectId=${a1.id}`)).includes(`${a1.id}/a1-only`));
  // Names the child already sees (an ancestor's, the platform's) would shadow its snapshot.
  for (const name of ['team-env', 'tools', 'base:latest']) {
    const r = await snapshot(a1.key, await sandbox(a1.key), name);
    assert.deepEqual([r.status, r.body.error?.code], [409, 'conflict'], name);
  }
  // A parent cannot delete through its child's name, nor a child its parent's layer.
  absent(await call(a1.key, 'DELETE', '/v1/images/team-env'), 'ref');
  absent(await call(a.key, 'DELETE', '/v1/images/tools'), 'ref');
  assert.equal((await call(a.key, 'DELETE', `/v1/images/a1-only?projectId=${a1.id}`)).status, 204);
});

test('images: the imageBytes quota refuses a snapshot past it, children within parents; delete frees', async (t) => {
  const { api, edge, call, project, sandbox, snapshot } = await owned(t);
  const parent = await project('q', undefined, { imageBytes: 1000 });
  const over = await call(api.rootKey, 'POST', '/v1/projects', {
    name: 'q2',
    parentId: parent.id,
    quota: { imageBytes: 1001 },
  });
  assert.deepEqual([over.status, over.body.error?.field], [403, 'quota.imageBytes']);
  const child = await project('qc', parent.id);
  const id = await sandbox(child.key);
  edge.snapshotBytes = 2000;
  const big = await snapshot(child.key, id, 'big');
  assert.deepEqual([big.status, big.body.error?.code], [429, 'quota_exceeded']);
  assert.equal(big.body.error?.details?.resource, 'imageBytes');
  assert.equal((await api.iam.usage(parent.id)).imageBytes, 0, 'the reservation went back');
  edge.snapshotBytes = 400;
  assert.equal((await snapshot(child.key, id, 'small')).status, 201);
  assert.equal((await api.iam.usage(parent.id)).imageBytes, 400);
  // A fork is a snapshot too: 700 more do not fit the 600 left.
  edge.snapshotBytes = 700;
  const fork = await call(child.key, 'POST', `/v1/sandboxes/${id}/fork`, { count: 1 });
  assert.deepEqual([fork.status, fork.body.error?.code], [429, 'quota_exceeded']);
  edge.snapshotBytes = 600;
  assert.equal(
    (await call(child.key, 'POST', `/v1/sandboxes/${id}/fork`, { count: 1 })).status,
    201,
  );
  assert.equal((await api.iam.usage(parent.id)).imageBytes, 1000);
  edge.snapshotBytes = 1;
  assert.equal((await snapshot(child.key, id, 'full')).status, 429);
  assert.equal((await call(child.key, 'DELETE', '/v1/images/small')).status, 204);
  assert.equal((await api.iam.usage(parent.id)).imageBytes, 600);
  assert.equal((await snapshot(child.key, id, 'fits-again')).status, 201);
});

test('images: no caller can hand the edge a view or a byte limit of its choosing', async (t) => {
  const { edge, call, project, create, sandbox } = await owned(t);
  const a = await project('a');
  const b = await project('b');
  const id = await sandbox(b.key);
  // The internal fields are not part of any public body: strict schemas refuse them.
  const smuggled = await create(b.key, 'base', { layerView: [a.id] });
  assert.deepEqual([smuggled.status, smuggled.body.error?.field], [400, 'layerView']);
  for (const extra of [{ layerView: [a.id] }, { maxBytes: 1e12 }]) {
    const r = await call(b.key, 'POST', `/v1/sandboxes/${id}/snapshot`, { name: 'x', ...extra });
    assert.deepEqual(
      [r.status, r.body.error?.code],
      [400, 'invalid_argument'],
      JSON.stringify(extra),
    );
  }
  // Query and path tricks: a project ID that is no project, a ref that is no layer name.
  for (const q of ['?projectId=..', `?projectId=${a.id}%2F..`, '?projectId=*']) {
    const r = await call(b.key, 'GET', `/v1/images${q}`);
    assert.ok(r.status === 404 || r.status === 400, `${q}: ${r.status}`);
  }
  for (const ref of ['..%2F..%2Fetc%2Fpasswd', `${a.id}%2Fa-secret`, 'A-SECRET']) {
    const r = await call(b.key, 'DELETE', `/v1/images/${ref}`);
    assert.deepEqual([r.status, r.body.error?.field], [400, 'ref'], ref);
  }
  assert.deepEqual(edge.creates.at(-1)?.layerView?.at(-1), b.id, 'B’s own view, always');
});

test('images: deleting needs sandboxes:snapshot on a scoped key', async (t) => {
  const { call, project, sandbox, snapshot } = await owned(t);
  const a = await project('a');
  assert.equal((await snapshot(a.key, await sandbox(a.key), 'mine')).status, 201);
  const rt = (
    await call(a.key, 'POST', '/v1/keys', { projectId: a.id, scopes: ['images:run:mine'] })
  ).body.key as string;
  const denied = await call(rt, 'DELETE', '/v1/images/mine');
  assert.deepEqual([denied.status, denied.body.error?.code], [403, 'permission_denied']);
  const bad = await call(a.key, 'DELETE', '/v1/images/Bad%20Name');
  assert.deepEqual([bad.status, bad.body.error?.field], [400, 'ref']);
});
