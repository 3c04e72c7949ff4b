/**
 * @dsec/eval — runs agentic evaluations and RL rollouts on SWE-style tasks
 * (paper 2.1, 6.2): every task in its own sandbox composed from layers (a
 * base image, toolkits, and a workspace layer with the repository at its
 * base commit), an agent plug-in acting through tools whose every command
 * carries a request ID, and SWE-bench grading: the agent's work is taken as
 * a patch of the repository, without the test files and the files that
 * steer the test runner or the interpreter (`LEAVE_OUT_RULES`), applied to a
 * fresh sandbox of the task's environment, then `test_patch` is applied and
 * `test_command` run there; reward 1 iff every FAIL_TO_PASS and PASS_TO_PASS
 * test passes (`grading: "in_place"` tasks are graded in the agent's sandbox
 * after all its processes are killed). The driver keeps a journal next to
 * its results, so a killed run resumes against the same sandboxes without
 * running any command twice.
 * `dsec eval prepare|run|grade` is the CLI over it.
 *
 * @example
 * ```ts
 * import { DSecClient } from '@dsec/sdk';
 * import { GoldAgent, RepoCache, loadTasks, prepareTasks, runEval } from '@dsec/eval';
 *
 * const { file, tasks } = await loadTasks('examples/swe-tasks/tasks.jsonl');
 * const repos = new RepoCache('/var/lib/dsec/eval-cache');
 * const { tasks: prepared } = await prepareTasks(tasks, { store, repos });
 * const summary = await runEval({
 *   client: new DSecClient(), tasks, tasksFile: file, agent: new GoldAgent(),
 *   prepared: new Map(prepared.map((p) => [p.instance_id, p])),
 *   original: (task, path) => repos.fileAtBase(task, path),
 *   outPath: 'results.jsonl', concurrency: 8, labels: { job: 'nightly' },
 * });
 * console.log(summary.solved, '/', summary.tasks);
 * ```
 */
export { parsePatch, applyFilePatch } from './diff.js';
export type { FilePatch, Hunk, HunkLine } from './diff.js';
export { parseTestOutput, computeReward, isPassing } from './test-output.js';
export type { TestOutcome, RewardInput } from './test-output.js';
export { loadTasks, normalizeTask, DEFAULT_WORKDIR } from './task.js';
export type { EvalTask, LoadedTasks } from './task.js';
export { RequestIds, newRunId } from './request-ids.js';
export { Journal } from './journal.js';
export type { TaskJournal, RunHeader } from './journal.js';
export { SandboxTools, ToolError, MAX_FILE_BYTES, DEFAULT_SHELL_TIMEOUT_MS } from './tools.js';
export type { ShellOutcome, SandboxToolsOptions } from './tools.js';
export { applyPatchWithTools, writePatchedFiles } from './apply.js';
export {
  gradeSandbox,
  gradeByPatch,
  gradeInPlace,
  DEFAULT_TEST_TIMEOUT_MS,
  GRADER_PATH,
  GRADER_TEST_WRAPPER,
  RECORDED_DIFF_CHARS,
  RECORDED_LEFT_OUT,
} from './grade.js';
export type { GradeResult, GradeOptions, AgentPatchRecord } from './grade.js';
export {
  takeAgentPatch,
  applyAgentPatch,
  parseListing,
  MAX_PATCH_BYTES,
  MAX_PATCH_FILE_BYTES,
  MAX_PATCH_ENTRIES,
} from './agent-patch.js';
export type { AgentPatch, LeftOut, Listing, ListedEntry } from './agent-patch.js';
export {
  LEAVE_OUT_RULES,
  PYTHON_RUNNER_MODULES,
  PACKAGE_JSON_RUNNER_KEYS,
  gradingScope,
  leaveOut,
  pytestConfigChange,
} from './steering.js';
export type { Change, GradingScope, LeaveOutRule, TreeEntry } from './steering.js';
export { diffOfChanges } from './patch-text.js';
export { killLeftovers, KILL_LEFTOVERS_SCRIPT } from './in-place.js';
export { RepoCache, workspaceLayerName, ensureWorkspace } from './workspace.js';
export { prepareTasks } from './prepare.js';
export { clusterInstallRunner } from './install-runner.js';
export type { InstallSandboxLimits } from './install-runner.js';
export type {
  EnvironmentBuilder,
  PrepareOptions,
  PrepareProgress,
  PrepareReport,
} from './prepare.js';
export { runEval, readResults, countSteps } from './runner.js';
export type {
  EvalProgress,
  EvalResult,
  EvalSummary,
  PreparedTask,
  RunEvalOptions,
  SandboxLimits,
  TaskError,
  UnrunnableTask,
} from './runner.js';
export { loadSwebenchDataset, isSwebenchTask, testDirectives } from './swebench/dataset.js';
export type {
  InstanceError,
  LoadedDataset,
  SwebenchInstanceInfo,
  SwebenchTask,
} from './swebench/dataset.js';
export { patchFiles } from './swebench/patch-files.js';
export type { PatchFile } from './swebench/patch-files.js';
export { loadSpecs, specFor, SHIPPED_SPECS_PATH, DEFAULT_ACTIVATE } from './swebench/specs.js';
export type { InstanceSpec, SpecTable } from './swebench/specs.js';
export {
  gradeSwebench,
  swebenchEvalScript,
  swebenchVerdict,
  testOutputOf,
  START_TEST_OUTPUT,
  END_TEST_OUTPUT,
} from './swebench/grade.js';
export { parseLog, LOG_PARSER_NAMES } from './log-parsers/python.js';
export type { LogParserName, StatusMap, SwebenchStatus } from './log-parsers/python.js';
export type { Agent, AgentContext, AgentOutcome, TokenUsage } from './agents/agent.js';
export { GoldAgent, NoneAgent, gitApplyInSandbox } from './agents/scripted.js';
export { HttpAgent, TOOL_SCHEMAS } from './agents/http.js';
export type { HttpAgentOptions, ChatMessage, ToolCall } from './agents/http.js';
export {
  checkTemplate,
  DEFAULT_IMAGE_CONCURRENCY,
  importTaskImages,
  INSTANCE_ID_PLACEHOLDER,
  isImageTemplate,
  parseDockerImageRef,
  resolveTaskImage,
  swebenchImageKey,
  swebenchImageRef,
  taskImageLayerRef,
} from './task-images.js';
export type {
  DockerImageRef,
  ImportTaskImagesOptions,
  TaskImage,
  TaskImageProgress,
} from './task-images.js';
export * from './harbor/index.js';
