import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { EdgeApi, EdgeStatus } from '@dsec/core';
import { Watcher } from './index.js';

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
