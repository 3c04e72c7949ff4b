import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  formatLayerKey,
  layerVisible,
  parseLayerKey,
  visibleLayers,
  type LayerInfo,
} from './images.js';

test('layer keys: a bare ref is the platform’s, project/ref a project’s; malformed is undefined', () => {
  assert.deepEqual(parseLayerKey('base'), { name: 'base', version: 'latest' });
  assert.deepEqual(parseLayerKey('prj-A_b/snap:v1'), {
    name: 'snap',
    version: 'v1',
    project: 'prj-A_b',
  });
  for (const bad of ['/snap', 'a/b/c', '../x/snap', 'prj a/snap', 'prj/', 'prj/Bad', '']) {
    assert.equal(parseLayerKey(bad), undefined, bad);
  }
  for (const key of ['base:latest', 'prj-1/snap:v2']) {
    assert.equal(formatLayerKey(parseLayerKey(key)!), key);
  }
});

test('a view sees the platform and its own projects, in resolution order', () => {
  const l = (name: string, project?: string) =>
    ({ name, version: 'latest', ...(project ? { project } : {}) }) as LayerInfo;
  const view = ['prj-root', 'prj-team'];
  assert.equal(layerVisible(l('x'), []), true);
  assert.equal(layerVisible(l('x', 'prj-other'), view), false);
  const seen = visibleLayers(
    [l('b', 'prj-team'), l('b', 'prj-other'), l('a', 'prj-team'), l('b'), l('b', 'prj-root')],
    view,
  );
  assert.deepEqual(
    seen.map((x) => [x.name, x.project]),
    [
      ['a', 'prj-team'],
      ['b', undefined],
      ['b', 'prj-root'],
      ['b', 'prj-team'],
    ],
  );
});
