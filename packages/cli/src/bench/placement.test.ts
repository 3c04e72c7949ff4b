import { test } from 'node:test';
import assert from 'node:assert/strict';
import { benchPlacement, PLACEMENT_STRATEGIES, simulatePlacement } from './placement.js';
import type { PlacementStrategy } from './placement.js';

const small = {
  nodes: 16,
  requests: 3000,
  instances: 2,
  burstMs: 1000,
  viewIntervalMs: 250,
  k: 2,
  seed: 3,
};

test('the simulation conserves requests and never overfills an edge', () => {
  // 16 edges (12 of 1000 sandboxes, 4 of 2000) are too small for everything to fit
  // under leastLoadedStale's herding; the others place all of it.
  for (const strategy of PLACEMENT_STRATEGIES) {
    const out = simulatePlacement(strategy, small);
    assert.equal(out.placed + out.failures, small.requests, strategy);
    assert.equal(
      out.fleet.sandboxes.reduce((a, b) => a + b, 0),
      out.placed,
      strategy,
    );
    // Every place() call either placed, was refused by the edge, or found no edge.
    assert.ok(out.decisions >= out.placed + out.refusals, strategy);
    out.fleet.sandboxes.forEach((n, i) => {
      const cap = out.fleet.capacity[i]!;
      assert.ok(n <= cap.sandboxes, `${strategy} edge ${i}`);
      assert.ok(out.fleet.memoryMb[i]! <= cap.memoryMb, `${strategy} edge ${i}`);
      assert.ok(out.fleet.cpuCores[i]! <= cap.cpuCores + 1e-6, `${strategy} edge ${i}`);
    });
    assert.ok(out.imbalance >= 1 && out.maxLoad >= out.meanLoad, strategy);
  }
});

test('views refresh on each instance’s staggered schedule', () => {
  const out = simulatePlacement('powerOfKOverlay', small);
  // Instance 0 at 0, 250, 500, 750; instance 1 at 0, 125, 375, 625, 875.
  assert.deepEqual(out.refreshes, [4, 5]);
  const never = simulatePlacement('powerOfKOverlay', { ...small, viewIntervalMs: 5000 });
  assert.deepEqual(never.refreshes, [1, 1]);
});

test('a stale view herds least-loaded onto one edge; fresher views and power-of-k spread', () => {
  const cfg = { ...small, requests: 1000 };
  // Never refreshed: every view shows an empty fleet, the emptiest-looking edge is the
  // same for every decision, and an apiserver tries 3 edges, so at most three edges
  // ever get anything (and each refuses once full).
  const stale = simulatePlacement('leastLoadedStale', { ...cfg, viewIntervalMs: 5000 });
  assert.ok(stale.fleet.sandboxes.filter((n) => n > 0).length <= 3, JSON.stringify(stale.fleet));
  assert.ok(stale.refusals > 0, JSON.stringify(stale));
  // Refreshed before every decision of each instance, least-loaded is exact.
  const fresh = simulatePlacement('leastLoadedStale', {
    ...cfg,
    viewIntervalMs: cfg.burstMs / cfg.requests,
  });
  assert.equal(fresh.refusals, 0);
  assert.ok(fresh.imbalance < 1.3, `fresh ${fresh.imbalance}`);
  assert.ok(stale.imbalance > 3 * fresh.imbalance, `stale ${stale.imbalance}`);

  const by = (s: PlacementStrategy) => simulatePlacement(s, small).imbalance;
  assert.ok(by('powerOfKOverlay') < by('random'));
  assert.ok(by('random') < by('leastLoadedStale'));
});

test('the same seed makes the same decisions', () => {
  const a = simulatePlacement('powerOfKOverlay', small);
  const b = simulatePlacement('powerOfKOverlay', small);
  assert.deepEqual(a.fleet, b.fleet);
  const c = simulatePlacement('powerOfKOverlay', { ...small, seed: 4 });
  assert.notDeepEqual(a.fleet.sandboxes, c.fleet.sandboxes);
});

test('benchPlacement reports every strategy under its JSON key', async () => {
  let last = 0;
  const report = await benchPlacement({
    ...small,
    onProgress: (done, total) => {
      assert.ok(done >= last && done <= total);
      last = done;
    },
  });
  assert.equal(report.benchmark, 'placement');
  assert.deepEqual(Object.keys(report.results), [...PLACEMENT_STRATEGIES]);
  for (const r of Object.values(report.results)) {
    assert.ok(r.decisionsPerSecond > 0 && Number.isFinite(r.imbalance));
  }
  assert.equal(last, PLACEMENT_STRATEGIES.length * small.requests);
  assert.deepEqual(report.view, {
    intervalMs: 250,
    refreshesPerInstance: 4,
    decisionsPerRefresh: 750,
    ownDecisionsPerRefresh: 375,
  });
  await assert.rejects(benchPlacement({ ...small, nodes: 0 }), /--nodes/);
});
