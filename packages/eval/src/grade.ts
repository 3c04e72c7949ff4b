import { writePatchedFiles } from './apply.js';
import type { EvalTask } from './task.js';
import { computeReward, isPassing, parseTestOutput, type TestOutcome } from './test-output.js';
import type { SandboxTools } from './tools.js';

export const DEFAULT_TEST_TIMEOUT_MS = 30 * 60_000;
const TEST_OUTPUT_CAP_BYTES = 8 * 1024 * 1024;
const OUTPUT_TAIL_CHARS = 2000;

export interface GradeResult {
  reward: 0 | 1;
  /** Every test the run reported, by ID. */
  tests: Record<string, TestOutcome>;
  /** FAIL_TO_PASS and PASS_TO_PASS tests that did not pass (missing ones included). */
  failing: string[];
  testExitCode: number;
  /** `exited`, or `timeout` when the test command ran past its limit. */
  testOutcome: string;
  /** The end of the test output, for a human reading a 0. */
  outputTail: string;
}

/**
 * Grades a sandbox SWE-bench style: puts every file `test_patch` touches
 * into its base-plus-test-patch state (from the repository at
 * `base_commit`, whatever the agent did to it), runs `test_command` in the
 * workdir, parses per-test outcomes and computes the reward. Every step goes
 * through `tools` (phase `g`), so a resumed grader replays the recorded
 * test run instead of running the tests again.
 */
export async function gradeSandbox(
  tools: SandboxTools,
  task: EvalTask,
  options: {
    original: (path: string) => Promise<string | undefined>;
    testTimeoutMs?: number | undefined;
  },
): Promise<GradeResult> {
  await writePatchedFiles(tools, task.test_patch, options.original);
  const r = await tools.exec(task.test_command, {
    timeoutMs: options.testTimeoutMs ?? DEFAULT_TEST_TIMEOUT_MS,
    maxOutputBytes: TEST_OUTPUT_CAP_BYTES,
  });
  const output = `${r.stdout}\n${r.stderr}`;
  const tests = parseTestOutput(output);
  const wanted = [...task.FAIL_TO_PASS, ...task.PASS_TO_PASS];
  return {
    reward: computeReward({
      tests,
      failToPass: task.FAIL_TO_PASS,
      passToPass: task.PASS_TO_PASS,
      exitCode: r.exitCode,
    }),
    tests,
    failing: wanted.filter((id) => !isPassing(tests[id])),
    testExitCode: r.exitCode,
    testOutcome: r.outcome,
    outputTail: output.trimEnd().slice(-OUTPUT_TAIL_CHARS),
  };
}
