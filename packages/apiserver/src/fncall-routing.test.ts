import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { FnCallGpuUnitStatus, FnCallPoolStatus } from '@dsec/core';
import { routeFnCall } from './fncall-routing.js';
import type { FnCallEdgeCandidate } from './fncall-routing.js';

const pool = (p: Partial<FnCallPoolStatus>): FnCallPoolStatus => ({
  language: 'python',
  network: false,
  idle: 0,
  busy: 0,
  starting: 0,
  max: 8,
  ...p,
});
const edge = (edgeId: string, e: Partial<FnCallEdgeCandidate> = {}): FnCallEdgeCandidate => ({
  edgeId,
  healthy: true,
  labels: {},
  pools: undefined,
  implementsFnCall: true,
  ...e,
});
/** A sequence of "random" numbers, then 0. */
const seq = (...xs: number[]) => {
  let i = 0;
  return () => xs[i++] ?? 0;
};
const ids = (r: { edgeId: string }[]) => r.map((x) => x.edgeId);

test('idle workers first, then room to grow, then other FnCall edges, then edges without pools', () => {
  const edges = [
    edge('no-pools'),
    edge('full', { pools: [pool({ busy: 8 })] }),
    edge('other-runtime', { pools: [pool({ language: 'node', idle: 5 })] }),
    edge('can-grow', { pools: [pool({ busy: 2 })] }),
    edge('idle', { pools: [pool({ idle: 3, busy: 1 })] }),
  ];
  const r = routeFnCall(edges, { language: 'python' }, { random: () => 0 });
  assert.deepEqual(
    r.map((x) => [x.edgeId, x.tier]),
    [
      ['idle', 0],
      ['can-grow', 1],
      ['full', 2],
      ['other-runtime', 2],
      ['no-pools', 3],
    ],
  );
});

test('the pool must match the network setting of the call', () => {
  const edges = [
    edge('offline', { pools: [pool({ idle: 4 })] }),
    edge('online', { pools: [pool({ network: true, idle: 1 })] }),
  ];
  assert.deepEqual(ids(routeFnCall(edges, { language: 'python', network: true })).at(0), 'online');
  assert.deepEqual(ids(routeFnCall(edges, { language: 'python' })).at(0), 'offline');
});

test('excluded, non-FnCall and selector-mismatched edges are left out; unhealthy ones go last', () => {
  const edges = [
    edge('down', { healthy: false, pools: [pool({ idle: 9 })] }),
    edge('plain', { implementsFnCall: false }),
    edge('tried', { pools: [pool({ idle: 9 })] }),
    edge('cpu', { labels: { pool: 'cpu' }, pools: [pool({ idle: 9 })] }),
    edge('gpu', { labels: { pool: 'gpu', hardware: 'h200' } }),
  ];
  const r = routeFnCall(
    edges,
    { language: 'python', edgeSelector: { pool: 'gpu' } },
    { exclude: new Set(['tried']) },
  );
  assert.deepEqual(r, [{ edgeId: 'gpu', tier: 3 }]);
  assert.deepEqual(
    routeFnCall(edges, { language: 'python' }, { exclude: new Set(['tried']) }).map((x) => [
      x.edgeId,
      x.tier,
    ]),
    [
      ['cpu', 0],
      ['gpu', 3],
      ['down', 4],
    ],
  );
  assert.deepEqual(
    routeFnCall([edge('plain', { implementsFnCall: false })], { language: 'python' }),
    [],
  );
});

test('within a tier, edges are drawn in proportion to their idle workers', () => {
  const edges = [
    edge('a', { pools: [pool({ idle: 1 })] }),
    edge('b', { pools: [pool({ idle: 3 })] }),
  ];
  // Total weight 4: a draw below 1/4 lands on `a`, above on `b`.
  assert.deepEqual(ids(routeFnCall(edges, { language: 'python' }, { random: seq(0.2) })), [
    'a',
    'b',
  ]);
  assert.deepEqual(ids(routeFnCall(edges, { language: 'python' }, { random: seq(0.3) })), [
    'b',
    'a',
  ]);
  // Over many draws the split follows the weights (a deterministic sweep of the unit interval).
  const first = { a: 0, b: 0 };
  for (let i = 0; i < 100; i++) {
    const r = routeFnCall(edges, { language: 'python' }, { random: seq(i / 100) });
    first[r[0]!.edgeId as 'a' | 'b']++;
  }
  assert.deepEqual(first, { a: 25, b: 75 });
});

test('room to grow weighs tier 1; a pool capped at zero cannot grow', () => {
  const edges = [
    edge('capped', { pools: [pool({ max: 0 })] }),
    edge('small', { pools: [pool({ max: 2, starting: 1 })] }),
    edge('large', { pools: [pool({ max: 10, busy: 1 })] }),
  ];
  const r = routeFnCall(edges, { language: 'python' }, { random: seq(0.5) });
  assert.deepEqual(
    r.map((x) => [x.edgeId, x.tier]),
    [
      ['large', 1],
      ['small', 1],
      ['capped', 2],
    ],
  );
});

test('GPU calls go only to pools of their GPU request and edges with matching free units', () => {
  const unit = (u: Partial<FnCallGpuUnitStatus>): FnCallGpuUnitStatus => ({
    kind: 'gpu',
    uuid: 'GPU-0',
    model: 'NVIDIA H200',
    mode: 'free',
    workers: 0,
    maxSharedWorkers: 4,
    ...u,
  });
  const exclusive = { mode: 'exclusive' as const };
  const edges = [
    // A CPU pool with idle workers: never for a GPU call, and its GPU pool never for a CPU call.
    edge('cpu-only', { pools: [pool({ idle: 4 })] }),
    edge('free-h200', { pools: [pool({})], gpus: [unit({})] }),
    edge('taken', { pools: [pool({})], gpus: [unit({ mode: 'exclusive', workers: 1 })] }),
    edge('busy-pool', {
      pools: [pool({ busy: 1, gpu: { mode: 'exclusive', count: 1 } })],
      gpus: [unit({ mode: 'exclusive', workers: 1 })],
    }),
    edge('idle-gpu-worker', {
      pools: [pool({ idle: 1, gpu: { mode: 'exclusive', count: 1 } })],
      gpus: [unit({ mode: 'exclusive', workers: 1 })],
    }),
    edge('a100', { pools: [pool({})], gpus: [unit({ model: 'NVIDIA A100-SXM4-80GB' })] }),
    edge('unprobed'),
  ];
  const r = routeFnCall(edges, { language: 'python', gpu: exclusive }, { random: () => 0 });
  assert.deepEqual(
    r.map((x) => [x.edgeId, x.tier]),
    [
      ['idle-gpu-worker', 0],
      // No pool of this GPU request yet (tier 2, as for any runtime), but free units.
      ['free-h200', 2],
      ['busy-pool', 2],
      ['a100', 2],
      ['unprobed', 3],
    ],
  );
  const h200 = routeFnCall(edges, { language: 'python', gpu: { ...exclusive, model: 'H200' } });
  assert.deepEqual(ids(h200).sort(), ['free-h200', 'unprobed']);
  // Two units: nobody has them.
  assert.deepEqual(
    ids(routeFnCall(edges, { language: 'python', gpu: { ...exclusive, count: 2 } })),
    ['unprobed'],
  );
  // Shared: a unit held exclusively is not usable, a shared one with room is.
  const shared = [
    edge('held', { pools: [pool({})], gpus: [unit({ mode: 'exclusive', workers: 1 })] }),
    edge('room', { pools: [pool({})], gpus: [unit({ mode: 'shared', workers: 3 })] }),
    edge('full', { pools: [pool({})], gpus: [unit({ mode: 'shared', workers: 4 })] }),
  ];
  assert.deepEqual(ids(routeFnCall(shared, { language: 'python', gpu: { mode: 'shared' } })), [
    'room',
  ]);
  // A CPU call ignores GPU pools' idle workers.
  assert.deepEqual(ids(routeFnCall(edges, { language: 'python' })).at(0), 'cpu-only');
});
