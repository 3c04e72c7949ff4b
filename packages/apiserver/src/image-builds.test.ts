import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { Readable } from 'node:stream';
import { mkdir, mkdtemp, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { DsecError, formatLayerKey, formatLayerRef, isDsecError, type LayerInfo } from '@dsec/core';
import { openControlDb, type Principal } from '@dsec/iam';
import { ImageBuildService, type ImageBuilder } from './image-builds.js';
import { ImageService } from './image-service.js';

// Attacks on the accounting of API builds and their tags (adversarial review of h/imgbuild):
// a real IAM (in-memory SQLite), an in-memory image store whose records share blobs by digest
// as the node's does, and a builder that "builds" a layer of a fixed size.

const SIZE = 600;

async function setup(
  t: { after: (fn: () => Promise<void> | void) => void },
  imageBytes = 1000,
  gate?: Promise<void>,
) {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  const { iam } = db;
  const root = await iam.authenticate((await iam.bootstrap()).key);
  const project = await iam.createProject(root, { name: 'tenant', quota: { imageBytes } });
  const tenant: Principal = await iam.authenticate(
    (await iam.createKey(root, { projectId: project.id, role: 'admin' })).key,
  );
  const work = await mkdtemp(join(tmpdir(), 'dsec-build-unit-'));
  t.after(() => rm(work, { recursive: true, force: true }));
  const layers: LayerInfo[] = [];
  const find = (ref: string, project: string) =>
    layers.findIndex((l) => formatLayerRef(l) === ref && l.project === project);
  let n = 0;
  const builder: ImageBuilder = {
    workDir: work,
    build: async (r) => {
      await gate;
      const layer: LayerInfo = {
        name: r.name,
        version: r.version,
        kind: 'base',
        digest: `sha256:${String(++n).padStart(64, '0')}`,
        sizeBytes: SIZE,
        createdAt: new Date().toISOString(),
        project: r.project,
      } as LayerInfo;
      layers.push(layer);
      return { layer, cached: false };
    },
    remove: async (ref, project) => {
      const i = find(ref, project);
      if (i < 0) throw new DsecError('image_not_found', `no layer ${ref}`);
      layers.splice(i, 1);
    },
    tag: async (project, from, to) => {
      const source = layers[find(from, project)]!;
      const [name, version] = to.split(':') as [string, string];
      const i = find(to, project);
      if (i >= 0) layers.splice(i, 1);
      const layer = { ...source, name, version };
      layers.push(layer);
      return layer;
    },
  };
  const images = new ImageService({
    iam,
    catalog: {
      list: async ({ projects }) =>
        layers.filter((l) => l.project === undefined || projects?.includes(l.project)),
      remove: async (ref, project) => await builder.remove(ref, project),
    },
  });
  const builds = new ImageBuildService({ iam, images, builder });
  const build = async (name: string) => {
    const started = await builds.startPrepared(tenant, {
      name,
      prepare: async (_work, ctx) => {
        await writeFile(join(ctx, 'Dockerfile'), 'FROM scratch\n');
        return { dockerfile: 'Dockerfile' };
      },
    });
    return await builds.wait(tenant, started.id);
  };
  return { iam, root, tenant, project, layers, builds, images, build };
}

test('a tag holds the bytes of its layer: deleting the original does not free quota the tag still uses', async (t) => {
  const { iam, tenant, project, layers, builds, images, build } = await setup(t, 1500);
  assert.equal((await build('t:b-1')).status, 'ready');
  await builds.tag(tenant, 't:b-1', 't:latest');
  // The attack: delete the charged original; the tag keeps the same blobs on disk.
  await images.remove(tenant, 't:b-1', {});
  assert.deepEqual(
    layers.map((l) => formatLayerRef(l)),
    ['t:latest'],
  );
  assert.equal(
    (await iam.usage(project.id)).imageBytes,
    SIZE,
    'the tag that keeps the layer on disk is charged to the project',
  );
  // So of two more layers of that size only one fits the 1500-byte quota.
  assert.equal((await build('u:b-2')).status, 'ready');
  const third = await build('v:b-3');
  assert.equal(third.status, 'failed');
  assert.equal(third.errorCode, 'quota_exceeded');
});

test('a tag past the quota is refused and not left behind', async (t) => {
  const { tenant, layers, builds, build } = await setup(t);
  assert.equal((await build('t:b-1')).status, 'ready');
  await assert.rejects(builds.tag(tenant, 't:b-1', 't:latest'), (e) =>
    isDsecError(e, 'quota_exceeded'),
  );
  assert.deepEqual(
    layers.map((l) => formatLayerRef(l)),
    ['t:b-1'],
  );
});

test('retagging a name replaces its charge, and untagging gives the bytes back', async (t) => {
  const { iam, tenant, project, layers, builds, build } = await setup(t, 2000);
  assert.equal((await build('t:b-1')).status, 'ready');
  const one = (await iam.usage(project.id)).imageBytes;
  assert.equal(one, SIZE);
  await builds.tag(tenant, 't:b-1', 't:latest');
  await builds.tag(tenant, 't:b-1', 't:latest');
  assert.equal((await iam.usage(project.id)).imageBytes, 2 * SIZE);
  await builds.untag(tenant, 't:latest');
  assert.deepEqual(
    layers.map((l) => formatLayerRef(l)),
    ['t:b-1'],
  );
  assert.equal((await iam.usage(project.id)).imageBytes, SIZE);
});

test('retagging a name another layer stacks on is refused, as deleting it is', async (t) => {
  const { tenant, project, layers, builds, build } = await setup(t, 10_000);
  assert.equal((await build('t:b-1')).status, 'ready');
  assert.equal((await build('t:b-2')).status, 'ready');
  await builds.tag(tenant, 't:b-1', 't:latest');
  // A snapshot of a sandbox started from t:latest, stacked on it.
  layers.push({
    ...layers[0]!,
    name: 'snap',
    version: 'latest',
    digest: `sha256:${'9'.repeat(64)}`,
    parents: [formatLayerKey({ name: 't', version: 'latest', project: project.id })],
  });
  await assert.rejects(builds.tag(tenant, 't:b-2', 't:latest'), (e) => isDsecError(e, 'conflict'));
  const latest = layers.find((l) => formatLayerRef(l) === 't:latest');
  assert.equal(latest?.digest, layers.find((l) => formatLayerRef(l) === 't:b-1')?.digest);
});

test("a tenant's child projects share its build slots: they cannot take every slot of the node", async (t) => {
  let open!: () => void;
  const gate = new Promise<void>((r) => (open = r));
  const { iam, root, project, builds } = await setup(t, 10_000, gate);
  const keyOf = async (name: string) => {
    const child = await iam.createProject(root, { name, parentId: project.id });
    return await iam.authenticate(
      (await iam.createKey(root, { projectId: child.id, role: 'admin' })).key,
    );
  };
  const start = (p: Principal, name: string) =>
    builds.startPrepared(p, {
      name,
      prepare: async (_work, ctx) => {
        await writeFile(join(ctx, 'Dockerfile'), 'FROM scratch\n');
        return { dockerfile: 'Dockerfile' };
      },
    });
  const a = await keyOf('child-a');
  const b = await keyOf('child-b');
  await start(a, 'x:1');
  await start(a, 'x:2');
  // Node-wide there are 4 slots (the default): a second child of the same tenant gets none.
  await assert.rejects(start(b, 'y:1'), (e) => isDsecError(e, 'quota_exceeded'));
  // Another tenant still builds.
  const other = await iam.createProject(root, { name: 'other' });
  const o = await iam.authenticate(
    (await iam.createKey(root, { projectId: other.id, role: 'admin' })).key,
  );
  await start(o, 'z:1');
  open();
  await builds.settle();
});

test('an ignore file that is a symlink is refused: buildah would read it on the host through the link', async (t) => {
  const { tenant, builds } = await setup(t, 10_000);
  const src = await mkdtemp(join(tmpdir(), 'dsec-build-ctx-'));
  t.after(() => rm(src, { recursive: true, force: true }));
  for (const [i, ignore] of [
    '.dockerignore',
    '.containerignore',
    'Dockerfile.dockerignore',
  ].entries()) {
    const ctx = join(src, String(i));
    await mkdir(ctx);
    await writeFile(join(ctx, 'Dockerfile'), 'FROM scratch\n');
    await symlink('/dev/zero', join(ctx, ignore));
    const r = spawnSync('tar', ['-C', ctx, '-cf', '-', '.']);
    assert.equal(r.status, 0);
    await assert.rejects(
      builds.start(tenant, { name: `ign${i}:1`, body: Readable.from([r.stdout]) }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'context',
      ignore,
    );
  }
  assert.deepEqual(builds.list(tenant), []);
});
