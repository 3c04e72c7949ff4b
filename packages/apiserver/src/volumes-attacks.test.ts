/*
 * Adversarial tests of the control plane's volume bookkeeping (docs/volumes.md):
 * a tenant must never end up with bytes on an edge that no IAM record (and so
 * no `volumeBytes` quota) accounts for. The edge here behaves like a served
 * one (`RemoteEdge` over HTTP): its create runs to the end whatever the
 * caller does, while the caller's promise rejects as soon as its signal
 * aborts (the HTTP request was dropped) — the edge is never told.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DsecError, type EdgeApi, type EdgeVolumeApi, type EdgeVolumeInfo } from '@dsec/core';
import { createTestApi } from './testing/harness.js';
import { VolumeService } from './volume-service.js';
import { FakeEdge } from './testing/fake-edge.js';

const MiB = 2 ** 20;

/** An edge whose volume creates wait for `release()`, as a slow mkfs would. */
function slowEdge(edgeId: string) {
  const volumes = new Map<string, EdgeVolumeInfo>();
  const key = (p: string, n: string) => `${p}\n${n}`;
  let release!: () => void;
  let gate = new Promise<void>((r) => (release = r));
  const started: Promise<void>[] = [];
  let startedOne!: () => void;
  const firstStart = new Promise<void>((r) => (startedOne = r));
  const api: EdgeVolumeApi = {
    create(req, signal) {
      if (volumes.has(key(req.projectId, req.name)))
        return Promise.reject(new DsecError('conflict', `volume ${req.name} exists`));
      // The edge's own work: finishes regardless of the caller.
      const work = gate.then(() => {
        const v: EdgeVolumeInfo = {
          ...req,
          createdAt: new Date().toISOString(),
          usedBytes: 0,
          mountedBy: [],
        };
        volumes.set(key(req.projectId, req.name), v);
        return v;
      });
      started.push(work.then(() => undefined));
      startedOne();
      // The caller's view: a dropped request rejects at once.
      return new Promise<EdgeVolumeInfo>((resolve, reject) => {
        const onAbort = () => reject(new DsecError('unavailable', 'request aborted'));
        if (signal?.aborted) return onAbort();
        signal?.addEventListener('abort', onAbort, { once: true });
        work.then(resolve, reject);
      });
    },
    get: async (p, n) => {
      const v = volumes.get(key(p, n));
      if (!v) throw new DsecError('volume_not_found', `no volume ${n}`);
      return v;
    },
    list: async (p) => [...volumes.values()].filter((v) => p === undefined || v.projectId === p),
    delete: async (p, n) => {
      if (!volumes.delete(key(p, n))) throw new DsecError('volume_not_found', `no volume ${n}`);
    },
  };
  const edge = { edgeId, volumes: api } as unknown as EdgeApi;
  return {
    edge,
    volumes,
    firstStart,
    /** Lets every pending create finish and waits for the edge's work. */
    finish: async () => {
      release();
      await Promise.all(started);
      gate = Promise.resolve();
    },
  };
}

async function setup(t: { after: (fn: () => Promise<void>) => void }) {
  const api = await createTestApi();
  t.after(() => api.close());
  const slow = slowEdge('edge-slow');
  const service = new VolumeService({
    iam: api.iam,
    edges: new Map([['edge-slow', slow.edge]]),
    watcher: { view: () => ({ edges: [{ edgeId: 'edge-slow', healthy: true }] }) },
  });
  const root = await api.iam.authenticate(api.rootKey);
  const project = await api.iam.createProject(root, {
    name: 'tenant',
    quota: { volumeBytes: 64 * MiB },
  });
  const made = await api.app.inject({
    method: 'POST',
    url: '/v1/keys',
    headers: { authorization: `Bearer ${api.rootKey}` },
    payload: { projectId: project.id, role: 'member' },
  });
  assert.equal(made.statusCode, 201, made.body);
  const principal = await api.iam.authenticate(made.json<{ key: string }>().key);
  /** Every edge volume has its IAM record: nothing escapes the quota. */
  const assertAccounted = async () => {
    const records = (await api.iam.listVolumes(project.id)).map((r) => r.name).sort();
    const onEdge = [...slow.volumes.values()].map((v) => v.name).sort();
    assert.deepEqual(onEdge, records, 'edge volumes without an IAM record escape the quota');
  };
  return { api, slow, service, project, principal, assertAccounted };
}

test('volumes attack: a DELETE racing its create leaves no edge volume outside the quota', async (t) => {
  const { api, slow, service, project, principal, assertAccounted } = await setup(t);
  const creating = service.create(principal, { name: 'data', sizeMb: 64 });
  creating.catch(() => undefined);
  await slow.firstStart;
  // The record exists ('creating'); the edge has not made the volume yet.
  await service.delete(principal, 'data', undefined).catch(() => undefined);
  await slow.finish();
  await creating.catch(() => undefined);
  await assertAccounted();
  // And the quota still bounds the project: a second 64 MiB is only possible if the first is gone.
  const usage = await api.iam.usage(project.id);
  assert.equal(usage.volumeBytes, slow.volumes.size * 64 * MiB);
});

test('volumes attack: a caller that hangs up mid-create leaves no edge volume outside the quota', async (t) => {
  const { slow, service, principal, assertAccounted } = await setup(t);
  for (const name of ['one', 'two', 'three']) {
    const ac = new AbortController();
    const creating = service.create(principal, { name, sizeMb: 64 }, ac.signal);
    creating.catch(() => undefined);
    await new Promise((r) => setImmediate(r));
    ac.abort();
    await slow.finish();
    await creating.catch(() => undefined);
    await assertAccounted();
  }
  // 64 MiB of quota: at most one volume exists, whatever the hang-ups did.
  assert.ok(slow.volumes.size <= 1, `${slow.volumes.size} volumes in a 64 MiB quota`);
});

test('volumes attack: a runtime key (images:run only) neither reads, writes, mounts nor deletes volumes', async (t) => {
  const api = await createTestApi({ edges: [new FakeEdge({ edgeId: 'edge-a' })] });
  t.after(() => api.close());
  const call = async (key: string, method: string, url: string, body?: unknown) => {
    const res = await api.app.inject({
      method: method as 'GET',
      url,
      headers: { authorization: `Bearer ${key}` },
      ...(body === undefined ? {} : { payload: body as object }),
    });
    return {
      status: res.statusCode,
      body: res.body ? res.json<{ error?: { code: string }; [k: string]: unknown }>() : {},
    };
  };
  const key = async (scopes?: string[]) => {
    const k = await call(api.rootKey, 'POST', '/v1/keys', {
      projectId: api.rootProjectId,
      role: 'member',
      ...(scopes ? { scopes } : {}),
    });
    assert.equal(k.status, 201, JSON.stringify(k.body));
    return k.body.key as string;
  };
  // The builder (unscoped) keeps the hidden tests in a volume.
  const builder = await key();
  assert.equal(
    (await call(builder, 'POST', '/v1/volumes', { name: 'answers', sizeMb: 16 })).status,
    201,
  );
  // The agent's key may run task images and nothing else.
  const agent = await key(['images:run:base*']);
  const denied = async (method: string, url: string, body?: unknown) => {
    const r = await call(agent, method, url, body);
    assert.equal(r.status, 403, `${method} ${url}: ${JSON.stringify(r.body)}`);
    assert.equal(r.body.error?.code, 'permission_denied');
  };
  await denied('GET', '/v1/volumes');
  await denied('GET', '/v1/volumes/answers');
  await denied('POST', '/v1/volumes', { name: 'stash', sizeMb: 16 });
  await denied('DELETE', '/v1/volumes/answers');
  await denied('POST', '/v1/sandboxes', {
    image: 'base',
    volumes: [{ name: 'answers', path: '/answers' }],
  });
  // The volume is untouched, and the agent still runs its images without volumes.
  assert.equal((await call(builder, 'GET', '/v1/volumes/answers')).status, 200);
  assert.equal((await call(agent, 'POST', '/v1/sandboxes', { image: 'base' })).status, 201);
  // A scoped key given volumes:use has them.
  const withVolumes = await key(['images:run:base*', 'volumes:use']);
  assert.equal((await call(withVolumes, 'GET', '/v1/volumes/answers')).status, 200);
  const mounted = await call(withVolumes, 'POST', '/v1/sandboxes', {
    image: 'base',
    volumes: [{ name: 'answers', path: '/answers' }],
  });
  assert.equal(mounted.status, 201, JSON.stringify(mounted.body));
});

test('volumes attack: create, DELETE, create again on another edge: the first edge keeps no volume outside the quota', async (t) => {
  const api = await createTestApi();
  t.after(() => api.close());
  const slow = slowEdge('edge-slow');
  const fast = slowEdge('edge-fast');
  await fast.finish(); // its creates finish at once
  const picks = [0, 0.99]; // edge-slow first, then edge-fast
  const service = new VolumeService({
    iam: api.iam,
    edges: new Map([
      ['edge-slow', slow.edge],
      ['edge-fast', fast.edge],
    ]),
    watcher: {
      view: () => ({
        edges: [
          { edgeId: 'edge-slow', healthy: true },
          { edgeId: 'edge-fast', healthy: true },
        ],
      }),
    },
    random: () => picks.shift() ?? 0,
  });
  const principal = await api.iam.authenticate(api.rootKey);
  const first = service.create(principal, { name: 'data', sizeMb: 16 });
  first.catch(() => undefined);
  await slow.firstStart;
  await service.delete(principal, 'data', undefined).catch(() => undefined);
  await service.create(principal, { name: 'data', sizeMb: 16 });
  await slow.finish();
  await first.catch(() => undefined);
  const records = await api.iam.listVolumes(principal.projectId);
  const onEdges = [
    ...[...slow.volumes.values()].map((v) => `edge-slow:${v.name}`),
    ...[...fast.volumes.values()].map((v) => `edge-fast:${v.name}`),
  ];
  assert.deepEqual(
    onEdges.sort(),
    records.map((r) => `${r.edgeId}:${r.name}`).sort(),
    'every edge volume is the one its record names',
  );
});
