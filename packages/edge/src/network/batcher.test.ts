import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';
import { isDsecError } from '@dsec/core';
import { bisect, MicroBatcher } from './batcher.js';
import { IpSession } from './sys.js';

describe('MicroBatcher', () => {
  it('runs the callers of one tick as one batch and later callers as the next', async () => {
    const batches: number[][] = [];
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const b = new MicroBatcher<number, number>(async (items) => {
      batches.push(items);
      if (batches.length === 1) await gate;
      return items.map((i) => ({ status: 'fulfilled', value: i * 10 }));
    });
    const first = [1, 2, 3].map((i) => b.submit(i));
    await new Promise((resolve) => setImmediate(resolve));
    // The first batch is running: these wait and go together.
    const second = [4, 5].map((i) => b.submit(i));
    release();
    assert.deepEqual(await Promise.all([...first, ...second]), [10, 20, 30, 40, 50]);
    assert.deepEqual(batches, [
      [1, 2, 3],
      [4, 5],
    ]);
    await b.idle();
  });

  it('gives each caller its own outcome, and a thrown batch fails all of its callers', async () => {
    const b = new MicroBatcher<number, number>(async (items) => {
      if (items.includes(0)) throw new Error('whole batch');
      return items.map((i) =>
        i < 0
          ? { status: 'rejected', reason: new Error(`bad ${i}`) }
          : { status: 'fulfilled', value: i },
      );
    });
    const [ok, bad] = await Promise.allSettled([b.submit(1), b.submit(-1)]);
    assert.deepEqual(ok, { status: 'fulfilled', value: 1 });
    assert.equal(bad?.status, 'rejected');
    const all = await Promise.allSettled([b.submit(0), b.submit(2)]);
    assert.deepEqual(
      all.map((r) => r.status),
      ['rejected', 'rejected'],
    );
  });
});

describe('bisect', () => {
  it('isolates the items that fail an all-or-nothing run', async () => {
    const runs: string[][] = [];
    const results = await bisect(['a', 'b', 'bad', 'c', 'd'], async (items) => {
      runs.push(items);
      if (items.includes('bad')) throw new Error('bad item in run');
    });
    assert.deepEqual(
      results.map((r) => r.status),
      ['fulfilled', 'fulfilled', 'rejected', 'fulfilled', 'fulfilled'],
    );
    // Every good item was applied in some run that succeeded.
    const applied = runs.filter((r) => !r.includes('bad')).flat();
    assert.deepEqual(applied.sort(), ['a', 'b', 'c', 'd']);
  });
});

const hasIp = spawnSync('ip', ['-V']).status === 0;

describe('IpSession', { skip: hasIp ? false : 'needs iproute2' }, () => {
  it('runs requests through one process and names the ones that fail', async () => {
    const ip = new IpSession();
    try {
      const outcomes = await Promise.allSettled([
        ip.run(['link show dev lo']),
        ip.run(['link show dev lo', 'link show dev dsnosuch0', 'link show dev lo']),
        ip.run(['link show dev lo']),
      ]);
      assert.equal(outcomes[0]?.status, 'fulfilled');
      assert.equal(outcomes[2]?.status, 'fulfilled');
      const failed = outcomes[1];
      assert.ok(failed?.status === 'rejected');
      assert.ok(isDsecError(failed.reason, 'internal'));
      assert.match(failed.reason.message, /dsnosuch0/);
      // After a failure the session starts a fresh process and goes on.
      await ip.run(['link show dev lo']);
    } finally {
      ip.close();
    }
  });
});
