import {
  applyAgentPatch,
  sha256,
  takeAgentPatch,
  type LeftOut,
  type Listing,
} from './agent-patch.js';
import { writePatchedFiles } from './apply.js';
import { parsePatch } from './diff.js';
import { killLeftovers } from './in-place.js';
import { diffOfChanges } from './patch-text.js';
import { gradingScope } from './steering.js';
import { patchFiles } from './swebench/patch-files.js';
import type { EvalTask } from './task.js';
import { computeReward, isPassing, parseTestOutput, type TestOutcome } from './test-output.js';
import type { SandboxTools } from './tools.js';

export const DEFAULT_TEST_TIMEOUT_MS = 30 * 60_000;
const TEST_OUTPUT_CAP_BYTES = 8 * 1024 * 1024;
const OUTPUT_TAIL_CHARS = 2000;
/** The diff kept in a result line; the whole one is named by `sha256`. */
export const RECORDED_DIFF_CHARS = 1024 * 1024;
/** Left-out paths listed in a result line (all of them are counted). */
export const RECORDED_LEFT_OUT = 200;
/** The test command's PATH, whatever the sandbox or the agent set. */
export const GRADER_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

/**
 * Runs the test command through the platform's shell with nothing of the
 * caller's environment but HOME and USER (which the platform sets from the
 * sandbox's passwd entry): `env -i` drops whatever the sandbox was created
 * with (PYTHONPATH, LD_PRELOAD, NODE_OPTIONS…), PATH is fixed. `env` and
 * `sh` here are the platform's sealed busybox applets, not the sandbox's.
 */
export const GRADER_TEST_WRAPPER =
  'set -- PATH="$DSEC_GRADER_PATH"; ' +
  '[ -n "${HOME+x}" ] && set -- "$@" HOME="$HOME"; ' +
  '[ -n "${USER+x}" ] && set -- "$@" USER="$USER"; ' +
  'exec env -i "$@" sh -c "$DSEC_GRADER_TEST"';

/** What a grader took from the agent's sandbox (patch grading). */
export interface AgentPatchRecord {
  /** The carried changes as a git diff (binary-safe), cut at RECORDED_DIFF_CHARS (`truncated`). */
  diff: string;
  /** sha256 of the whole diff. */
  sha256: string;
  /** Characters of the whole diff. */
  chars: number;
  truncated: boolean;
  /** Paths carried over. */
  files: number;
  /** Bytes of carried file content. */
  bytes: number;
  /** Paths not carried over, with the rule and reason (the first RECORDED_LEFT_OUT). */
  leftOut: LeftOut[];
  leftOutCount: number;
  /** Paths the grading sandbox would not take (a symlink on the way, a directory in the way). */
  applyFailed?: string[] | undefined;
  /** Why `diff` is empty although files were carried (host git refused a path). */
  diffError?: string | undefined;
}

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
  /** How the task was graded: `patch` (a fresh sandbox) or `in_place` (the agent's). */
  grading?: 'patch' | 'in_place' | undefined;
  agentPatch?: AgentPatchRecord | undefined;
  /** The agent's processes killed before grading: before the patch was taken, or in place before the tests were written. */
  killedProcesses?: number | undefined;
}

export interface GradeOptions {
  /** A file's content at `base_commit` (the source of the test files). */
  original: (path: string) => Promise<string | undefined>;
  testTimeoutMs?: number | undefined;
  /**
   * Runs the tests and grades them instead of the default (test files
   * written from `original` and `test_patch`, `test_command`, DSec's parser):
   * a SWE-bench instance's evaluation script (`gradeSwebench`).
   */
  runTests?: ((tools: SandboxTools, task: EvalTask) => Promise<GradeResult>) | undefined;
}

/**
 * Writes every file `test_patch` touches in its base-plus-test-patch state
 * (from the repository at `base_commit`), runs `test_command` in the workdir
 * with a clean environment (GRADER_TEST_WRAPPER), parses per-test outcomes and
 * computes SWE-bench's reward. It trusts the sandbox `tools` act on: call it
 * on a fresh grading sandbox (`gradeByPatch`) or after `killLeftovers`
 * (`gradeInPlace`). Every step goes through `tools` (phase `g`), so a resumed
 * grader replays the recorded test run instead of running the tests again.
 */
export async function gradeSandbox(
  tools: SandboxTools,
  task: EvalTask,
  options: GradeOptions,
): Promise<GradeResult> {
  if (options.runTests) return await options.runTests(tools, task);
  await writePatchedFiles(tools, task.test_patch, options.original);
  const r = await tools.exec(GRADER_TEST_WRAPPER, {
    timeoutMs: options.testTimeoutMs ?? DEFAULT_TEST_TIMEOUT_MS,
    maxOutputBytes: TEST_OUTPUT_CAP_BYTES,
    env: { DSEC_GRADER_PATH: GRADER_PATH, DSEC_GRADER_TEST: task.test_command },
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

/**
 * Grades in the agent's own sandbox, for tasks whose outcome is the
 * environment itself (`grading: "in_place"`): every process the agent left
 * is killed first, then the test files are written and the tests run with a
 * clean environment. The filesystem is the agent's: that is the point of
 * such a task, and why it is a per-task choice.
 */
export async function gradeInPlace(
  tools: SandboxTools,
  task: EvalTask,
  options: GradeOptions,
): Promise<GradeResult> {
  const killedProcesses = await killLeftovers(tools);
  return { ...(await gradeSandbox(tools, task, options)), grading: 'in_place', killedProcesses };
}

/**
 * Grades the agent's work as a patch, as SWE-bench's harness does with a
 * model's: the repository files the agent changed or added are read from its
 * sandbox (`agent`), the test files and every file that steers the test
 * runner or the interpreter are left out (LEAVE_OUT_RULES), the rest is
 * applied to `graderSandbox`, a fresh sandbox of the task's own environment
 * that nothing of the agent has touched (it may still be starting: the
 * agent's side is listed meanwhile), and the tests run there. Nothing outside
 * the workdir and no process of the agent reaches it.
 */
export async function gradeByPatch(
  agent: SandboxTools,
  graderSandbox: SandboxTools | Promise<SandboxTools>,
  task: EvalTask,
  options: GradeOptions,
): Promise<GradeResult> {
  // From the headers alone: a binary hunk (which `git apply` takes in the sandbox) parses too.
  const testPaths = new Set<string>();
  for (const fp of patchFiles(task.test_patch)) {
    testPaths.add(fp.oldPath);
    testPaths.add(fp.path);
  }
  // And every path a plain unified diff (no `diff --git` header) names.
  let parsed: ReturnType<typeof parsePatch> = [];
  try {
    parsed = parsePatch(task.test_patch);
  } catch {
    // Binary hunks: the headers above named their files.
  }
  for (const fp of parsed) {
    if (fp.oldPath !== undefined) testPaths.add(fp.oldPath);
    if (fp.newPath !== undefined) testPaths.add(fp.newPath);
  }
  // The test files' base content is read from the repository on the host meanwhile.
  const originals = new Map([...testPaths].map((p) => [p, options.original(p)] as const));
  for (const pending of originals.values()) pending.catch(() => undefined);
  const original = (p: string) => originals.get(p) ?? options.original(p);
  // Nothing of the agent runs while its workdir is read: a leftover could otherwise swap a file for
  // a FIFO between the read's test and its open (the read would wait out its timeout and the fix be
  // lost), or a directory for a symlink to what only root may read.
  const killedProcesses = await killLeftovers(agent);
  const patch = await takeAgentPatch(agent, graderSandbox, (base: Listing) => {
    const dirs = new Set<string>();
    for (const p of base.entries.keys()) {
      for (let i = p.indexOf('/'); i >= 0; i = p.indexOf('/', i + 1)) dirs.add(p.slice(0, i));
    }
    return gradingScope({
      testPaths,
      testCommand: task.test_command,
      baseKind: (p) => (base.entries.has(p) ? 'file' : dirs.has(p) ? 'dir' : undefined),
      // The base's packages only: an __init__.py the agent adds does not take a module off sys.path.
      isPackage: (dir) => base.entries.has(dir === '' ? '__init__.py' : `${dir}/__init__.py`),
      baseFiles: base.entries.keys(),
    });
  });
  const grader = await graderSandbox;
  const applyFailed = await applyAgentPatch(grader, patch.changes);
  const failedSet = new Set(applyFailed);
  const applied = patch.changes.filter((c) => !failedSet.has(c.path));
  // The record is written on the host while the tests run; it never decides the grading.
  let diffError: string | undefined;
  const recording = diffOfChanges(applied).catch((err: unknown) => {
    diffError = `git could not record the diff: ${(err as Error).message.slice(0, 500)}`;
    return '';
  });
  const graded = await gradeSandbox(grader, task, { ...options, original });
  const diff = await recording;
  const leftOut = [
    ...patch.leftOut,
    ...applyFailed.map((path) => ({
      path,
      rule: 'apply-failed',
      reason: 'the grading sandbox would not take it (a symlink or a directory in the way)',
    })),
  ];
  const record: AgentPatchRecord = {
    diff: diff.length > RECORDED_DIFF_CHARS ? diff.slice(0, RECORDED_DIFF_CHARS) : diff,
    sha256: sha256(diff),
    chars: diff.length,
    truncated: diff.length > RECORDED_DIFF_CHARS,
    files: applied.length,
    bytes: patch.bytes,
    leftOut: leftOut.slice(0, RECORDED_LEFT_OUT),
    leftOutCount: leftOut.length,
    ...(applyFailed.length > 0 ? { applyFailed } : {}),
    ...(diffError !== undefined ? { diffError } : {}),
  };
  return { ...graded, grading: 'patch', agentPatch: record, killedProcesses };
}
