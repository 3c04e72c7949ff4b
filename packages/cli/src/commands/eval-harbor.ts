import { createHash } from 'node:crypto';
import { mkdir } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { DsecError } from '@dsec/core';
import { mountErofs, unmount } from '@dsec/native';
import {
  HttpAgent,
  Journal,
  NoneAgent,
  OracleAgent,
  loadHarborTasks,
  runHarbor,
  type Agent,
  type HarborEnvironmentBuilder,
  type HarborResult,
  type HarborTask,
} from '@dsec/eval';
import { loadClusterConfig, nodeBuildNetwork, nodeRegistrySettings } from '@dsec/cluster';
import { buildDockerfile } from '@dsec/images';
import type { CliContext } from '../context.js';
import { formatTable } from '../format.js';
import { createProgress } from '../progress.js';
import { localStore } from '../stores.js';

/** Exit code after SIGTERM (128 + 15), as `dsec eval run`'s. */
const EXIT_TERMINATED = 143;

/** The flags of `dsec eval run` a Harbor run reads. */
export interface HarborRunOptions {
  agent: string;
  endpoint?: string;
  model?: string;
  apiKeyEnv: string;
  maxTurns?: number;
  concurrency: number;
  label?: Record<string, string>;
  out: string;
  resume?: boolean;
  keepSandboxes?: boolean;
  memoryMb?: number;
  cpus?: number;
  diskMb?: number;
  ttlSeconds?: number;
  buildArg?: Record<string, string>;
  networkAllow?: string[];
  /** The node's config file: its `registries`, and `up.network` / `edge.network` for RUN steps. */
  config?: string;
}

/** A task's environment layer name: `harbor-<task>`, within the layer name rules. */
export function harborLayerName(task: HarborTask): string {
  const clean = task.name.toLowerCase().replace(/[^a-z0-9._-]/g, '-');
  const name = `harbor-${clean}`;
  if (name.length <= 128 && clean === task.name) return name;
  const hash = createHash('sha256').update(task.name).digest('hex').slice(0, 10);
  return `${name.slice(0, 116)}-${hash}`;
}

/**
 * Builds each task's `environment/Dockerfile` with `buildDockerfile`
 * (cached there: the same Dockerfile and context build nothing), `FROM`
 * through the registry settings (DSEC_INSECURE_REGISTRIES,
 * DSEC_REGISTRY_MIRRORS, REGISTRY_AUTH_FILE), RUN steps on the node's
 * egress machinery as `dsec image build --dockerfile`'s (root only; else
 * none), within task.toml's `build_timeout_sec`. One build at a time: the
 * build network's table and addresses under `<state-dir>/build` are one
 * build's, and a cached build costs nothing anyway.
 */
async function dockerfileBuilder(
  ctx: CliContext,
  opts: HarborRunOptions,
): Promise<HarborEnvironmentBuilder> {
  const store = localStore(ctx);
  // The same file `dsec up` reads (`--config`, else `DSEC_CONFIG`): its registries and its network.
  const configFile = opts.config ?? (ctx.io.env.DSEC_CONFIG || undefined);
  const config = configFile !== undefined ? await loadClusterConfig(configFile) : undefined;
  const registries = nodeRegistrySettings(config, ctx.io.env);
  // The node's egress settings (upstream resolvers, public and protected ranges), not its mode.
  const { mode: _mode, ...netOptions } = config?.up?.network ?? config?.edge?.network ?? {};
  const { stateDir } = ctx.options;
  const network =
    process.getuid?.() === 0 ? nodeBuildNetwork(join(stateDir, 'build'), netOptions) : undefined;
  let queue: Promise<unknown> = Promise.resolve();
  return (task, { signal }) => {
    const run = queue.then(async () => {
      await mkdir(stateDir, { recursive: true, mode: 0o711 });
      const r = await buildDockerfile(store, {
        name: harborLayerName(task),
        kind: 'base',
        contextDir: task.environmentDir,
        dockerfile: task.dockerfile,
        buildArgs: opts.buildArg ?? {},
        networkAllow: opts.networkAllow ?? [],
        registries,
        mounter: { mountErofs, unmount },
        network,
        timeoutMs: Math.ceil(task.buildTimeoutSec * 1000),
        buildahRoot: join(stateDir, 'buildah'),
        env: ctx.io.env,
        signal,
      });
      return { image: `${r.layer.name}:${r.layer.version}`, cached: r.cached };
    });
    queue = run.catch(() => undefined);
    return run;
  };
}

function makeAgent(ctx: CliContext, opts: HarborRunOptions): Agent {
  if (opts.agent === 'oracle') return new OracleAgent();
  if (opts.agent === 'none') return new NoneAgent();
  if (opts.agent === 'http') {
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
  throw new DsecError(
    'invalid_argument',
    `--format harbor takes --agent oracle, none or http, not ${opts.agent}`,
    { field: 'agent' },
  );
}

/**
 * `dsec eval run DIR --format harbor`: every task directory under DIR (or
 * DIR itself) built, run by the agent and verified by its test.sh; result
 * lines in `dsec eval run`'s shape, the same score table and `--json`
 * summary. `builder` replaces the Dockerfile build (tests).
 */
export async function runHarborCommand(
  ctx: CliContext,
  path: string,
  opts: HarborRunOptions,
  builder?: HarborEnvironmentBuilder,
): Promise<void> {
  const agent = makeAgent(ctx, opts);
  const tasks = await loadHarborTasks(path);
  const tasksPath = resolve(path);
  const out = resolve(opts.out);
  let labels = opts.label;
  if (opts.resume) {
    const header = Journal.open(`${out}.journal`).header;
    if (header.tasksFile !== tasksPath) {
      throw new DsecError('invalid_argument', `the journal's run is over ${header.tasksFile}`, {
        field: 'tasks',
      });
    }
    labels = header.labels;
  }
  const stop = new AbortController();
  let terminated = false;
  const onAbort = () => stop.abort();
  ctx.signal?.addEventListener('abort', onAbort, { once: true });
  const onTerm = () => {
    terminated = true;
    stop.abort();
  };
  process.on('SIGTERM', onTerm);
  const bar = createProgress({
    label: `eval ${agent.name}`,
    total: tasks.length,
    enabled: !ctx.json,
    stream: ctx.io.stderr,
  });
  let summary;
  try {
    summary = await runHarbor({
      client: ctx.client(),
      tasks,
      agent,
      environment: builder ?? (await dockerfileBuilder(ctx, opts)),
      tasksPath,
      outPath: out,
      resume: opts.resume,
      concurrency: opts.concurrency,
      labels,
      sandbox: {
        memoryLimitMb: opts.memoryMb,
        cpuCoresLimit: opts.cpus,
        diskLimitMb: opts.diskMb,
        ttlSeconds: opts.ttlSeconds,
      },
      keepSandboxes: opts.keepSandboxes,
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
      ...(summary.interrupted ? { interrupted: true } : {}),
    });
    return;
  }
  printHarborScores(ctx, summary.results);
  ctx.out(
    `solved ${summary.solved}/${summary.tasks}, errors ${summary.errors}` +
      (summary.pending ? `, ${summary.pending} pending` : '') +
      ` (run ${summary.runId}, results in ${out})`,
  );
  if (summary.interrupted) {
    ctx.err('dsec: interrupted: continue with the same command and --resume');
  }
}

function printHarborScores(ctx: CliContext, results: HarborResult[]): void {
  const rows = [...results]
    .sort((a, b) => a.instance_id.localeCompare(b.instance_id))
    .map((r) => [
      r.instance_id,
      r.reward === null ? '-' : String(r.reward),
      r.environment ? (r.environment.cached ? 'cached' : 'built') : '-',
      String(r.toolCalls),
      `${(r.durations.totalMs / 1000).toFixed(1)}s`,
      r.error
        ? `${r.error.code}: ${r.error.message}`.slice(0, 80)
        : (r.details?.reason ?? (r.agentTimedOut ? 'agent timed out' : '')),
    ]);
  ctx.io.stdout.write(
    formatTable(['TASK', 'REWARD', 'ENVIRONMENT', 'TOOL CALLS', 'TIME', 'NOTE'], rows),
  );
}
