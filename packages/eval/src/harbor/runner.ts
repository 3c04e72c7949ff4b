import { appendFileSync, writeFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { DsecError, isDsecError } from '@dsec/core';
import type { DSecClient, Sandbox } from '@dsec/sdk';
import type { Agent, AgentContext, AgentOutcome, TokenUsage } from '../agents/agent.js';
import { Journal } from '../journal.js';
import { RequestIds, newRunId } from '../request-ids.js';
import { countSteps, readResults, type EvalProgress, type SandboxLimits } from '../runner.js';
import type { EvalTask } from '../task.js';
import { SandboxTools, ToolError } from '../tools.js';
import type { HarborTask } from './task.js';
import { listUpload, runVerifier, uploadDir, type VerifierResult } from './verifier.js';

/** Where `solution/` is put for `--agent oracle`. */
export const SOLUTION_DIR = '/solution';
const DEFAULT_TTL_SECONDS = 4 * 3600;
/** The agent's last words kept in a result line. */
const AGENT_MESSAGE_CHARS = 2000;

/** The layers a task's sandbox is made of, as the environment builder made them. */
export interface HarborEnvironment {
  image: string;
  toolkits?: string[] | undefined;
  workspace?: string | undefined;
  /** Whether nothing had to be built (the same Dockerfile and context were built before). */
  cached?: boolean | undefined;
}

/** Builds (or finds cached) a task's environment from `environment/Dockerfile`. */
export type HarborEnvironmentBuilder = (
  task: HarborTask,
  options: { signal: AbortSignal },
) => Promise<HarborEnvironment>;

/**
 * The task an agent plug-in sees: the fields of an `EvalTask` it reads
 * (`problem_statement` is instruction.md), plus the Harbor task itself.
 */
export type HarborAgentTask = EvalTask & { harbor: HarborTask };

/** One line of `--out`: the shape of `dsec eval run`'s lines, with a Harbor reward (any number). */
export interface HarborResult {
  instance_id: string;
  /** The verifier's number; null when the harness failed (`error` says why), which is not a 0. */
  reward: number | null;
  /** Harbor's verifier reports no per-test outcomes: always empty. */
  tests: Record<string, never>;
  toolCalls: number;
  tokens?: TokenUsage | undefined;
  agentFinished?: boolean | undefined;
  /** The agent's last words (a model's final message; the end of solve.sh's output for oracle). */
  agentMessage?: string | undefined;
  /** The agent ran past `[agent] timeout_sec` and was stopped; the verifier still ran. */
  agentTimedOut?: boolean | undefined;
  durations: {
    /** Building (or finding) the environment. */
    buildMs: number;
    /** The build and the sandbox's create. */
    setupMs: number;
    agentMs: number;
    /** The verifier: resetting /logs/verifier and /tests, test.sh, reading the reward. */
    gradingMs: number;
    totalMs: number;
  };
  sandboxId: string | undefined;
  grading: 'harbor';
  /** The environment layer and whether it came from the build cache. */
  environment?: { image: string; cached: boolean | undefined } | undefined;
  /** reward.json's metrics, `source` (which file), and `reason` for a 0 the verifier did not give. */
  verifier?:
    | {
        source?: string | undefined;
        metrics?: Record<string, number> | undefined;
        exitCode: number;
        outcome: string;
      }
    | undefined;
  details?: { reason: string } | undefined;
  killedProcesses?: number | undefined;
  outputTail?: string | undefined;
  executedSteps: number;
  replayedSteps: number;
  duplicateExecutions: number;
  attempt: number;
  runId: string;
  agent: string;
  error?: { code: string; message: string } | undefined;
}

export interface RunHarborOptions {
  client: DSecClient;
  tasks: HarborTask[];
  agent: Agent;
  environment: HarborEnvironmentBuilder;
  /** What the run is over (a task directory or a folder of them), recorded in the journal. */
  tasksPath: string;
  outPath: string;
  /** Default `<outPath>.journal`. */
  journalPath?: string | undefined;
  /** Continue the journal's run: tasks with a result are skipped, the rest start a new attempt. */
  resume?: boolean | undefined;
  concurrency?: number | undefined;
  labels?: Record<string, string> | undefined;
  /** Overrides of task.toml's `[environment]` cpus / memory_mb / storage_mb, and the TTL. */
  sandbox?: SandboxLimits | undefined;
  keepSandboxes?: boolean | undefined;
  signal?: AbortSignal | undefined;
  onProgress?: ((p: EvalProgress) => void) | undefined;
  onResult?: ((r: HarborResult) => void) | undefined;
}

export interface HarborSummary {
  runId: string;
  labels: Record<string, string>;
  tasks: number;
  /** Tasks with reward ≥ 1 (Harbor's rewards are any number; 1 is a pass). */
  solved: number;
  errors: number;
  pending: number;
  interrupted: boolean;
  results: HarborResult[];
}

/** `--agent oracle`: runs the task's `solution/solve.sh` in its sandbox, as Harbor's oracle does. */
export class OracleAgent implements Agent {
  readonly name = 'oracle';
  async run(ctx: AgentContext): Promise<AgentOutcome> {
    const task = (ctx.task as HarborAgentTask).harbor;
    if (!task.solutionDir) {
      throw new DsecError(
        'invalid_argument',
        `${task.dir} has no solution/solve.sh for --agent oracle`,
        {
          field: 'agent',
        },
      );
    }
    const files = await listUpload(task.solutionDir, 'solution');
    await uploadDir(ctx.tools.sandbox, files, SOLUTION_DIR, ctx.signal);
    const r = await ctx.tools.exec(`exec bash ${SOLUTION_DIR}/solve.sh`, {
      timeoutMs: task.agentTimeoutSec * 1000,
      env: task.solutionEnv,
    });
    const tail = `${r.stdout}\n${r.stderr}`.trimEnd().slice(-2000);
    return { finished: r.exitCode === 0 && r.outcome === 'exited', message: tail };
  }
}

/**
 * Runs Harbor / Terminal-Bench tasks: each task's environment is built from
 * its Dockerfile (cached by `environment`), a sandbox of it runs the agent
 * under `[agent] timeout_sec`, then `runVerifier` checks the result under
 * `[verifier] timeout_sec`. One result line per task in `outPath`, in
 * `dsec eval run`'s shape; a task whose build or sandbox fails gets a line
 * with `error` and the batch goes on. The journal beside `outPath` holds
 * the run ID and labels; `resume` skips tasks with a result and starts
 * the others over (their old sandboxes stopped).
 */
export async function runHarbor(options: RunHarborOptions): Promise<HarborSummary> {
  const journalPath = options.journalPath ?? `${options.outPath}.journal`;
  const signal = options.signal ?? new AbortController().signal;
  let journal: Journal;
  let previous: HarborResult[] = [];
  if (options.resume) {
    journal = Journal.open(journalPath);
    if (journal.header.agent !== options.agent.name) {
      throw new DsecError(
        'invalid_argument',
        `the journal's run used --agent ${journal.header.agent}, not ${options.agent.name}`,
        { field: 'agent' },
      );
    }
    previous = readResults(options.outPath) as unknown as HarborResult[];
    journal.mark('resumed');
  } else {
    const runId = newRunId();
    journal = Journal.create(journalPath, {
      runId,
      agent: options.agent.name,
      labels:
        options.labels && Object.keys(options.labels).length > 0
          ? options.labels
          : { job: `eval-${runId}` },
      tasksFile: options.tasksPath,
      startedAt: new Date().toISOString(),
    });
    writeFileSync(options.outPath, '');
  }
  const names = new Set(options.tasks.map((t) => t.name));
  const results = previous.filter((r) => names.has(r.instance_id));
  const done = new Set(results.map((r) => r.instance_id));
  const todo = options.tasks.filter((t) => !done.has(t.name));
  const progress: EvalProgress = {
    done: results.length,
    total: options.tasks.length,
    solved: results.filter((r) => (r.reward ?? 0) >= 1).length,
    errors: results.filter((r) => r.error).length,
    running: 0,
  };
  options.onProgress?.({ ...progress });
  // One build per Dockerfile at a time: tasks sharing an environment wait for the first build.
  const builds = new Map<string, Promise<HarborEnvironment>>();
  const build = (task: HarborTask) => {
    let pending = builds.get(task.environmentDir);
    if (!pending) {
      pending = options.environment(task, { signal });
      builds.set(task.environmentDir, pending);
    }
    return pending;
  };
  let next = 0;
  const worker = async () => {
    while (next < todo.length && !signal.aborted) {
      const task = todo[next++]!;
      progress.running++;
      options.onProgress?.({ ...progress });
      const result = await runTask(options, journal, task, build, signal);
      progress.running--;
      if (!result) continue;
      appendFileSync(options.outPath, JSON.stringify(result) + '\n');
      journal.done(task.name);
      results.push(result);
      progress.done++;
      if ((result.reward ?? 0) >= 1) progress.solved++;
      if (result.error) progress.errors++;
      options.onResult?.(result);
      options.onProgress?.({ ...progress });
      if (!options.keepSandboxes && result.sandboxId) {
        await options.client
          .sandbox(result.sandboxId)
          .stop()
          .catch(() => undefined);
      }
    }
  };
  const concurrency = Math.max(1, options.concurrency ?? 4);
  await Promise.all(Array.from({ length: Math.min(concurrency, todo.length) }, worker));
  return {
    runId: journal.header.runId,
    labels: journal.header.labels,
    tasks: options.tasks.length,
    solved: progress.solved,
    errors: progress.errors,
    pending: options.tasks.length - results.length,
    interrupted: signal.aborted,
    results,
  };
}

async function runTask(
  options: RunHarborOptions,
  journal: Journal,
  task: HarborTask,
  build: (task: HarborTask) => Promise<HarborEnvironment>,
  signal: AbortSignal,
): Promise<HarborResult | undefined> {
  const t0 = performance.now();
  const id = task.name;
  const jt = journal.task(id);
  if (jt.sandboxId) {
    // A run killed mid-task: its sandbox's state is unknown, the task starts over.
    await options.client
      .sandbox(jt.sandboxId)
      .stop()
      .catch(() => undefined);
    journal.newAttempt(id, 'resumed: the task starts over in a new sandbox');
  }
  const attempt = journal.task(id).attempt;
  const runId = journal.header.runId;
  const ids = new RequestIds(runId, id, attempt);
  const durations = { buildMs: 0, setupMs: 0, agentMs: 0, gradingMs: 0, totalMs: 0 };
  let sandbox: Sandbox | undefined;
  let agentTools: SandboxTools | undefined;
  let verifyTools: SandboxTools | undefined;
  let environment: HarborEnvironment | undefined;
  const finish = async (extra: Partial<HarborResult>): Promise<HarborResult> => {
    const counted = sandbox ? await countSteps(sandbox, ids).catch(() => undefined) : undefined;
    durations.totalMs = Math.round(performance.now() - t0);
    return {
      instance_id: id,
      reward: null,
      tests: {},
      toolCalls: agentTools?.toolCalls ?? 0,
      durations,
      sandboxId: sandbox?.id,
      grading: 'harbor',
      ...(environment
        ? { environment: { image: environment.image, cached: environment.cached } }
        : {}),
      executedSteps: counted?.executed ?? 0,
      replayedSteps: (agentTools?.replayedSteps ?? 0) + (verifyTools?.replayedSteps ?? 0),
      duplicateExecutions: counted?.duplicates ?? 0,
      attempt,
      runId,
      agent: options.agent.name,
      ...extra,
    };
  };
  try {
    environment = await build(task);
    durations.buildMs = Math.round(performance.now() - t0);
    const limits = options.sandbox ?? {};
    sandbox = await options.client.runContainer(
      {
        image: environment.image,
        toolkits: environment.toolkits ?? [],
        ...(environment.workspace ? { workspace: environment.workspace } : {}),
        labels: {
          ...journal.header.labels,
          instance_id: id,
          eval_run: runId,
          eval_attempt: String(attempt),
        },
        memoryLimitMb: limits.memoryLimitMb ?? task.memoryMb,
        cpuCoresLimit: limits.cpuCoresLimit ?? task.cpus,
        diskLimitMb: limits.diskLimitMb ?? task.storageMb,
        ttlSeconds: limits.ttlSeconds ?? DEFAULT_TTL_SECONDS,
        requestId: ids.create,
      },
      { signal },
    );
    journal.sandbox(id, sandbox.id);
    // Docker's WORKDIR makes the directory; the agent's shell and the verifier start there.
    await sandbox.files.mkdir(task.workdir, { parents: true, user: 'root', signal });
    durations.setupMs = Math.round(performance.now() - t0);

    // The agent's limit: its tools are cut off when it passes, and the verifier still runs.
    const agentStop = new AbortController();
    const onAbort = () => agentStop.abort();
    signal.addEventListener('abort', onAbort, { once: true });
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      agentStop.abort();
    }, task.agentTimeoutSec * 1000);
    const toolsFor = (phase: string, s: AbortSignal) =>
      new SandboxTools({
        sandbox: sandbox!,
        ids,
        phase,
        workdir: task.workdir,
        onStep: (rid) => journal.step(id, rid),
        signal: s,
      });
    agentTools = toolsFor('a', agentStop.signal);
    const t1 = performance.now();
    let outcome: AgentOutcome | undefined;
    try {
      const memos = journal.task(id).memos;
      outcome = await options.agent.run({
        task: agentTask(task),
        tools: agentTools,
        signal: agentStop.signal,
        remember: async <T>(key: string, compute: () => Promise<T>): Promise<T> => {
          if (memos.has(key)) return memos.get(key) as T;
          const value = await compute();
          journal.memo(id, key, value);
          return value;
        },
      });
    } catch (err) {
      if (signal.aborted) return undefined;
      if (!timedOut) throw err;
    } finally {
      clearTimeout(timer);
      signal.removeEventListener('abort', onAbort);
    }
    durations.agentMs = Math.round(performance.now() - t1);

    const t2 = performance.now();
    verifyTools = toolsFor('v', signal);
    const verified: VerifierResult = await runVerifier(verifyTools, {
      testsDir: task.testsDir,
      timeoutMs: task.verifierTimeoutSec * 1000,
      env: task.verifierEnv,
      signal,
    });
    durations.gradingMs = Math.round(performance.now() - t2);
    return await finish({
      reward: verified.reward,
      tokens: outcome?.tokens,
      agentFinished: outcome?.finished ?? false,
      agentMessage: outcome?.message?.slice(-AGENT_MESSAGE_CHARS),
      ...(timedOut ? { agentTimedOut: true } : {}),
      verifier: {
        source: verified.source,
        metrics: verified.metrics,
        exitCode: verified.exitCode,
        outcome: verified.outcome,
      },
      ...(verified.reason ? { details: { reason: verified.reason } } : {}),
      killedProcesses: verified.killedProcesses,
      outputTail: verified.reward >= 1 ? undefined : verified.outputTail,
    });
  } catch (err) {
    if (signal.aborted) return undefined;
    const code = err instanceof ToolError ? 'tool_error' : isDsecError(err) ? err.code : 'internal';
    return finish({ reward: null, error: { code, message: (err as Error).message } });
  }
}

/** What an agent plug-in gets as its task: instruction.md as the problem statement. */
function agentTask(task: HarborTask): HarborAgentTask {
  return {
    instance_id: task.name,
    repo: '',
    base_commit: '',
    problem_statement: task.instruction,
    patch: '',
    test_patch: '',
    FAIL_TO_PASS: [],
    PASS_TO_PASS: [],
    environment: { image: '', toolkits: [] },
    test_command: 'bash /tests/test.sh',
    workdir: task.workdir,
    grading: 'in_place',
    harbor: task,
  };
}
