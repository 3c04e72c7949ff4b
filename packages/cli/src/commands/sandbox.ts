import { constants } from 'node:os';
import { Option, type Command } from 'commander';
import { DEFAULT_COMMAND_TIMEOUT_MS } from '@dsec/sdk';
import type { CommandResult, QosClass, SandboxInfo } from '@dsec/sdk';
import { contextOf } from '../context.js';
import type { CliContext } from '../context.js';
import { formatBytes, formatRelative, formatTable } from '../format.js';
import { collect, collectKeyValue, parseInteger, parseNumber } from '../parse.js';
import { reportError } from '../report-error.js';
import { registerSandboxIo } from './sandbox-io.js';
import { registerSandboxLifecycle, removeByLabel, selectionOf } from './sandbox-lifecycle.js';
import { collectVolume } from './volume.js';

/** `dsec sandbox create|exec|ls|get|rm`, and the lifecycle commands (`pause`, `snapshot`, …). */
export function register(program: Command): void {
  const sandbox = program.command('sandbox').description('create, use and remove sandboxes');
  registerSandboxIo(sandbox);
  registerSandboxLifecycle(sandbox);

  sandbox
    .command('create')
    .description('create a sandbox (a container unless --backend says otherwise) and print its ID')
    .requiredOption('--image <name>', 'base image layer, name or name:version')
    .option('--workspace <name>', 'workspace layer above the base')
    .option('--toolkit <name>', 'toolkit layer (repeatable; the last wins)', collect)
    .option('--memory-mb <n>', 'memory limit in MiB (default 512)', parseInteger)
    .option('--cpus <n>', 'CPU cores (default 1)', parseNumber)
    .option('--pids <n>', 'process limit (default 1024)', parseInteger)
    .option(
      '--disk-mb <n>',
      'disk quota of the writable layer in MiB (default: none)',
      parseInteger,
    )
    .addOption(
      new Option(
        '--qos <class>',
        'CPU QoS class (default latency-sensitive); best-effort runs under SCHED_IDLE with minimal CPU weight and gets only idle cycles',
      ).choices(['latency-sensitive', 'best-effort']),
    )
    .option('--ttl-seconds <n>', 'stop after this many seconds (default 3600)', parseInteger)
    .option('--env <K=V>', 'default environment of commands (repeatable)', collectKeyValue)
    .option('--label <K=V>', 'label (repeatable)', collectKeyValue)
    .option('--init-user <user>', 'user commands run as by default (default root)')
    .option(
      '--volume <name:/path>',
      "mount the project's volume NAME at /path (repeatable; the sandbox runs on the volume's edge)",
      collectVolume,
    )
    .option('--project <id>', "project to bill (default: the key's)")
    .option('--request-id <id>', 'idempotency key: a retry returns the same sandbox')
    .addOption(
      new Option(
        '--backend <kind>',
        'container (default) or microvm: its own guest kernel',
      ).choices(['container', 'microvm']),
    )
    .action(async (opts: CreateOptions, command: Command) => {
      const ctx = contextOf(command);
      const client = ctx.client();
      const run: typeof client.runContainer = (spec, o) =>
        opts.backend === 'microvm' ? client.runMicroVM(spec, o) : client.runContainer(spec, o);
      const sb = await run(
        {
          image: opts.image,
          workspace: opts.workspace,
          toolkits: opts.toolkit,
          memoryLimitMb: opts.memoryMb,
          cpuCoresLimit: opts.cpus,
          pidsLimit: opts.pids,
          diskLimitMb: opts.diskMb,
          qosClass: opts.qos,
          ttlSeconds: opts.ttlSeconds,
          env: opts.env,
          labels: opts.label,
          initUser: opts.initUser,
          ...(opts.volume ? { volumes: opts.volume } : {}),
          projectId: opts.project,
          requestId: opts.requestId,
        },
        { signal: ctx.signal },
      );
      if (ctx.json) ctx.printJson(sb.info);
      else ctx.out(sb.id);
    });

  sandbox
    .command('exec')
    .description(
      'run a command, streaming its output; exits with its exit code (128+N for signal N, 124 on timeout).\n' +
        'One word with spaces after -- is a shell line (`-- "make && make test"`); several words are argv.',
    )
    .argument('<id>', 'sandbox ID')
    .argument('<cmd...>', 'command, after --')
    .option(
      '--timeout-ms <n>',
      `command timeout (default ${DEFAULT_COMMAND_TIMEOUT_MS})`,
      parseInteger,
    )
    .option('--cwd <dir>', 'working directory')
    .option('--user <user>', 'user to run as')
    .option('--env <K=V>', 'environment variable (repeatable)', collectKeyValue)
    .option(
      '--session <name>',
      'type CMD as one line into this shell session (created on first use; cd and export persist)',
    )
    .option(
      '--request-id <id>',
      'idempotency key: a retry returns the recorded result, never runs twice',
    )
    .action(async (id: string, cmd: string[], opts: ExecOptions, command: Command) => {
      const ctx = contextOf(command);
      await execCommand(ctx, id, cmd, opts);
    });

  sandbox
    .command('ls')
    .description('list the sandboxes your key may see')
    .option('--project <id>', 'only this project')
    .option(
      '--label <K=V>',
      'only sandboxes with this label (repeatable: all must match)',
      collectKeyValue,
    )
    .action(
      async (opts: { project?: string; label?: Record<string, string> }, command: Command) => {
        const ctx = contextOf(command);
        const list = await ctx
          .client()
          .listSandboxes({ projectId: opts.project, labels: opts.label, signal: ctx.signal });
        if (ctx.json) {
          ctx.printJson(list);
          return;
        }
        const now = Date.now();
        const rows = list.map((s) => [
          s.id,
          s.state,
          s.spec.image,
          formatRelative(s.createdAt, now),
          s.state === 'stopped' || s.state === 'failed'
            ? '-'
            : formatRelative(s.state === 'paused' ? s.pausedExpiresAt : s.expiresAt, now),
        ]);
        ctx.io.stdout.write(formatTable(['ID', 'STATE', 'IMAGE', 'CREATED', 'EXPIRES'], rows));
      },
    );

  sandbox
    .command('get')
    .description("show one sandbox's state and spec")
    .argument('<id>', 'sandbox ID')
    .action(async (id: string, _opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      const info = await ctx.client().sandbox(id).refresh({ signal: ctx.signal });
      if (ctx.json) ctx.printJson(info);
      else ctx.io.stdout.write(describe(info));
    });

  sandbox
    .command('rm')
    .description('stop and remove sandboxes')
    .argument('[id...]', 'sandbox IDs')
    .option(
      '--label <K=V>',
      'every live sandbox with this label (repeatable: all must match)',
      collectKeyValue,
    )
    .action(async (ids: string[], opts: { label?: Record<string, string> }, command: Command) => {
      const ctx = contextOf(command);
      if (selectionOf(command, ids, opts.label) === 'labels') {
        await removeByLabel(ctx, opts.label!);
        return;
      }
      const client = ctx.client();
      const outcomes = await Promise.allSettled(
        ids.map((id) => client.sandbox(id).stop({ signal: ctx.signal })),
      );
      const removed: string[] = [];
      const failed: unknown[] = [];
      outcomes.forEach((o, i) => {
        const id = ids[i] ?? '';
        if (o.status === 'fulfilled') removed.push(id);
        else failed.push(o.reason);
      });
      if (ctx.json) ctx.printJson({ removed });
      else for (const id of removed) ctx.out(id);
      for (const reason of failed) ctx.exitCode = reportError(reason, ctx);
    });
}

interface CreateOptions {
  image: string;
  backend?: 'container' | 'microvm';
  workspace?: string;
  toolkit?: string[];
  memoryMb?: number;
  cpus?: number;
  pids?: number;
  diskMb?: number;
  qos?: QosClass;
  ttlSeconds?: number;
  env?: Record<string, string>;
  label?: Record<string, string>;
  initUser?: string;
  volume?: { name: string; path: string }[];
  project?: string;
  requestId?: string;
}

interface ExecOptions {
  timeoutMs?: number;
  cwd?: string;
  user?: string;
  env?: Record<string, string>;
  session?: string;
  requestId?: string;
}

async function execCommand(
  ctx: CliContext,
  id: string,
  cmd: string[],
  opts: ExecOptions,
): Promise<void> {
  const sandbox = ctx.client().sandbox(id);
  const [first] = cmd;
  // A lone word with whitespace can only have been meant as a shell line.
  const asShell = cmd.length === 1 && first !== undefined && /\s/.test(first);
  const base = {
    timeoutMs: opts.timeoutMs,
    cwd: opts.cwd,
    user: opts.user,
    env: opts.env,
    signal: ctx.signal,
  };
  const run = (
    options: typeof base & { onStdout?: (s: string) => void; onStderr?: (s: string) => void },
  ) =>
    opts.session !== undefined
      ? sandbox
          .session(opts.session, { cwd: opts.cwd, user: opts.user, env: opts.env })
          .run(cmd.join(' '), { ...options, requestId: opts.requestId })
      : sandbox.commands.run(asShell && first !== undefined ? first : cmd, {
          ...options,
          requestId: opts.requestId,
        });

  if (ctx.json) {
    const r = await run(base);
    ctx.printJson({
      exitCode: r.exitCode,
      stdout: r.stdout,
      stderr: r.stderr,
      truncated: r.truncated,
      outcome: r.outcome,
      ...(r.signal !== undefined ? { signal: r.signal } : {}),
    });
    ctx.exitCode = exitCodeOf(r);
    return;
  }
  const result = await run({
    ...base,
    onStdout: (s) => ctx.io.stdout.write(s),
    onStderr: (s) => ctx.io.stderr.write(s),
  });
  const note = outcomeNote(result, opts.timeoutMs);
  if (note) ctx.err(`dsec: ${note}`);
  ctx.exitCode = exitCodeOf(result);
}

/** Shell conventions: the exit status, 128+N for death by signal N, 124 on timeout (like timeout(1)). */
export function exitCodeOf(result: CommandResult): number {
  if (result.outcome === 'timeout') return 124;
  if (result.signal !== undefined) {
    const n = (constants.signals as Record<string, number | undefined>)[result.signal];
    if (n !== undefined) return 128 + n;
  }
  if (result.exitCode < 0 || result.exitCode > 255) return 1;
  return result.exitCode;
}

function outcomeNote(result: CommandResult, timeoutMs: number | undefined): string | undefined {
  switch (result.outcome) {
    case 'timeout':
      return `command timed out after ${timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS} ms`;
    case 'oom':
      return 'command was killed: out of memory (raise --memory-mb at create)';
    case 'killed':
      return `command was killed${result.signal ? ` (${result.signal})` : ''}`;
    case 'signaled':
      return `command died of ${result.signal ?? 'a signal'}`;
    default:
      return undefined;
  }
}

function describe(info: SandboxInfo): string {
  const s = info.spec;
  const layers = [s.image, s.workspace, ...s.toolkits].filter((x): x is string => Boolean(x));
  const pairs: Array<[string, string]> = [
    ['id', info.id],
    ['state', info.state + (info.reason ? ` (${info.reason})` : '')],
    ...(info.memoryBytes !== undefined
      ? [['memory used', formatBytes(info.memoryBytes)] as [string, string]]
      : []),
    ['project', info.projectId],
    ['edge', info.edgeId],
    ['backend', s.backend],
    ['layers', layers.join(' < ')],
    ['memory', `${s.memoryLimitMb} MiB`],
    ['cpus', String(s.cpuCoresLimit)],
    ['pids', String(s.pidsLimit)],
    ['disk', s.diskLimitMb !== undefined ? `${s.diskLimitMb} MiB` : 'node disk'],
    ['qos', s.qosClass ?? 'latency-sensitive'],
    ['user', s.initUser],
    ...(s.volumes?.length
      ? [['volumes', s.volumes.map((v) => `${v.name}:${v.path}`).join(', ')] as [string, string]]
      : []),
    ['created', `${info.createdAt} (${formatRelative(info.createdAt)})`],
    ['expires', `${info.expiresAt} (${formatRelative(info.expiresAt)})`],
  ];
  if (info.pausedAt !== undefined) {
    pairs.push(['paused', `${info.pausedAt} (${formatRelative(info.pausedAt)})`]);
    if (info.pausedExpiresAt !== undefined) {
      pairs.push([
        'paused until',
        `${info.pausedExpiresAt} (${formatRelative(info.pausedExpiresAt)}; stopped then unless resumed)`,
      ]);
    }
  }
  const net = Object.entries(s.networkRules).map(([k, v]) => `${k}=${v ? 'allow' : 'deny'}`);
  if (net.length > 0) pairs.push(['network', net.join(' ')]);
  const labels = Object.entries(s.labels).map(([k, v]) => `${k}=${v}`);
  if (labels.length > 0) pairs.push(['labels', labels.join(' ')]);
  const width = Math.max(...pairs.map(([k]) => k.length));
  return pairs.map(([k, v]) => `${k.padEnd(width)}  ${v}`).join('\n') + '\n';
}
