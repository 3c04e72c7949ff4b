import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  PYTHON_PROVIDERS,
  SDK_PROVIDER_TARGET_RATIO,
  medianRatios,
  sdkRatios,
  sdkTargetsMet,
  type SdkRatios,
  type SdkSystem,
} from './sdk.js';
import { summarize, type LatencySummary } from './stats.js';

const at = (p50: number) => summarize([p50]);
const results = (overrides: Partial<Record<SdkSystem, number>> = {}) => {
  const base: Record<SdkSystem, number> = {
    typescript: 2,
    python: 2,
    e2b: 2.5,
    e2bServerPath: 2,
    inspect_ai: 2.2,
    swerex: 2.1,
    verifiers: 2.2,
    tinker: 2.1,
    harbor: 2.2,
  };
  return Object.fromEntries(
    Object.entries({ ...base, ...overrides }).map(([k, v]) => [k, at(v)]),
  ) as Record<SdkSystem, LatencySummary>;
};

test('every Python framework provider gets a row', () => {
  assert.deepEqual(
    [...PYTHON_PROVIDERS],
    ['inspect_ai', 'swerex', 'verifiers', 'tinker', 'harbor'],
  );
});

test('providers are compared with the Python SDK, the SDKs with TypeScript', () => {
  const r = sdkRatios(results({ typescript: 4, python: 2, e2b: 6, inspect_ai: 3, harbor: 2 }));
  assert.equal(r.python, 0.5);
  assert.equal(r.e2b, 1.5);
  assert.equal(r.e2bServerPath, 0.5);
  assert.equal(r.inspect_ai, 1.5);
  assert.equal(r.harbor, 1);
  assert.deepEqual(
    Object.keys(r).sort(),
    ['e2b', 'e2bServerPath', 'python', ...PYTHON_PROVIDERS].sort(),
  );
});

test('met needs python and e2b within 1.5 and every provider within 1.2 of Python', () => {
  assert.equal(sdkTargetsMet(sdkRatios(results())), true);
  // One provider past 1.2 × Python fails the target, though still within 1.5 × TypeScript.
  const slow = sdkRatios(results({ swerex: 2 * SDK_PROVIDER_TARGET_RATIO + 0.01 }));
  assert.equal(sdkTargetsMet(slow), false);
  assert.equal(sdkTargetsMet(sdkRatios(results({ e2b: 3.01 }))), false);
  // A provider with no samples has no ratio, and is not met.
  const missing = { ...sdkRatios(results()), tinker: null };
  assert.equal(sdkTargetsMet(missing), false);
});

test('medianRatios takes each ratio over rounds, providers included', () => {
  const round = (python: number, verifiers: number | null): SdkRatios => ({
    ...sdkRatios(results()),
    python,
    verifiers,
  });
  const m = medianRatios([round(0.9, 1.1), round(1.3, 1.0), round(0.8, null), round(1.0, 1.4)]);
  assert.equal(m.python, 0.95);
  assert.equal(m.verifiers, 1.1);
  assert.equal(medianRatios([]).harbor, null);
});
