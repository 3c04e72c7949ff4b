import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { wantedWorkers, workersToRetire, workersToStart, type PoolSizing } from './sizing.js';

const sizing: PoolSizing = { min: 1, max: 8, spare: 1, maxStarting: 3, idleRetireMs: 60_000 };
const counts = (c: Partial<{ idle: number; busy: number; starting: number; queued: number }>) => ({
  idle: 0,
  busy: 0,
  starting: 0,
  queued: 0,
  ...c,
});

void describe('fncall pool sizing', () => {
  test('an empty pool starts its warm minimum', () => {
    assert.equal(workersToStart(counts({}), sizing), 1);
    assert.equal(workersToStart(counts({}), { ...sizing, min: 0 }), 0);
  });

  test('queued calls grow the pool by the queue plus a spare, a few starts at a time', () => {
    assert.equal(wantedWorkers(counts({ busy: 2, queued: 3 }), sizing), 6);
    assert.equal(workersToStart(counts({ busy: 2, queued: 3 }), sizing), 3);
    // Starts in flight count: no second wave for the same queue.
    assert.equal(workersToStart(counts({ busy: 2, queued: 3, starting: 3 }), sizing), 0);
    assert.equal(workersToStart(counts({ busy: 2, queued: 3, starting: 1 }), sizing), 2);
  });

  test('never past max, whatever the queue', () => {
    assert.equal(wantedWorkers(counts({ busy: 8, queued: 100 }), sizing), 8);
    assert.equal(workersToStart(counts({ busy: 7, queued: 100 }), sizing), 1);
    assert.equal(workersToStart(counts({ busy: 8, queued: 100 }), sizing), 0);
  });

  test('a busy pool keeps one spare ready, an idle one shrinks to min', () => {
    assert.equal(workersToStart(counts({ busy: 3 }), sizing), 1);
    assert.equal(workersToStart(counts({ busy: 3, idle: 1 }), sizing), 0);
    assert.equal(wantedWorkers(counts({ idle: 5 }), sizing), 1);
  });

  test('idle workers retire after idleRetireMs, longest unused first, down to the wanted size', () => {
    const now = 1_000_000;
    const idle = [
      { id: 'a', idleSinceMs: now - 10_000 },
      { id: 'b', idleSinceMs: now - 120_000 },
      { id: 'c', idleSinceMs: now - 90_000 },
      { id: 'd', idleSinceMs: now - 200_000 },
    ];
    const c = counts({ idle: 4 });
    assert.deepEqual(
      workersToRetire(idle, c, sizing, now).map((w) => w.id),
      ['d', 'b', 'c'],
    );
    // With demand the spare and the busy ones are kept.
    assert.deepEqual(
      workersToRetire(idle, counts({ idle: 4, busy: 2, queued: 1 }), sizing, now).map((w) => w.id),
      ['d', 'b'],
    );
    // Nobody idle long enough: nothing retires.
    assert.deepEqual(workersToRetire(idle, c, sizing, now - 150_000), []);
    assert.deepEqual(workersToRetire(idle, c, { ...sizing, min: 4 }, now), []);
  });
});
