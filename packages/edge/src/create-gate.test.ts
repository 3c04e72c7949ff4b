import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { isDsecError } from '@dsec/core';
import { CreateGate } from './create-gate.js';

/** A start that finishes when told to. */
function pending() {
  let finish!: () => void;
  const done = new Promise<void>((resolve) => (finish = resolve));
  return { start: () => done, finish };
}

describe('CreateGate', () => {
  it('runs at most maxInProgress starts at once, the rest in arrival order', async () => {
    const gate = new CreateGate({ maxInProgress: 2 });
    const order: number[] = [];
    const starts = [0, 1, 2, 3].map(() => pending());
    const runs = starts.map((s, i) =>
      gate.run(async () => {
        order.push(i);
        await s.start();
      }),
    );
    await new Promise((resolve) => setImmediate(resolve));
    assert.deepEqual(order, [0, 1]);
    assert.deepEqual(gate.stats, { inProgress: 2, queued: 2 });
    starts[1]!.finish();
    await runs[1];
    await new Promise((resolve) => setImmediate(resolve));
    assert.deepEqual(order, [0, 1, 2]);
    for (const s of starts) s.finish();
    await Promise.all(runs);
    assert.deepEqual(order, [0, 1, 2, 3]);
    assert.deepEqual(gate.stats, { inProgress: 0, queued: 0 });
  });

  it('a failed start frees its slot', async () => {
    const gate = new CreateGate({ maxInProgress: 1 });
    await assert.rejects(
      gate.run(() => Promise.reject(new Error('boom'))),
      /boom/,
    );
    assert.equal(await gate.run(async () => 7), 7);
  });

  it('a waiting create whose caller gives up leaves the queue without starting', async () => {
    const gate = new CreateGate({ maxInProgress: 1 });
    const first = pending();
    const running = gate.run(first.start);
    const ac = new AbortController();
    let started = false;
    const waiting = gate.run(async () => {
      started = true;
    }, ac.signal);
    ac.abort();
    await assert.rejects(waiting, (e) => isDsecError(e, 'aborted'));
    assert.deepEqual(gate.stats, { inProgress: 1, queued: 0 });
    first.finish();
    await running;
    assert.equal(started, false);
  });

  it('refuses with capacity_exhausted a create that waited too long', async () => {
    const gate = new CreateGate({ maxInProgress: 1, maxQueueWaitMs: 5 });
    const first = pending();
    const running = gate.run(first.start);
    // The gate's timer does not hold a process open; this test's process must stay up for it.
    const keepAlive = setInterval(() => undefined, 1000);
    await assert.rejects(
      gate.run(async () => undefined),
      (e) => isDsecError(e, 'capacity_exhausted'),
    );
    clearInterval(keepAlive);
    first.finish();
    await running;
    assert.deepEqual(gate.stats, { inProgress: 0, queued: 0 });
  });
});
