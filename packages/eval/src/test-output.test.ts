import { test } from 'node:test';
import assert from 'node:assert/strict';
import { computeReward, parseTestOutput } from './test-output.js';

test('pytest -rA: summary lines with node IDs, messages after " - ", verbose lines, colours', () => {
  const out = [
    'tests/test_calc.py::test_add PASSED                                      [ 33%]',
    'tests/test_calc.py::test_sub FAILED                                      [ 66%]',
    '=========================== short test summary info ============================',
    'PASSED tests/test_calc.py::test_add',
    'PASSED tests/test_calc.py::test_param[1-2]',
    '\x1b[31mFAILED\x1b[0m tests/test_calc.py::test_sub - AssertionError: assert 1 == 2',
    'ERROR tests/test_io.py::test_open - FileNotFoundError',
    'SKIPPED [1] tests/test_io.py:10: needs network',
    'XFAIL tests/test_io.py::test_known - bug 12',
    'XPASS tests/test_io.py::test_lucky',
    '========================= 1 failed, 2 passed in 0.12s =========================',
  ].join('\n');
  assert.deepEqual(parseTestOutput(out), {
    'tests/test_calc.py::test_add': 'passed',
    'tests/test_calc.py::test_param[1-2]': 'passed',
    'tests/test_calc.py::test_sub': 'failed',
    'tests/test_io.py::test_open': 'error',
    'tests/test_io.py::test_known': 'xfail',
    'tests/test_io.py::test_lucky': 'xpass',
  });
});

test('pytest -rA: parametrised IDs with spaces and " - " in them', () => {
  // What pytest 7.2 prints for @pytest.mark.parametrize("x", ["a b", "c - d", "e f"]).
  const out = [
    'PASSED test_p.py::test_x[a b]',
    'FAILED test_p.py::test_x[c - d] - AssertionError: assert 1',
    'FAILED test_p.py::test_x[e f] - AssertionError: assert 2',
    'PASSED test_p.py::test_y[e g]',
    'PASSED test_p.py::test_y[e h]',
    'FAILED test_p.py::test_y[e i] - assert 3',
    'PASSED  test_p.py::test_z',
  ].join('\n');
  assert.deepEqual(parseTestOutput(out), {
    'test_p.py::test_x[a b]': 'passed',
    // Cut at the first " - ": the real ID is missing, so not passing.
    'test_p.py::test_x[c': 'failed',
    'test_p.py::test_x[e f]': 'failed',
    // SWE-bench's form of a spaced ID: its first word; the worst of the cases sharing it.
    'test_p.py::test_x[a': 'passed',
    'test_p.py::test_x[e': 'failed',
    'test_p.py::test_y[e g]': 'passed',
    'test_p.py::test_y[e h]': 'passed',
    'test_p.py::test_y[e i]': 'failed',
    'test_p.py::test_y[e': 'failed',
  });
});

test('TAP (node --test, prove): ok / not ok, SKIP and TODO directives, indented subtests', () => {
  const out = [
    'TAP version 13',
    '# Subtest: parser',
    '    ok 1 - parses empty input',
    '    not ok 2 - parses numbers',
    'ok 3 - adds # SKIP no network',
    'not ok 4 - known bug # TODO fix later',
    'ok 5 parses without dash',
    '1..5',
  ].join('\n');
  assert.deepEqual(parseTestOutput(out), {
    'parses empty input': 'passed',
    'parses numbers': 'failed',
    adds: 'skipped',
    'known bug': 'xfail',
    'parses without dash': 'passed',
  });
});

test('unittest -v and go test -v lines', () => {
  const out = [
    'test_add (tests.test_calc.CalcTest.test_add) ... ok',
    'test_sub (tests.test_calc.CalcTest.test_sub) ... FAIL',
    'test_div (tests.test_calc.CalcTest.test_div) ... ERROR',
    "test_net (tests.test_calc.CalcTest.test_net) ... skipped 'offline'",
    '=== RUN   TestParse',
    '--- PASS: TestParse (0.00s)',
    '    --- FAIL: TestParse/empty (0.00s)',
  ].join('\n');
  assert.deepEqual(parseTestOutput(out), {
    'test_add (tests.test_calc.CalcTest.test_add)': 'passed',
    'test_sub (tests.test_calc.CalcTest.test_sub)': 'failed',
    'test_div (tests.test_calc.CalcTest.test_div)': 'error',
    'test_net (tests.test_calc.CalcTest.test_net)': 'skipped',
    TestParse: 'passed',
    'TestParse/empty': 'failed',
  });
});

test('a test reported twice keeps its worst outcome', () => {
  assert.deepEqual(parseTestOutput('ok 1 - a\nnot ok 2 - a\nok 3 - a\n'), { a: 'failed' });
});

test('reward: 1 iff every FAIL_TO_PASS and PASS_TO_PASS test passed; missing is not passed', () => {
  const tests = { a: 'passed', b: 'xfail', c: 'failed', d: 'skipped' } as const;
  const r = (failToPass: string[], passToPass: string[], exitCode = 0) =>
    computeReward({ tests, failToPass, passToPass, exitCode });
  assert.equal(r(['a'], ['b']), 1);
  assert.equal(r(['a'], ['c']), 0);
  assert.equal(r(['a', 'missing'], []), 0);
  assert.equal(r(['d'], []), 0);
  // No tests named: the exit code decides.
  assert.equal(r([], [], 0), 1);
  assert.equal(r([], [], 1), 0);
});
