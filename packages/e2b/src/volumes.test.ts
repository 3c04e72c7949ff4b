import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ApiMetrics, SandboxService, VolumeService } from '@dsec/apiserver';
import { createTestApi, FakeEdge } from '@dsec/apiserver/testing';
import { PowerOfKPlacer } from '@dsec/placement';
import { registerE2bRoutes } from './register.js';
import { E2B_VOLUME_SIZE_MB } from './volumes.js';

// E2B's volume routes and `volumeMounts` on DSec's volumes (docs/volumes.md), through inject().
async function setup(t: { after: (fn: () => Promise<void>) => void }) {
  const api = await createTestApi({ edges: [new FakeEdge({ edgeId: 'edge-a' })] });
  t.after(() => api.close());
  const volumes = new VolumeService({ iam: api.iam, edges: api.edges, watcher: api.watcher });
  const service = new SandboxService({
    iam: api.iam,
    edges: api.edges,
    watcher: api.watcher,
    placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
    ids: api.ids,
    metrics: new ApiMetrics(),
    volumes,
  });
  registerE2bRoutes(api.app, { service, iam: api.iam, templates: { base: 'busybox' }, volumes });
  const call = async (method: string, url: string, body?: unknown, key = api.rootKey) => {
    const res = await api.app.inject({
      method: method as 'GET',
      url,
      headers: {
        'x-api-key': key,
        ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
      },
      ...(body !== undefined ? { payload: JSON.stringify(body) } : {}),
    });
    return {
      status: res.statusCode,
      json: res.body ? (JSON.parse(res.body) as Record<string, unknown> & unknown[]) : undefined,
    };
  };
  return { api, call };
}

test('E2B volumes: create, list, get, mount with volumeMounts, refuse deletion while mounted', async (t) => {
  const { api, call } = await setup(t);
  const made = await call('POST', '/volumes', { name: 'data' });
  assert.equal(made.status, 201, JSON.stringify(made.json));
  assert.deepEqual(made.json, { volumeID: 'data', name: 'data', token: api.rootKey });
  assert.equal(
    (await api.iam.getVolume(api.rootProjectId, 'data'))?.sizeBytes,
    E2B_VOLUME_SIZE_MB * 2 ** 20,
  );
  assert.deepEqual((await call('GET', '/volumes')).json, [{ volumeID: 'data', name: 'data' }]);
  assert.equal((await call('GET', '/volumes/data')).json?.name, 'data');
  const again = await call('POST', '/volumes', { name: 'data' });
  assert.equal(again.status, 409);
  assert.equal(again.json?.code, 409, 'E2B’s error shape');

  const sb = await call('POST', '/sandboxes', {
    templateID: 'base',
    volumeMounts: [{ name: 'data', path: '/home/user/data' }],
  });
  assert.equal(sb.status, 201, JSON.stringify(sb.json));
  const id = sb.json?.sandboxID as string;
  const listed = (await call('GET', '/v2/sandboxes')).json as unknown as {
    volumeMounts: unknown;
  }[];
  assert.deepEqual(listed[0]?.volumeMounts, [{ name: 'data', path: '/home/user/data' }]);
  const busy = await call('DELETE', '/volumes/data');
  assert.equal(busy.status, 409);
  assert.match(String(busy.json?.message), /mounted/);
  assert.equal((await call('DELETE', `/sandboxes/${id}`)).status, 204);
  assert.equal((await call('DELETE', '/volumes/data')).status, 204);
  assert.equal((await call('GET', '/volumes/data')).status, 404);
});

test('E2B volumes: bad names and mounts are refused by their E2B field; other projects see nothing', async (t) => {
  const { api, call } = await setup(t);
  for (const name of ['a/b', '..', 'x'.repeat(64), ''])
    assert.equal((await call('POST', '/volumes', { name })).status, 400, name);
  assert.equal((await call('POST', '/volumes', { name: 'ok', sizeMb: 9 })).status, 400);
  assert.equal((await call('POST', '/volumes', { name: 'ok' })).status, 201);
  const missing = await call('POST', '/sandboxes', {
    templateID: 'base',
    volumeMounts: [{ name: 'nope', path: '/data' }],
  });
  assert.equal(missing.status, 404);
  const proc = await call('POST', '/sandboxes', {
    templateID: 'base',
    volumeMounts: [{ name: 'ok', path: '/proc/x' }],
  });
  assert.equal(proc.status, 400);
  assert.match(String(proc.json?.message), /volumeMounts\.0\.path/);
  assert.equal(
    (await call('POST', '/sandboxes', { templateID: 'base', volumeMounts: ['x'] })).status,
    400,
  );
  // Another project's key: the volume does not exist for it.
  const native = async (url: string, payload: object) =>
    (
      await api.app.inject({
        method: 'POST',
        url,
        headers: { authorization: `Bearer ${api.rootKey}` },
        payload,
      })
    ).json<{ id: string; key: string }>();
  const other = await native('/v1/projects', { name: 'other' });
  const key = await native('/v1/keys', { projectId: other.id, role: 'member' });
  assert.deepEqual((await call('GET', '/volumes', undefined, key.key)).json, []);
  assert.equal((await call('GET', '/volumes/ok', undefined, key.key)).status, 404);
  assert.equal((await call('DELETE', '/volumes/ok', undefined, key.key)).status, 404);
  const theirs = await call(
    'POST',
    '/sandboxes',
    { templateID: 'base', volumeMounts: [{ name: 'ok', path: '/data' }] },
    key.key,
  );
  assert.equal(theirs.status, 404);
});
