import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { contextOf } from '../context.js';
import { addAdmissionOptions, admissionConfig, type AdmissionFlags } from './up-admission.js';

/**
 * `dsec up`: a single-node cluster in this process. Prints `ready <url>` once
 * it serves; SIGTERM or SIGINT shut it down cleanly. Sandboxes keep running
 * across a restart (the edge adopts them) unless `--stop-sandboxes`.
 *
 * Shutdown closes every handle the node holds, so the process then ends by
 * itself within a few seconds (requests in flight get 2 s). A second signal
 * ends it at once. Should a handle ever leak, a last guard exits anyway
 * `EXIT_GUARD_MS` after `stopped` and names what was still open.
 */
const EXIT_GUARD_MS = 5000;

export function register(program: Command): void {
  addAdmissionOptions(program.command('up'))
    .description(
      'run a single-node cluster (apiserver, placement, watcher, IAM, edge) until stopped',
    )
    .option('--port <n>', 'port to listen on', '7420')
    .option('--host <addr>', 'address to listen on', '127.0.0.1')
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
          logRequests?: boolean;
          stopSandboxes?: boolean;
          runtime?: string;
          cgroupFavordynmods: boolean;
        } & AdmissionFlags,
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const { stateDir } = ctx.options;
        const node = await startSingleNode({
          stateDir,
          port: Number(opts.port),
          host: opts.host,
          logRequests: opts.logRequests === true,
          ...(ctx.options.imageStore ? { imageStore: ctx.options.imageStore } : {}),
          admission: admissionConfig(opts),
          ...(opts.runtime ? { runtimeBinary: opts.runtime } : {}),
          cgroupFavorDynmods: opts.cgroupFavordynmods,
        });
        ctx.out(`ready ${node.url}`);
        ctx.io.stderr.write(`admin key in ${stateDir}/admin.key; export DSEC_URL=${node.url}\n`);
        await new Promise<void>((resolve) => {
          const stop = () => {
            // Removed at once, so that a second signal takes its default action: exit now.
            process.off('SIGTERM', stop);
            process.off('SIGINT', stop);
            resolve();
          };
          process.on('SIGTERM', stop);
          process.on('SIGINT', stop);
          ctx.signal?.addEventListener('abort', stop, { once: true });
        });
        await node.close({ stopSandboxes: opts.stopSandboxes === true });
        ctx.io.stderr.write('stopped\n');
        // Unref'd: it never delays a clean exit, it only bounds a leaked one.
        setTimeout(() => {
          const open = process.getActiveResourcesInfo().filter((r) => r !== 'Timeout');
          ctx.io.stderr.write(`dsec up: exiting with handles still open: ${open.join(', ')}\n`);
          process.exit(process.exitCode ?? 0);
        }, EXIT_GUARD_MS).unref();
      },
    );
}
