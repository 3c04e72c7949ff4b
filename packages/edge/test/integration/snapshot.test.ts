import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, readdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { isDsecError, randomId, type SandboxSpec } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { buildLayer, type DirImageStore } from '@dsec/images';
import { hostResources, makeStateDir, spec } from './fixture.js';

async function withEdge(
  fn: (ctx: {
    edge: Edge;
    store: DirImageStore;
    dir: string;
    cgroupParent: string;
  }) => Promise<void>,
): Promise<void> {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  const open = () =>
    openContainerEdge({ edgeId: 'node-1', stateDir: join(dir, 'edge'), store, cgroupParent });
  const edge = await open();
  try {
    await fn({ edge, store, dir, cgroupParent });
  } finally {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await cleanup();
  }
}

async function create(edge: Edge, overrides: Partial<SandboxSpec>): Promise<string> {
  const sb = await edge.createSandbox({
    id: randomId('sb'),
    projectId: 'p1',
    spec: spec(overrides),
  });
  return sb.id;
}

async function sh(edge: Edge, id: string, line: string): Promise<string> {
  const r = await edge.runCommand(id, { shell: line });
  assert.equal(r.exitCode, 0, `${line}: ${r.stderr}`);
  return r.stdout;
}

/** A workspace layer with files the sandbox changes, deletes and scrubs. */
async function buildWorkspace(store: DirImageStore, dir: string): Promise<void> {
  const ws = join(dir, 'ws-tree', 'ws');
  await mkdir(join(ws, 'dir'), { recursive: true });
  await writeFile(join(ws, 'keep'), 'old\n');
  await writeFile(join(ws, 'gone'), 'delete me\n');
  await writeFile(join(ws, 'answer.txt'), '42\n');
  await writeFile(join(ws, 'dir', 'a'), 'a\n');
  await writeFile(join(ws, 'dir', 'b'), 'b\n');
  await buildLayer(store, { name: 'ws', kind: 'workspace', from: { dir: join(dir, 'ws-tree') } });
}

test('a snapshot captures written, changed and deleted files, scrubs, and is an image create accepts', async () => {
  await withEdge(async ({ edge, store, dir }) => {
    await buildWorkspace(store, dir);
    const id = await create(edge, { workspace: 'ws' });
    await sh(
      edge,
      id,
      [
        'mkdir -p /data /tmp/build/obj',
        'echo new > /data/new.txt',
        'echo mine > /data/user.txt && chown 1000:1001 /data/user.txt',
        'echo secret > /data/secret.txt',
        'echo residue > /tmp/build/obj/x.o',
        'echo changed > /ws/keep',
        'rm /ws/gone',
        'rm -rf /ws/dir && mkdir /ws/dir && echo c > /ws/dir/c',
      ].join(' && '),
    );
    const snap = await edge.snapshotSandbox(id, {
      name: 'snap1',
      scrub: ['/data/secret.txt', '/ws/answer.txt', '/tmp/build/**'],
    });
    assert.equal(snap.image, 'snap1:latest');
    assert.equal(snap.layer.kind, 'snapshot');
    assert.deepEqual(snap.parents, ['busybox:latest', 'ws:latest']);
    assert.deepEqual(snap.layer.scrub, ['/data/secret.txt', '/ws/answer.txt', '/tmp/build/**']);
    assert.ok(snap.freezeMs > 0 && snap.freezeMs <= snap.totalMs, JSON.stringify(snap));
    const stored = await store.getLayer('snap1', { project: 'p1' });
    assert.deepEqual(stored.parentDigests, [
      (await store.getLayer('busybox')).digest,
      (await store.getLayer('ws')).digest,
    ]);

    // The running sandbox is thawed and untouched by the scrub.
    assert.equal(await sh(edge, id, 'cat /data/secret.txt /ws/answer.txt'), 'secret\n42\n');

    const copy = await create(edge, { image: 'snap1' });
    assert.equal(await sh(edge, copy, 'cat /data/new.txt /ws/keep /ws/dir/c'), 'new\nchanged\nc\n');
    assert.equal(await sh(edge, copy, 'stat -c %u:%g /data/user.txt'), '1000:1001\n');
    assert.equal(await sh(edge, copy, 'stat -c %u /data/new.txt'), '0\n');
    assert.equal(await sh(edge, copy, 'ls /ws/dir'), 'c\n', 'an opaque directory stays opaque');
    assert.equal(await sh(edge, copy, 'ls -A /tmp/build'), '', 'a scrubbed subtree is empty');
    for (const gone of ['/ws/gone', '/data/secret.txt', '/ws/answer.txt']) {
      const r = await edge.runCommand(copy, { shell: `test -e ${gone}` });
      assert.equal(r.exitCode, 1, `${gone} is absent in the snapshot`);
    }
    // The new sandbox writes freely over the read-only layers.
    await sh(
      edge,
      copy,
      'echo more >> /data/new.txt && echo 2 > /data/second && rm /ws/keep && rm -rf /ws/dir && mkdir /ws/dir && echo d > /ws/dir/d',
    );

    // A snapshot of a sandbox made from a snapshot stacks on it (the direct path: no lower scrub).
    const snap2 = await edge.snapshotSandbox(copy, { name: 'snap2:v1' });
    assert.deepEqual(snap2.parents, ['busybox:latest', 'ws:latest', 'p1/snap1:latest']);
    const third = await create(edge, { image: 'snap2:v1' });
    assert.equal(await sh(edge, third, 'cat /data/new.txt /data/second'), 'new\nmore\n2\n');
    assert.equal(await sh(edge, third, 'ls /ws/dir'), 'd\n', 'opaque on the direct path too');
    assert.equal((await edge.runCommand(third, { shell: 'test -e /ws/keep' })).exitCode, 1);
    assert.equal(
      (await edge.runCommand(third, { shell: 'test -e /ws/answer.txt' })).exitCode,
      1,
      'scrubbed in the parent snapshot stays scrubbed',
    );

    // A snapshot image carries its workspace; toolkits may go on top.
    await assert.rejects(
      edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p1',
        spec: spec({ image: 'snap1', workspace: 'ws' }),
      }),
      (err) => isDsecError(err, 'invalid_argument'),
    );
    await assert.rejects(
      edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p1',
        spec: spec({ toolkits: ['snap1'] }),
      }),
      (err) => isDsecError(err, 'invalid_argument'),
    );
  });
});

test('K sandboxes from one snapshot share its layer: mounted once, each with its own writes', async () => {
  await withEdge(async ({ edge }) => {
    const id = await create(edge, {});
    await sh(edge, id, 'mkdir /state && echo base > /state/f');
    await edge.snapshotSandbox(id, { name: 'forkme' });
    const before = edge.options.layers.stats().mounted;
    const ids = await Promise.all(
      Array.from({ length: 4 }, () => create(edge, { image: 'forkme' })),
    );
    assert.equal(edge.options.layers.stats().mounted, before + 1, 'one mount for the snapshot');
    await Promise.all(ids.map((k, i) => sh(edge, k, `echo ${i} >> /state/f`)));
    for (const [i, k] of ids.entries())
      assert.equal(await sh(edge, k, 'cat /state/f'), `base\n${i}\n`);
  });
});

test('snapshot refusals: stopped sandbox, taken name, bad scrub', async () => {
  await withEdge(async ({ edge }) => {
    const id = await create(edge, {});
    await edge.snapshotSandbox(id, { name: 'taken' });
    await assert.rejects(edge.snapshotSandbox(id, { name: 'taken' }), (err) =>
      isDsecError(err, 'conflict'),
    );
    await assert.rejects(edge.snapshotSandbox(id, { name: 'Bad Name' }), (err) =>
      isDsecError(err, 'invalid_argument'),
    );
    await assert.rejects(edge.snapshotSandbox(id, { name: 'x', scrub: ['relative/path'] }), (err) =>
      isDsecError(err, 'invalid_argument'),
    );
    await assert.rejects(edge.snapshotSandbox(id, { name: 'x', scrub: ['/a/../b'] }), (err) =>
      isDsecError(err, 'invalid_argument'),
    );
    await edge.stopSandbox(id);
    await assert.rejects(edge.snapshotSandbox(id, { name: 'late' }), (err) =>
      isDsecError(err, 'sandbox_not_running'),
    );
  });
});

test('a sandbox with a disk quota snapshots through its own upper filesystem', async () => {
  await withEdge(async ({ edge }) => {
    const id = await create(edge, { diskLimitMb: 32 });
    await sh(edge, id, 'echo quota > /q && rm /bin/vi');
    await edge.snapshotSandbox(id, { name: 'quota-snap', scrub: ['/bin/ls'] });
    const copy = await create(edge, { image: 'quota-snap' });
    assert.equal(await sh(edge, copy, 'cat /q'), 'quota\n');
    for (const gone of ['/bin/vi', '/bin/ls'])
      assert.equal((await edge.runCommand(copy, { shell: `test -e ${gone}` })).exitCode, 1, gone);
    assert.deepEqual((await hostResources(join(edge.options.stateDir, '..'))).mounts, []);
  });
});

function freezerState(cgroupParent: string, id: string): Promise<string> {
  const name = 'dsec-' + createHash('sha256').update(id).digest('hex').slice(0, 20);
  return readFile(`/sys/fs/cgroup/freezer/${cgroupParent}/${name}/freezer.state`, 'utf8').then(
    (s) => s.trim(),
    () => 'gone',
  );
}

test('kill -9 during a snapshot: the sandbox is thawed at restart and no half-written layer is visible', async () => {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  try {
    const child = spawn(
      process.execPath,
      [
        '--conditions=dsec-source',
        '--import',
        'tsx',
        new URL('./snapshot-crash-child.ts', import.meta.url).pathname,
        dir,
        cgroupParent,
      ],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    let out = '';
    child.stdout.setEncoding('utf8').on('data', (s: string) => (out += s));
    const exited = new Promise((r) => child.once('exit', r));
    for (let i = 0; i < 1200 && !/^snapshotting (\S+)$/m.test(out); i++) await sleep(50);
    const id = /^snapshotting (\S+)$/m.exec(out)?.[1];
    assert.ok(id, `the child started a snapshot: ${out}`);
    let state = '';
    for (let i = 0; i < 5000 && state !== 'FROZEN'; i++)
      state = await freezerState(cgroupParent, id);
    child.kill('SIGKILL');
    await exited;
    assert.equal(state, 'FROZEN', 'killed while the sandbox was frozen');
    assert.ok(!out.includes('snapshotted'), 'the snapshot did not finish first');
    assert.equal(await freezerState(cgroupParent, id), 'FROZEN', 'a killed edge leaves it frozen');

    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      assert.equal(await freezerState(cgroupParent, id), 'THAWED');
      assert.equal((await edge.getSandbox(id)).state, 'running');
      assert.equal(await sh(edge, id, 'echo alive'), 'alive\n');
      await assert.rejects(store.getLayer('crashed', { project: 'p1' }), (err) =>
        isDsecError(err, 'image_not_found'),
      );
      assert.deepEqual(
        (await store.listLayers()).map((l) => l.name),
        ['busybox'],
      );
      assert.deepEqual(await readdir(join(dir, 'edge', 'snapshots')), [], 'scratch space is gone');
      // The same name works once the edge is back.
      const snap = await edge.snapshotSandbox(id, { name: 'crashed' });
      assert.equal(snap.layer.kind, 'snapshot');
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
    }
  } finally {
    await cleanup();
  }
});
