import type { Command } from 'commander';
import { startLocalCluster, startSingleNode } from '@dsec/cluster';
import { contextOf } from '../context.js';
import { parseInteger } from '../parse.js';
import { dsecCommand } from '../self-command.js';
import { runUntilStopped } from './run-until-stopped.js';
import { addAdmissionOptions, admissionConfig, type AdmissionFlags } from './up-admission.js';

/**
 * `dsec up`: a single-node cluster in this process; with `--edges N`, a
 * cluster of N edge processes, a watcher process and this process as the
 * apiserver (docs/cluster.md). Prints `ready <url>` once it serves; SIGTERM or
 * SIGINT shut it down cleanly. Sandboxes keep running across a restart (the
 * edge adopts them) unless `--stop-sandboxes`.
 */
export function register(program: Command): void {
  addAdmissionOptions(program.command('up'))
    .description(
      'run a single-node cluster (apiserver, placement, watcher, IAM, edge) until stopped',
    )
    .option('--port <n>', 'port to listen on', '7420')
    .option('--host <addr>', 'address to listen on', '127.0.0.1')
    .option(
      '--edges <n>',
      'run a local multi-node cluster: N edge processes and a watcher process (docs/cluster.md)',
      parseInteger,
    )
    .option(
      '--paused-ttl-seconds <n>',
      'stop a paused sandbox after this long (default 86400)',
      parseInteger,
    )
    .option(
      '--idle-pause-seconds <n>',
      'pause sandboxes unused for this long (default: off)',
      parseInteger,
    )
    .option(
      '--pause-swap-max-mb <n>',
      'swap the edge may add under its state dir for pauses (default: half the memory)',
      parseInteger,
    )
    .option(
      '--e2b-domain <domain>',
      'serve E2B host names <port>-<sandboxId>.<domain> (docs/e2b.md)',
    )
    .option('--log-requests', 'log every request as a JSON line')
    .option('--stop-sandboxes', 'stop all sandboxes on shutdown instead of leaving them running')
    .option('--runtime <binary>', 'OCI runtime: crun (default where installed) or runc')
    .option(
      '--no-cgroup-favordynmods',
      'leave the host cgroup2 mount as it is (by default it is remounted with favordynmods: faster creates)',
    )
    .action(
      async (
        opts: {
          port: string;
          host: string;
          edges?: number;
          pausedTtlSeconds?: number;
          idlePauseSeconds?: number;
          pauseSwapMaxMb?: number;
          e2bDomain?: string;
          logRequests?: boolean;
          stopSandboxes?: boolean;
          runtime?: string;
          cgroupFavordynmods: boolean;
        } & AdmissionFlags,
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const { stateDir } = ctx.options;
        const common = {
          stateDir,
          port: Number(opts.port),
          host: opts.host,
          logRequests: opts.logRequests === true,
          admission: admissionConfig(opts),
          cgroupFavorDynmods: opts.cgroupFavordynmods,
          lifecycle: {
            pausedTtlMs: opts.pausedTtlSeconds && opts.pausedTtlSeconds * 1000,
            idleTimeoutMs: opts.idlePauseSeconds && opts.idlePauseSeconds * 1000,
            pauseSwapMaxBytes:
              opts.pauseSwapMaxMb === undefined ? undefined : opts.pauseSwapMaxMb * 2 ** 20,
          },
        };
        const node =
          opts.edges === undefined
            ? await startSingleNode({
                ...common,
                ...(ctx.options.imageStore ? { imageStore: ctx.options.imageStore } : {}),
                ...(opts.runtime ? { runtimeBinary: opts.runtime } : {}),
                e2b: { sandboxDomain: opts.e2bDomain },
              })
            : await startLocalCluster({
                ...common,
                edges: opts.edges,
                runtime: opts.runtime,
                e2bDomain: opts.e2bDomain,
                dsecCommand: dsecCommand(),
                log: (msg) => ctx.io.stderr.write(msg + '\n'),
              });
        ctx.out(`ready ${node.url}`);
        ctx.io.stderr.write(`admin key in ${stateDir}/admin.key; export DSEC_URL=${node.url}\n`);
        await runUntilStopped(ctx, 'dsec up', () =>
          node.close({ stopSandboxes: opts.stopSandboxes === true }),
        );
      },
    );
}
