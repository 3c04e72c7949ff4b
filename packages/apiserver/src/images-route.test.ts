import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { LayerInfo } from '@dsec/core';
import { createTestApi } from './testing/harness.js';

test('GET /v1/images asks the store for plumbing records only with ?all, and refuses other flags', async (t) => {
  const asked: boolean[] = [];
  const api = await createTestApi({
    imagesList: async ({ all }) => {
      asked.push(all);
      return [] as LayerInfo[];
    },
  });
  t.after(() => api.close());
  const get = (url: string) =>
    api.app.inject({ method: 'GET', url, headers: { authorization: `Bearer ${api.rootKey}` } });
  assert.equal((await get('/v1/images')).statusCode, 200);
  assert.equal((await get('/v1/images?all=true')).statusCode, 200);
  assert.equal((await get('/v1/images?all=0')).statusCode, 200);
  assert.deepEqual(asked, [false, true, false]);
  const bad = await get('/v1/images?all=yes');
  assert.equal(bad.statusCode, 400);
  assert.equal(bad.json<{ error: { field: string } }>().error.field, 'all');
});
