/**
 * Review attacks on the autoPause sweeper (lifecycle.ts). Its watch list is
 * one bounded map for every tenant of the apiserver: an entry whose sandbox
 * was deleted elsewhere (the native API, another apiserver) must leave it
 * soon, not at its E2B timeout (up to a week away), or a tenant that creates
 * and deletes long-timeout autoPause sandboxes fills the list and pushes out
 * other tenants' entries, whose sandboxes are then killed at the backstop TTL
 * instead of paused.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ApiMetrics, SandboxService } from '@dsec/apiserver';
import { createTestApi, FakeEdge } from '@dsec/apiserver/testing';
import { PowerOfKPlacer } from '@dsec/placement';
import { toDsecSandboxId } from './ids.js';
import { AutoPauser, E2bSandboxAccess } from './lifecycle.js';
import { registerE2bRoutes } from './register.js';

test('autoPause sweeper: a watched sandbox deleted elsewhere leaves the watch list within minutes, not at its timeout', async () => {
  const clock = { now: Date.parse('2026-12-01T00:00:00.000Z') };
  const edge = new FakeEdge({ edgeId: 'edge-a', now: () => clock.now });
  const api = await createTestApi({ edges: [edge] });
  const service = new SandboxService({
    iam: api.iam,
    edges: api.edges,
    watcher: api.watcher,
    placer: new PowerOfKPlacer({ view: () => api.watcher.view() }),
    ids: api.ids,
    metrics: new ApiMetrics(),
  });
  registerE2bRoutes(api.app, { service, iam: api.iam, templates: { base: 'busybox' } });
  const pauser = new AutoPauser({
    service,
    access: new E2bSandboxAccess(service),
    now: () => clock.now,
    intervalMs: 3_600_000,
  });
  try {
    const principal = await api.iam.authenticate(api.rootKey);
    const ids: string[] = [];
    for (let i = 0; i < 3; i++) {
      const r = await api.app.inject({
        method: 'POST',
        url: '/v2/sandboxes',
        headers: { 'x-api-key': api.rootKey, 'content-type': 'application/json' },
        // A week: the longest E2B timeout DSec takes.
        payload: JSON.stringify({ templateID: 'base', timeout: 604_000, autoPause: true }),
      });
      assert.equal(r.statusCode, 201, r.body);
      const id = toDsecSandboxId((JSON.parse(r.body) as { sandboxID: string }).sandboxID);
      pauser.watch(principal, await service.get(principal, id));
      ids.push(id);
    }
    assert.equal(pauser.size, 3);
    // Deleted through the native API (or another apiserver): this sweeper is not told.
    for (const id of ids.slice(0, 2)) await service.delete(principal, id);
    clock.now += 5 * 60_000;
    await pauser.sweep();
    assert.equal(pauser.size, 1, 'the deleted sandboxes still hold places in the watch list');
    // The one still running is still watched, and paused at its timeout all the same.
    clock.now += (604_000 - 5 * 60 + 10) * 1000;
    await pauser.sweep();
    assert.equal((await service.get(principal, ids[2]!)).state, 'paused');
  } finally {
    pauser.close();
    await api.close();
  }
});
