import assert from 'node:assert/strict';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PassThrough } from 'node:stream';
import { test } from 'node:test';
import Fastify, { type FastifyInstance } from 'fastify';
import {
  ImageBuildService,
  ImageService,
  type ImageBuilder,
  type ImageBuildRequest,
} from '@dsec/apiserver';
import { isDsecError, type LayerInfo } from '@dsec/core';
import { openControlDb } from '@dsec/iam';
import { resolveImageAlias, templateBuildRoutes } from './template-build.js';
import { TemplateFiles } from './template-files.js';

// Attacks on E2B template builds (adversarial review of h/imgbuild).

const HASH = 'b'.repeat(64);

test('one upload link PUT many times at once cannot hold unbounded disk: uploads per project are bounded', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxUploadsPerProject: 3 });
  // Each PUT of the same link writes a part file of its own while its body trickles in.
  const bodies = [0, 1, 2].map(() => new PassThrough());
  const running = bodies.map((b) => files.store('proj-a', HASH, b));
  for (const b of bodies) b.write(Buffer.alloc(1024));
  const extra = new PassThrough();
  await assert.rejects(
    files.store('proj-a', HASH, extra),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['resource'] === 'templateUploads',
  );
  // Another project's uploads are not this one's to block.
  const other = new PassThrough();
  const otherDone = files.store('proj-b', HASH, other);
  other.end(Buffer.from('x'));
  await otherDone;
  for (const b of bodies) b.end();
  await Promise.all(running);
  // Once they are done the slots are free again, and no part file is left behind.
  const again = new PassThrough();
  const againDone = files.store('proj-a', HASH, again);
  again.end(Buffer.from('y'));
  await againDone;
  assert.deepEqual(await readdir(join(dir, 'proj-a')), [`${HASH}.tar`]);
});

test('a failed upload gives its slot back', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxUploadsPerProject: 1, maxFileBytes: 10 });
  for (let i = 0; i < 3; i++) {
    const body = new PassThrough();
    const done = files.store('proj-a', HASH, body);
    body.end(Buffer.alloc(100));
    await assert.rejects(done, (e) => isDsecError(e, 'payload_too_large'));
  }
  assert.deepEqual(await readdir(join(dir, 'proj-a')), []);
});

test('uploads in progress are bounded in bytes per project, not only one by one', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxFileBytes: 4096, maxProjectBytes: 5000 });
  // Each upload stays under maxFileBytes; together they would hold 3 × 2048 bytes of part files.
  const bodies = [0, 1, 2].map(() => new PassThrough());
  const running = bodies.map((b) => files.store('proj-a', HASH, b));
  const settled = running.map((p) =>
    p.then(
      () => 'ok',
      (e: unknown) => (isDsecError(e, 'quota_exceeded') ? 'refused' : String(e)),
    ),
  );
  bodies[0]!.write(Buffer.alloc(2048));
  bodies[1]!.write(Buffer.alloc(2048));
  bodies[2]!.write(Buffer.alloc(2048));
  assert.equal(await settled[2], 'refused');
  bodies[0]!.end();
  bodies[1]!.end();
  assert.deepEqual(await Promise.all(settled.slice(0, 2)), ['ok', 'ok']);
  // Their bytes are given back once they are done.
  const next = new PassThrough();
  const nextDone = files.store('proj-a', 'c'.repeat(64), next);
  next.end(Buffer.alloc(2048));
  await nextDone;
});

/** The template build routes on a real IAM and an in-memory image store; `onBuild` is the builder. */
async function routes(
  t: { after: (fn: () => Promise<void> | void) => void },
  onBuild: (log: (line: string) => void) => void = () => undefined,
): Promise<{ app: FastifyInstance; key: string; builds: ImageBuildService }> {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  const { iam } = db;
  const root = await iam.authenticate((await iam.bootstrap()).key);
  const project = await iam.createProject(root, { name: 'tenant' });
  const { key } = await iam.createKey(root, { projectId: project.id, role: 'admin' });
  const work = await mkdtemp(join(tmpdir(), 'dsec-e2b-routes-'));
  t.after(() => rm(work, { recursive: true, force: true }));
  const layers: LayerInfo[] = [];
  const builder: ImageBuilder = {
    workDir: work,
    build: async (r) => {
      onBuild(r.onLog);
      const layer = {
        name: r.name,
        version: r.version,
        kind: 'base',
        digest: `sha256:${'1'.repeat(64)}`,
        sizeBytes: 1,
        createdAt: new Date().toISOString(),
        project: r.project,
      } as LayerInfo;
      layers.push(layer);
      return { layer, cached: false };
    },
    remove: async () => undefined,
    tag: async (_project, _from, to) => {
      const [name, version] = to.split(':') as [string, string];
      const layer = { ...layers[0]!, name, version };
      layers.push(layer);
      return layer;
    },
  };
  // The project's view as `ImageService.list` answers it (one project: every layer is its own).
  const images = { list: async () => layers } as unknown as ImageBuildService['deps']['images'];
  const builds = new ImageBuildService({ iam, images, builder });
  const app = Fastify();
  templateBuildRoutes(app, { iam, builds });
  await app.ready();
  t.after(() => app.close());
  return { app, key, builds };
}

test('template names asked for and never built cannot pile up without bound in memory', async (t) => {
  const { app, key } = await routes(t);
  const ids: string[] = [];
  for (let i = 0; i < 300; i++) {
    const r = await app.inject({
      method: 'POST',
      url: '/v3/templates',
      headers: { 'x-api-key': key },
      payload: { name: `t${i}` },
    });
    assert.equal(r.statusCode, 202, r.body);
    ids.push(r.json<{ buildID: string }>().buildID);
  }
  const status = async (i: number) =>
    (
      await app.inject({
        url: `/templates/t${i}/builds/${ids[i]}/status`,
        headers: { 'x-api-key': key },
      })
    ).statusCode;
  // The newest are kept, the oldest forgotten: a bounded number per project.
  assert.equal(await status(299), 200);
  assert.equal(await status(0), 404);
});

test("a build's log kept for E2B's status is bounded in bytes, not only in lines", async (t) => {
  const { app, key, builds } = await routes(t, (log) => {
    for (let i = 0; i < 5000; i++) log(`${i} ${'x'.repeat(8000)}`);
  });
  const created = await app.inject({
    method: 'POST',
    url: '/v3/templates',
    headers: { 'x-api-key': key },
    payload: { name: 'loud' },
  });
  const { buildID } = created.json<{ buildID: string }>();
  const started = await app.inject({
    method: 'POST',
    url: `/v2/templates/loud/builds/${buildID}`,
    headers: { 'x-api-key': key },
    payload: { fromImage: 'busybox:1', steps: [] },
  });
  assert.equal(started.statusCode, 202, started.body);
  await builds.settle();
  // Every entry kept, read page by page (each build output line is unique by its number).
  const kept = new Set<string>();
  for (let offset = 0; ;) {
    const r = await app.inject({
      url: `/templates/loud/builds/${buildID}/status?logsOffset=${offset}&limit=100`,
      headers: { 'x-api-key': key },
    });
    const page = r.json<{ logEntries: { message: string }[] }>().logEntries;
    if (page.length === 0) break;
    for (const e of page) kept.add(e.message);
    offset += page.length;
    if (offset > 1_000_000) break;
  }
  const bytes = [...kept].reduce((n, m) => n + Buffer.byteLength(m), 0);
  assert.ok(kept.size > 0);
  assert.ok(bytes <= 512 * 1024, `the log kept is ${bytes} bytes`);
});

test("stored template files count in the project's imageBytes quota (child projects cannot each keep 4 GiB outside it)", async (t) => {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  const { iam } = db;
  const root = await iam.authenticate((await iam.bootstrap()).key);
  const tenant = await iam.createProject(root, { name: 'tenant', quota: { imageBytes: 5000 } });
  const child = await iam.createProject(root, { name: 'child', parentId: tenant.id });
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(
    () => dir,
    { maxFilesPerProject: 2 },
    {
      bind: async (project, key, bytes) => await iam.bindImageBytes(key, project, key, bytes),
      release: async (key) => {
        await iam.releaseImageBytes(key);
      },
    },
  );
  const put = async (project: string, hash: string, bytes: number) => {
    const body = new PassThrough();
    const done = files.store(project, hash, body);
    body.end(Buffer.alloc(bytes));
    await done;
  };
  await put(tenant.id, 'a'.repeat(64), 2048);
  await put(child.id, 'b'.repeat(64), 2048);
  assert.equal((await iam.usage(tenant.id)).imageBytes, 4096);
  // The child's next file would take the tenant past its 5000 bytes.
  await assert.rejects(put(child.id, 'c'.repeat(64), 2048), (e) =>
    isDsecError(e, 'quota_exceeded'),
  );
  assert.equal(await files.present(child.id, 'c'.repeat(64)), false);
  // An evicted file gives its bytes back.
  await put(child.id, 'd'.repeat(64), 100);
  await put(child.id, 'e'.repeat(64), 100);
  assert.equal(await files.present(child.id, 'b'.repeat(64)), false);
  assert.equal((await iam.usage(tenant.id)).imageBytes, 2048 + 200);
});

test('image aliases: only the whole name is aliased, so a caller cannot steer an alias to another registry or layer', () => {
  const aliases = { 'e2bdev/base': 'layer:team-base:1', 'python:3': 'mirror.local:5000/python:3' };
  // Docker Hub's spellings of the same name are that name.
  for (const from of ['e2bdev/base', 'e2bdev/base:latest', 'docker.io/e2bdev/base:latest'])
    assert.deepEqual(resolveImageAlias(from, aliases), { from, layer: 'team-base:1' });
  assert.deepEqual(resolveImageAlias('docker.io/library/python:3', aliases), {
    from: 'mirror.local:5000/python:3',
  });
  // Another registry's, another tag's or a digest's image of that name is not the alias: it is
  // pulled as named (under the node's registry settings and credential hosts), never rewritten.
  for (const from of [
    'evil.example/e2bdev/base',
    'evil.example:5000/e2bdev/base:latest',
    'e2bdev/base:other',
    `e2bdev/base@sha256:${'a'.repeat(64)}`,
    'e2bdev/base-evil',
  ])
    assert.deepEqual(resolveImageAlias(from, aliases, { base: 'busybox' }), { from });
  // Without an alias, e2bdev/base is the template `base`'s image (its base only).
  assert.deepEqual(resolveImageAlias('e2bdev/base', {}, { base: 'e2b-base:2/ws+tool' }), {
    from: 'e2bdev/base',
    layer: 'e2b-base:2',
  });
  assert.deepEqual(resolveImageAlias('e2bdev/base', {}, {}), { from: 'e2bdev/base' });
  // An operator's alias to DSec's own names or a transport is refused when the routes are made.
  const app = Fastify();
  for (const bad of ['localhost/dsec-build-x', 'oci:/etc', 'layer:Bad Name'])
    assert.throws(
      () =>
        templateBuildRoutes(app, {
          iam: {} as never,
          builds: { workDir: '/nonexistent' } as never,
          imageAliases: { 'e2bdev/base': bad },
        }),
      (e: unknown) => isDsecError(e, 'invalid_argument'),
    );
});

test("an alias to a layer builds on the caller's view: never another tenant's private layer", async (t) => {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  const { iam } = db;
  const root = await iam.authenticate((await iam.bootstrap()).key);
  const a = await iam.createProject(root, { name: 'tenant-a' });
  const b = await iam.createProject(root, { name: 'tenant-b' });
  const keyA = (await iam.createKey(root, { projectId: a.id, role: 'admin' })).key;
  const keyB = (await iam.createKey(root, { projectId: b.id, role: 'admin' })).key;
  const work = await mkdtemp(join(tmpdir(), 'dsec-e2b-alias-'));
  t.after(() => rm(work, { recursive: true, force: true }));
  const layer = (name: string, digit: string, project?: string): LayerInfo =>
    ({
      name,
      version: '1',
      kind: 'base',
      digest: `sha256:${digit.repeat(64)}`,
      sizeBytes: 1,
      createdAt: new Date().toISOString(),
      ...(project !== undefined ? { project } : {}),
    }) as LayerInfo;
  // Every owner's records: the catalog does not filter, ImageService's view does.
  const stored = [layer('e2b-base', 'a'), layer('team-base', 'b', b.id)];
  const requests: ImageBuildRequest[] = [];
  const builder: ImageBuilder = {
    workDir: work,
    build: async (r) => {
      requests.push(r);
      const l = layer(r.name, 'c', r.project);
      return { layer: { ...l, version: r.version }, cached: false };
    },
    remove: async () => undefined,
    tag: async (project, _from, to) => {
      const [name, version] = to.split(':') as [string, string];
      return { ...layer(name, 'c', project), version };
    },
  };
  const images = new ImageService({ iam, catalog: { list: async () => stored } });
  const builds = new ImageBuildService({ iam, images, builder });
  const app = Fastify();
  templateBuildRoutes(app, {
    iam,
    builds,
    templates: { base: 'e2b-base:1' },
    imageAliases: { 'e2bdev/team': 'layer:team-base:1' },
  });
  await app.ready();
  t.after(() => app.close());
  const build = async (key: string, name: string, fromImage: string) => {
    const created = await app.inject({
      method: 'POST',
      url: '/v3/templates',
      headers: { 'x-api-key': key },
      payload: { name },
    });
    assert.equal(created.statusCode, 202, created.body);
    const { buildID } = created.json<{ buildID: string }>();
    return await app.inject({
      method: 'POST',
      url: `/v2/templates/${name}/builds/${buildID}`,
      headers: { 'x-api-key': key },
      payload: { fromImage, steps: [] },
    });
  };
  // E2B's base is the platform's template image, for anyone.
  assert.equal((await build(keyA, 'from-base', 'e2bdev/base')).statusCode, 202);
  await builds.settle();
  assert.deepEqual(requests.at(-1)!.storeBases, {
    'e2bdev/base': { ref: 'e2b-base:1', digest: `sha256:${'a'.repeat(64)}` },
  });
  // Tenant B's private layer is B's alone: A's build through the same alias is refused, and the
  // answer does not say whose it is.
  const refused = await build(keyA, 'steal', 'e2bdev/team');
  assert.equal(refused.statusCode, 400, refused.body);
  assert.ok(!refused.body.includes(b.id), refused.body);
  assert.equal(requests.length, 1);
  assert.equal((await build(keyB, 'mine', 'e2bdev/team')).statusCode, 202);
  await builds.settle();
  assert.deepEqual(requests.at(-1)!.storeBases, {
    'e2bdev/team': { ref: 'team-base:1', project: b.id, digest: `sha256:${'b'.repeat(64)}` },
  });
  // A name that is not the alias is pulled as named: no store base, FROM as the caller wrote it.
  assert.equal((await build(keyA, 'other', 'evil.example/e2bdev/base')).statusCode, 202);
  await builds.settle();
  assert.equal(requests.at(-1)!.storeBases, undefined);
});
