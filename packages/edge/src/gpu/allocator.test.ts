import { test } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { GpuAllocator, gpuModelMatches, isMigProfile } from './allocator.js';
import type { GpuAllocatorOptions } from './allocator.js';
import { discoverGpuInventory } from './discover.js';
import { A100_MIG_NODE, A100_MIG_UUIDS, fixtureProbe, H200_NODE } from './gpu-fixtures.js';

const h200 = await discoverGpuInventory({ probe: fixtureProbe(H200_NODE) });
const a100 = await discoverGpuInventory({ probe: fixtureProbe(A100_MIG_NODE) });

const indexes = (a: { units: { kind: string; index?: number }[] }) =>
  a.units.map((u) => (u.kind === 'gpu' ? u.index : -1));

function exhausted(details: Record<string, unknown>) {
  return (e: unknown) =>
    isDsecError(e, 'capacity_exhausted') &&
    Object.entries(details).every(([k, v]) => e.details?.[k] === v);
}

test('exclusive: one worker per GPU, lowest index first, then capacity_exhausted with details', () => {
  const alloc = new GpuAllocator(h200);
  for (let w = 0; w < 8; w++) {
    assert.deepEqual(indexes(alloc.assign(`w${w}`, { mode: 'exclusive' })), [w]);
  }
  assert.throws(
    () => alloc.assign('w8', { mode: 'exclusive' }),
    exhausted({ resource: 'gpu', mode: 'exclusive', count: 1, matching: 8, available: 0 }),
  );
  // The refusal changed nothing.
  assert.equal(alloc.assignmentOf('w8'), undefined);
  assert.ok(alloc.status().every((s) => s.mode === 'exclusive' && s.workers.length === 1));
});

test('release frees the units for reuse, and only once', () => {
  const alloc = new GpuAllocator(h200);
  for (let w = 0; w < 8; w++) alloc.assign(`w${w}`, { mode: 'exclusive' });
  assert.equal(alloc.release('w3'), true);
  assert.equal(alloc.release('w3'), false);
  assert.equal(alloc.release('never'), false);
  assert.deepEqual(indexes(alloc.assign('w9', { mode: 'exclusive' })), [3]);
  // A released worker ID may be assigned again.
  alloc.release('w0');
  assert.deepEqual(indexes(alloc.assign('w3', { mode: 'exclusive' })), [0]);
});

test('count > 1: distinct units, all or none', () => {
  const alloc = new GpuAllocator(h200);
  assert.deepEqual(indexes(alloc.assign('a', { mode: 'exclusive', count: 3 })), [0, 1, 2]);
  assert.deepEqual(indexes(alloc.assign('b', { mode: 'exclusive', count: 4 })), [3, 4, 5, 6]);
  assert.throws(
    () => alloc.assign('c', { mode: 'exclusive', count: 2 }),
    exhausted({ count: 2, matching: 8, available: 1 }),
  );
  // Nothing was taken by the refused request: the last GPU is still free.
  assert.deepEqual(indexes(alloc.assign('d', { mode: 'exclusive' })), [7]);
  alloc.release('b');
  assert.deepEqual(indexes(alloc.assign('c', { mode: 'exclusive', count: 2 })), [3, 4]);
  assert.throws(
    () => new GpuAllocator(h200).assign('x', { mode: 'exclusive', count: 9 }),
    exhausted({ matching: 8, available: 8 }),
  );
});

test('shared spread: least-loaded first, up to N per GPU, then exhausted', () => {
  const small = { ...h200, gpus: h200.gpus.slice(0, 2) };
  const alloc = new GpuAllocator(small, { maxSharedWorkersPerUnit: 3 });
  const placed = Array.from(
    { length: 6 },
    (_, w) => indexes(alloc.assign(`s${w}`, { mode: 'shared' }))[0],
  );
  assert.deepEqual(placed, [0, 1, 0, 1, 0, 1]);
  assert.throws(
    () => alloc.assign('s6', { mode: 'shared' }),
    exhausted({ mode: 'shared', matching: 2, available: 0, maxSharedWorkersPerUnit: 3 }),
  );
  // Freeing one slot on GPU 1 makes GPU 1 the only (and least-loaded) choice.
  alloc.release('s3');
  assert.deepEqual(indexes(alloc.assign('s7', { mode: 'shared' })), [1]);
  assert.deepEqual(alloc.status()[0]?.workers, ['s0', 's2', 's4']);
  // Shared count 2 takes the two least-loaded distinct GPUs.
  const fresh = new GpuAllocator(h200, { maxSharedWorkersPerUnit: 2 });
  fresh.assign('x', { mode: 'shared', count: 2 });
  assert.deepEqual(indexes(fresh.assign('y', { mode: 'shared', count: 2 })), [2, 3]);
});

test('shared pack: fill a shared GPU before opening a free one', () => {
  const options: GpuAllocatorOptions = { maxSharedWorkersPerUnit: 2, sharedPlacement: 'pack' };
  const alloc = new GpuAllocator(h200, options);
  const placed = Array.from(
    { length: 5 },
    (_, w) => indexes(alloc.assign(`p${w}`, { mode: 'shared' }))[0],
  );
  assert.deepEqual(placed, [0, 0, 1, 1, 2]);
  alloc.release('p0');
  // GPU 0 has one worker, GPU 2 one: the lower index wins the tie.
  assert.deepEqual(indexes(alloc.assign('p5', { mode: 'shared' })), [0]);
});

test('modes never mix on one unit', () => {
  const two = { ...h200, gpus: h200.gpus.slice(0, 2) };
  const alloc = new GpuAllocator(two, { maxSharedWorkersPerUnit: 4 });
  alloc.assign('ex', { mode: 'exclusive' }); // GPU 0
  // Shared workers go around the exclusive GPU, even though GPU 1 then holds them all.
  for (let w = 0; w < 4; w++)
    assert.deepEqual(indexes(alloc.assign(`s${w}`, { mode: 'shared' })), [1]);
  assert.throws(() => alloc.assign('s4', { mode: 'shared' }), exhausted({ available: 0 }));
  // An exclusive request may not take a GPU that has shared workers, however few.
  for (let w = 1; w < 4; w++) alloc.release(`s${w}`);
  assert.throws(
    () => alloc.assign('ex2', { mode: 'exclusive' }),
    exhausted({ mode: 'exclusive', matching: 2, available: 0 }),
  );
  alloc.release('s0');
  assert.deepEqual(indexes(alloc.assign('ex2', { mode: 'exclusive' })), [1]);
  // Released to free, the exclusive GPU takes shared workers again.
  alloc.release('ex');
  assert.deepEqual(indexes(alloc.assign('s9', { mode: 'shared' })), [0]);
});

test('MIG: instances are selected by profile, never as "a GPU"; the MIG GPU is not whole', () => {
  const alloc = new GpuAllocator(a100);
  const one = alloc.assign('m1', { mode: 'exclusive', model: '1g.10gb' });
  assert.deepEqual(
    one.units.map((u) => [u.kind, u.uuid]),
    [['mig', A100_MIG_UUIDS.g1a]],
  );
  assert.equal(
    alloc.assign('m2', { mode: 'exclusive', model: '1G.10GB' }).units[0]?.uuid,
    A100_MIG_UUIDS.g1b,
  );
  assert.throws(
    () => alloc.assign('m3', { mode: 'exclusive', model: '1g.10gb' }),
    exhausted({ model: '1g.10gb', matching: 2, available: 0 }),
  );
  assert.equal(
    alloc.assign('m4', { mode: 'exclusive', model: '3g.40gb' }).units[0]?.uuid,
    A100_MIG_UUIDS.g3,
  );
  // A plain request gets the one whole GPU (index 1), not GPU 0 in MIG mode.
  assert.deepEqual(indexes(alloc.assign('g', { mode: 'exclusive', model: 'A100' })), [1]);
  assert.throws(
    () => alloc.assign('g2', { mode: 'exclusive' }),
    exhausted({ matching: 1, available: 0 }),
  );
  // A profile this node lacks.
  assert.throws(
    () => alloc.assign('x', { mode: 'exclusive', model: '2g.20gb' }),
    exhausted({ matching: 0 }),
  );
  // Releasing one MIG instance frees exactly it.
  alloc.release('m1');
  assert.equal(
    alloc.assign('m5', { mode: 'exclusive', model: '1g.10gb' }).units[0]?.uuid,
    A100_MIG_UUIDS.g1a,
  );
  // Shared on a MIG instance: the same packing rules, per instance.
  const shared = new GpuAllocator(a100, { maxSharedWorkersPerUnit: 2 });
  const uuids = ['a', 'b', 'c', 'd'].map(
    (w) => shared.assign(w, { mode: 'shared', model: '1g.10gb' }).units[0]?.uuid,
  );
  assert.deepEqual(uuids, [
    A100_MIG_UUIDS.g1a,
    A100_MIG_UUIDS.g1b,
    A100_MIG_UUIDS.g1a,
    A100_MIG_UUIDS.g1b,
  ]);
});

test('model filter by GPU name words', () => {
  assert.ok(gpuModelMatches('NVIDIA H200', 'H200'));
  assert.ok(gpuModelMatches('NVIDIA H200', 'nvidia h200'));
  assert.ok(gpuModelMatches('NVIDIA A100-SXM4-80GB', 'A100-80GB'));
  assert.ok(gpuModelMatches('NVIDIA A100-SXM4-80GB', 'NVIDIA A100-SXM4-80GB'));
  assert.ok(!gpuModelMatches('NVIDIA A100-SXM4-40GB', 'A100-80GB'));
  assert.ok(!gpuModelMatches('NVIDIA H200', 'H20'));
  assert.ok(!gpuModelMatches('NVIDIA H200', 'NVIDIA'));
  assert.ok(isMigProfile('1g.10gb') && isMigProfile('1g.10gb+me') && isMigProfile('1c.3g.40gb'));
  assert.ok(!isMigProfile('A100-80GB') && !isMigProfile('H200'));
  const alloc = new GpuAllocator(h200);
  assert.throws(
    () => alloc.assign('x', { mode: 'exclusive', model: 'A100' }),
    exhausted({ model: 'A100', matching: 0, available: 0 }),
  );
  assert.deepEqual(
    indexes(alloc.assign('y', { mode: 'exclusive', model: 'H200', count: 2 })),
    [0, 1],
  );
});

test('malformed requests and a second assignment are refused with their codes', () => {
  const alloc = new GpuAllocator(a100);
  const bad = (field: string) => (e: unknown) =>
    isDsecError(e, 'invalid_argument') && e.field === field;
  assert.throws(() => alloc.assign('w', { mode: 'both' as 'shared' }), bad('gpu.mode'));
  assert.throws(() => alloc.assign('w', { mode: 'shared', count: 0 }), bad('gpu.count'));
  assert.throws(() => alloc.assign('w', { mode: 'shared', count: 1.5 }), bad('gpu.count'));
  assert.throws(() => alloc.assign('w', { mode: 'shared', count: 65 }), bad('gpu.count'));
  assert.throws(
    () => alloc.assign('w', { mode: 'exclusive', model: '1g.10gb', count: 2 }),
    bad('gpu.count'),
  );
  alloc.assign('w', { mode: 'shared' });
  assert.throws(
    () => alloc.assign('w', { mode: 'shared' }),
    (e) => isDsecError(e, 'conflict'),
  );
  assert.throws(
    () => new GpuAllocator(a100, { maxSharedWorkersPerUnit: 0 }),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('deterministic: the same requests give the same assignments', () => {
  const run = () => {
    const alloc = new GpuAllocator(h200, { maxSharedWorkersPerUnit: 3 });
    const out: string[][] = [];
    const reqs = [
      { mode: 'exclusive', count: 2 },
      { mode: 'shared' },
      { mode: 'shared', count: 3 },
      { mode: 'exclusive' },
      { mode: 'shared' },
    ] as const;
    reqs.forEach((r, i) => out.push(alloc.assign(`w${i}`, r).units.map((u) => u.uuid)));
    alloc.release('w1');
    out.push(alloc.assign('w9', { mode: 'shared', count: 2 }).units.map((u) => u.uuid));
    return out;
  };
  assert.deepEqual(run(), run());
});

test('property: any sequence of assigns and releases keeps every unit consistent', () => {
  const requests = fc.record({
    mode: fc.constantFrom('shared' as const, 'exclusive' as const),
    count: fc.option(fc.integer({ min: 1, max: 4 }), { nil: undefined }),
    model: fc.option(fc.constantFrom('1g.10gb', '3g.40gb', 'A100', 'H200', 'B200'), {
      nil: undefined,
    }),
  });
  const op = fc.oneof(
    fc.record({ kind: fc.constant('assign' as const), worker: fc.nat(12), request: requests }),
    fc.record({ kind: fc.constant('release' as const), worker: fc.nat(12) }),
  );
  fc.assert(
    fc.property(
      fc.constantFrom(h200, a100),
      fc.integer({ min: 1, max: 3 }),
      fc.array(op, { maxLength: 60 }),
      (inventory, maxShared, ops) => {
        const alloc = new GpuAllocator(inventory, { maxSharedWorkersPerUnit: maxShared });
        const held = new Map<string, string[]>();
        for (const o of ops) {
          const w = `w${o.worker}`;
          if (o.kind === 'release') {
            assert.equal(alloc.release(w), held.delete(w));
            continue;
          }
          try {
            const a = alloc.assign(w, o.request);
            assert.ok(!held.has(w));
            assert.equal(a.units.length, o.request.count ?? 1);
            assert.equal(new Set(a.units.map((u) => u.uuid)).size, a.units.length);
            for (const u of a.units) {
              if (o.request.model === undefined) assert.equal(u.kind, 'gpu');
              else if (isMigProfile(o.request.model))
                assert.equal(u.kind === 'mig' && u.profile, o.request.model);
              else assert.ok(u.kind === 'gpu' && gpuModelMatches(u.name, o.request.model));
            }
            held.set(
              w,
              a.units.map((u) => u.uuid),
            );
          } catch (e) {
            // A refusal is one of the documented codes and leaves nothing behind.
            assert.ok(
              isDsecError(e, 'capacity_exhausted') ||
                isDsecError(e, 'conflict') ||
                isDsecError(e, 'invalid_argument'),
            );
            if (isDsecError(e, 'conflict')) assert.ok(held.has(w));
          }
          for (const s of alloc.status()) {
            const holders = [...held]
              .filter(([, uuids]) => uuids.includes(s.unit.uuid))
              .map(([x]) => x);
            assert.deepEqual([...s.workers].sort(), holders.sort());
            if (s.mode === 'free') assert.equal(s.workers.length, 0);
            if (s.mode === 'exclusive') assert.equal(s.workers.length, 1);
            if (s.mode === 'shared')
              assert.ok(s.workers.length >= 1 && s.workers.length <= maxShared);
            for (const x of s.workers) assert.equal(alloc.assignmentOf(x)?.mode, s.mode);
          }
        }
      },
    ),
    { numRuns: 300 },
  );
});
