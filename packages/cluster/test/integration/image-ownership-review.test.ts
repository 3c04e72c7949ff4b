import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { createTestApi, type TestApi } from '@dsec/apiserver/testing';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import type { LayerInfo } from '@dsec/core';
import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';
import { listImages, makeBusyboxRootfs } from '@dsec/images';

/*
 * SECURITY (issue 24, point 2; SECURITY.md I37): a review of the image
 * ownership change, as tenant B attacking the store, the imageBytes quota
 * and other tenants' answers through the real HTTP API of a real node.
 */

let dir: string;
let node: SingleNode;
let cgroupParent: string;
const keys: Record<string, string> = {};
const projects: Record<string, string> = {};

interface Answer {
  status: number;
  body: Record<string, unknown> & {
    error?: { code: string; message: string; field?: string; details?: Record<string, unknown> };
  };
}

async function callAt(
  url: string,
  key: string,
  method: string,
  path: string,
  body?: unknown,
  signal?: AbortSignal,
): Promise<Answer> {
  const res = await fetch(url + path, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
    },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
    ...(signal ? { signal } : {}),
  });
  const text = await res.text();
  return { status: res.status, body: text ? (JSON.parse(text) as Answer['body']) : {} };
}

const call = (key: string, method: string, path: string, body?: unknown) =>
  callAt(node.url, key, method, path, body);

function ok(a: Answer, status = 200): Answer['body'] {
  assert.equal(a.status, status, JSON.stringify(a.body));
  return a.body;
}

async function sandbox(key: string, more: Record<string, unknown> = {}, url = node.url) {
  const body = { image: 'busybox', memoryLimitMb: 64, ttlSeconds: 600, ...more };
  return ok(await callAt(url, key, 'POST', '/v1/sandboxes', body), 201).id as string;
}

async function sh(key: string, id: string, line: string, url = node.url): Promise<string> {
  const r = ok(await callAt(url, key, 'POST', `/v1/sandboxes/${id}/commands`, { shell: line }));
  assert.equal(r.exitCode, 0, JSON.stringify(r));
  return r.stdout as string;
}

/** Blobs in the node's store that no layer record uses: bytes nobody is charged for. */
async function orphanBlobs(): Promise<string[]> {
  const used = new Set(
    (await node.store.listLayers()).flatMap((l) =>
      [l.digest, l.blobDigest, l.blobChunksDigest].filter((d) => d !== undefined),
    ),
  );
  const files = await readdir(join(dir, 'state', 'images', 'blobs', 'sha256'));
  return files.filter((f) => !used.has(`sha256:${f}`));
}

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-owner-rev-'));
  await chmod(dir, 0o711);
  cgroupParent = `dsec-ownrev-${basename(dir).slice(-6)}`;
  node = await startSingleNode({ stateDir: join(dir, 'state'), port: 0, cgroupParent });
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
  for (const name of ['a', 'b']) {
    const p = ok(await call(node.adminKey, 'POST', '/v1/projects', { name }), 201);
    projects[name] = p.id as string;
    const k = ok(
      await call(node.adminKey, 'POST', '/v1/keys', { projectId: p.id, role: 'admin' }),
      201,
    );
    keys[name] = k.key as string;
  }
});

after(async () => {
  await node?.close({ stopSandboxes: true });
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
});

test('two snapshots racing for one name leave no blob behind that no layer (and no quota) holds', async () => {
  // B snapshots two sandboxes under one name at once. Both pass the edge's name check before
  // either is stored; the loser's putLayer is a conflict after its blob is already in the
  // store. That blob belonged to no record and was charged to no quota: repeated, B filled
  // the shared store past any imageBytes limit.
  const b = keys.b!;
  const ids = [await sandbox(b), await sandbox(b)];
  for (const [i, id] of ids.entries())
    await sh(b, id, `dd if=/dev/urandom of=/blob${i} bs=1M count=12 2>/dev/null`);
  assert.deepEqual(await orphanBlobs(), [], 'no orphan before');
  const answers = await Promise.all(
    ids.map((id) => call(b, 'POST', `/v1/sandboxes/${id}/snapshot`, { name: 'twin' })),
  );
  const statuses = answers.map((a) => a.status).sort();
  assert.deepEqual(statuses, [201, 409], JSON.stringify(answers.map((a) => a.body)));
  assert.deepEqual(await orphanBlobs(), [], 'the loser’s blob is gone with its refusal');
  const winner = answers.find((a) => a.status === 201)!.body.layer as LayerInfo;
  assert.equal((await node.iam.usage(projects.b!)).imageBytes, winner.sizeBytes);
  for (const id of ids) await call(b, 'DELETE', `/v1/sandboxes/${id}`);
  assert.equal((await call(b, 'DELETE', '/v1/images/twin')).status, 204);
  assert.deepEqual(await orphanBlobs(), []);
});

test('a client that hangs up on a snapshot through a remote edge still gets the layer charged', async () => {
  // Multi-node: the apiserver reaches the edge over HTTP (RemoteEdge → serveEdge). When the
  // client hung up, the apiserver's call to the edge rejected at once and the reservation was
  // released, while the edge, past its last abort check (storing the record), went on and
  // stored the layer: a layer of any size that no quota held. Here the node's own edge is
  // served to a second apiserver, and the store holds the record back until the client is gone.
  const secret = newEdgeSecret();
  const served = await serveEdge({ edge: node.edge, secret });
  const remote = new RemoteEdge({ edgeId: node.edge.edgeId, url: served.url, secret });
  let api: TestApi | undefined;
  const putLayer = node.store.putLayer.bind(node.store);
  try {
    api = await createTestApi({
      edges: [remote as never],
      imagesList: (o) => listImages(node.store, o),
      imagesRemove: (ref, project) => node.store.removeLayer(ref, { project }),
    });
    const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
    const p = ok(
      await callAt(url, api.rootKey, 'POST', '/v1/projects', {
        name: 'remote',
        quota: { imageBytes: 256 * 1024 * 1024 },
      }),
      201,
    );
    const key = ok(await callAt(url, api.rootKey, 'POST', '/v1/keys', { projectId: p.id }), 201)
      .key as string;
    const id = await sandbox(key, { diskLimitMb: 32 }, url);
    await sh(key, id, 'dd if=/dev/urandom of=/data bs=1M count=4 2>/dev/null', url);

    let entered!: () => void;
    const inPut = new Promise<void>((r) => (entered = r));
    let open!: () => void;
    const gate = new Promise<void>((r) => (open = r));
    let stored!: () => void;
    const done = new Promise<void>((r) => (stored = r));
    node.store.putLayer = async (layer: LayerInfo) => {
      if (layer.name !== 'hangup') return putLayer(layer);
      entered();
      await gate;
      await putLayer(layer);
      stored();
    };
    const ac = new AbortController();
    const answer = callAt(
      url,
      key,
      'POST',
      `/v1/sandboxes/${id}/snapshot`,
      { name: 'hangup' },
      ac.signal,
    );
    await inPut;
    ac.abort();
    await assert.rejects(answer);
    // Let the apiserver see the hang-up before the edge finishes.
    await new Promise((r) => setTimeout(r, 300));
    open();
    await done;
    const layer = await node.store.getLayer('hangup', { project: p.id as string });
    // The edge's answer reaches the apiserver; give it the time to charge.
    const deadline = Date.now() + 20_000;
    let used = 0;
    while (Date.now() < deadline) {
      used = (await api.iam.usage(p.id as string)).imageBytes;
      if (used === layer.sizeBytes) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(used, layer.sizeBytes, 'the stored layer is charged to its project');
    await callAt(url, key, 'DELETE', `/v1/sandboxes/${id}`);
    assert.equal((await callAt(url, key, 'DELETE', '/v1/images/hangup')).status, 204);
    assert.equal((await api.iam.usage(p.id as string)).imageBytes, 0);
  } finally {
    node.store.putLayer = putLayer;
    await api?.close();
    remote.close();
    await served.close();
  }
});

/** Holds the store's putLayer of `name` until `open()`; `entered` resolves when it is reached. */
function holdPut(name: string) {
  const putLayer = node.store.putLayer.bind(node.store);
  let entered!: () => void;
  const reached = new Promise<void>((r) => (entered = r));
  let open!: () => void;
  const gate = new Promise<void>((r) => (open = r));
  node.store.putLayer = async (layer: LayerInfo) => {
    if (layer.name === name) {
      entered();
      await gate;
    }
    return putLayer(layer);
  };
  return { reached, open, restore: () => (node.store.putLayer = putLayer) };
}

test("a sibling's snapshot without a disk limit does not starve the others of a shared imageBytes quota", async () => {
  // A snapshot of a sandbox without a disk limit reserved all the room left in every limiting
  // ancestor while it was taken. Under a shared limit (a team's, or the operator's on the root
  // project for the whole store) one tenant snapshotting such a sandbox in a loop made every
  // other tenant's snapshot `quota_exceeded`, holding nothing itself.
  const admin = node.adminKey;
  const team = ok(
    await call(admin, 'POST', '/v1/projects', {
      name: 'shared',
      quota: { imageBytes: 64 * 1024 * 1024 },
    }),
    201,
  );
  const tenant = async (name: string) => {
    const p = ok(await call(admin, 'POST', '/v1/projects', { name, parentId: team.id }), 201);
    return ok(await call(admin, 'POST', '/v1/keys', { projectId: p.id }), 201).key as string;
  };
  const [ka, kb] = [await tenant('shared-a'), await tenant('shared-b')];
  const hog = await sandbox(kb); // no disk limit
  await sh(kb, hog, 'echo b > /b');
  const held = holdPut('hog');
  try {
    const hogging = call(kb, 'POST', `/v1/sandboxes/${hog}/snapshot`, { name: 'hog' });
    await held.reached;
    const small = await sandbox(ka, { diskLimitMb: 16 });
    await sh(ka, small, 'echo a > /a');
    const mine = await call(ka, 'POST', `/v1/sandboxes/${small}/snapshot`, { name: 'mine' });
    assert.equal(mine.status, 201, JSON.stringify(mine.body));
    held.open();
    assert.equal((await hogging).status, 201);
    const sizes = await Promise.all(
      [ka, kb].map(async (k) =>
        (ok(await call(k, 'GET', '/v1/images')).layers as LayerInfo[])
          .filter((l) => l.name === 'mine' || l.name === 'hog')
          .reduce((n, l) => n + l.sizeBytes, 0),
      ),
    );
    assert.equal(
      (await node.iam.usage(team.id as string)).imageBytes,
      sizes[0]! + sizes[1]!,
      'both layers are charged, nothing more',
    );
    for (const [k, id, image] of [
      [ka, small, 'mine'],
      [kb, hog, 'hog'],
    ] as const) {
      await call(k, 'DELETE', `/v1/sandboxes/${id}`);
      assert.equal((await call(k, 'DELETE', `/v1/images/${image}`)).status, 204);
    }
    assert.equal((await node.iam.usage(team.id as string)).imageBytes, 0);
  } finally {
    held.open();
    held.restore();
  }
});

test('a snapshot without a disk limit is still held to the room left when it is charged', async () => {
  // What the fix above must keep: a layer past the room left is refused and nothing stays.
  const admin = node.adminKey;
  const p = ok(
    await call(admin, 'POST', '/v1/projects', {
      name: 'tight',
      quota: { imageBytes: 2 * 1024 * 1024 },
    }),
    201,
  );
  const key = ok(await call(admin, 'POST', '/v1/keys', { projectId: p.id }), 201).key as string;
  const id = await sandbox(key);
  await sh(key, id, 'dd if=/dev/urandom of=/big bs=1M count=3 2>/dev/null');
  const refused = await call(key, 'POST', `/v1/sandboxes/${id}/snapshot`, { name: 'big' });
  assert.equal(refused.status, 429, JSON.stringify(refused.body));
  assert.equal(refused.body.error?.details?.resource, 'imageBytes');
  assert.equal((await node.iam.usage(p.id as string)).imageBytes, 0);
  assert.ok(!(await node.store.listLayers()).some((l) => l.name === 'big'));
  assert.deepEqual(await orphanBlobs(), []);
  await call(key, 'DELETE', `/v1/sandboxes/${id}`);
});

test('project trees are bounded in depth, and the deepest project a tenant can make runs sandboxes', async () => {
  // A create sends the project's whole lineage as its layer view, and an edge takes at most 64
  // (each one a store read for a name nobody has; a GET each on S3). Projects had no depth
  // limit: past 63 levels every create in the project was `invalid_argument: layerView`, and
  // a tenant's chain of thousands made every resolution, quota walk and cached lineage of its
  // projects cost that much.
  const admin = node.adminKey;
  const top = ok(await call(admin, 'POST', '/v1/projects', { name: 'deep-0' }), 201);
  const topKey = ok(
    await call(admin, 'POST', '/v1/keys', { projectId: top.id, role: 'admin' }),
    201,
  ).key as string;
  const src = await sandbox(topKey);
  await sh(topKey, src, 'echo top > /who');
  ok(await call(topKey, 'POST', `/v1/sandboxes/${src}/snapshot`, { name: 'top-env' }), 201);
  await call(topKey, 'DELETE', `/v1/sandboxes/${src}`);
  // The tenant nests as deep as it is let.
  let deepest = top.id as string;
  let refused: Answer | undefined;
  for (let i = 1; i <= 70 && !refused; i++) {
    const a = await call(topKey, 'POST', '/v1/projects', { name: `deep-${i}`, parentId: deepest });
    if (a.status === 201) deepest = a.body.id as string;
    else refused = a;
  }
  assert.ok(refused, 'a chain of 70 levels is refused before its end');
  assert.equal(refused.status, 400, JSON.stringify(refused.body));
  assert.equal(refused.body.error?.code, 'invalid_argument');
  assert.equal(refused.body.error?.field, 'parentId');
  const lineage = await node.iam.lineage(deepest);
  assert.ok(lineage.length <= 64, `lineage of ${lineage.length}`);
  // The deepest project runs the platform's image and its top ancestor's snapshot.
  const id = await sandbox(topKey, { projectId: deepest, image: 'top-env' });
  assert.equal((await sh(topKey, id, 'cat /who')).trim(), 'top');
  await call(topKey, 'DELETE', `/v1/sandboxes/${id}`);
  assert.equal((await call(topKey, 'DELETE', '/v1/images/top-env')).status, 204);
});

test("a tenant's listing and deletes read only the namespaces it sees, not every tenant's", async () => {
  // GET /v1/images read every record of every owner and filtered after: tenant C's thousands of
  // tiny snapshots made every other tenant's listing (and every DELETE, even of a name it does
  // not have) cost that many reads (1–4.5 s for 3,000 records here), and one unreadable record
  // in C's namespace made every tenant's answer 500. Here C's namespace holds a record that
  // cannot be read: A's answers must not touch it.
  const { a } = keys as { a: string };
  const c = ok(await call(node.adminKey, 'POST', '/v1/projects', { name: 'c-noisy' }), 201);
  const bad = join(dir, 'state', 'images', 'projects', c.id as string, 'layers', 'junk');
  await mkdir(bad, { recursive: true });
  await writeFile(join(bad, 'latest.json'), '{"not": "a layer"}');
  try {
    const listed = await call(a, 'GET', '/v1/images');
    assert.equal(listed.status, 200, JSON.stringify(listed.body));
    assert.ok((listed.body.layers as LayerInfo[]).some((l) => l.name === 'busybox'));
    const gone = await call(a, 'DELETE', '/v1/images/nothing-here');
    assert.equal(gone.status, 404, JSON.stringify(gone.body));
    assert.equal(gone.body.error?.code, 'image_not_found');
  } finally {
    await rm(join(dir, 'state', 'images', 'projects', c.id as string), { recursive: true });
  }
});

test("a burst edge is chosen for a layer only when the caller's view holds it there", async () => {
  // A burst edge reports its store's layers (EdgeStatus.layers) and placement sends work there
  // only if every layer it needs is listed. The list was by name across owners: with the
  // on-premise pool full, A naming B's snapshot was placed on the burst edge and answered
  // image_not_found, a name nobody has capacity_exhausted (A learnt that someone holds the
  // name); and with separate stores, B's snapshot under A's name drew A's creates to an edge
  // that does not have A's layer. Here: a full on-premise fake edge and a real burst edge.
  const { FakeEdge } = await import('@dsec/apiserver/testing');
  const { openContainerEdge } = await import('@dsec/edge');
  const stateDir = join(dir, 'burst-edge');
  const burst = await openContainerEdge({
    edgeId: 'burst-1',
    stateDir,
    store: node.store,
    cgroupParent: `${cgroupParent}-burst`,
    labels: { pool: 'burst' },
  });
  const onPrem = new FakeEdge({
    edgeId: 'op-1',
    capacity: { memoryMb: 4096, cpuCores: 8, sandboxes: 1 },
  });
  let api: TestApi | undefined;
  try {
    api = await createTestApi({ edges: [onPrem, burst as never] });
    const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
    const tenant = async (name: string) => {
      const p = ok(await callAt(url, api!.rootKey, 'POST', '/v1/projects', { name }), 201);
      return ok(await callAt(url, api!.rootKey, 'POST', '/v1/keys', { projectId: p.id }), 201)
        .key as string;
    };
    const [ka, kb] = [await tenant('burst-a'), await tenant('burst-b')];
    // A fills the on-premise pool; B's next sandbox bursts (busybox is the platform's).
    await sandbox(ka, {}, url);
    await api.watcher.refresh();
    const bid = await sandbox(kb, {}, url);
    await sh(kb, bid, 'echo B > /who', url);
    ok(await callAt(url, kb, 'POST', `/v1/sandboxes/${bid}/snapshot`, { name: 'b-secret' }), 201);
    await api.watcher.refresh();
    const tryCreate = (key: string, image: string) =>
      callAt(url, key, 'POST', '/v1/sandboxes', { image, memoryLimitMb: 64, ttlSeconds: 600 });
    const theirs = await tryCreate(ka, 'b-secret');
    const nobody = await tryCreate(ka, 'nobody-has-this');
    assert.deepEqual(
      [theirs.status, theirs.body.error?.code],
      [nobody.status, nobody.body.error?.code],
      `B's name answers A as a name nobody has: ${JSON.stringify([theirs.body, nobody.body])}`,
    );
    // B's own snapshot still bursts.
    const again = ok(await tryCreate(kb, 'b-secret'), 201);
    assert.equal((await sh(kb, again.id as string, 'cat /who', url)).trim(), 'B');
  } finally {
    await api?.close();
    for (const sb of await burst.listSandboxes({}))
      await burst.stopSandbox(sb.id).catch(() => undefined);
    await burst.close();
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}-burst`).catch(() => undefined);
  }
});
