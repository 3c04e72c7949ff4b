import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { DsecError, isDsecError, type LayerInfo } from '@dsec/core';
import { DirImageStore } from '@dsec/images';
import { prepareTasks } from './prepare.js';
import type { EvalTask } from './task.js';
import { RepoCache, workspaceLayerName, workspaceSource } from './workspace.js';

const TASK = {
  instance_id: 'o__r-1',
  repo: 'o/r',
  base_commit: 'a'.repeat(40),
  workdir: '/testbed',
  environment: { image: 'base', toolkits: ['tk', 'by-hand'] },
} as unknown as EvalTask;

/** A real store in a temp dir, and a way to record a layer in it under any owner. */
async function tempStore(t: { after: (fn: () => Promise<void>) => void }) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-prepare-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const store = new DirImageStore(join(dir, 'store'));
  let n = 0;
  const put = async (over: Partial<LayerInfo> & Pick<LayerInfo, 'name' | 'kind'>) => {
    const file = join(dir, `blob-${n++}`);
    await writeFile(file, `${over.name} ${n}`);
    const { digest } = await store.putBlob(file);
    const layer: LayerInfo = {
      version: 'latest',
      digest,
      sizeBytes: 1,
      contentBytes: 1,
      fileCount: 1,
      createdAt: new Date(0).toISOString(),
      source: 'dir',
      ...(over.kind === 'snapshot'
        ? { parents: ['base:latest'], parentDigests: [digest], source: 'snapshot' }
        : {}),
      ...over,
    };
    await store.putLayer(layer);
    return layer;
  };
  return { store, put };
}

const noRecipe = (name: string) =>
  Promise.reject(new DsecError('image_not_found', 'no recipe', { details: { layer: name } }));

void test('prepare asks the builder about present layers too: a rebuilt one is built, a matching one present', async (t) => {
  const { store, put } = await tempStore(t);
  await put({ name: 'base', kind: 'base' });
  await put({ name: 'tk', kind: 'toolkit' });
  await put({ name: 'by-hand', kind: 'toolkit' });
  await put({ name: workspaceLayerName(TASK), kind: 'workspace', source: workspaceSource(TASK) });
  const asked: string[] = [];
  const report = await prepareTasks([TASK], {
    store,
    repos: new RepoCache('/nonexistent'),
    buildEnvironment: async (name) => {
      asked.push(name);
      // The recipe of `tk` changed (its builder rebuilds it); `by-hand` has no recipe.
      if (name === 'tk') {
        await store.removeLayer('tk');
        await put({ name: 'tk', kind: 'toolkit', source: 'debs' });
      }
      if (name === 'by-hand') return noRecipe(name);
    },
  });
  assert.deepEqual(asked, ['base', 'tk', 'by-hand']);
  assert.deepEqual(report.built, ['tk']);
  assert.deepEqual(report.present, ['base', 'by-hand', workspaceLayerName(TASK)]);
});

void test('prepare still fails for a missing layer that no recipe builds', async (t) => {
  const { store, put } = await tempStore(t);
  await put({ name: 'base', kind: 'base' });
  const repos = new RepoCache('/nonexistent');
  await assert.rejects(prepareTasks([TASK], { store, repos }), /tk is missing/);
  await assert.rejects(
    prepareTasks([TASK], {
      store,
      repos,
      buildEnvironment: (name) =>
        name === 'base'
          ? Promise.resolve()
          : Promise.reject(
              new DsecError('image_not_found', `no recipe for ${name}`, {
                details: { layer: name },
              }),
            ),
    }),
    /no recipe for tk/,
  );
});

void test('prepare never looks at a tenant’s layers under a task’s names: their owner’s alone', async (t) => {
  const { store, put } = await tempStore(t);
  // A tenant snapshotted under every name the task uses; nothing of it is the platform's.
  for (const name of ['base', 'tk', 'by-hand', workspaceLayerName(TASK)])
    await put({ name, kind: 'snapshot', project: 'prj-squatter' });
  await assert.rejects(
    prepareTasks([TASK], { store, repos: new RepoCache('/nonexistent') }),
    /layer base is missing/,
    'the tenant’s `base` is not taken for the platform’s',
  );
  await put({ name: 'base', kind: 'base' });
  await put({ name: 'tk', kind: 'toolkit' });
  await put({ name: 'by-hand', kind: 'toolkit' });
  await put({ name: workspaceLayerName(TASK), kind: 'workspace', source: workspaceSource(TASK) });
  const report = await prepareTasks([TASK], { store, repos: new RepoCache('/nonexistent') });
  assert.deepEqual(report.built, []);
  assert.equal(report.present.length, 4);
});

void test('prepare refuses, loudly and without deleting, a platform layer that is not what it builds', async (t) => {
  const ws = workspaceLayerName(TASK);
  const cases: [string, Partial<LayerInfo> & Pick<LayerInfo, 'name' | 'kind'>][] = [
    // A snapshot written before layers had owners is the platform's: a squat from then.
    ['a snapshot under the workspace name', { name: ws, kind: 'snapshot' }],
    ['a workspace of another repository', { name: ws, kind: 'workspace', source: 'eval:x/y@b' }],
    ['a workspace built by hand', { name: ws, kind: 'workspace', source: 'dir' }],
    ['a base under the workspace name', { name: ws, kind: 'base' }],
  ];
  for (const [what, squat] of cases) {
    const { store, put } = await tempStore(t);
    await put({ name: 'base', kind: 'base' });
    await put({ name: 'tk', kind: 'toolkit' });
    await put({ name: 'by-hand', kind: 'toolkit' });
    const planted = await put(squat);
    await assert.rejects(
      prepareTasks([TASK], { store, repos: new RepoCache('/nonexistent') }),
      (e) =>
        isDsecError(e, 'conflict') &&
        (e.details as { reason?: string }).reason === 'foreign_layer' &&
        (e.details as { layer?: string }).layer === `${ws}:latest`,
      what,
    );
    assert.equal((await store.getLayer(ws)).digest, planted.digest, `${what}: left in place`);
  }
  // An environment layer of the wrong kind: a toolkit slot holding a snapshot, the image a toolkit.
  for (const [name, kind] of [
    ['tk', 'snapshot'],
    ['base', 'toolkit'],
  ] as const) {
    const { store, put } = await tempStore(t);
    for (const [n, k] of [
      ['base', 'base'],
      ['tk', 'toolkit'],
      ['by-hand', 'toolkit'],
    ] as const)
      if (n !== name) await put({ name: n, kind: k });
    await put({ name, kind });
    await assert.rejects(
      prepareTasks([TASK], {
        store,
        repos: new RepoCache('/nonexistent'),
        buildEnvironment: noRecipe,
      }),
      (e) =>
        isDsecError(e, 'conflict') && (e.details as { layer?: string }).layer === `${name}:latest`,
      `${name} as a ${kind}`,
    );
  }
});

void test('an install toolkit on the workspace is built per task after its workspace, and the task runs on it', async (t) => {
  const { store, put } = await tempStore(t);
  await put({ name: 'base', kind: 'base' });
  await put({ name: 'by-hand', kind: 'toolkit' });
  const ws = await put({
    name: workspaceLayerName(TASK),
    kind: 'workspace',
    source: workspaceSource(TASK),
  });
  const calls: string[] = [];
  const report = await prepareTasks([TASK], {
    store,
    repos: new RepoCache('/nonexistent'),
    buildEnvironment: async (name, o) => {
      calls.push(`${name}${o.workspace ? `@${o.workspace.name}` : ''}`);
      if (name === 'tk' && o.workspace === undefined) {
        throw new DsecError('invalid_argument', 'needs the workspace', {
          field: 'tk.workspace',
          details: { reason: 'install_needs_workspace', layer: 'tk' },
        });
      }
      if (name === 'tk') {
        assert.equal(o.workspace?.digest, ws.digest);
        return { layer: await put({ name: 'tk.ws-0123456789ab', kind: 'toolkit' }), built: true };
      }
      return await noRecipe(name);
    },
  });
  assert.deepEqual(calls, ['base', 'tk', 'by-hand', `tk@${workspaceLayerName(TASK)}`]);
  assert.deepEqual(report.tasks[0]?.toolkits, ['tk.ws-0123456789ab:latest', 'by-hand']);
  assert.ok(report.built.includes('tk.ws-0123456789ab:latest'));
});
