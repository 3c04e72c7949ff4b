import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { LayerInfo } from '@dsec/core';
import { listImages, OCI_DIFF_LAYER_NAME } from './index.js';

test('listImages leaves the per-OCI-layer records out unless asked for all', async () => {
  const layer = (name: string, version: string) => ({ name, version }) as LayerInfo;
  const layers = [
    layer('debian', 'latest'),
    layer(OCI_DIFF_LAYER_NAME, 'ab12'),
    layer('oci-diff-tools', '1'),
  ];
  const store = { listLayers: async () => layers };
  assert.deepEqual(
    (await listImages(store, { all: false })).map((l) => l.name),
    ['debian', 'oci-diff-tools'],
  );
  assert.equal((await listImages(store, { all: true })).length, 3);
});
