import { test } from 'node:test';
import assert from 'node:assert/strict';
import { interleave, ratio, summarize } from './stats.js';

test('summarize picks nearest-rank percentiles', () => {
  const s = summarize(Array.from({ length: 100 }, (_, i) => i + 1));
  assert.equal(s.p50Ms, 50);
  assert.equal(s.p99Ms, 99);
  assert.equal(s.minMs, 1);
  assert.equal(s.maxMs, 100);
  assert.equal(s.n, 100);
});

test('ratio is ours over peer and null without a peer', () => {
  const a = summarize([10]);
  assert.equal(ratio(a, summarize([20])), 0.5);
  assert.equal(ratio(a, undefined), null);
});

test('interleave runs blocks of consecutive calls, rotating the first system', async () => {
  const order: string[] = [];
  const system = (name: string) => async (i: number) => void order.push(`${name}${i}`);
  const results = await interleave(
    { a: system('a'), b: system('b') },
    { iterations: 4, warmup: 1, block: 2 },
  );
  // Rounds of two calls each: a0 a1 b0 b1, then b2 b3 a2 a3, then a4 b4 (the last, short round).
  assert.deepEqual(order, ['a0', 'a1', 'b0', 'b1', 'b2', 'b3', 'a2', 'a3', 'a4', 'b4']);
  assert.equal(results.a!.n, 4);
  assert.equal(results.b!.n, 4);
});
