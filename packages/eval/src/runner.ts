import { setTimeout as sleep } from 'node:timers/promises';
import { appendFileSync, existsSync, readFileSync, writeFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { DsecError, isDsecError, type ErrorCode } from '@dsec/core';
import type { DSecClient, Sandbox } from '@dsec/sdk';
import type { Agent, TokenUsage } from './agents/agent.js';
import { gradeByPatch, gradeInPlace, type AgentPatchRecord, type GradeResult } from './grade.js';
import { Journal } from './journal.js';
import { RequestIds, newRunId } from './request-ids.js';
import { gradeSwebench } from './swebench/grade.js';
import { isSwebenchTask } from './swebench/dataset.js';
import type { EvalTask } from './task.js';
import type { TestOutcome } from './test-output.js';
import { SandboxTools, ToolError } from './tools.js';

/** Where a task's sandbox comes from: what `prepareTasks` made sure exists. */
export interface PreparedTask {
  instance_id: string;
  image: string;
  toolkits: string[];
  /** None for an image that holds the repository itself (SWE-bench's instance images). */
  workspace?: string | undefined;
  workdir: string;
  /** Why the task's environment could not be made ready (an image import failed): its result line's `error`. */
  error?: TaskError | undefined;
}

/** Why a task has no reward: a stable code (`docs/errors.md`), `reason` for the sub-case. */
export interface TaskError {
  code: string;
  message: string;
  reason?: string | undefined;
}

/** A task that cannot run at all (no spec for its repository, a patch that cannot be read): one error line. */
export interface UnrunnableTask {
  instance_id: string;
  error: TaskError;
}

/** One line of `--out`. */
export interface EvalResult {
  instance_id: string;
  /** 1 or 0; null when the harness failed (`error` says why), which is not a 0. */
  reward: 0 | 1 | null;
  tests: Record<string, TestOutcome>;
  /** FAIL_TO_PASS / PASS_TO_PASS tests that did not pass. */
  failing?: string[] | undefined;
  toolCalls: number;
  tokens?: TokenUsage | undefined;
  /** Whether the agent said it was done (`finish`), rather than running out of turns. */
  agentFinished?: boolean | undefined;
  durations: { setupMs: number; agentMs: number; gradingMs: number; totalMs: number };
  /** The agent's sandbox. */
  sandboxId: string | undefined;
  /** How the task was graded: `patch` (in a fresh sandbox, the default) or `in_place`. */
  grading?: 'patch' | 'in_place' | undefined;
  /** The fresh sandbox the tests ran in (patch grading). */
  gradingSandboxId?: string | undefined;
  /** What the grader carried from the agent's sandbox, and what it left out and why (patch grading). */
  agentPatch?: AgentPatchRecord | undefined;
  /** Processes of the agent killed before grading: before its patch was taken, or in place before the tests were written. */
  killedProcesses?: number | undefined;
  /** Commands of this task the sandboxes' logs show as run (each request ID once, if all is well). */
  executedSteps: number;
  /** Calls this driver made whose request ID the log already held: answered from the log. */
  replayedSteps: number;
  /** Request IDs the log shows run more than once (0 unless something ran twice). */
  duplicateExecutions: number;
  testExitCode?: number | undefined;
  testOutcome?: string | undefined;
  outputTail?: string | undefined;
  attempt: number;
  runId: string;
  agent: string;
  error?: TaskError | undefined;
}

export interface EvalProgress {
  done: number;
  total: number;
  solved: number;
  errors: number;
  running: number;
}

export interface SandboxLimits {
  memoryLimitMb?: number | undefined;
  cpuCoresLimit?: number | undefined;
  diskLimitMb?: number | undefined;
  ttlSeconds?: number | undefined;
}

export interface RunEvalOptions {
  client: DSecClient;
  tasks: EvalTask[];
  prepared: ReadonlyMap<string, PreparedTask>;
  agent: Agent;
  /** The task file (recorded in the journal; a resume must name the same). */
  tasksFile: string;
  /** Result lines go here, one per task, as each finishes. */
  outPath: string;
  /** Default `<outPath>.journal`. */
  journalPath?: string | undefined;
  /** Continue the run the journal describes: re-attach to its sandboxes, skip tasks with a result. */
  resume?: boolean | undefined;
  /**
   * Continue the run the journal describes and run again only the tasks
   * whose result line has an `error` (a new attempt each, new sandboxes);
   * the other lines stay.
   */
  retryErrors?: boolean | undefined;
  /** Tasks that cannot run: each gets its error line (and counts in `tasks` and `errors`). */
  unrunnable?: readonly UnrunnableTask[] | undefined;
  /** Tasks in flight at once (default 4). */
  concurrency?: number | undefined;
  /** The job's labels (`{ job: 'x' }`), on every sandbox; default `{ job: 'eval-<runId>' }`. */
  labels?: Record<string, string> | undefined;
  sandbox?: SandboxLimits | undefined;
  testTimeoutMs?: number | undefined;
  /** Base content of a task's file at `base_commit` (the grader's source for test files). */
  original: (task: EvalTask, path: string) => Promise<string | undefined>;
  /** Leave each sandbox (the agent's and the grading one) running after grading (for inspection); default stop them. */
  keepSandboxes?: boolean | undefined;
  /** Ends the run early: tasks in flight write no result, their sandboxes stay for `--resume`. */
  signal?: AbortSignal | undefined;
  /**
   * Asked when the run ends interrupted: true pauses the job's sandboxes
   * (`pauseJob` by its labels: a preemption notice), and the next `resume`
   * resumes them. Default: leave them running.
   */
  pauseOnInterrupt?: (() => boolean) | undefined;
  onProgress?: ((p: EvalProgress) => void) | undefined;
  onResult?: ((r: EvalResult) => void) | undefined;
}

export interface EvalSummary {
  runId: string;
  labels: Record<string, string>;
  /** Tasks in the batch (with results from before a resume). */
  tasks: number;
  solved: number;
  errors: number;
  /** Tasks without a result because the run was interrupted. */
  pending: number;
  interrupted: boolean;
  results: EvalResult[];
}

const DEFAULT_TTL_SECONDS = 4 * 3600;

/**
 * Runs a batch of tasks, each in its own sandbox (and, for grading, a fresh
 * sandbox of the same environment: `gradeByPatch`), and writes one result
 * line per task. The rollout outlives its driver (paper 6.2): the journal
 * next to `--out` records the run ID, each task's sandbox and finished
 * steps, and the agent's decisions; every command carries a request ID
 * derived from (run, instance, attempt, step). A driver killed at any point
 * and started again with `resume` re-attaches to the same sandboxes, repeats
 * the same calls and gets recorded results for those already run, so no
 * command runs twice and the rewards are the same as without the kill.
 */
export async function runEval(options: RunEvalOptions): Promise<EvalSummary> {
  const journalPath = options.journalPath ?? `${options.outPath}.journal`;
  const signal = options.signal ?? new AbortController().signal;
  let journal: Journal;
  let previous: EvalResult[] = [];
  const reuse = options.resume === true || options.retryErrors === true;
  let retried = new Set<string>();
  if (reuse) {
    journal = Journal.open(journalPath);
    if (journal.header.agent !== options.agent.name) {
      throw new DsecError(
        'invalid_argument',
        `the journal's run used --agent ${journal.header.agent}, not ${options.agent.name}`,
        { field: 'agent' },
      );
    }
    previous = readResults(options.outPath);
    if (options.retryErrors) {
      retried = new Set(previous.filter((r) => r.error).map((r) => r.instance_id));
      previous = previous.filter((r) => !r.error);
      writeFileSync(options.outPath, previous.map((r) => JSON.stringify(r) + '\n').join(''));
    }
    // Paused by a preemption notice (or not: resuming a running sandbox is a no-op).
    await options.client.resumeJob(journal.header.labels, { signal });
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
      tasksFile: options.tasksFile,
      startedAt: new Date().toISOString(),
    });
    writeFileSync(options.outPath, '');
  }
  for (const id of retried) {
    if (options.tasks.some((t) => t.instance_id === id)) journal.newAttempt(id, 'retry-errors');
  }
  const runner = new TaskRunner({ ...options, resume: reuse }, journal, signal);
  const done = new Set(previous.map((r) => r.instance_id));
  // Tasks finished before the kill may have left their sandbox running (killed between the result and the stop).
  if (reuse && !options.keepSandboxes) {
    for (const task of options.tasks) {
      if (!done.has(task.instance_id)) continue;
      const jt = journal.task(task.instance_id);
      await stopAll(options.client, [jt.sandboxId, jt.graderSandboxId]);
    }
  }
  const todo = options.tasks.filter((t) => !done.has(t.instance_id));
  const unrunnable = (options.unrunnable ?? []).filter((u) => !done.has(u.instance_id));
  const known = new Set([
    ...options.tasks.map((t) => t.instance_id),
    ...(options.unrunnable ?? []).map((u) => u.instance_id),
  ]);
  const total = known.size;
  const results = [...previous.filter((r) => known.has(r.instance_id))];
  for (const u of unrunnable) {
    const line: EvalResult = {
      instance_id: u.instance_id,
      reward: null,
      tests: {},
      toolCalls: 0,
      durations: { setupMs: 0, agentMs: 0, gradingMs: 0, totalMs: 0 },
      sandboxId: undefined,
      executedSteps: 0,
      replayedSteps: 0,
      duplicateExecutions: 0,
      attempt: journal.task(u.instance_id).attempt,
      runId: journal.header.runId,
      agent: options.agent.name,
      error: u.error,
    };
    appendFileSync(options.outPath, JSON.stringify(line) + '\n');
    journal.done(u.instance_id);
    results.push(line);
    options.onResult?.(line);
  }
  const progress: EvalProgress = {
    done: results.length,
    total,
    solved: results.filter((r) => r.reward === 1).length,
    errors: results.filter((r) => r.error).length,
    running: 0,
  };
  options.onProgress?.({ ...progress });

  let next = 0;
  const worker = async () => {
    while (next < todo.length && !signal.aborted) {
      const task = todo[next++]!;
      progress.running++;
      options.onProgress?.({ ...progress });
      const result = await runner.run(task);
      progress.running--;
      if (!result) continue; // interrupted: no line, the journal keeps its state
      appendFileSync(options.outPath, JSON.stringify(result) + '\n');
      journal.done(task.instance_id);
      results.push(result);
      progress.done++;
      if (result.reward === 1) progress.solved++;
      if (result.error) progress.errors++;
      options.onResult?.(result);
      options.onProgress?.({ ...progress });
      if (!options.keepSandboxes) {
        await stopAll(options.client, [result.sandboxId, result.gradingSandboxId]);
      }
    }
  };
  const concurrency = Math.max(1, options.concurrency ?? 4);
  await Promise.all(Array.from({ length: Math.min(concurrency, todo.length) }, worker));
  if (signal.aborted && options.pauseOnInterrupt?.()) {
    await options.client.pauseJob(journal.header.labels);
    await pauseLateCreates(options.client, journal.header.labels);
    journal.mark('paused');
  }
  return {
    runId: journal.header.runId,
    labels: journal.header.labels,
    tasks: total,
    solved: progress.solved,
    errors: progress.errors,
    pending: total - results.length,
    interrupted: signal.aborted,
    results,
  };
}

/**
 * A create the interrupt abandoned client-side (a grading sandbox starting
 * when SIGTERM came) still finishes on the server: wait for the job's
 * sandboxes in `creating` to settle (at most `waitMs`), then pause the job
 * again so they are paused too.
 */
async function pauseLateCreates(
  client: DSecClient,
  labels: Record<string, string>,
  waitMs = 60_000,
): Promise<void> {
  const deadline = Date.now() + waitMs;
  let late = false;
  for (;;) {
    const creating = (await client.listSandboxes({ labels })).some((s) => s.state === 'creating');
    if (!creating) break;
    late = true;
    if (Date.now() > deadline) break;
    await sleep(200);
  }
  if (late) await client.pauseJob(labels);
}

/** Stops sandboxes by ID, together (a missing or stopped one is fine). */
async function stopAll(client: DSecClient, ids: (string | undefined)[]): Promise<void> {
  await Promise.all(
    ids
      .filter((id): id is string => id !== undefined)
      .map((id) =>
        client
          .sandbox(id)
          .stop()
          .catch(() => undefined),
      ),
  );
}

/** The result lines already in `path`; a torn last line (a killed driver) is dropped from the file. */
export function readResults(path: string): EvalResult[] {
  if (!existsSync(path)) return [];
  const kept: string[] = [];
  const results: EvalResult[] = [];
  for (const line of readFileSync(path, 'utf8').split('\n')) {
    if (line.trim() === '') continue;
    try {
      const r = JSON.parse(line) as EvalResult;
      if (typeof r.instance_id !== 'string') continue;
      results.push(r);
      kept.push(line);
    } catch {
      // torn
    }
  }
  writeFileSync(path, kept.map((l) => l + '\n').join(''));
  return results;
}

/** A task's sandboxes as `#attach` found or made them, with the request IDs their logs held. */
interface Attached {
  sandbox: Sandbox;
  ids: RequestIds;
  recorded: Set<string>;
  grader: { sandbox: Sandbox; recorded: ReadonlySet<string> } | undefined;
}

class TaskRunner {
  readonly #o: RunEvalOptions;
  readonly #journal: Journal;
  readonly #signal: AbortSignal;

  constructor(options: RunEvalOptions, journal: Journal, signal: AbortSignal) {
    this.#o = options;
    this.#journal = journal;
    this.#signal = signal;
  }

  get #runId(): string {
    return this.#journal.header.runId;
  }

  /** Runs (or continues) one task; undefined when the run was interrupted meanwhile. */
  async run(task: EvalTask): Promise<EvalResult | undefined> {
    const t0 = performance.now();
    const id = task.instance_id;
    const durations = { setupMs: 0, agentMs: 0, gradingMs: 0, totalMs: 0 };
    const base: EvalResult = {
      instance_id: id,
      reward: null,
      tests: {},
      toolCalls: 0,
      durations,
      sandboxId: undefined,
      executedSteps: 0,
      replayedSteps: 0,
      duplicateExecutions: 0,
      attempt: this.#journal.task(id).attempt,
      runId: this.#runId,
      agent: this.#o.agent.name,
    };
    let agentTools: SandboxTools | undefined;
    let patchTools: SandboxTools | undefined;
    let gradeTools: SandboxTools | undefined;
    let sandbox: Sandbox | undefined;
    let grader: Sandbox | undefined;
    let pendingGrader: Promise<unknown> | undefined;
    let ids: RequestIds | undefined;
    const finish = async (extra: Partial<EvalResult>): Promise<EvalResult> => {
      // A grading sandbox still starting when the grading failed is in the result (and stopped).
      await pendingGrader?.catch(() => undefined);
      let executed = 0;
      let duplicates = 0;
      const counts = await Promise.all(
        [sandbox, grader].map((sb) =>
          sb && ids ? countSteps(sb, ids).catch(() => undefined) : Promise.resolve(undefined),
        ),
      );
      for (const counted of counts) {
        executed += counted?.executed ?? 0;
        duplicates += counted?.duplicates ?? 0;
      }
      durations.totalMs = Math.round(performance.now() - t0);
      return {
        ...base,
        ...extra,
        sandboxId: sandbox?.id,
        gradingSandboxId: grader?.id,
        attempt: this.#journal.task(id).attempt,
        toolCalls: agentTools?.toolCalls ?? 0,
        replayedSteps: [agentTools, patchTools, gradeTools].reduce(
          (n, t) => n + (t?.replayedSteps ?? 0),
          0,
        ),
        executedSteps: executed,
        duplicateExecutions: duplicates,
        durations,
      };
    };
    try {
      const prepared = this.#o.prepared.get(id);
      if (!prepared) throw new DsecError('image_not_found', `${id} was not prepared`);
      if (prepared.error) {
        throw new DsecError(
          prepared.error.code as ErrorCode,
          prepared.error.message,
          prepared.error.reason ? { details: { reason: prepared.error.reason } } : {},
        );
      }
      const attached = await this.#attach(task, prepared);
      sandbox = attached.sandbox;
      ids = attached.ids;
      durations.setupMs = Math.round(performance.now() - t0);

      const toolsFor = (sb: Sandbox, phase: string, recorded: ReadonlySet<string>) =>
        new SandboxTools({
          sandbox: sb,
          ids: attached.ids,
          phase,
          workdir: prepared.workdir,
          recorded,
          onStep: (rid) => this.#journal.step(id, rid),
          signal: this.#signal,
        });
      agentTools = toolsFor(attached.sandbox, 'a', attached.recorded);
      const t1 = performance.now();
      const memos = this.#journal.task(id).memos;
      const outcome = await this.#o.agent.run({
        task,
        tools: agentTools,
        signal: this.#signal,
        remember: async <T>(key: string, compute: () => Promise<T>): Promise<T> => {
          if (memos.has(key)) return memos.get(key) as T;
          const value = await compute();
          this.#journal.memo(id, key, value);
          return value;
        },
      });
      durations.agentMs = Math.round(performance.now() - t1);

      const t2 = performance.now();
      const testTimeoutMs = this.#o.testTimeoutMs;
      const gradeOptions = {
        // A SWE-bench instance's test files come from its own sandbox (`git checkout`), not the host.
        original: isSwebenchTask(task)
          ? () => Promise.resolve(undefined)
          : (path: string) => this.#o.original(task, path),
        testTimeoutMs,
        runTests: isSwebenchTask(task)
          ? (tools: SandboxTools) => gradeSwebench(tools, task, { testTimeoutMs })
          : undefined,
      };
      let graded: GradeResult;
      if (task.grading === 'in_place') {
        gradeTools = toolsFor(attached.sandbox, 'g', attached.recorded);
        graded = await gradeInPlace(gradeTools, task, gradeOptions);
      } else {
        patchTools = toolsFor(attached.sandbox, 'x', attached.recorded);
        // The grading sandbox starts while the agent's workdir is listed.
        const fresh = this.#grader(task, prepared, attached).then((g) => {
          grader = g.sandbox;
          gradeTools = toolsFor(g.sandbox, 'g', g.recorded);
          return gradeTools;
        });
        pendingGrader = fresh;
        // An interrupt returns before `finish` awaits it: its rejection must not end the process.
        fresh.catch(() => undefined);
        graded = await gradeByPatch(patchTools, fresh, task, gradeOptions);
      }
      durations.gradingMs = Math.round(performance.now() - t2);
      return await finish({
        reward: graded.reward,
        tests: graded.tests,
        failing: graded.failing,
        tokens: outcome.tokens,
        agentFinished: outcome.finished,
        testExitCode: graded.testExitCode,
        testOutcome: graded.testOutcome,
        outputTail: graded.reward === 1 ? undefined : graded.outputTail,
        grading: graded.grading,
        agentPatch: graded.agentPatch,
        killedProcesses: graded.killedProcesses,
      });
    } catch (err) {
      if (this.#signal.aborted) return undefined;
      const code =
        err instanceof ToolError ? 'tool_error' : isDsecError(err) ? err.code : 'internal';
      const reason = isDsecError(err)
        ? (err.details as { reason?: unknown } | undefined)?.reason
        : undefined;
      return finish({
        reward: null,
        error: {
          code,
          message: (err as Error).message,
          ...(typeof reason === 'string' ? { reason } : {}),
        },
      });
    }
  }

  /**
   * The task's sandbox: the journal's (resumed if paused) while it lives and
   * its log still holds every step the journal says finished there; else a
   * new attempt with a new sandbox. The same goes for the attempt's grading
   * sandbox when the journal has one: if it cannot carry on, neither can
   * the attempt. Returns the request IDs each log already held.
   */
  async #attach(task: EvalTask, prepared: PreparedTask): Promise<Attached> {
    const id = task.instance_id;
    const client = this.#o.client;
    const jt = this.#journal.task(id);
    let known = jt.sandboxId;
    if (!known && this.#o.resume) {
      // Killed between the create and the journal line: the labels find it (not its grading sandbox).
      const found = await client.listSandboxes({
        labels: { eval_run: this.#runId, instance_id: id, eval_attempt: String(jt.attempt) },
        signal: this.#signal,
      });
      known = found.find(
        (s) =>
          (s.state === 'running' || s.state === 'paused') &&
          s.spec.labels?.['eval_role'] !== 'grader',
      )?.id;
    }
    if (known) {
      const ids = new RequestIds(this.#runId, id, jt.attempt);
      // Patch grading runs the `g` steps in the grading sandbox; everything else is the agent's.
      const inGrader = (rid: string) =>
        task.grading !== 'in_place' && rid.startsWith(`${ids.prefix}:g`);
      const steps = [...jt.steps];
      let reason = await this.#reusable(
        known,
        ids,
        steps.filter((r) => !inGrader(r)),
      );
      let grader: Attached['grader'];
      if (typeof reason !== 'string' && jt.graderSandboxId) {
        const g = await this.#reusable(jt.graderSandboxId, ids, steps.filter(inGrader));
        if (typeof g === 'string') reason = `its grading sandbox: ${g}`;
        else grader = { sandbox: client.sandbox(jt.graderSandboxId), recorded: g };
      }
      if (typeof reason !== 'string') {
        if (!jt.sandboxId) this.#journal.sandbox(id, known);
        return { sandbox: client.sandbox(known), ids, recorded: reason, grader };
      }
      await stopAll(client, [known, jt.graderSandboxId]);
      this.#journal.newAttempt(id, reason);
    }
    const ids = new RequestIds(this.#runId, id, this.#journal.task(id).attempt);
    const sandbox = await client.runContainer(
      {
        ...this.#spec(task, prepared, 'agent'),
        // A retry after a lost answer (or a driver killed before the journal line) gets the same sandbox.
        requestId: ids.create,
      },
      { signal: this.#signal },
    );
    this.#journal.sandbox(id, sandbox.id);
    const recorded = this.#o.resume ? await loggedIds(sandbox, ids) : new Set<string>();
    return { sandbox, ids, recorded, grader: undefined };
  }

  /** What a sandbox of the task's environment is created with (the agent's and the grading one alike). */
  #spec(task: EvalTask, prepared: PreparedTask, role: 'agent' | 'grader') {
    const limits = this.#o.sandbox ?? {};
    return {
      image: prepared.image,
      toolkits: prepared.toolkits,
      workspace: prepared.workspace,
      labels: {
        ...this.#journal.header.labels,
        instance_id: task.instance_id,
        eval_run: this.#runId,
        eval_attempt: String(this.#journal.task(task.instance_id).attempt),
        ...(role === 'grader' ? { eval_role: 'grader' } : {}),
      },
      memoryLimitMb: limits.memoryLimitMb,
      cpuCoresLimit: limits.cpuCoresLimit,
      diskLimitMb: limits.diskLimitMb,
      ttlSeconds: limits.ttlSeconds ?? DEFAULT_TTL_SECONDS,
    };
  }

  /**
   * The attempt's grading sandbox: the one `#attach` re-attached to, or a
   * fresh one of the task's own environment (same image, toolkits,
   * workspace and limits as the agent's), journaled before any step runs in
   * it. Its create carries a request ID: a driver killed before the journal
   * line gets the same sandbox back.
   */
  async #grader(
    task: EvalTask,
    prepared: PreparedTask,
    attached: Attached,
  ): Promise<{ sandbox: Sandbox; recorded: ReadonlySet<string> }> {
    if (attached.grader) return attached.grader;
    const create = (requestId: string) =>
      this.#o.client.runContainer(
        { ...this.#spec(task, prepared, 'grader'), requestId },
        { signal: this.#signal },
      );
    let sandbox = await create(attached.ids.graderCreate);
    if (this.#o.resume) {
      // A create the preemption abandoned finished on the server (and was paused with the job,
      // or failed): the same request ID hands that sandbox back. A grader is fresh by design,
      // so a dead one is replaced.
      const info = await sandbox.refresh({ signal: this.#signal });
      if (info.state === 'paused') await sandbox.resume({ signal: this.#signal });
      else if (info.state !== 'running') sandbox = await create(`${attached.ids.graderCreate}.r`);
    }
    this.#journal.grader(task.instance_id, sandbox.id);
    const recorded = this.#o.resume ? await loggedIds(sandbox, attached.ids) : new Set<string>();
    return { sandbox, recorded };
  }

  /** The IDs the sandbox's log holds, or why the sandbox cannot carry the task on. */
  async #reusable(
    sandboxId: string,
    ids: RequestIds,
    steps: readonly string[],
  ): Promise<Set<string> | string> {
    const sandbox = this.#o.client.sandbox(sandboxId);
    try {
      const info = await sandbox.refresh({ signal: this.#signal });
      if (info.state === 'paused') await sandbox.resume({ signal: this.#signal });
      else if (info.state !== 'running') return `sandbox ${sandboxId} is ${info.state}`;
      const recorded = await loggedIds(sandbox, ids);
      const lost = steps.filter((rid) => !recorded.has(rid));
      // Past the log's retention a step would run again: start the task over instead.
      if (lost.length > 0) return `the command log no longer holds ${lost.length} finished steps`;
      return recorded;
    } catch (err) {
      if (
        isDsecError(err) &&
        (err.code === 'sandbox_not_found' || err.code === 'sandbox_not_running')
      ) {
        return `sandbox ${sandboxId} is gone`;
      }
      throw err;
    }
  }
}

async function loggedIds(sandbox: Sandbox, ids: RequestIds): Promise<Set<string>> {
  const log = await sandbox.commands.list();
  return new Set(log.map((c) => c.requestId).filter((r): r is string => ids.owns(r)));
}

/** From the sandbox's command log: commands this attempt ran, and request IDs that ran more than once. */
export async function countSteps(
  sandbox: Sandbox,
  ids: RequestIds,
): Promise<{ executed: number; duplicates: number }> {
  const log = await sandbox.commands.list();
  const seen = new Map<string, number>();
  for (const c of log) {
    if (!ids.owns(c.requestId)) continue;
    seen.set(c.requestId!, (seen.get(c.requestId!) ?? 0) + 1);
  }
  let executed = 0;
  let duplicates = 0;
  for (const n of seen.values()) {
    executed += n;
    duplicates += n - 1;
  }
  return { executed, duplicates };
}
