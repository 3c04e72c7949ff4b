/**
 * The shipped SWE-style task set: its instance format, the parsers that turn
 * a test run's output into per-test outcomes, and the check that every
 * instance is valid (FAIL_TO_PASS fails before the gold patch, everything
 * passes after it). Used by `check-tasks.ts` on the host and by the tests,
 * which run the same check inside a sandbox.
 */
import { readFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';

/** One line of tasks.jsonl: SWE-bench's fields plus DSec's (`environment`, `test_command`, `repo_archive`). */
export interface SweTask {
  instance_id: string;
  repo: string;
  base_commit: string;
  patch: string;
  test_patch: string;
  problem_statement: string;
  hints_text: string;
  created_at: string;
  version: string;
  FAIL_TO_PASS: string[];
  PASS_TO_PASS: string[];
  environment: { image: string; toolkits: string[] };
  test_command: string;
  /** A git bundle holding the history up to `base_commit`, relative to the tasks file. */
  repo_archive: string;
}

export type TestStatus = 'passed' | 'failed' | 'error' | 'skipped' | 'xfail' | 'xpass';

/** Statuses that count as a pass when grading, as in SWE-bench (an expected failure is fine). */
export const PASSING: readonly TestStatus[] = ['passed', 'xfail'];

/** Reads tasks.jsonl; `repo_archive` is made absolute (relative to the file). */
export async function readTasks(file: string): Promise<SweTask[]> {
  const dir = dirname(resolve(file));
  return (await readFile(file, 'utf8'))
    .split('\n')
    .filter((line) => line.trim() !== '')
    .map((line) => {
      const task = JSON.parse(line) as SweTask;
      return { ...task, repo_archive: resolve(dir, task.repo_archive) };
    });
}

/**
 * Outcomes from `pytest -rA` output: the "short test summary info" lines,
 * `PASSED tests/test_x.py::test_y`, `FAILED … - message`. IDs are pytest node IDs.
 */
export function parsePytestOutcomes(output: string): Map<string, TestStatus> {
  const out = new Map<string, TestStatus>();
  const status: Record<string, TestStatus> = {
    PASSED: 'passed',
    FAILED: 'failed',
    ERROR: 'error',
    XFAIL: 'xfail',
    XPASS: 'xpass',
  };
  for (const line of output.split('\n')) {
    const m = /^(PASSED|FAILED|ERROR|XFAIL|XPASS) ([^\s[]+(?:\[[^\]]*\])?)(?: - .*)?$/.exec(
      line.trimEnd(),
    );
    if (m) out.set(m[2]!, status[m[1]!]!);
  }
  return out;
}

/**
 * Outcomes from `node --test --test-reporter=tap` (Node 18 and later). The ID
 * is the test's name; a nested test's is its ancestors' names and its own
 * joined with ` > ` (`suite > case`). A file that fails to load is reported
 * as a failed test named by its path.
 */
export function parseTapOutcomes(output: string): Map<string, TestStatus> {
  const out = new Map<string, TestStatus>();
  const names: string[] = [];
  const unescape = (s: string): string => s.replace(/\\([\\#])/g, '$1');
  for (const line of output.split('\n')) {
    const sub = /^( *)# Subtest: (.*)$/.exec(line);
    if (sub) {
      const level = Math.floor(sub[1]!.length / 4);
      names.length = level;
      names[level] = unescape(sub[2]!);
      continue;
    }
    const m = /^( *)(ok|not ok) \d+(?: - (.*?))?(?: # (SKIP|TODO)\b.*)?$/.exec(line);
    if (!m) continue;
    const level = Math.floor(m[1]!.length / 4);
    const name = unescape(m[3] ?? '');
    const id = [...names.slice(0, level), name].join(' > ');
    const status: TestStatus = m[4] !== undefined ? 'skipped' : m[2] === 'ok' ? 'passed' : 'failed';
    out.set(id, status);
  }
  return out;
}

/** Picks the parser a task's `test_command` needs. */
export function parseTestOutcomes(
  task: Pick<SweTask, 'test_command'>,
  output: string,
): Map<string, TestStatus> {
  if (/--test-reporter[= ]tap/.test(task.test_command)) return parseTapOutcomes(output);
  if (/\bpytest\b/.test(task.test_command)) return parsePytestOutcomes(output);
  throw new Error(`no outcome parser for ${JSON.stringify(task.test_command)}`);
}

/** Runs shell in a checkout of the task's repository at `base_commit` (on the host, or in a sandbox). */
export interface TaskShell {
  run(script: string, stdin?: string): Promise<{ exitCode: number; output: string }>;
}

export interface TaskCheck {
  instance_id: string;
  ok: boolean;
  /** What is wrong, one line each; empty when ok. */
  problems: string[];
  before: Record<string, TestStatus | 'missing'>;
  after: Record<string, TestStatus | 'missing'>;
}

/**
 * Checks one instance in `shell` (a fresh checkout at base_commit): the test
 * patch applies with `patch -p1`, then every FAIL_TO_PASS test fails (or is
 * missing) and every PASS_TO_PASS test passes; after the gold patch, all of
 * them pass.
 */
export async function checkTask(task: SweTask, shell: TaskShell): Promise<TaskCheck> {
  const problems: string[] = [];
  const ids = [...task.FAIL_TO_PASS, ...task.PASS_TO_PASS];
  const overlap = task.FAIL_TO_PASS.filter((id) => task.PASS_TO_PASS.includes(id));
  if (overlap.length > 0)
    problems.push(`in both FAIL_TO_PASS and PASS_TO_PASS: ${overlap.join(', ')}`);
  if (task.FAIL_TO_PASS.length === 0) problems.push('FAIL_TO_PASS is empty');

  const apply = async (which: 'test_patch' | 'patch'): Promise<boolean> => {
    const r = await shell.run('patch -p1 --batch --forward --no-backup-if-mismatch', task[which]);
    if (r.exitCode !== 0)
      problems.push(
        `${which} does not apply: ${r.output.trim().split('\n').slice(-3).join(' | ')}`,
      );
    return r.exitCode === 0;
  };
  const runTests = async (): Promise<Record<string, TestStatus | 'missing'>> => {
    const r = await shell.run(task.test_command);
    const outcomes = parseTestOutcomes(task, r.output);
    return Object.fromEntries(ids.map((id) => [id, outcomes.get(id) ?? 'missing']));
  };
  const passes = (s: TestStatus | 'missing'): boolean => s !== 'missing' && PASSING.includes(s);

  let before: Record<string, TestStatus | 'missing'> = {};
  let after: Record<string, TestStatus | 'missing'> = {};
  if (await apply('test_patch')) {
    before = await runTests();
    for (const id of task.FAIL_TO_PASS)
      if (passes(before[id]!)) problems.push(`FAIL_TO_PASS passes before the fix: ${id}`);
    for (const id of task.PASS_TO_PASS) {
      if (!passes(before[id]!))
        problems.push(`PASS_TO_PASS is ${before[id]} before the fix: ${id}`);
    }
    if (await apply('patch')) {
      after = await runTests();
      for (const id of ids)
        if (!passes(after[id]!)) problems.push(`${id} is ${after[id]} after the fix`);
    }
  }
  return { instance_id: task.instance_id, ok: problems.length === 0, problems, before, after };
}
