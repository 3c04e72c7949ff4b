import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ratio, summarize } from './stats.js';

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
