import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { EdgeApi, EdgeStatus } from '@dsec/core';
import { Watcher, viewFromRecords } from './index.js';
import type { EdgeProbeRecord, ProbeResult } from './index.js';

/** Only `status()` matters to the watcher; the rest throws if touched. */
function stubEdge(edgeId: string, status: () => Promise<EdgeStatus>): EdgeApi & { probes: number } {
  const never = () => Promise.reject(new Error('not used'));
  const edge = {
    edgeId,
    probes: 0,
    status: () => {
      edge.probes++;
      return status();
    },
    createSandbox: never,
    getSandbox: never,
    listSandboxes: never,
    stopSandbox: never,
    runCommand: never,
  };
  return edge;
}

function status(edgeId: string, over: Partial<EdgeStatus> = {}): EdgeStatus {
  return {
    edgeId,
    url: `http://${edgeId}`,
    healthy: true,
    backends: ['container'],
    capacity: { memoryMb: 8192, cpuCores: 8, sandboxes: 100 },
    used: { memoryMb: 1024, cpuCores: 2, sandboxes: 2 },
    sandboxesByProject: { p1: 2 },
    labels: {},
    ...over,
  };
}

test('refresh builds per-edge, per-backend and per-project views', async () => {
  const edges = new Map<string, EdgeApi>([
    ['e1', stubEdge('e1', async () => status('e1'))],
    [
      'e2',
      stubEdge('e2', async () =>
        status('e2', { backends: ['container', 'microvm'], sandboxesByProject: { p1: 1, p2: 3 } }),
      ),
    ],
  ]);
  const w = new Watcher({ edges });
  assert.equal(w.view().edges.length, 0);
  const v = await w.refresh();
  assert.deepEqual(
    v.edges.map((e) => [e.edgeId, e.healthy]),
    [
      ['e1', true],
      ['e2', true],
    ],
  );
  assert.equal(v.byBackend.container?.healthyEdges, 2);
  assert.equal(v.byBackend.microvm?.healthyEdges, 1);
  assert.deepEqual(v.byProject, { p1: 3, p2: 3 });
  assert.equal(v.totals.capacity.sandboxes, 200);
});

test('a failed, hung or lying probe marks the edge unhealthy; success restores it', async () => {
  let fail = true;
  const edges = new Map<string, EdgeApi>([
    ['e1', stubEdge('e1', async () => (fail ? Promise.reject(new Error('down')) : status('e1')))],
    ['e2', stubEdge('e2', () => new Promise<EdgeStatus>(() => {}))],
    ['e3', stubEdge('e3', async () => status('not-e3'))],
  ]);
  const w = new Watcher({ edges, probeTimeoutMs: 50 });
  let v = await w.refresh();
  assert.deepEqual(
    v.edges.map((e) => e.healthy),
    [false, false, false],
  );
  assert.equal(v.edges[0]?.consecutiveFailures, 1);
  assert.equal(v.totals.healthyEdges, 0);
  fail = false;
  v = await w.refresh();
  assert.equal(v.edges.find((e) => e.edgeId === 'e1')?.healthy, true);
  edges.delete('e2');
  v = await w.refresh();
  assert.deepEqual(
    v.edges.map((e) => e.edgeId),
    ['e1', 'e3'],
  );
});

test('start probes repeatedly until stop', async () => {
  const e1 = stubEdge('e1', async () => status('e1'));
  const w = new Watcher({ edges: () => [e1], intervalMs: 5 });
  w.start();
  while (e1.probes < 3) await new Promise((r) => setTimeout(r, 5));
  w.stop();
  const after = e1.probes;
  await new Promise((r) => setTimeout(r, 30));
  assert.ok(e1.probes <= after + 1);
  assert.equal(w.view().edges[0]?.healthy, true);
});

test('an edge goes down only after failuresBeforeDown failures in a row, and up after one success', async () => {
  let fail = false;
  const e1 = stubEdge('e1', async () => (fail ? Promise.reject(new Error('down')) : status('e1')));
  const never = stubEdge('never', async () => Promise.reject(new Error('refused')));
  const w = new Watcher({ edges: () => [e1, never], failuresBeforeDown: 3 });
  const health = () => w.view().edges.map((e) => [e.edgeId, e.healthy, e.consecutiveFailures]);
  await w.refresh();
  // An edge that never answered is down at once: nothing is known about it.
  assert.deepEqual(health(), [
    ['e1', true, 0],
    ['never', false, 1],
  ]);
  fail = true;
  await w.refresh();
  await w.refresh();
  assert.deepEqual(health()[0], ['e1', true, 2]);
  assert.equal(w.view().edges[0]?.lastError, 'down');
  // Still placed on with its last known status while it is given the benefit of the doubt.
  assert.equal(w.view().edges[0]?.used.sandboxes, 2);
  await w.refresh();
  assert.deepEqual(health()[0], ['e1', false, 3]);
  fail = false;
  await w.refresh();
  assert.deepEqual(health()[0], ['e1', true, 0]);
  // An edge that reports itself unhealthy is down whatever the threshold.
  const sick = stubEdge('e1', async () => status('e1', { healthy: false }));
  const w2 = new Watcher({ edges: () => [sick], failuresBeforeDown: 3 });
  assert.equal((await w2.refresh()).edges[0]?.healthy, false);
});

test('with failuresBeforeDown Infinity (an in-process edge) slow probes never mark it down', async () => {
  let hang = false;
  let healthy = true;
  const e1 = stubEdge('e1', () =>
    hang ? new Promise<EdgeStatus>(() => {}) : Promise.resolve(status('e1', { healthy })),
  );
  const w = new Watcher({
    edges: () => [e1],
    probeTimeoutMs: 20,
    failuresBeforeDown: Number.POSITIVE_INFINITY,
  });
  await w.refresh();
  hang = true;
  for (let i = 0; i < 5; i++) await w.refresh();
  const e = w.view().edges[0]!;
  assert.equal(e.healthy, true);
  assert.equal(e.consecutiveFailures, 5);
  assert.match(e.lastError ?? '', /timed out/);
  // Its own report still counts.
  hang = false;
  healthy = false;
  assert.equal((await w.refresh()).edges[0]?.healthy, false);
});

test('onProbe reports every probe; a throwing or rejecting hook changes nothing', async () => {
  let fail = false;
  const e1 = stubEdge('e1', async () => (fail ? Promise.reject(new Error('boom')) : status('e1')));
  const seen: [string, ProbeResult][] = [];
  const hookErrors: string[] = [];
  let hookMode: 'ok' | 'throw' | 'reject' = 'ok';
  let now = 100;
  const w = new Watcher({
    edges: () => [e1],
    failuresBeforeDown: 2,
    now: () => now,
    onProbe: (edgeId, result) => {
      seen.push([edgeId, result]);
      if (hookMode === 'throw') throw new Error('registry down');
      if (hookMode === 'reject') return Promise.reject(new Error('registry slow'));
    },
    onProbeError: (_id, err) => hookErrors.push((err as Error).message),
  });
  await w.refresh();
  assert.equal(seen.length, 1);
  assert.deepEqual(seen[0]![1], {
    healthy: true,
    at: 100,
    status: status('e1'),
    consecutiveFailures: 0,
  });
  fail = true;
  now = 200;
  await w.refresh();
  now = 300;
  await w.refresh();
  assert.deepEqual(
    seen.slice(1).map(([id, r]) => [id, r.healthy, r.at, r.error, r.status, r.consecutiveFailures]),
    [
      ['e1', true, 200, 'boom', undefined, 1],
      ['e1', false, 300, 'boom', undefined, 2],
    ],
  );
  fail = false;
  hookMode = 'throw';
  await w.refresh();
  hookMode = 'reject';
  await w.refresh();
  await new Promise((r) => setImmediate(r));
  assert.equal(w.view().edges[0]?.healthy, true);
  assert.deepEqual(hookErrors, ['boom', 'boom', 'registry down', 'registry slow']);
});

test('edges join and leave between rounds; one that left is out of the view before slow probes end', async () => {
  let release: (() => void) | undefined;
  let slow = false;
  const members = new Map<string, EdgeApi>([
    ['e1', stubEdge('e1', async () => status('e1'))],
    [
      'e2',
      stubEdge('e2', () =>
        slow
          ? new Promise<EdgeStatus>((resolve) => (release = () => resolve(status('e2'))))
          : Promise.resolve(status('e2')),
      ),
    ],
  ]);
  const w = new Watcher({ edges: members });
  const ids = () => w.view().edges.map((e) => e.edgeId);
  await w.refresh();
  assert.deepEqual(ids(), ['e1', 'e2']);
  members.delete('e1');
  members.set(
    'e3',
    stubEdge('e3', async () => status('e3', { labels: { pool: 'burst' } })),
  );
  slow = true;
  const round = w.refresh();
  await new Promise((r) => setImmediate(r));
  assert.ok(release, 'the e2 probe is in flight');
  assert.deepEqual(ids(), ['e2']);
  release();
  await round;
  assert.deepEqual(ids(), ['e2', 'e3']);
  assert.deepEqual(w.view().edges[1]?.labels, { pool: 'burst' });
});

test('the view carries labels and layers; a new view is a new snapshot', async () => {
  const e1 = stubEdge('e1', async () =>
    status('e1', { labels: { pool: 'burst', hardware: 'h200' }, layers: ['base:latest', 'py:3'] }),
  );
  const w = new Watcher({ edges: () => [e1] });
  const v1 = await w.refresh();
  assert.equal(w.view(), v1);
  assert.deepEqual(v1.edges[0]?.labels, { pool: 'burst', hardware: 'h200' });
  assert.deepEqual(v1.edges[0]?.layers, ['base:latest', 'py:3']);
  const v2 = await w.refresh();
  assert.notEqual(v2.edges, v1.edges);
});

test('viewFromRecords builds the same kind of view from registry records', () => {
  const records: EdgeProbeRecord[] = [
    {
      edgeId: 'b',
      healthy: true,
      status: status('b', { labels: { pool: 'gpu' } }),
      lastProbeAt: 1000,
    },
    {
      edgeId: 'a',
      healthy: true,
      status: status('a', { sandboxesByProject: { p1: 1, p2: 4 } }),
      lastProbeAt: 900,
      observedAt: 800,
    },
    // The watcher's verdict wins over a stale healthy status.
    { edgeId: 'c', healthy: false, status: status('c'), lastProbeAt: 1000, lastError: 'timeout' },
    // Never answered: down, no capacity.
    { edgeId: 'd', healthy: true, lastProbeAt: 1000 },
  ];
  const v = viewFromRecords(records, { now: 1500 });
  assert.deepEqual(
    v.edges.map((e) => [e.edgeId, e.healthy, e.observedAt, e.lastError]),
    [
      ['a', true, 800, undefined],
      ['b', true, 1000, undefined],
      ['c', false, 1000, 'timeout'],
      ['d', false, 0, undefined],
    ],
  );
  assert.equal(v.refreshedAt, 1000);
  assert.deepEqual(v.byProject, { p1: 3, p2: 4 });
  assert.equal(v.totals.healthyEdges, 2);
  assert.equal(v.totals.capacity.sandboxes, 200);
  assert.deepEqual(v.edges[1]?.labels, { pool: 'gpu' });
  assert.deepEqual(viewFromRecords(records, { now: 1500 }), v);
  // Records no watcher refreshed for longer than staleAfterMs count as down.
  const stale = viewFromRecords(records, { now: 1950, staleAfterMs: 1000 });
  assert.deepEqual(
    stale.edges.map((e) => [e.edgeId, e.healthy]),
    [
      ['a', false],
      ['b', true],
      ['c', false],
      ['d', false],
    ],
  );
  assert.equal(stale.edges[0]?.lastError, 'no probe for 1050 ms');
  assert.equal(viewFromRecords([]).edges.length, 0);
});
