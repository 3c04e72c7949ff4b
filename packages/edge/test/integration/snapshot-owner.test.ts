import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { isDsecError, randomId, type SandboxSpec } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { buildLayer, type DirImageStore } from '@dsec/images';
import { makeStateDir, spec } from './fixture.js';

/*
 * SECURITY (issue 24, point 2; SECURITY.md I37) on the real edge: a snapshot
 * is its sandbox's project's, a create stacks only the layers of its layer
 * view (the platform's first, then its projects root first), and a snapshot
 * bigger than its image-quota reservation is never stored. The apiserver's
 * side (views, quota): cluster/test/integration/image-ownership.test.ts.
 */

async function withEdge(fn: (edge: Edge, store: DirImageStore, dir: string) => Promise<void>) {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  const edge = await openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
  });
  try {
    await fn(edge, store, dir);
  } finally {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await cleanup();
  }
}

async function create(
  edge: Edge,
  projectId: string,
  overrides: Partial<SandboxSpec>,
  layerView?: string[],
): Promise<string> {
  const sb = await edge.createSandbox({
    id: randomId('sb'),
    projectId,
    spec: spec(overrides),
    ...(layerView ? { layerView } : {}),
  });
  return sb.id;
}

async function sh(edge: Edge, id: string, line: string): Promise<string> {
  const r = await edge.runCommand(id, { shell: line });
  assert.equal(r.exitCode, 0, `${line}: ${r.stderr}`);
  return r.stdout;
}

/** A sandbox of `projectId` with `marker` in /who, snapshotted as `name`. */
async function snapWith(edge: Edge, projectId: string, name: string, marker: string) {
  const id = await create(edge, projectId, {});
  await sh(edge, id, `echo ${marker} > /who`);
  const snap = await edge.snapshotSandbox(id, { name, layerView: [projectId] });
  await edge.stopSandbox(id);
  return snap;
}

const notFound = (field: string) => (err: unknown) =>
  isDsecError(err, 'image_not_found') && err.field === field;

test('snapshots are their project’s; a create sees only its view, the platform’s name first', async () => {
  await withEdge(async (edge, store, dir) => {
    const a = await snapWith(edge, 'prj-a', 'task', 'A');
    const b = await snapWith(edge, 'prj-b', 'task', 'B');
    assert.equal(a.layer.project, 'prj-a');
    assert.equal(b.layer.project, 'prj-b', 'the same name in another project: no conflict');
    assert.notEqual(a.layer.digest, b.layer.digest);
    const who = async (projectId: string, image: string, view?: string[]) =>
      (
        await sh(edge, await create(edge, projectId, { image, toolkits: [] }, view), 'cat /who')
      ).trim();
    assert.equal(await who('prj-a', 'task'), 'A');
    assert.equal(await who('prj-b', 'task'), 'B');
    assert.equal(await who('prj-a1', 'task', ['prj-a', 'prj-a1']), 'A', 'a child sees its parent');
    await assert.rejects(create(edge, 'prj-c', { image: 'task' }), notFound('image'));
    await assert.rejects(create(edge, 'prj-c', { image: 'busybox', toolkits: ['task'] }), (e) =>
      isDsecError(e, 'image_not_found'),
    );
    // An empty view is the platform's alone (FnCall workers), whatever the project.
    await assert.rejects(create(edge, 'prj-a', { image: 'task' }, []), notFound('image'));
    await assert.rejects(create(edge, 'prj-a', { image: 'task' }, ['../x']), (e) =>
      isDsecError(e, 'invalid_argument'),
    );

    // The platform builds `task` later: it wins for every project, and theirs are untouched.
    const tree = join(dir, 'platform-task');
    await mkdir(tree, { recursive: true });
    await writeFile(join(tree, 'who'), 'platform\n');
    await buildLayer(store, { name: 'task', kind: 'toolkit', from: { dir: tree } });
    const withTask = async (projectId: string) =>
      (await sh(edge, await create(edge, projectId, { toolkits: ['task'] }), 'cat /who')).trim();
    assert.equal(await withTask('prj-a'), 'platform');
    assert.equal(await withTask('prj-b'), 'platform');
    assert.equal((await store.getLayer('task', { project: 'prj-a' })).digest, a.layer.digest);
    // A name the project already sees would shadow its snapshot: taken.
    const busy = await create(edge, 'prj-a', {});
    await assert.rejects(edge.snapshotSandbox(busy, { name: 'task', layerView: ['prj-a'] }), (e) =>
      isDsecError(e, 'conflict'),
    );

    // A snapshot of a sandbox started from an ancestor's snapshot names that parent by key.
    await snapWith(edge, 'prj-a', 'a-env', 'A');
    const child = await create(edge, 'prj-a1', { image: 'a-env' }, ['prj-a', 'prj-a1']);
    await sh(edge, child, 'echo A1 > /who');
    const deeper = await edge.snapshotSandbox(child, {
      name: 'deeper',
      layerView: ['prj-a', 'prj-a1'],
    });
    assert.deepEqual(deeper.parents, ['busybox:latest', 'prj-a/a-env:latest']);
    assert.equal(await who('prj-a1', 'deeper', ['prj-a', 'prj-a1']), 'A1');
    await assert.rejects(create(edge, 'prj-a', { image: 'deeper' }), notFound('image'));

    // A record whose parent lies outside the creating view is refused as if absent.
    const secret = await snapWith(edge, 'prj-secret', 'secret', 'S');
    await store.putLayer({
      ...deeper.layer,
      name: 'forged',
      project: 'prj-x',
      parents: ['busybox:latest', 'prj-secret/secret:latest'],
      parentDigests: [deeper.layer.parentDigests![0]!, secret.layer.digest],
    });
    await assert.rejects(create(edge, 'prj-x', { image: 'forged' }), notFound('image'));
  });
});

test('a snapshot larger than its reservation is refused and nothing is stored', async () => {
  await withEdge(async (edge, store) => {
    const id = await create(edge, 'prj-q', {});
    await sh(edge, id, 'dd if=/dev/urandom of=/big bs=1M count=2 2>/dev/null');
    await assert.rejects(
      edge.snapshotSandbox(id, { name: 'big', maxBytes: 1024 * 1024 }),
      (e) =>
        isDsecError(e, 'quota_exceeded') &&
        (e.details as { resource?: string }).resource === 'imageBytes',
    );
    assert.deepEqual(
      (await store.listLayers()).map((l) => l.name),
      ['busybox'],
    );
    const fits = await edge.snapshotSandbox(id, { name: 'big', maxBytes: 8 * 1024 * 1024 });
    assert.ok(fits.layer.sizeBytes > 2 * 1024 * 1024 && fits.layer.sizeBytes <= 8 * 1024 * 1024);
  });
});
