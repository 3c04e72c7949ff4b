/**
 * Harbor / Terminal-Bench task directories (`task.toml`, `instruction.md`,
 * `environment/Dockerfile`, `tests/test.sh`, `solution/solve.sh`): loaded
 * (`loadHarborTasks`), run by an agent in a sandbox of the task's
 * Dockerfile environment, and verified by the task's own `test.sh`
 * (`runVerifier`), with the reward from `/logs/verifier/reward.txt` or
 * `reward.json`. `dsec eval run DIR --format harbor` is the CLI over it.
 */
export {
  loadHarborTask,
  loadHarborTasks,
  dockerfileWorkdir,
  sizeToMb,
  HARBOR_DEFAULTS,
} from './task.js';
export type { HarborTask } from './task.js';
export {
  runVerifier,
  readReward,
  resetVerifierLogs,
  uploadDir,
  listUpload,
  parseRewardText,
  parseRewardJson,
  VERIFIER_LOG_DIR,
  TESTS_DIR,
  MAX_REWARD_TXT_BYTES,
  MAX_REWARD_JSON_BYTES,
  MAX_UPLOAD_BYTES,
  MAX_UPLOAD_FILES,
} from './verifier.js';
export type { RewardReason, RunVerifierOptions, VerifierResult } from './verifier.js';
export { runHarbor, OracleAgent, SOLUTION_DIR } from './runner.js';
export type {
  HarborAgentTask,
  HarborEnvironment,
  HarborEnvironmentBuilder,
  HarborResult,
  HarborSummary,
  RunHarborOptions,
} from './runner.js';
