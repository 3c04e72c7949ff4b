import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { LeastLoadedPlacer, PowerOfKPlacer, RandomPlacer } from './index.js';
import type { PlacementEdge, Placer } from './index.js';

const spec: SandboxSpec = {
  backend: 'container',
  image: 'base',
  toolkits: ['py'],
  memoryLimitMb: 512,
  cpuCoresLimit: 1,
  pidsLimit: 1024,
  ttlSeconds: 60,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

const SMALL = { memoryMb: 1 << 20, cpuCores: 1000, sandboxes: 10 };

function edge(edgeId: string, over: Partial<PlacementEdge> = {}): PlacementEdge {
  return {
    edgeId,
    healthy: true,
    backends: ['container'],
    capacity: { memoryMb: 64 * 1024, cpuCores: 64, sandboxes: 1000 },
    used: { memoryMb: 0, cpuCores: 0, sandboxes: 0 },
    observedAt: 0,
    ...over,
  };
}

function used(sandboxes: number) {
  return { memoryMb: 512 * sandboxes, cpuCores: sandboxes, sandboxes };
}

function seeded(seed: number): () => number {
  let a = seed;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function tally(placer: Placer, n: number, s: SandboxSpec = spec): Record<string, number> {
  const counts: Record<string, number> = {};
  for (let i = 0; i < n; i++) {
    const id = placer.place({ spec: s });
    counts[id] = (counts[id] ?? 0) + 1;
  }
  return counts;
}

const exhausted = (e: unknown) => isDsecError(e, 'capacity_exhausted');

test('edgeSelector keeps only edges carrying every selected label', () => {
  const edges = [
    edge('cpu', { labels: { pool: 'cpu' } }),
    edge('gpu-a100', { labels: { pool: 'gpu', hardware: 'a100' } }),
    edge('gpu-h200', { labels: { pool: 'gpu', hardware: 'h200' } }),
    edge('bare'),
  ];
  for (const placer of [
    new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(1) }),
    new RandomPlacer({ view: () => ({ edges }), random: seeded(1) }),
    new LeastLoadedPlacer({ view: () => ({ edges }) }),
  ]) {
    const h200 = { ...spec, edgeSelector: { pool: 'gpu', hardware: 'h200' } };
    assert.deepEqual(tally(placer, 20, h200), { 'gpu-h200': 20 });
    const gpu = tally(placer, 60, { ...spec, edgeSelector: { pool: 'gpu' } });
    assert.deepEqual(
      Object.keys(gpu).sort(),
      placer instanceof LeastLoadedPlacer ? ['gpu-a100'] : ['gpu-a100', 'gpu-h200'],
    );
    assert.throws(
      () => placer.place({ spec: { ...spec, edgeSelector: { hardware: 'tpu' } } }),
      exhausted,
    );
    // Inherited properties are not labels.
    assert.throws(
      () => placer.place({ spec: { ...spec, edgeSelector: { toString: 'x' } } }),
      exhausted,
    );
    // An empty selector selects every edge, including one without labels.
    assert.equal(
      placer.place({
        spec: { ...spec, edgeSelector: {} },
        exclude: new Set(['cpu', 'gpu-a100', 'gpu-h200']),
      }),
      'bare',
    );
  }
});

test('a cordoned edge takes nothing, however healthy and empty; the rest of the fleet does', () => {
  const edges = [edge('busy', { used: used(10) }), edge('cordoned', { cordoned: true })];
  for (const placer of [
    new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(3) }),
    new RandomPlacer({ view: () => ({ edges }), random: seeded(3) }),
    new LeastLoadedPlacer({ view: () => ({ edges }) }),
  ]) {
    assert.deepEqual(tally(placer, 20), { busy: 20 });
    assert.throws(() => placer.place({ spec, exclude: new Set(['busy']) }), exhausted);
  }
});

test('sampling falls back to a full scan: the one edge with room is always found', () => {
  const edges = Array.from({ length: 200 }, (_, i) =>
    edge(`e${i}`, i === 137 ? {} : { used: { memoryMb: 64 * 1024, cpuCores: 0, sandboxes: 0 } }),
  );
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(5), overlay: false });
  for (let i = 0; i < 100; i++) assert.equal(placer.place({ spec }), 'e137');
  assert.throws(() => placer.place({ spec, exclude: new Set(['e137']) }), exhausted);
});

test('power-of-2 samples uniformly among the fitting edges', () => {
  // Two full edges never count as samples; among the three that fit, the least
  // loaded wins 2/3 of the time, the middle one 1/3, the most loaded never.
  const edges = [
    edge('full1', { used: { memoryMb: 64 * 1024, cpuCores: 0, sandboxes: 0 } }),
    edge('low', { used: used(10) }),
    edge('full2', { used: { memoryMb: 0, cpuCores: 64, sandboxes: 0 } }),
    edge('mid', { used: used(20) }),
    edge('high', { used: used(30) }),
  ];
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(9), overlay: false });
  const counts = tally(placer, 6000);
  assert.equal(counts['high'] ?? 0, 0);
  assert.ok(Math.abs((counts['low'] ?? 0) - 4000) < 200, JSON.stringify(counts));
  assert.ok(Math.abs((counts['mid'] ?? 0) - 2000) < 200, JSON.stringify(counts));
});

test('without the overlay a burst piles onto what the stale view shows as emptiest', () => {
  const edges = [edge('a', { capacity: SMALL }), edge('b', { capacity: SMALL, used: used(5) })];
  const withOverlay = new PowerOfKPlacer({ view: () => ({ edges }), now: () => 1 });
  const without = new PowerOfKPlacer({ view: () => ({ edges }), now: () => 1, overlay: false });
  // 'a' fits 10, 'b' 5: the overlay fills both exactly; without it 'a' takes everything.
  assert.deepEqual(tally(withOverlay, 15), { a: 10, b: 5 });
  assert.throws(() => withOverlay.place({ spec }), exhausted);
  assert.deepEqual(tally(without, 15), { a: 15 });
  assert.equal(without.inflightCount(), 0);
});

test('overlay entries expire after the TTL and survive an edge leaving the view briefly', () => {
  let now = 0;
  let edges = [edge('a', { capacity: SMALL }), edge('b', { capacity: SMALL })];
  const placer = new PowerOfKPlacer({
    view: () => ({ edges }),
    now: () => now,
    overlayTtlMs: 100,
    random: seeded(2),
  });
  tally(placer, 8);
  assert.equal(placer.inflightCount(), 8);
  const onA = placer.inflightCount('a');
  // 'a' leaves the view and comes back with no newer report: its placements still count.
  now = 10;
  edges = [edges[1]!];
  placer.place({ spec });
  edges = [edge('a', { capacity: SMALL }), edges[0]!];
  assert.equal(placer.inflightCount('a'), onA);
  assert.equal(placer.inflightCount(), 9);
  now = 100; // the first 8 (at t=0) are past the TTL, the 9th (t=10) is not
  assert.equal(placer.inflightCount(), 1);
  now = 110;
  assert.equal(placer.inflightCount(), 0);
});

test('least-loaded on a stale view herds; random ignores load', () => {
  const edges = [
    edge('a', { used: used(3) }),
    edge('b', { used: used(1) }),
    edge('c', { used: used(2) }),
  ];
  assert.deepEqual(tally(new LeastLoadedPlacer({ view: () => ({ edges }) }), 30), { b: 30 });
  const random = tally(new RandomPlacer({ view: () => ({ edges }), random: seeded(4) }), 3000);
  for (const id of ['a', 'b', 'c']) assert.ok((random[id] ?? 0) > 850, JSON.stringify(random));
  // Both still respect room: a full edge is never chosen.
  const full = [edge('x', { used: { memoryMb: 0, cpuCores: 0, sandboxes: 1000 } }), edge('y')];
  assert.deepEqual(tally(new LeastLoadedPlacer({ view: () => ({ edges: full }) }), 5), { y: 5 });
  assert.deepEqual(
    tally(new RandomPlacer({ view: () => ({ edges: full }), random: seeded(4) }), 50),
    { y: 50 },
  );
});

test('burst edges take eligible work only while the on-premise pool is above the threshold', () => {
  const onPremCap = { memoryMb: 1 << 20, cpuCores: 1000, sandboxes: 10 };
  const burstEdge = (id: string, layers?: string[]) =>
    edge(id, { labels: { pool: 'burst' }, ...(layers ? { layers } : {}) });
  let edges = [
    edge('op1', { capacity: onPremCap, used: used(7) }),
    edge('op2', { capacity: onPremCap, used: used(8) }),
    // A burst edge of another backend, or unhealthy, does not count either way.
    edge('op-vm', { backends: ['vm'], capacity: onPremCap }),
    edge('op-sick', { healthy: false, capacity: onPremCap }),
    burstEdge('cloud', ['base:latest', 'py', 'ws:2']),
    burstEdge('cloud-nolayers'),
  ];
  const placer = new PowerOfKPlacer({
    view: () => ({ edges }),
    random: seeded(11),
    now: () => 1,
  });
  // 15/20 = 0.75: at most 0.8, so on-prem only (the overlay brings it to 17/20 after two).
  const first = [placer.place({ spec }), placer.place({ spec })];
  assert.ok(
    first.every((id) => id === 'op1' || id === 'op2'),
    first.join(),
  );
  // 17/20 = 0.85 > 0.8 with the overlay: eligible work may now burst, to the edge holding its layers.
  const counts = tally(placer, 3);
  assert.ok((counts['cloud'] ?? 0) >= 1, JSON.stringify(counts));
  assert.equal(counts['cloud-nolayers'], undefined);
  // Ineligible: a layer the cloud edge lacks. It goes on-prem while there is room, then nowhere.
  const needsMore = { ...spec, workspace: 'ws:3' };
  for (let i = 0; i < 20; i++) {
    let id: string;
    try {
      id = placer.place({ spec: needsMore });
    } catch (e) {
      assert.ok(exhausted(e));
      continue;
    }
    assert.ok(id === 'op1' || id === 'op2', id);
  }
  // Explicit `layers` replace the spec's own: this request needs only `ws:2` and `base`.
  assert.equal(
    placer.place({ spec: { ...spec, toolkits: [] }, layers: ['ws:2', 'base'] }),
    'cloud',
  );

  // A fresh view where the pool is under the threshold again closes the burst pool.
  edges = edges.map((e) =>
    e.edgeId.startsWith('op') ? { ...e, used: used(2), observedAt: 2 } : e,
  );
  const fresh = new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(3), now: () => 3 });
  const calm = tally(fresh, 10);
  assert.equal(calm['cloud'], undefined, JSON.stringify(calm));
});

test('burst label and threshold are configurable; an empty on-premise pool lets eligible work burst', () => {
  const edges = [
    edge('onprem', { capacity: SMALL, used: used(4) }),
    edge('spot', { labels: { tier: 'spot' }, layers: ['base', 'py'] }),
  ];
  const placer = new PowerOfKPlacer({
    view: () => ({ edges }),
    random: seeded(6),
    overlay: false,
    burst: { labelKey: 'tier', labelValue: 'spot', utilisationThreshold: 0.3 },
  });
  // 4/10 > 0.3: both edges are candidates and the empty spot edge is less loaded.
  assert.ok((tally(placer, 40)['spot'] ?? 0) > 20);
  const onlyBurst = [edge('cloud', { labels: { pool: 'burst' }, layers: ['base', 'py'] })];
  const p2 = new PowerOfKPlacer({ view: () => ({ edges: onlyBurst }) });
  assert.equal(p2.place({ spec }), 'cloud');
  assert.throws(() => p2.place({ spec: { ...spec, image: 'other' } }), exhausted);
});

test('instances: own in-flight placements count that many times in ranking, once for room', () => {
  const cap = { memoryMb: 1 << 20, cpuCores: 1000, sandboxes: 10 };
  const edges = [edge('a', { capacity: cap }), edge('b', { capacity: cap, used: used(2) })];
  const seq = (instances: number) => {
    const placer = new PowerOfKPlacer({ view: () => ({ edges }), now: () => 1, instances });
    return [placer.place({ spec }), placer.place({ spec })];
  };
  // Alone, 'a' (1 of 10 in flight) still looks emptier than 'b' (2 used); with two
  // more instances presumed to have done the same, 'a' counts as 3 and 'b' wins.
  assert.deepEqual(seq(1), ['a', 'a']);
  assert.deepEqual(seq(3), ['a', 'b']);
  const tiny = [edge('t', { capacity: { ...cap, sandboxes: 2 } })];
  const placer = new PowerOfKPlacer({ view: () => ({ edges: tiny }), now: () => 1, instances: 4 });
  assert.deepEqual([placer.place({ spec }), placer.place({ spec })], ['t', 't']);
  assert.throws(() => placer.place({ spec }), exhausted);

  // The burst gate uses the same estimate: 6 of 10 used, each own placement counts twice.
  const pool = [
    edge('op', { capacity: cap, used: used(6) }),
    edge('cloud', { labels: { pool: 'burst' }, layers: ['base', 'py'] }),
  ];
  const two = new PowerOfKPlacer({ view: () => ({ edges: pool }), now: () => 1, instances: 2 });
  // 0.6, then 0.8 (not above the threshold), then 1.0: the third request may burst.
  assert.deepEqual(
    [two.place({ spec }), two.place({ spec }), two.place({ spec })],
    ['op', 'op', 'cloud'],
  );
});

test('a burst edge holds a layer for a request only as the platform’s or a project of its view', () => {
  // EdgeStatus.layers are layer keys; another tenant's snapshot of the name never counts.
  const edges = [
    edge('op', { capacity: SMALL, used: used(10) }),
    edge('cloud', {
      labels: { pool: 'burst' },
      layers: ['base:latest', 'prj-b/snap:latest', 'prj-root/env:v2'],
    }),
  ];
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), overlay: false });
  const wants = (image: string, layerView?: string[]) => () =>
    placer.place({ spec: { ...spec, image, toolkits: [] }, ...(layerView ? { layerView } : {}) });
  assert.equal(wants('base')(), 'cloud');
  assert.throws(wants('snap', ['prj-root', 'prj-a']), exhausted, 'B’s layer is not A’s');
  assert.throws(wants('snap'), exhausted, 'nor the platform’s');
  assert.equal(wants('snap', ['prj-root', 'prj-b'])(), 'cloud');
  assert.equal(wants('env:v2', ['prj-root', 'prj-a'])(), 'cloud', 'an ancestor’s counts');
  // Explicit layers name keys of the same form.
  assert.equal(placer.place({ spec, layers: ['base', 'prj-b/snap'] }), 'cloud');
});
