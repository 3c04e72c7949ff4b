/** What a test run said about one test. `xfail` counts as passing (SWE-bench's rule), `xpass` does not. */
export type TestOutcome = 'passed' | 'failed' | 'error' | 'skipped' | 'xfail' | 'xpass';

/** How bad an outcome is: a test reported twice keeps its worst. */
const SEVERITY: Record<TestOutcome, number> = {
  passed: 0,
  xfail: 1,
  skipped: 2,
  xpass: 3,
  failed: 4,
  error: 5,
};

const PYTEST_STATUS: Record<string, TestOutcome> = {
  PASSED: 'passed',
  FAILED: 'failed',
  ERROR: 'error',
  SKIPPED: 'skipped',
  XFAIL: 'xfail',
  XPASS: 'xpass',
};

const UNITTEST_STATUS: Record<string, TestOutcome> = {
  ok: 'passed',
  FAIL: 'failed',
  ERROR: 'error',
  'expected failure': 'xfail',
  'unexpected success': 'xpass',
};

const ANSI = /\x1b\[[0-9;]*m/g;

/**
 * Per-test outcomes from a test run's output. Recognised line by line, so a
 * run may mix formats:
 * - pytest with `-rA`: `PASSED tests/test_x.py::test_a`, `FAILED path::id - message`,
 *   and verbose lines `tests/test_x.py::test_a PASSED [ 50%]` (IDs are pytest node IDs);
 * - TAP (node --test, prove, bats): `ok 3 - name`, `not ok 4 - name`, `# SKIP`, `# TODO`;
 * - unittest `-v`: `test_a (pkg.mod.TestCase.test_a) ... ok` (the ID is what precedes ` ... `);
 * - Go `-v`: `--- PASS: TestName (0.00s)`.
 */
export function parseTestOutput(output: string): Record<string, TestOutcome> {
  const tests: Record<string, TestOutcome> = {};
  const record = (id: string, outcome: TestOutcome) => {
    const name = id.trim();
    if (name === '') return;
    const prev = tests[name];
    if (prev === undefined || SEVERITY[outcome] > SEVERITY[prev]) tests[name] = outcome;
  };
  for (const raw of output.split('\n')) {
    const line = raw.replace(ANSI, '').replace(/\r$/, '');
    let m: RegExpExecArray | null;
    // pytest -rA short summary. SKIPPED lines name a location, not a node ID.
    const summary = pytestSummary(line);
    if (summary) {
      for (const id of summary.ids) record(id, summary.outcome);
    } else if (
      (m = /^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?$/.exec(line))
    ) {
      record(m[1]!, PYTEST_STATUS[m[2]!]!);
    } else if ((m = /^\s*(ok|not ok)\s+\d+(?:\s+-)?\s*(.*?)\s*$/.exec(line))) {
      const [, status, rest] = m;
      const directive = /\s+#\s*(SKIP|TODO)\b.*$/i.exec(rest!);
      const name = directive ? rest!.slice(0, directive.index) : rest!;
      let outcome: TestOutcome = status === 'ok' ? 'passed' : 'failed';
      if (directive?.[1]?.toUpperCase() === 'SKIP') outcome = 'skipped';
      else if (directive) outcome = status === 'ok' ? 'xpass' : 'xfail';
      record(name, outcome);
    } else if (
      (m =
        /^(\S+ \([\w.]+\)) \.\.\. (ok|FAIL|ERROR|expected failure|unexpected success|skipped\b.*)$/.exec(
          line,
        ))
    ) {
      const status = m[2]!;
      record(m[1]!, status.startsWith('skipped') ? 'skipped' : UNITTEST_STATUS[status]!);
    } else if ((m = /^\s*--- (PASS|FAIL|SKIP): (\S+)/.exec(line))) {
      record(m[2]!, m[1] === 'PASS' ? 'passed' : m[1] === 'FAIL' ? 'failed' : 'skipped');
    }
  }
  return tests;
}

/**
 * A pytest `-rA` summary line: `PASSED <id>`, or `FAILED|ERROR|XFAIL|XPASS
 * <id>[ - <message>]`. A parametrised ID may hold spaces (`test_x[a b]`): a
 * PASSED line's ID is the rest of the line; the others' ends at the first
 * ` - ` (an ID with ` - ` in it is then cut short there, and so missing: not
 * passing). An ID with a space is also recorded by its first word, the form
 * SWE-bench's log parser gives datasets; every case sharing that prefix
 * counts, the worst wins.
 */
function pytestSummary(line: string): { ids: string[]; outcome: TestOutcome } | undefined {
  const sp = line.indexOf(' ');
  if (sp <= 0) return undefined;
  const status = line.slice(0, sp);
  if (status === 'SKIPPED' || !Object.hasOwn(PYTEST_STATUS, status)) return undefined;
  let id = line.slice(sp + 1);
  if (status !== 'PASSED') {
    const dash = id.indexOf(' - ');
    if (dash >= 0) id = id.slice(0, dash);
  }
  id = id.trim();
  if (id === '' || id !== line.slice(sp + 1, sp + 1 + id.length)) return undefined;
  const ids = [id];
  const word = id.split(/\s/)[0]!;
  if (word !== id) ids.push(word);
  return { ids, outcome: PYTEST_STATUS[status]! };
}

export function isPassing(outcome: TestOutcome | undefined): boolean {
  return outcome === 'passed' || outcome === 'xfail';
}

export interface RewardInput {
  tests: Record<string, TestOutcome>;
  failToPass: string[];
  passToPass: string[];
  /** The test command's exit code: decides alone when the task names no tests. */
  exitCode: number;
}

/**
 * SWE-bench's reward: 1 when every FAIL_TO_PASS and every PASS_TO_PASS test
 * passed (a test missing from the output did not pass), else 0. A task that
 * names no tests at all is scored by the test command's exit code.
 */
export function computeReward(input: RewardInput): 0 | 1 {
  const wanted = [...input.failToPass, ...input.passToPass];
  if (wanted.length === 0) return input.exitCode === 0 ? 1 : 0;
  return wanted.every((id) => isPassing(input.tests[id])) ? 1 : 0;
}
