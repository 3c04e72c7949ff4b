import type { Command } from 'commander';
import {
  cordonEdge,
  drainEdge,
  joinEdge,
  leaveEdge,
  listEdges,
  loadClusterConfig,
  type EdgeSummary,
  startApiserver,
  startEdgeServer,
  startWatcher,
} from '@dsec/cluster';
import { DsecError } from '@dsec/core';
import { jsonLogger } from '@dsec/edge';
import type { Logger } from 'pino';
import { contextOf, type CliContext } from '../context.js';
import { formatTable } from '../format.js';
import { runUntilStopped } from './run-until-stopped.js';

/**
 * The processes of a multi-node cluster, each from the one config file
 * (docs/cluster.md): `dsec serve edge|apiserver|watcher --config FILE`, and
 * `dsec edge join|ls|cordon|uncordon|drain|leave` to manage the registered edges.
 */
export function register(program: Command): void {
  const serve = program
    .command('serve')
    .description('run one process of a multi-node cluster (see docs/cluster.md)');

  const common = (c: Command) =>
    c
      .requiredOption('--config <file>', 'cluster config file (JSON, docs/cluster.md)')
      // For `dsec up --edges N`: its children end when the parent's pipe closes.
      .option('--exit-with-stdin', 'also stop when stdin closes');

  common(serve.command('edge'))
    .description('serve this machine’s sandboxes over the authenticated edge protocol')
    .option('--stop-sandboxes', 'stop all sandboxes on shutdown instead of leaving them running')
    .action(
      async (
        opts: { config: string; exitWithStdin?: boolean; stopSandboxes?: boolean },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const config = await loadClusterConfig(opts.config);
        const edge = await startEdgeServer(config, { logger: logTo(ctx) });
        ctx.out(`ready ${edge.url}`);
        await runUntilStopped(
          ctx,
          'dsec serve edge',
          () => edge.close({ stopSandboxes: opts.stopSandboxes === true }),
          opts,
        );
      },
    );

  common(serve.command('apiserver'))
    .description('serve the public API from the shared control database (stateless)')
    .action(async (opts: { config: string; exitWithStdin?: boolean }, command: Command) => {
      const ctx = contextOf(command);
      const config = await loadClusterConfig(opts.config);
      const api = await startApiserver(config, { logger: logTo(ctx) });
      ctx.out(`ready ${api.url}`);
      if (api.adminKey && !config.apiserver?.adminKeyFile)
        ctx.err(`admin key of the new root project (store it now): ${api.adminKey}`);
      await runUntilStopped(ctx, 'dsec serve apiserver', () => api.close(), opts);
    });

  common(serve.command('watcher'))
    .description('probe every registered edge and record its health for the apiservers')
    .action(async (opts: { config: string; exitWithStdin?: boolean }, command: Command) => {
      const ctx = contextOf(command);
      const config = await loadClusterConfig(opts.config);
      const watcher = await startWatcher(config, { logger: logTo(ctx) });
      ctx.out('ready watcher');
      await runUntilStopped(ctx, 'dsec serve watcher', () => watcher.close(), opts);
    });

  const edge = program.command('edge').description('edges of a multi-node cluster');
  edge
    .command('join')
    .description('register the config’s edge in the control database (it must be serving)')
    .requiredOption('--config <file>', 'config with `database` and the `edge` section')
    .option('--edge-url <url>', 'the URL apiservers dial (default: the config’s)')
    .action(async (opts: { config: string; edgeUrl?: string }, command: Command) => {
      const ctx = contextOf(command);
      const config = await loadClusterConfig(opts.config);
      const record = await joinEdge(config, {
        ...(opts.edgeUrl ? { url: opts.edgeUrl } : {}),
        ...(ctx.signal ? { signal: ctx.signal } : {}),
      });
      const shown = {
        id: record.edgeId,
        url: record.url,
        labels: record.labels,
        backends: record.backends,
      };
      if (ctx.json) ctx.printJson(shown);
      else ctx.out(`${shown.id} joined at ${shown.url}`);
    });
  edge
    .command('ls')
    .description('list the registered edges: health, cordon, users’ sandboxes')
    .requiredOption('--config <file>', 'config with `database`')
    .action(async (opts: { config: string }, command: Command) => {
      const ctx = contextOf(command);
      const edges = await listEdges(await loadClusterConfig(opts.config));
      if (ctx.json) ctx.printJson({ edges });
      else
        ctx.out(
          formatTable(
            ['ID', 'URL', 'HEALTH', 'SANDBOXES', 'LABELS'],
            edges.map((e) => [
              e.id,
              e.url,
              `${e.healthy ? 'up' : 'down'}${e.cordoned ? ',cordoned' : ''}`,
              e.sandboxes === undefined ? '-' : String(e.sandboxes),
              Object.entries(e.labels)
                .map(([k, v]) => `${k}=${v}`)
                .join(','),
            ]),
          ),
        );
    });
  for (const [name, cordoned] of [
    ['cordon', true],
    ['uncordon', false],
  ] as const) {
    edge
      .command(name)
      .description(
        cordoned
          ? 'send an edge no new sandboxes or function calls (what runs there keeps running)'
          : 'let placement use a cordoned edge again',
      )
      .argument('<id>', 'edge ID')
      .requiredOption('--config <file>', 'config with `database`')
      .action(async (id: string, opts: { config: string }, command: Command) => {
        const ctx = contextOf(command);
        const shown = await cordonEdge(await loadClusterConfig(opts.config), id, cordoned);
        if (ctx.json) ctx.printJson(shown);
        else ctx.out(`${id} ${cordoned ? 'cordoned' : 'uncordoned'}`);
      });
  }
  edge
    .command('drain')
    .description(
      'cordon an edge, then wait until it holds no users’ sandboxes (they end by TTL or their owners)',
    )
    .argument('<id>', 'edge ID')
    .requiredOption('--config <file>', 'config with `database`')
    .option('--timeout-s <n>', 'give up after this many seconds (the edge stays cordoned)', '3600')
    .action(async (id: string, opts: { config: string; timeoutS: string }, command: Command) => {
      const ctx = contextOf(command);
      const timeoutS = Number(opts.timeoutS);
      if (!Number.isFinite(timeoutS) || timeoutS < 0)
        throw new DsecError('invalid_argument', '--timeout-s must be a number of seconds ≥ 0', {
          field: 'timeoutS',
        });
      let last = -1;
      const shown = await drainEdge(await loadClusterConfig(opts.config), id, {
        timeoutMs: timeoutS * 1000,
        ...(ctx.signal ? { signal: ctx.signal } : {}),
        onProgress: (e: EdgeSummary) => {
          if (ctx.json || e.sandboxes === last) return;
          last = e.sandboxes ?? -1;
          ctx.err(`${id}: ${e.sandboxes ?? 'unknown (no probe recorded yet)'} sandboxes left`);
        },
      });
      if (ctx.json) ctx.printJson(shown);
      else ctx.out(`${id} drained (cordoned, no sandboxes): \`dsec edge leave ${id}\` removes it`);
    });
  edge
    .command('leave')
    .description(
      'remove an edge from the control database (refused while it holds sandboxes: drain it first)',
    )
    .argument('<id>', 'edge ID')
    .requiredOption('--config <file>', 'config with `database`')
    .option('--force', 'remove it even though its sandboxes become unreachable')
    .action(async (id: string, opts: { config: string; force?: boolean }, command: Command) => {
      const ctx = contextOf(command);
      const removed = await leaveEdge(await loadClusterConfig(opts.config), id, {
        force: opts.force === true,
      });
      if (ctx.json) ctx.printJson({ removed: removed ? [id] : [] });
      else ctx.out(removed ? `${id} left` : `${id} was not registered`);
    });
}

/** JSON lines on stderr (stdout carries the `ready` line `dsec up --edges` waits for). */
export function logTo(ctx: CliContext): Logger {
  return jsonLogger({ name: 'dsec', destination: ctx.io.stderr });
}
