import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { PowerOfKPlacer } from './index.js';
import type { PlacementEdge } from './index.js';

const spec: SandboxSpec = {
  backend: 'container',
  image: 'base',
  toolkits: [],
  memoryLimitMb: 512,
  cpuCoresLimit: 1,
  pidsLimit: 1024,
  ttlSeconds: 60,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

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

/** Deterministic PRNG (mulberry32) so the distribution checks never flake. */
function seeded(seed: number): () => number {
  let a = seed;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

test('spreads evenly over equal edges and avoids the loaded one', () => {
  let now = 1;
  const edges = [
    edge('a'),
    edge('b'),
    edge('c'),
    edge('d', { used: { memoryMb: 60 * 1024, cpuCores: 60, sandboxes: 900 } }),
  ];
  const placer = new PowerOfKPlacer({
    view: () => ({ edges }),
    random: seeded(7),
    now: () => now,
    overlayTtlMs: 1,
  });
  const counts: Record<string, number> = {};
  for (let i = 0; i < 3000; i++) {
    now += 10; // every placement is already "seen" by the view: no overlay carry-over
    const id = placer.place({ spec });
    counts[id] = (counts[id] ?? 0) + 1;
  }
  // With k=2 the loaded edge wins only when both samples are it, which cannot happen without replacement.
  assert.equal(counts['d'] ?? 0, 0);
  for (const id of ['a', 'b', 'c']) assert.ok((counts[id] ?? 0) > 700, `${id}: ${counts[id]}`);
});

test('filters unhealthy, excluded, wrong-backend and full edges', () => {
  const edges = [
    edge('sick', { healthy: false }),
    edge('vm-only', { backends: ['vm'] }),
    edge('full', { used: { memoryMb: 64 * 1024 - 100, cpuCores: 0, sandboxes: 0 } }),
    edge('ok'),
    edge('other'),
  ];
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(1) });
  for (let i = 0; i < 50; i++) {
    assert.equal(placer.place({ spec, exclude: new Set(['other']) }), 'ok');
  }
  assert.throws(
    () => placer.place({ spec, exclude: new Set(['ok', 'other']) }),
    (e) => isDsecError(e, 'capacity_exhausted'),
  );
  assert.throws(
    () => placer.place({ spec: { ...spec, backend: 'microvm' } }),
    (e) => isDsecError(e, 'capacity_exhausted'),
  );
});

test('the overlay counts in-flight placements until the view catches up', () => {
  let now = 1000;
  let edges = [
    edge('a', { capacity: { memoryMb: 1 << 20, cpuCores: 100, sandboxes: 2 }, observedAt: 900 }),
  ];
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), now: () => now });
  assert.equal(placer.place({ spec }), 'a');
  assert.equal(placer.place({ spec }), 'a');
  // The view still says 0 used, but two placements are in flight: the edge is full.
  assert.throws(
    () => placer.place({ spec }),
    (e) => isDsecError(e, 'capacity_exhausted'),
  );
  assert.equal(placer.inflightCount('a'), 2);
  // The edge reports after those placements, with one of them running.
  now += 5;
  // A new report is a new snapshot (views are immutable).
  edges = [{ ...edges[0]!, used: { memoryMb: 512, cpuCores: 1, sandboxes: 1 }, observedAt: now }];
  now += 5;
  assert.equal(placer.place({ spec }), 'a');
  assert.equal(placer.inflightCount('a'), 1);
});

test('the overlay steers a burst away from the edge it just filled', () => {
  const small = { memoryMb: 1 << 20, cpuCores: 100, sandboxes: 10 };
  const edges = [edge('a', { capacity: small }), edge('b', { capacity: small })];
  const placer = new PowerOfKPlacer({ view: () => ({ edges }), random: seeded(3), now: () => 5 });
  const counts: Record<string, number> = {};
  for (let i = 0; i < 20; i++) {
    const id = placer.place({ spec });
    counts[id] = (counts[id] ?? 0) + 1;
  }
  assert.deepEqual(counts, { a: 10, b: 10 });
});
