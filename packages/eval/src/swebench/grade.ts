import { DsecError } from '@dsec/core';
import {
  DEFAULT_TEST_TIMEOUT_MS,
  GRADER_PATH,
  GRADER_TEST_WRAPPER,
  type GradeOptions,
  type GradeResult,
} from '../grade.js';
import { parseLog, type StatusMap, type SwebenchStatus } from '../log-parsers/python.js';
import { shellQuote } from '../task.js';
import type { TestOutcome } from '../test-output.js';
import type { SandboxTools } from '../tools.js';
import { MAX_TEST_PATCH_BYTES, type SwebenchTask } from './dataset.js';

/** SWE-bench's markers around the test output (`START_TEST_OUTPUT`, `END_TEST_OUTPUT`). */
export const START_TEST_OUTPUT = '>>>>> Start Test Output';
export const END_TEST_OUTPUT = '>>>>> End Test Output';
/** Printed by the script when `test_patch` does not apply. */
export const TEST_PATCH_FAILED = '>>>>> Test Patch Apply Failed';
/** The script's exit status when `test_patch` does not apply. */
const TEST_PATCH_EXIT = 86;
const TEST_OUTPUT_CAP_BYTES = 8 * 1024 * 1024;
const OUTPUT_TAIL_CHARS = 2000;

const OUTCOME: Record<SwebenchStatus, TestOutcome> = {
  PASSED: 'passed',
  FAILED: 'failed',
  SKIPPED: 'skipped',
  ERROR: 'error',
  XFAIL: 'xfail',
};

/**
 * The evaluation script SWE-bench's harness runs in the instance's
 * container (`make_eval_script_list_py`), for bash: activate the
 * environment, run the spec's `eval_commands` and `install`, reset the files
 * `test_patch` changes to `base_commit` (and remove those it creates), apply
 * `test_patch` with `git apply` (binary hunks included), run the test
 * command with the directives between the start and end markers, reset the
 * test files again. Differences, each on purpose: stderr joins stdout (one
 * stream, in order, as `docker exec` gives SWE-bench); `test_patch` comes on
 * stdin rather than in a heredoc (no size limit of an argument); bytecode
 * is not written (`PYTHONDONTWRITEBYTECODE=1`, Python's `-B`); the
 * informational `git status`/`git show`/`git diff` are left out (they only
 * fill the output cap); a `test_patch` that does not apply ends the script
 * (an instance error, not a 0); the script exits with the test command's
 * status.
 */
export function swebenchEvalScript(task: SwebenchTask): string {
  const s = task.swebench;
  const base = task.base_commit;
  const dir = shellQuote(task.workdir);
  const lines = [
    'exec 2>&1',
    'set -uxo pipefail',
    'dsec_test_patch=$(mktemp)',
    'cat > "$dsec_test_patch"',
    'export PYTHONDONTWRITEBYTECODE=1',
    s.spec.activate,
    `cd ${dir}`,
    ...s.spec.evalCommands,
    `git config --global --add safe.directory ${dir}`,
    `cd ${dir}`,
    s.spec.activate,
    ...(s.spec.install ? [s.spec.install] : []),
  ];
  const reset: string[] = [];
  if (s.modifiedFiles.length > 0) {
    reset.push(`git checkout ${base} -- ${s.modifiedFiles.map(shellQuote).join(' ')}`);
  }
  if (s.newFiles.length > 0) reset.push(`rm -f -- ${s.newFiles.map(shellQuote).join(' ')}`);
  lines.push(
    ...reset,
    `git apply -v "$dsec_test_patch" || { echo ${shellQuote(TEST_PATCH_FAILED)}; exit ${TEST_PATCH_EXIT}; }`,
    `: ${shellQuote(START_TEST_OUTPUT)}`,
    task.test_command,
    'dsec_rc=$?',
    `: ${shellQuote(END_TEST_OUTPUT)}`,
    ...reset,
    'rm -f "$dsec_test_patch"',
    'exit $dsec_rc',
  );
  return lines.join('\n') + '\n';
}

/** The part of the log between the markers (SWE-bench parses only that), or undefined without both. */
export function testOutputOf(log: string): string | undefined {
  const start = log.indexOf(START_TEST_OUTPUT);
  if (start < 0) return undefined;
  const rest = log.slice(start + START_TEST_OUTPUT.length);
  const end = rest.indexOf(END_TEST_OUTPUT);
  return end < 0 ? undefined : rest.slice(0, end);
}

/**
 * SWE-bench's verdict over a log: the repository's parser over the marked
 * part (the whole log when that part yields nothing, as SWE-bench falls
 * back); reward 1 only when every FAIL_TO_PASS and PASS_TO_PASS test is
 * PASSED or XFAIL (a test missing from the log has not passed). A log
 * without both markers, a timeout, or a test command that failed while the
 * log shows no failure at all (the log is not the run's: code under test
 * printed its own PASSED lines), gives no passing test.
 */
export function swebenchVerdict(
  task: SwebenchTask,
  log: string,
  run: { exitCode: number; timedOut: boolean },
): { reward: 0 | 1; statuses: StatusMap; failing: string[] } {
  const marked = testOutputOf(log);
  let statuses: StatusMap = {};
  if (marked !== undefined && !run.timedOut) {
    statuses = parseLog(task.swebench.spec.parser, marked);
    if (Object.keys(statuses).length === 0) statuses = parseLog(task.swebench.spec.parser, log);
    const noFailure = !Object.values(statuses).some((s) => s === 'FAILED' || s === 'ERROR');
    if (run.exitCode !== 0 && noFailure) statuses = {};
  }
  const passing = (id: string) =>
    Object.hasOwn(statuses, id) && (statuses[id] === 'PASSED' || statuses[id] === 'XFAIL');
  const wanted = [...task.FAIL_TO_PASS, ...task.PASS_TO_PASS];
  const failing = wanted.filter((id) => !passing(id));
  return { reward: failing.length === 0 ? 1 : 0, statuses, failing };
}

/**
 * Runs SWE-bench's evaluation in the grading sandbox (`swebenchEvalScript`
 * through the grader's clean-environment wrapper, `test_patch` on stdin)
 * and grades the log (`swebenchVerdict`). Plugs into `gradeSandbox` as
 * `GradeOptions.runTests`. A `test_patch` that does not apply is
 * `conflict` (reason `test_patch_does_not_apply`): the instance is broken,
 * which is not a 0.
 */
export async function gradeSwebench(
  tools: SandboxTools,
  task: SwebenchTask,
  options: Pick<GradeOptions, 'testTimeoutMs'>,
): Promise<GradeResult> {
  if (Buffer.byteLength(task.test_patch) > MAX_TEST_PATCH_BYTES) {
    throw new DsecError(
      'payload_too_large',
      `${task.instance_id}: test_patch is over 1 MiB, more than a command's stdin takes`,
      { field: 'test_patch', details: { reason: 'test_patch_too_large' } },
    );
  }
  const r = await tools.exec(GRADER_TEST_WRAPPER, {
    timeoutMs: options.testTimeoutMs ?? DEFAULT_TEST_TIMEOUT_MS,
    maxOutputBytes: TEST_OUTPUT_CAP_BYTES,
    stdin: task.test_patch,
    env: {
      DSEC_GRADER_PATH: GRADER_PATH,
      DSEC_GRADER_TEST: `exec bash -c ${shellQuote(swebenchEvalScript(task))}`,
    },
  });
  const log = `${r.stdout}${r.stderr ? `\n${r.stderr}` : ''}`;
  if (r.exitCode === TEST_PATCH_EXIT && log.includes(TEST_PATCH_FAILED)) {
    throw new DsecError(
      'conflict',
      `${task.instance_id}: test_patch does not apply at ${task.base_commit}: ${log.trimEnd().slice(-500)}`,
      { field: 'test_patch', details: { reason: 'test_patch_does_not_apply' } },
    );
  }
  const verdict = swebenchVerdict(task, log, {
    exitCode: r.exitCode,
    timedOut: r.outcome === 'timeout',
  });
  const tests: Record<string, TestOutcome> = {};
  for (const [id, s] of Object.entries(verdict.statuses)) tests[id] = OUTCOME[s];
  return {
    reward: verdict.reward,
    tests,
    failing: verdict.failing,
    testExitCode: r.exitCode,
    testOutcome: r.outcome,
    outputTail: log.trimEnd().slice(-OUTPUT_TAIL_CHARS),
  };
}
