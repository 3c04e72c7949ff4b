import { Option, type Command } from 'commander';
import { fncallOptions, startLocalCluster, startSingleNode } from '@dsec/cluster';
import { EROFS_MOUNT_SETTINGS, jsonLogger, parseListenAddress } from '@dsec/edge';
import { contextOf } from '../context.js';
import { parseInteger } from '../parse.js';
import { dsecCommand } from '../self-command.js';
import { runUntilStopped } from './run-until-stopped.js';
import { addAdmissionOptions } from './up-admission.js';
import { upSettings, type UpFlags } from './up-config.js';

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
    .option(
      '--config <file>',
      'a cluster config file (JSON, docs/cluster.md): its `up`, `apiserver`, `imageStore`, `e2b` and `registries` sections; flags override it',
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
    .option(
      '--metrics-listen <host:port>',
      'serve /metrics without a key on this admin address, e.g. 127.0.0.1:9464 (default off; with --edges N, edge i serves on port+i)',
      (v: string) => parseListenAddress(v, 'metrics-listen'),
    )
    .option(
      '--sandboxfusion-listen <host:port>',
      "serve SandboxFusion's /run_code without a key on this address, every call in --sandboxfusion-project (default off; docs/fncall.md)",
      (v: string) => parseListenAddress(v, 'sandboxfusion-listen'),
    )
    .option(
      '--sandboxfusion-project <id>',
      'the project the keyless SandboxFusion listener runs its calls in (its quotas count them)',
    )
    .option('--stop-sandboxes', 'stop all sandboxes on shutdown instead of leaving them running')
    .option('--runtime <binary>', 'OCI runtime: crun (default where installed) or runc')
    .addOption(
      new Option(
        '--erofs-mount <how>',
        'how layers are mounted: file (Linux 6.12+), loop (older kernels) or auto (probe; default, or env DSEC_EROFS_MOUNT)',
      ).choices(EROFS_MOUNT_SETTINGS),
    )
    .addOption(
      new Option(
        '--gpus <how>',
        "GPUs for FnCall workers: off (default) or auto (the NVIDIA driver's devices; docs/gpu.md)",
      ).choices(['auto', 'off']),
    )
    .option(
      '--no-image-builds',
      "refuse builds over the API (POST /v1/images/builds, E2B's Template.build): they run callers' Dockerfile steps as root in runc on this node",
    )
    .option(
      '--no-cgroup-favordynmods',
      'leave the host cgroup2 mount as it is (by default it is remounted with favordynmods: faster creates)',
    )
    .action(async (opts: UpFlags & { imageBuilds?: boolean }, command: Command) => {
      const ctx = contextOf(command);
      const up = await upSettings(opts, command, ctx);
      const { stateDir } = up;
      // JSON lines on stderr: stdout carries the `ready` line scripts wait for.
      const logger = jsonLogger({ name: 'dsec', destination: ctx.io.stderr });
      const { metricsListen } = up;
      const common = {
        stateDir,
        port: up.port,
        host: up.host,
        logRequests: up.logRequests,
        apiBounds: up.apiBounds,
        admission: up.admission,
        cgroupFavorDynmods: up.cgroupFavorDynmods,
        lifecycle: {
          pausedTtlMs: up.pausedTtlSeconds && up.pausedTtlSeconds * 1000,
          idleTimeoutMs: up.idlePauseSeconds && up.idlePauseSeconds * 1000,
          pauseSwapMaxBytes:
            up.pauseSwapMaxMb === undefined ? undefined : up.pauseSwapMaxMb * 2 ** 20,
        },
      };
      const node =
        up.edges === undefined
          ? await startSingleNode({
              ...common,
              ...(up.imageStore ? { imageStore: up.imageStore } : {}),
              ...(up.runtime ? { runtimeBinary: up.runtime } : {}),
              ...(up.erofsMount ? { erofsMount: up.erofsMount } : {}),
              ...(up.gpus ? { gpus: up.gpus } : {}),
              ...(up.fncall !== undefined ? { fncall: fncallOptions(up.fncall) } : {}),
              ...(up.network ? { network: up.network } : {}),
              ...(up.blobCacheBytes ? { blobCacheBytes: up.blobCacheBytes } : {}),
              e2b: up.e2b,
              registries: up.registries,
              ...(opts.imageBuilds === false ? { imageBuilds: false as const } : {}),
              logger,
              metricsListen,
              ...(up.sandboxFusion ? { sandboxFusion: up.sandboxFusion } : {}),
            })
          : await startLocalCluster({
              ...common,
              edges: up.edges,
              runtime: up.runtime,
              e2bDomain: up.e2b.sandboxDomain,
              edgeConfig: {
                ...(up.erofsMount ? { erofsMount: up.erofsMount } : {}),
                ...(up.gpus ? { gpus: up.gpus } : {}),
                ...(up.fncall !== undefined ? { fncall: up.fncall } : {}),
                ...(up.network ? { network: up.network } : {}),
                ...(up.blobCacheBytes ? { blobCacheBytes: up.blobCacheBytes } : {}),
              },
              dsecCommand: dsecCommand(),
              log: (msg) => logger.warn({ component: 'cluster' }, msg),
              metricsListen,
            });
      ctx.out(`ready ${node.url}`);
      if ('sandboxFusionUrl' in node && node.sandboxFusionUrl)
        logger.info(
          { url: node.sandboxFusionUrl },
          `sandboxfusion: ${node.sandboxFusionUrl}/run_code`,
        );
      logger.info(
        { url: node.url, adminKeyFile: `${stateDir}/admin.key` },
        `ready: admin key in ${stateDir}/admin.key; export DSEC_URL=${node.url}`,
      );
      await runUntilStopped(ctx, 'dsec up', () => node.close({ stopSandboxes: up.stopSandboxes }));
    });
}
