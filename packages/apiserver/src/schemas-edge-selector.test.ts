import { test } from 'node:test';
import assert from 'node:assert/strict';
import { CreateSandboxBody, toSandboxSpec } from './schemas.js';

test('edgeSelector: small label keys and values, carried into the spec', () => {
  const ok = CreateSandboxBody.parse({
    image: 'base',
    edgeSelector: { pool: 'gpu', hardware: 'h200', 'topology.dsec/zone': 'eu-1:a' },
  });
  assert.deepEqual(toSandboxSpec(ok).edgeSelector, {
    pool: 'gpu',
    hardware: 'h200',
    'topology.dsec/zone': 'eu-1:a',
  });
  // Absent or empty: no selector in the spec (any edge).
  assert.equal('edgeSelector' in toSandboxSpec(CreateSandboxBody.parse({ image: 'base' })), false);
  assert.equal(
    'edgeSelector' in toSandboxSpec(CreateSandboxBody.parse({ image: 'base', edgeSelector: {} })),
    false,
  );
  for (const bad of [
    { '': 'x' },
    { '-pool': 'gpu' },
    { pool: 'g p u' },
    { pool: 'x'.repeat(64) },
    { ['k'.repeat(64)]: 'v' },
    { pool: 1 },
    Object.fromEntries(Array.from({ length: 17 }, (_, i) => [`k${i}`, 'v'])),
  ]) {
    const r = CreateSandboxBody.safeParse({ image: 'base', edgeSelector: bad });
    assert.equal(r.success, false, JSON.stringify(bad));
    assert.equal(r.error?.issues[0]?.path[0], 'edgeSelector');
  }
});
