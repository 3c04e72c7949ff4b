import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import type { LayerInfo } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';

/*
 * SECURITY (issue 24, point 2; SECURITY.md I37): every layer has an owner.
 * Through the real HTTP API of a real node (IAM, apiserver, edge, runc,
 * EROFS snapshots), tenant B tries everything the finding did against
 * tenant A: list A's snapshot, run it and read its reference answer, stack
 * it as a workspace or toolkit, take A's next snapshot name first so A's own
 * scoped runtime key runs B's layer, squat a name the platform builds later;
 * a child project sees its ancestors' layers, never a sibling's; a project's
 * image bytes count against its quota.
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

async function call(key: string, method: string, path: string, body?: unknown): Promise<Answer> {
  const res = await fetch(node.url + path, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
    },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  const text = await res.text();
  return { status: res.status, body: text ? (JSON.parse(text) as Answer['body']) : {} };
}

function ok(a: Answer, status = 200): Answer['body'] {
  assert.equal(a.status, status, JSON.stringify(a.body));
  return a.body;
}

/** A running sandbox of `key`'s project (or `projectId`), from `image` and optional layers. */
async function create(
  key: string,
  image: string,
  more: Record<string, unknown> = {},
): Promise<Answer> {
  return call(key, 'POST', '/v1/sandboxes', {
    image,
    memoryLimitMb: 64,
    ttlSeconds: 600,
    ...more,
  });
}

async function sandbox(key: string, image: string, more: Record<string, unknown> = {}) {
  return ok(await create(key, image, more), 201).id as string;
}

async function sh(key: string, id: string, line: string): Promise<string> {
  const r = ok(await call(key, 'POST', `/v1/sandboxes/${id}/commands`, { shell: line }));
  assert.equal(r.exitCode, 0, JSON.stringify(r));
  return r.stdout as string;
}

async function snapshot(key: string, id: string, name: string): Promise<Answer> {
  return call(key, 'POST', `/v1/sandboxes/${id}/snapshot`, { name });
}

async function images(key: string, query = ''): Promise<LayerInfo[]> {
  return ok(await call(key, 'GET', `/v1/images${query}`)).layers as LayerInfo[];
}

function names(layers: LayerInfo[]): string[] {
  return layers.map((l) => `${l.name}:${l.version}`);
}

function notFound(a: Answer, field: string): void {
  assert.equal(a.status, 404, JSON.stringify(a.body));
  assert.equal(a.body.error?.code, 'image_not_found');
  assert.equal(a.body.error?.field, field);
}

/** A sandbox of `key` holding `marker` in /who, snapshotted as `name`. */
async function snapshotWith(key: string, name: string, marker: string): Promise<string> {
  const id = await sandbox(key, 'busybox');
  await sh(key, id, `echo ${marker} > /who`);
  ok(await snapshot(key, id, name), 201);
  await call(key, 'DELETE', `/v1/sandboxes/${id}`);
  return id;
}

async function who(key: string, image: string, more: Record<string, unknown> = {}) {
  const id = await sandbox(key, image, more);
  try {
    return (await sh(key, id, 'cat /who')).trim();
  } finally {
    await call(key, 'DELETE', `/v1/sandboxes/${id}`);
  }
}

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-owner-it-'));
  await chmod(dir, 0o711);
  cgroupParent = `dsec-owner-${basename(dir).slice(-6)}`;
  node = await startSingleNode({ stateDir: join(dir, 'state'), port: 0, cgroupParent });
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
  const admin = node.adminKey;
  const project = async (name: string, parentId?: string, quota?: Record<string, number>) => {
    const p = ok(
      await call(admin, 'POST', '/v1/projects', {
        name,
        ...(parentId ? { parentId } : {}),
        ...(quota ? { quota } : {}),
      }),
      201,
    );
    projects[name] = p.id as string;
    const k = ok(await call(admin, 'POST', '/v1/keys', { projectId: p.id, role: 'admin' }), 201);
    keys[name] = k.key as string;
  };
  await project('a');
  await project('b');
  await project('a1', projects.a);
  await project('a2', projects.a);
});

after(async () => {
  await node?.close({ stopSandboxes: true });
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
});

test("B cannot list, run, stack or learn of A's snapshot: it answers as if absent", async () => {
  const { a, b } = keys as { a: string; b: string };
  const src = await sandbox(a, 'busybox');
  await sh(a, src, 'echo 42 > /answer');
  const snap = ok(await snapshot(a, src, 'a-secret'), 201);
  assert.equal(snap.image, 'a-secret:latest');
  assert.equal((snap.layer as LayerInfo).project, projects.a, 'the snapshot is A’s');

  assert.ok(names(await images(a)).includes('a-secret:latest'), 'A lists its own snapshot');
  assert.ok(!names(await images(b)).includes('a-secret:latest'), 'B does not');
  assert.ok(!names(await images(b, '?all=true')).includes('a-secret:latest'));
  // B naming A's project is a project B cannot see.
  assert.equal((await call(b, 'GET', `/v1/images?projectId=${projects.a}`)).status, 404);

  // Run, or stack as a workspace or a toolkit: as if there were no such layer.
  notFound(await create(b, 'a-secret'), 'image');
  notFound(await create(b, 'a-secret:latest'), 'image');
  notFound(await create(b, 'busybox', { workspace: 'a-secret' }), 'workspace');
  notFound(await create(b, 'busybox', { toolkits: ['a-secret'] }), 'toolkits.0');
  // Deleting it: as absent too, and A's stays.
  const del = await call(b, 'DELETE', '/v1/images/a-secret');
  assert.equal(del.status, 404, JSON.stringify(del.body));
  assert.equal(del.body.error?.code, 'image_not_found');

  // B's own snapshot of that name is no conflict (a conflict would tell B the name exists),
  // and each tenant's `a-secret` is its own.
  const bsrc = await sandbox(b, 'busybox');
  await sh(b, bsrc, 'echo 0 > /answer');
  ok(await snapshot(b, bsrc, 'a-secret'), 201);
  const read = async (key: string) => {
    const id = await sandbox(key, 'a-secret');
    return (await sh(key, id, 'cat /answer')).trim();
  };
  assert.equal(await read(b), '0', 'B runs its own a-secret');
  assert.equal(await read(a), '42', 'A still runs its own');
  // B forks its own sandbox: the fork image is B's, A sees nothing of it.
  const fork = ok(await call(b, 'POST', `/v1/sandboxes/${bsrc}/fork`, { count: 1 }), 201);
  assert.ok(!names(await images(a)).includes(fork.image as string));
  notFound(await create(a, fork.image as string), 'image');
  // A's fork of A's sandbox runs A's state.
  const afork = ok(await call(a, 'POST', `/v1/sandboxes/${src}/fork`, { count: 1 }), 201);
  const [forked] = afork.ids as string[];
  assert.equal((await sh(a, forked!, 'cat /answer')).trim(), '42');
});

test("B taking A's next snapshot name first has no effect on A, and A's scoped key runs only A's layers", async () => {
  const { a, b } = keys as { a: string; b: string };
  // A's runtime principal may run a-task-* and nothing else.
  const runtime = ok(
    await call(a, 'POST', '/v1/keys', {
      projectId: projects.a,
      scopes: ['images:run:a-task-*'],
    }),
    201,
  ).key as string;
  // B snapshots under A's next names first.
  await snapshotWith(b, 'a-task-2', 'B');
  await snapshotWith(b, 'a-task-3', 'B');
  // A's snapshot of the name works (no conflict), and is what A and A's runtime key run.
  await snapshotWith(a, 'a-task-2', 'A');
  assert.equal(await who(runtime, 'a-task-2'), 'A');
  assert.equal(await who(a, 'a-task-2'), 'A');
  assert.equal(await who(b, 'a-task-2'), 'B');
  // A name only B has is absent for A's runtime key, never B's layer.
  notFound(await create(runtime, 'a-task-3'), 'image');
  // A child's layer is not in the scoped key's own project's view either.
  await snapshotWith(keys.a1!, 'a-task-9', 'A1');
  notFound(await create(runtime, 'a-task-9', { projectId: projects.a1 }), 'image');
  // An unscoped key of A sees A1's layer in A1's sandboxes (A1's view).
  assert.equal(await who(a, 'a-task-9', { projectId: projects.a1 }), 'A1');
});

test('a child project sees its ancestors’ layers but not its siblings’; the parent not its children’s', async () => {
  const { a, a1, a2 } = keys as { a: string; a1: string; a2: string };
  await snapshotWith(a, 'team-env', 'A');
  assert.equal(await who(a1, 'team-env'), 'A', 'A1 runs its parent’s snapshot');
  assert.ok(names(await images(a1)).includes('team-env:latest'));
  // A1 builds on it; its snapshot is A1's and records A's layer as its parent.
  const id = await sandbox(a1, 'team-env');
  await sh(a1, id, 'echo A1 > /who');
  const snap = ok(await snapshot(a1, id, 'a1-only'), 201);
  assert.deepEqual(snap.parents, ['busybox:latest', `${projects.a}/team-env:latest`]);
  assert.equal(await who(a1, 'a1-only'), 'A1');
  notFound(await create(a2, 'a1-only'), 'image');
  assert.ok(!names(await images(a2)).includes('a1-only:latest'), 'A2 does not list its sibling’s');
  assert.ok(!names(await images(a)).includes('a1-only:latest'), 'nor does the parent by default');
  // The parent may look into its child's view by naming it.
  assert.ok(names(await images(a, `?projectId=${projects.a1}`)).includes('a1-only:latest'));
  // A name an ancestor has is taken for the child: its snapshot could never be what it runs.
  const taken = await snapshot(a1, id, 'team-env');
  assert.equal(taken.status, 409, JSON.stringify(taken.body));
  assert.equal(taken.body.error?.code, 'conflict');
  // A's layer cannot go while A1's stands on it; once A1's is gone, it can.
  const busy = await call(a, 'DELETE', '/v1/images/team-env');
  assert.equal(busy.status, 409, JSON.stringify(busy.body));
  assert.deepEqual(busy.body.error?.details?.layers, [`${projects.a1}/a1-only:latest`]);
  assert.equal((await call(a1, 'DELETE', '/v1/images/a1-only')).status, 204);
  assert.equal((await call(a, 'DELETE', '/v1/images/team-env')).status, 204);
  notFound(await create(a1, 'team-env'), 'image');
});

test('the platform building a name a tenant snapshotted first succeeds and wins for every tenant', async () => {
  const { a, b } = keys as { a: string; b: string };
  await snapshotWith(b, 'tools', 'B');
  const tree = join(dir, 'tools-tree');
  await mkdir(tree, { recursive: true });
  await writeFile(join(tree, 'who'), 'platform\n');
  const built = await node.buildLayer({ name: 'tools', kind: 'toolkit', from: { dir: tree } });
  assert.equal(built.project, undefined, 'an operator build is the platform’s');
  assert.equal(await who(b, 'busybox', { toolkits: ['tools'] }), 'platform');
  assert.equal(await who(a, 'busybox', { toolkits: ['tools'] }), 'platform');
  // B's listing shows what `tools` means for B: the platform's toolkit comes first.
  const listed = (await images(b)).filter((l) => l.name === 'tools');
  assert.deepEqual(
    listed.map((l) => [l.kind, l.project]),
    [
      ['toolkit', undefined],
      ['snapshot', projects.b],
    ],
  );
  // A tenant cannot snapshot under a platform name (visible to all: no secret in the refusal).
  const id = await sandbox(b, 'busybox');
  const refused = await snapshot(b, id, 'busybox');
  assert.equal(refused.status, 409, JSON.stringify(refused.body));
  assert.equal(refused.body.error?.code, 'conflict');
});

test("a project's image bytes count against its quota, children's within the parent's", async () => {
  const admin = node.adminKey;
  const QUOTA = 2 * 1024 * 1024;
  const parent = ok(
    await call(admin, 'POST', '/v1/projects', { name: 'q', quota: { imageBytes: QUOTA } }),
    201,
  );
  assert.deepEqual((parent.quota as Record<string, number>).imageBytes, QUOTA);
  // A child may not hold more than its parent.
  const over = await call(admin, 'POST', '/v1/projects', {
    name: 'q-big',
    parentId: parent.id,
    quota: { imageBytes: QUOTA + 1 },
  });
  assert.equal(over.status, 403, JSON.stringify(over.body));
  const child = ok(
    await call(admin, 'POST', '/v1/projects', { name: 'q-child', parentId: parent.id }),
    201,
  );
  const key = ok(await call(admin, 'POST', '/v1/keys', { projectId: child.id }), 201).key as string;

  const id = await sandbox(key, 'busybox');
  // 3 MiB of incompressible bytes: past the parent's 2 MiB, refused, nothing stored.
  await sh(key, id, 'dd if=/dev/urandom of=/big bs=1M count=3 2>/dev/null');
  const refused = await snapshot(key, id, 'too-big');
  assert.equal(refused.status, 429, JSON.stringify(refused.body));
  assert.equal(refused.body.error?.code, 'quota_exceeded');
  assert.equal(refused.body.error?.details?.resource, 'imageBytes');
  assert.ok(!names(await images(key)).includes('too-big:latest'));
  assert.ok(!(await node.store.listLayers()).some((l) => l.name === 'too-big'));

  // A small one fits and is charged to the child and the parent.
  await sh(key, id, 'rm /big && echo small > /small');
  const small = ok(await snapshot(key, id, 'small'), 201);
  const size = (small.layer as LayerInfo).sizeBytes;
  assert.equal((await node.iam.usage(child.id as string)).imageBytes, size);
  assert.equal((await node.iam.usage(parent.id as string)).imageBytes, size);
  // Deleting the layer gives its bytes back.
  assert.equal((await call(key, 'DELETE', '/v1/images/small')).status, 204);
  assert.equal((await node.iam.usage(parent.id as string)).imageBytes, 0);
  notFound(await create(key, 'small'), 'image');
});
