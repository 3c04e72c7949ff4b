/**
 * The API fuzzer (testing/api-fuzz) in CI: a fixed seed and a few requests
 * per route of the OpenAPI document, every property checked (no 5xx, no
 * hang, DSec's error shape and stable codes, documented statuses, 401
 * without a valid key, nothing of project A reachable or shown with project
 * B's key, no half-created sandbox). `dsec bench fuzz --seconds N` runs the
 * same for longer with a random seed.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runApiFuzz } from './testing/index.js';

test('every route, fuzzed from the OpenAPI document, keeps every property', async () => {
  const report = await runApiFuzz({ seed: 24, requestsPerRoute: 4 });
  assert.ok(report.results.routes >= 60, `routes: ${report.results.routes}`);
  assert.ok(report.results.requests >= report.results.routes * 4);
  assert.deepEqual(
    report.results.violations.map((v) => `${v.property} ${v.route}`),
    [],
    JSON.stringify(report.results.violations, null, 2),
  );
});
