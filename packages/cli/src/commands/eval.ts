import { existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { Option, type Command } from 'commander';
import { DsecError, type ImageStore } from '@dsec/core';
import {
  GoldAgent,
  HttpAgent,
  Journal,
  NoneAgent,
  RepoCache,
  RequestIds,
  SandboxTools,
  gradeByPatch,
  gradeInPlace,
  gradeSwebench,
  isSwebenchTask,
  loadSpecs,
  loadSwebenchDataset,
  loadTasks,
  prepareTasks,
  clusterInstallRunner,
  runEval,
  resolveTaskImage,
  workspaceLayerName,
  type Agent,
  type EnvironmentBuilder,
  type EvalResult,
  type EvalTask,
  type PreparedTask,
  type SwebenchTask,
  type UnrunnableTask,
} from '@dsec/eval';
import { ensureEnvironment, loadEnvironmentRecipes, type InstallRunner } from '@dsec/images';
import { contextOf, type CliContext } from '../context.js';
import { runHarborCommand } from './eval-harbor.js';
import { formatTable } from '../format.js';
import { collect, collectKeyValue, parseInteger, parseNumber } from '../parse.js';
import { createProgress } from '../progress.js';
import { localStore } from '../stores.js';
import { prepareTaskImages } from './eval-images.js';

/** Exit code after SIGTERM (128 + 15): the job's sandboxes are paused, `--resume` continues. */
const EXIT_TERMINATED = 143;

interface TaskOptions {
  environments?: string;
  cacheDir?: string;
  image?: string;
  toolkit?: string[];
  dataset: 'dsec' | 'swebench';
  specs?: string;
  /** `eval prepare`: images imported at once; `eval run`: tasks in flight (and images imported at once). */
  concurrency?: number;
}

interface RunOptions extends TaskOptions {
  agent: 'gold' | 'none' | 'http' | 'oracle';
  format?: 'jsonl' | 'harbor';
  buildArg?: Record<string, string>;
  networkAllow?: string[];
  config?: string;
  endpoint?: string;
  model?: string;
  apiKeyEnv: string;
  maxTurns?: number;
  concurrency: number;
  label?: Record<string, string>;
  out: string;
  resume?: boolean;
  retryErrors?: boolean;
  prepare: boolean;
  keepSandboxes?: boolean;
  memoryMb?: number;
  cpus?: number;
  diskMb?: number;
  ttlSeconds?: number;
  testTimeoutMs?: number;
}

/**
 * `dsec eval prepare|run|grade`: SWE-style tasks, each in its own sandbox,
 * scored by their tests (packages/eval). `run` writes one JSON line per task
 * to `--out` and keeps a journal beside it, so `--resume` after a kill or a
 * SIGTERM re-attaches to the same sandboxes and runs no command twice.
 */
export function register(program: Command): void {
  const evalCmd = program
    .command('eval')
    .description('run agents on SWE-style tasks in sandboxes and score them by their tests');

  taskOptions(
    evalCmd
      .command('prepare')
      .description(
        'build every layer the tasks need: environments from recipes, and a workspace layer per repository and commit (skips what exists)',
      )
      .argument('<tasks>', 'task file (JSONL, SWE-bench instance format)')
      .option(
        '--concurrency <n>',
        'with --dataset swebench: instance images imported at once (default 4)',
        parseInteger,
      ),
  ).action(async (file: string, opts: TaskOptions, command: Command) => {
    const ctx = contextOf(command);
    const batch = await loadBatch(file, opts);
    const report = await prepareBatch(ctx, file, batch, opts);
    if (ctx.json) {
      ctx.printJson({ ...report, unrunnable: batch.unrunnable });
      return;
    }
    ctx.io.stdout.write(
      formatTable(
        ['INSTANCE', 'IMAGE', 'TOOLKITS', 'WORKSPACE'],
        report.tasks.map((t) => [
          t.instance_id,
          t.image,
          t.toolkits.join(',') || '-',
          t.workspace ?? '-',
        ]),
      ),
    );
    ctx.out(`built ${report.built.length} layers, ${report.present.length} already present`);
    const broken = [
      ...batch.unrunnable,
      ...report.tasks.flatMap((t) =>
        t.error ? [{ instance_id: t.instance_id, error: t.error }] : [],
      ),
    ];
    for (const u of broken) ctx.err(`${u.instance_id}: ${u.error.code}: ${u.error.message}`);
    if (broken.length > 0)
      ctx.err(`${broken.length} instances cannot run (their result lines will say why)`);
  });

  taskOptions(
    evalCmd
      .command('run')
      .description(
        'run every task in its own sandbox with an agent, grade it by its tests, and write one JSON line per task to --out',
      )
      .argument('<tasks>', 'task file (JSONL, SWE-bench instance format)')
      .addOption(
        new Option(
          '--agent <name>',
          'gold applies the reference patch, none changes nothing, http asks a model; oracle (--format harbor) runs solution/solve.sh',
        )
          .choices(['gold', 'none', 'http', 'oracle'])
          .makeOptionMandatory(),
      )
      .option(
        '--endpoint <url>',
        'OpenAI-compatible API base for --agent http (http://host:port/v1)',
      )
      .option('--model <name>', 'model name for --agent http')
      .option(
        '--api-key-env <var>',
        'environment variable holding the endpoint key',
        'OPENAI_API_KEY',
      )
      .option('--max-turns <n>', 'model turns per task for --agent http (default 30)', parseInteger)
      .option('--concurrency <n>', 'tasks in flight at once', parseInteger, 4)
      .option(
        '--label <K=V>',
        'job label on every sandbox (repeatable; default job=eval-<run id>)',
        collectKeyValue,
      )
      .option(
        '--out <file>',
        'result lines (JSONL); the journal is <file>.journal',
        'results.jsonl',
      )
      .option(
        '--resume',
        "continue the run in --out's journal: re-attach to its sandboxes, skip finished tasks",
      )
      .option(
        '--retry-errors',
        "continue the run in --out's journal, running again only the tasks whose result line has an error",
      )
      .option('--no-prepare', 'do not build missing layers first (they must exist on the cluster)')
      .option(
        '--keep-sandboxes',
        "leave each task's sandboxes (the agent's and the grading one) running after grading",
      )
      .option('--memory-mb <n>', 'memory limit per sandbox in MiB (default 512)', parseInteger)
      .option('--cpus <n>', 'CPU cores per sandbox (default 1)', parseNumber)
      .option('--disk-mb <n>', 'disk quota per sandbox in MiB', parseInteger)
      .option('--ttl-seconds <n>', 'sandbox TTL (default 14400)', parseInteger)
      .option('--test-timeout-ms <n>', 'limit of the test command (default 1800000)', parseInteger)
      .addOption(
        new Option(
          '--format <format>',
          'jsonl: a task file; harbor: a Harbor / Terminal-Bench task directory or a folder of them',
        ).choices(['jsonl', 'harbor']),
      )
      .option('--build-arg <K=V>', 'Dockerfile build argument (--format harbor)', collectKeyValue)
      .option(
        '--network-allow <domain>',
        "a domain the Dockerfile's RUN steps may reach (--format harbor; repeatable)",
        collect,
      )
      .option(
        '--config <file>',
        "the node's config file, for Dockerfile builds (--format harbor): its registries section, and up.network or edge.network for RUN steps' egress",
      ),
  ).action(async (file: string, opts: RunOptions, command: Command) => {
    if (opts.format === 'harbor') return runHarborCommand(contextOf(command), file, opts);
    if (opts.agent === 'oracle') {
      throw new DsecError('invalid_argument', '--agent oracle is for --format harbor', {
        field: 'agent',
      });
    }
    await runCommand(contextOf(command), file, opts);
  });

  taskOptions(
    evalCmd
      .command('grade')
      .description(
        "grade one task an agent worked on in a sandbox: its patch applied to a fresh sandbox of the task's environment, then test_patch and the tests (in the agent's sandbox, after killing its processes, for grading: in_place): what dsec.eval's Python runner calls",
      )
      .argument('<tasks>', 'task file (JSONL)')
      .requiredOption('--instance <id>', 'instance_id of the task')
      .requiredOption('--sandbox <id>', "the agent's sandbox")
      .requiredOption('--run-id <id>', 'the run the request IDs derive from')
      .option('--attempt <n>', "the task's attempt in that run", parseInteger, 1)
      .option('--test-timeout-ms <n>', 'limit of the test command (default 1800000)', parseInteger)
      .option('--keep-grading-sandbox', 'leave the grading sandbox running afterwards'),
  ).action(
    async (
      file: string,
      opts: TaskOptions & {
        instance: string;
        sandbox: string;
        runId: string;
        attempt: number;
        testTimeoutMs?: number;
        keepGradingSandbox?: boolean;
      },
      command: Command,
    ) => {
      const ctx = contextOf(command);
      const batch = await loadBatch(file, opts);
      const broken = batch.unrunnable.find((u) => u.instance_id === opts.instance);
      if (broken) {
        throw new DsecError(broken.error.code as 'invalid_argument', broken.error.message, {
          field: 'instance',
          ...(broken.error.reason ? { details: { reason: broken.error.reason } } : {}),
        });
      }
      const task = batch.tasks.find((t) => t.instance_id === opts.instance);
      if (!task) {
        throw new DsecError('not_found', `${file} has no task ${opts.instance}`, {
          field: 'instance',
        });
      }
      const repos = new RepoCache(cacheDirOf(ctx, opts));
      const ids = new RequestIds(opts.runId, task.instance_id, opts.attempt);
      const client = ctx.client();
      const toolsOn = (sandboxId: string, phase: string) =>
        new SandboxTools({
          sandbox: client.sandbox(sandboxId),
          ids,
          phase,
          workdir: task.workdir,
          signal: ctx.signal,
        });
      const options = gradeOptionsFor(task, repos, opts.testTimeoutMs);
      let graded;
      let gradingSandboxId: string | undefined;
      if (task.grading === 'in_place') {
        graded = await gradeInPlace(toolsOn(opts.sandbox, 'g'), task, options);
      } else {
        // A fresh sandbox like the agent's: its layers, limits and labels (the job's), marked as the grader.
        const agent = await client.sandbox(opts.sandbox).refresh({ signal: ctx.signal });
        const grader = await client.runContainer(
          {
            image: agent.spec.image,
            toolkits: agent.spec.toolkits,
            workspace:
              agent.spec.workspace ?? (isSwebenchTask(task) ? undefined : workspaceLayerName(task)),
            memoryLimitMb: agent.spec.memoryLimitMb,
            cpuCoresLimit: agent.spec.cpuCoresLimit,
            diskLimitMb: agent.spec.diskLimitMb,
            labels: { ...agent.spec.labels, eval_role: 'grader' },
            requestId: ids.graderCreate,
          },
          { signal: ctx.signal },
        );
        gradingSandboxId = grader.id;
        try {
          graded = await gradeByPatch(
            toolsOn(opts.sandbox, 'x'),
            toolsOn(grader.id, 'g'),
            task,
            options,
          );
        } finally {
          if (!opts.keepGradingSandbox) await grader.stop().catch(() => undefined);
        }
      }
      if (ctx.json) ctx.printJson({ ...graded, gradingSandboxId });
      else
        ctx.out(
          `${task.instance_id}: reward ${graded.reward}${graded.failing.length ? `, failing ${graded.failing.join(' ')}` : ''}` +
            (graded.agentPatch?.leftOutCount
              ? `; left out ${graded.agentPatch.leftOut.map((l) => `${l.path} (${l.rule})`).join(', ')}`
              : ''),
        );
    },
  );
}

function taskOptions(command: Command): Command {
  return command
    .option(
      '--environments <file>',
      'environment recipes (default environments.json beside the task file)',
    )
    .option(
      '--cache-dir <dir>',
      'repository clones and build scratch (default <state-dir>/eval-cache)',
    )
    .option(
      '--image <name>',
      "base image of tasks that name none; with --dataset swebench the instance images' template, docker://REGISTRY/swebench/sweb.eval.x86_64.{id}:latest",
    )
    .option('--toolkit <name>', 'toolkit of tasks that name none (repeatable)', collect)
    .addOption(
      new Option(
        '--dataset <kind>',
        "the task file's format: dsec (DSec's task lines) or swebench (a SWE-bench dataset as published, JSON or JSONL)",
      )
        .choices(['dsec', 'swebench'])
        .default('dsec'),
    )
    .option(
      '--specs <file>',
      'with --dataset swebench: a spec table merged over the shipped one (packages/eval/specs/swebench.json)',
    );
}

async function runCommand(ctx: CliContext, file: string, opts: RunOptions): Promise<void> {
  const batch = await loadBatch(file, opts);
  const { file: tasksFile, tasks } = batch;
  const agent = makeAgent(ctx, opts);
  const out = resolve(opts.out);
  let labels = opts.label;
  if (opts.resume || opts.retryErrors) {
    // The run's labels and task file are the journal's; flags that disagree are a mistake.
    const header = Journal.open(`${out}.journal`).header;
    if (header.tasksFile !== tasksFile) {
      throw new DsecError('invalid_argument', `the journal's run is over ${header.tasksFile}`, {
        field: 'tasks',
      });
    }
    labels = header.labels;
  }
  const prepared = opts.prepare
    ? (await prepareBatch(ctx, file, batch, opts)).tasks
    : tasks.map((t): PreparedTask =>
        isSwebenchTask(t)
          ? {
              instance_id: t.instance_id,
              image: resolveTaskImage(opts.image!, t.instance_id).layer,
              toolkits: [],
              workdir: t.workdir,
            }
          : {
              instance_id: t.instance_id,
              image: t.environment.image,
              toolkits: t.environment.toolkits,
              workspace: workspaceLayerName(t),
              workdir: t.workdir,
            },
      );
  const repos = new RepoCache(cacheDirOf(ctx, opts));

  const stop = new AbortController();
  let terminated = false;
  const onAbort = () => stop.abort();
  ctx.signal?.addEventListener('abort', onAbort, { once: true });
  // A preemption notice: finish nothing more, pause the job's sandboxes, exit; `--resume` continues.
  const onTerm = () => {
    terminated = true;
    stop.abort();
  };
  process.on('SIGTERM', onTerm);
  const bar = createProgress({
    label: `eval ${agent.name}`,
    total: tasks.length + batch.unrunnable.length,
    enabled: !ctx.json,
    stream: ctx.io.stderr,
  });
  let summary;
  try {
    summary = await runEval({
      client: ctx.client(),
      tasks,
      tasksFile,
      prepared: new Map(prepared.map((p) => [p.instance_id, p])),
      agent,
      outPath: out,
      resume: opts.resume,
      retryErrors: opts.retryErrors,
      unrunnable: batch.unrunnable,
      concurrency: opts.concurrency,
      labels,
      sandbox: {
        memoryLimitMb: opts.memoryMb,
        cpuCoresLimit: opts.cpus,
        diskLimitMb: opts.diskMb,
        ttlSeconds: opts.ttlSeconds,
      },
      testTimeoutMs: opts.testTimeoutMs,
      original: (task, path) => repos.fileAtBase(task, path),
      keepSandboxes: opts.keepSandboxes,
      pauseOnInterrupt: () => terminated,
      signal: stop.signal,
      onProgress: (p) => bar.update(p.done),
    });
  } finally {
    process.off('SIGTERM', onTerm);
    ctx.signal?.removeEventListener('abort', onAbort);
    bar.done();
  }
  if (summary.interrupted) ctx.exitCode = terminated ? EXIT_TERMINATED : 130;
  if (ctx.json) {
    ctx.printJson({
      tasks: summary.tasks,
      solved: summary.solved,
      errors: summary.errors,
      pending: summary.pending,
      runId: summary.runId,
      labels: summary.labels,
      out,
      ...(summary.interrupted ? { interrupted: true, paused: terminated } : {}),
    });
    return;
  }
  printScores(ctx, summary.results);
  ctx.out(
    `solved ${summary.solved}/${summary.tasks}, errors ${summary.errors}` +
      (summary.pending ? `, ${summary.pending} pending` : '') +
      ` (run ${summary.runId}, results in ${out})`,
  );
  if (summary.interrupted) {
    ctx.err(
      `dsec: interrupted${terminated ? '; the job is paused' : ''}: continue with the same command and --resume`,
    );
  }
}

function printScores(ctx: CliContext, results: EvalResult[]): void {
  const rows = [...results]
    .sort((a, b) => a.instance_id.localeCompare(b.instance_id))
    .map((r) => {
      const tests = Object.values(r.tests);
      const passed = tests.filter((o) => o === 'passed' || o === 'xfail').length;
      return [
        r.instance_id,
        r.reward === null ? '-' : String(r.reward),
        `${passed}/${tests.length}`,
        String(r.toolCalls),
        `${(r.durations.totalMs / 1000).toFixed(1)}s`,
        r.error ? `${r.error.code}: ${r.error.message}`.slice(0, 80) : '',
      ];
    });
  ctx.io.stdout.write(
    formatTable(['INSTANCE', 'REWARD', 'TESTS', 'TOOL CALLS', 'TIME', 'ERROR'], rows),
  );
}

function makeAgent(ctx: CliContext, opts: RunOptions): Agent {
  if (opts.agent === 'gold') return new GoldAgent();
  if (opts.agent === 'none') return new NoneAgent();
  if (!opts.endpoint || !opts.model) {
    throw new DsecError('invalid_argument', '--agent http needs --endpoint and --model', {
      field: 'endpoint',
    });
  }
  return new HttpAgent({
    endpoint: opts.endpoint,
    model: opts.model,
    apiKey: ctx.io.env[opts.apiKeyEnv] || undefined,
    maxTurns: opts.maxTurns,
  });
}

/** A task file read in its format: the tasks that run, and those that cannot (one error line each). */
interface Batch {
  file: string;
  tasks: EvalTask[];
  unrunnable: UnrunnableTask[];
}

async function loadBatch(file: string, opts: TaskOptions): Promise<Batch> {
  if (opts.dataset === 'swebench') return await loadSwebenchBatch(file, opts);
  const loaded = await loadTasks(file, { image: opts.image, toolkits: opts.toolkit });
  return {
    file: loaded.file,
    tasks: loaded.tasks.filter((t) => t.unrunnable === undefined),
    unrunnable: loaded.tasks.flatMap((t) =>
      t.unrunnable ? [{ instance_id: t.instance_id, error: t.unrunnable }] : [],
    ),
  };
}

/**
 * `--dataset swebench`: the dataset as published, the spec table (shipped,
 * with `--specs` over it), and `--image` as the instance images' template.
 */
async function loadSwebenchBatch(file: string, opts: TaskOptions): Promise<Batch> {
  const template = opts.image;
  if (template === undefined) {
    throw new DsecError(
      'invalid_argument',
      "--dataset swebench needs --image 'docker://REGISTRY/swebench/sweb.eval.x86_64.{id}:latest' (the instance images' template)",
      { field: 'image' },
    );
  }
  if (opts.toolkit?.length) {
    throw new DsecError('invalid_argument', '--toolkit does not apply to --dataset swebench', {
      field: 'toolkit',
    });
  }
  // The template checked once, before any instance (`docker://…{id}…` or a local layer template).
  resolveTaskImage(template, 'check__template');
  const specs = await loadSpecs(opts.specs === undefined ? undefined : resolve(opts.specs));
  const ds = await loadSwebenchDataset(file, {
    specs,
    // The `docker://` reference an instance's image is imported from, or its local layer.
    image: (id) => {
      const image = resolveTaskImage(template, id);
      return image.source ?? image.layer;
    },
  });
  return {
    file: ds.file,
    tasks: ds.tasks,
    unrunnable: ds.errors.map((e) => ({
      instance_id: e.instance_id,
      error: { code: e.code, message: e.message, reason: e.reason },
    })),
  };
}

async function prepareBatch(ctx: CliContext, file: string, batch: Batch, opts: TaskOptions) {
  if (opts.dataset === 'swebench') {
    return await prepareSwebench(ctx, batch.tasks.filter(isSwebenchTask), opts);
  }
  return await prepare(ctx, file, batch.tasks, opts);
}

/**
 * Imports every instance's image ahead (the registry import: layers shared
 * between images are reused by diff ID), `--concurrency` at once (or a local layer template checked present),
 * with a progress bar. An image that cannot be imported fails its instance
 * alone: the prepared task carries the error, the run gives it an error line.
 */
async function prepareSwebench(ctx: CliContext, tasks: SwebenchTask[], opts: TaskOptions) {
  const store = localStore(ctx);
  const images = new Map(
    tasks.map((t) => [t.environment.image, resolveTaskImage(opts.image!, t.instance_id)]),
  );
  const present = new Set<string>();
  for (const { layer } of images.values()) {
    const found = await store.getLayer(layer).then(
      () => true,
      () => false,
    );
    if (found) present.add(layer);
  }
  // `docker://` images are imported (present ones cost a lookup); a local layer template names
  // layers that must exist already.
  const refs = [...images.values()].flatMap((i) => (i.source ? [i.source] : []));
  const imported =
    refs.length > 0
      ? await prepareTaskImages(ctx, refs, {
          ...(opts.concurrency !== undefined ? { concurrency: opts.concurrency } : {}),
        })
      : new Map<string, string | DsecError>();
  const outcome = (image: string): string | DsecError => {
    const resolved = images.get(image)!;
    if (resolved.source) return imported.get(resolved.source)!;
    return present.has(resolved.layer)
      ? resolved.layer
      : new DsecError(
          'image_not_found',
          `layer ${resolved.layer} is not in the store: import it (dsec image import ${resolved.layer} --from-oci …) or name a docker:// template`,
          { details: { layer: resolved.layer } },
        );
  };
  const prepared = tasks.map((t): PreparedTask => {
    const got = outcome(t.environment.image);
    const base = {
      instance_id: t.instance_id,
      image: typeof got === 'string' ? got : images.get(t.environment.image)!.layer,
      toolkits: [],
      workdir: t.workdir,
    };
    if (typeof got === 'string') return base;
    const reason = (got.details as { reason?: unknown } | undefined)?.reason;
    return {
      ...base,
      error: {
        code: got.code,
        message: got.message.includes(t.environment.image)
          ? got.message
          : `${t.environment.image}: ${got.message}`,
        ...(typeof reason === 'string' ? { reason } : {}),
      },
    };
  });
  const ok = [...new Set(prepared.filter((p) => !p.error).map((p) => p.image))];
  return {
    tasks: prepared,
    built: ok.filter((l) => !present.has(l)),
    present: ok.filter((l) => present.has(l)),
  };
}

/** How a task is graded: a SWE-bench instance by its evaluation script, in its own sandbox. */
function gradeOptionsFor(task: EvalTask, repos: RepoCache, testTimeoutMs: number | undefined) {
  if (isSwebenchTask(task)) {
    return {
      original: () => Promise.resolve(undefined),
      testTimeoutMs,
      runTests: (tools: SandboxTools) => gradeSwebench(tools, task, { testTimeoutMs }),
    };
  }
  return { original: (path: string) => repos.fileAtBase(task, path), testTimeoutMs };
}

function cacheDirOf(ctx: CliContext, opts: TaskOptions): string {
  return resolve(opts.cacheDir ?? join(ctx.options.stateDir, 'eval-cache'));
}

async function prepare(ctx: CliContext, file: string, tasks: EvalTask[], opts: TaskOptions) {
  const store = localStore(ctx);
  const cacheDir = cacheDirOf(ctx, opts);
  const bar = createProgress({
    label: 'eval prepare',
    total: 1,
    enabled: !ctx.json,
    stream: ctx.io.stderr,
  });
  try {
    return await prepareTasks(tasks, {
      store,
      repos: new RepoCache(cacheDir),
      // The same download cache as `dsec image build --from-debs`.
      buildEnvironment: await environmentBuilder(
        store,
        recipesFile(file, opts),
        join(ctx.options.stateDir, 'cache', 'debs'),
        // Install recipes build in a sandbox of the cluster the command talks to.
        clusterInstallRunner(ctx.client()),
      ),
      signal: ctx.signal,
      onProgress: (p) => bar.update(p.done, p.total),
    });
  } finally {
    bar.done();
  }
}

export function recipesFile(
  tasksFile: string,
  opts: Pick<TaskOptions, 'environments'>,
): string | undefined {
  if (opts.environments) return resolve(opts.environments);
  const beside = join(dirname(resolve(tasksFile)), 'environments.json');
  return existsSync(beside) ? beside : undefined;
}

/**
 * Builds missing environment layers (`ensureEnvironment`) from the recipe
 * file; undefined without one (a missing layer is then an error naming it).
 */
export async function environmentBuilder(
  store: ImageStore,
  recipesPath: string | undefined,
  cacheDir: string,
  installer?: InstallRunner,
): Promise<EnvironmentBuilder | undefined> {
  if (!recipesPath) return undefined;
  const recipes = await loadEnvironmentRecipes(recipesPath);
  return async (name, options) => {
    if (!(name in recipes)) {
      throw new DsecError(
        'image_not_found',
        `layer ${name} is missing and ${recipesPath} has no recipe for it`,
        {
          details: { layer: name },
        },
      );
    }
    return await ensureEnvironment(store, name, recipes, {
      cacheDir,
      installer,
      workspace: options.workspace,
      ...(options.signal ? { signal: options.signal } : {}),
    });
  };
}
