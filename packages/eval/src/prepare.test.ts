import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DsecError, type ImageStore } from '@dsec/core';
import { prepareTasks } from './prepare.js';
import type { EvalTask } from './task.js';
import { RepoCache, workspaceLayerName } from './workspace.js';

const TASK = {
  instance_id: 'o__r-1',
  repo: 'o/r',
  base_commit: 'a'.repeat(40),
  workdir: '/testbed',
  environment: { image: 'base', toolkits: ['tk', 'by-hand'] },
} as unknown as EvalTask;

/** Just enough of a store: layer name → digest. */
function fakeStore(layers: Map<string, string>): ImageStore {
  return {
    getLayer: (ref: string) => {
      const digest = layers.get(ref);
      if (digest === undefined) {
        return Promise.reject(new DsecError('image_not_found', `no layer ${ref}`));
      }
      return Promise.resolve({ name: ref, digest });
    },
  } as unknown as ImageStore;
}

void test('prepare asks the builder about present layers too: a rebuilt one is built, a matching one present', async () => {
  const layers = new Map([
    ['base', 'sha256:b1'],
    ['tk', 'sha256:t1'],
    ['by-hand', 'sha256:h1'],
    [workspaceLayerName(TASK), 'sha256:w1'],
  ]);
  const asked: string[] = [];
  const report = await prepareTasks([TASK], {
    store: fakeStore(layers),
    repos: new RepoCache('/nonexistent'),
    buildEnvironment: (name) => {
      asked.push(name);
      // The recipe of `tk` changed (its builder rebuilds it); `by-hand` has no recipe.
      if (name === 'tk') layers.set('tk', 'sha256:t2');
      if (name === 'by-hand') {
        return Promise.reject(
          new DsecError('image_not_found', 'no recipe', { details: { layer: name } }),
        );
      }
      return Promise.resolve();
    },
  });
  assert.deepEqual(asked, ['base', 'tk', 'by-hand']);
  assert.deepEqual(report.built, ['tk']);
  assert.deepEqual(report.present, ['base', 'by-hand', workspaceLayerName(TASK)]);
});

void test('prepare still fails for a missing layer that no recipe builds', async () => {
  const store = fakeStore(new Map([['base', 'sha256:b1']]));
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
