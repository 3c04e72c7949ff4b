import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError, type EdgeStatus } from '@dsec/core';
import { openControlDb } from '@dsec/iam';
import type { ClusterConfig } from './config.js';
import { cordonEdge, drainEdge, leaveEdge, listEdges } from './edge-ops.js';
import { RegistryFleet } from './fleet.js';

const SECRET = 's'.repeat(43);

/** A SQLite control database with edges a and b, and a probe of each holding `sandboxes`. */
async function cluster(t: { after(fn: () => unknown): void }) {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-edge-ops-'));
  const config: ClusterConfig = { database: join(dir, 'control.db') };
  const db = await openControlDb(join(dir, 'control.db'));
  t.after(async () => {
    await db.close();
    rmSync(dir, { recursive: true, force: true });
  });
  let at = Date.now();
  const probe = (edgeId: string, sandboxesByProject: Record<string, number>) =>
    db.edges.recordProbe(edgeId, {
      healthy: true,
      at: ++at,
      status: {
        edgeId,
        url: '',
        healthy: true,
        backends: ['container'],
        capacity: { memoryMb: 1024, cpuCores: 2, sandboxes: 100 },
        used: { memoryMb: 0, cpuCores: 0, sandboxes: 0 },
        sandboxesByProject,
        labels: {},
      } satisfies EdgeStatus,
    });
  for (const edgeId of ['a', 'b']) {
    await db.edges.register({
      edgeId,
      url: `http://127.0.0.1:${edgeId === 'a' ? 7001 : 7002}`,
      secret: SECRET,
      labels: { pool: 'cpu' },
      backends: ['container'],
    });
  }
  await probe('a', { p: 2, _fncall: 4 });
  await probe('b', { _fncall: 1 });
  return { config, db, probe };
}

test('ls shows health, cordon and users’ sandboxes (not function-call workers), never secrets', async (t) => {
  const { config } = await cluster(t);
  const edges = await listEdges(config);
  assert.deepEqual(
    edges.map((e) => [e.id, e.healthy, e.cordoned, e.sandboxes]),
    [
      ['a', true, false, 2],
      ['b', true, false, 0],
    ],
  );
  assert.ok(!JSON.stringify(edges).includes(SECRET));
});

test('a cordon reaches every apiserver’s fleet view, and placement’s, until uncordoned', async (t) => {
  const { config, db } = await cluster(t);
  const fleet = new RegistryFleet({ registry: db.edges, refreshMs: 60_000 });
  t.after(() => fleet.close());
  await fleet.refresh();
  assert.deepEqual(cordonedIn(fleet), []);
  assert.equal((await cordonEdge(config, 'a', true)).cordoned, true);
  await fleet.refresh();
  assert.deepEqual(cordonedIn(fleet), ['a']);
  // The same view object until something changes: placers index a view once.
  assert.equal(fleet.view(), fleet.view());
  await cordonEdge(config, 'a', false);
  await fleet.refresh();
  assert.deepEqual(cordonedIn(fleet), []);
  await assert.rejects(cordonEdge(config, 'nope', true), (e) => isDsecError(e, 'not_found'));
});

test('drain cordons, then returns once the recorded status counts no users’ sandboxes', async (t) => {
  const { config, probe } = await cluster(t);
  const seen: (number | undefined)[] = [];
  const drained = drainEdge(config, 'a', {
    timeoutMs: 30_000,
    pollMs: 10,
    onProgress: (e) => {
      seen.push(e.sandboxes);
      // The watcher records the edge emptying while the drain waits.
      if (seen.length === 3) void probe('a', { p: 1 });
      if (seen.length === 6) void probe('a', { _fncall: 2 });
    },
  });
  const edge = await drained;
  assert.equal(edge.cordoned, true);
  assert.equal(edge.sandboxes, 0);
  assert.equal(seen[0], 2);
  assert.ok(seen.includes(1));
});

test('drain gives up with deadline_exceeded and leaves the edge cordoned', async (t) => {
  const { config } = await cluster(t);
  await assert.rejects(
    drainEdge(config, 'a', { timeoutMs: 50, pollMs: 10 }),
    (e) => isDsecError(e, 'deadline_exceeded') && /still holds 2 sandboxes/.test(e.message),
  );
  assert.equal((await listEdges(config)).find((e) => e.id === 'a')?.cordoned, true);
});

test('leave refuses an edge that holds sandboxes unless forced; an empty one leaves', async (t) => {
  const { config, db } = await cluster(t);
  await assert.rejects(
    leaveEdge(config, 'a'),
    (e) => isDsecError(e, 'conflict') && /dsec edge drain a/.test(e.message),
  );
  assert.equal(await leaveEdge(config, 'b'), true);
  assert.equal(await leaveEdge(config, 'a', { force: true }), true);
  assert.equal(await leaveEdge(config, 'a'), false);
  assert.deepEqual(await db.edges.list(), []);
});

function cordonedIn(fleet: RegistryFleet): string[] {
  return fleet
    .view()
    .edges.filter((e) => e.cordoned)
    .map((e) => e.edgeId);
}
