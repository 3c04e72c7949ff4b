import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { contextOf } from '../context.js';

/**
 * `dsec up`: a single-node cluster in this process. Prints `ready <url>` once
 * it serves; SIGTERM or SIGINT shut it down cleanly. Sandboxes keep running
 * across a restart (the edge adopts them) unless `--stop-sandboxes`.
 */
export function register(program: Command): void {
  program
    .command('up')
    .description(
      'run a single-node cluster (apiserver, placement, watcher, IAM, edge) until stopped',
    )
    .option('--port <n>', 'port to listen on', '7420')
    .option('--host <addr>', 'address to listen on', '127.0.0.1')
    .option('--max-sandboxes <n>', 'admission limit on this node')
    .option('--log-requests', 'log every request as a JSON line')
    .option('--stop-sandboxes', 'stop all sandboxes on shutdown instead of leaving them running')
    .action(
      async (
        opts: {
          port: string;
          host: string;
          maxSandboxes?: string;
          logRequests?: boolean;
          stopSandboxes?: boolean;
        },
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
          ...(opts.maxSandboxes ? { capacity: { sandboxes: Number(opts.maxSandboxes) } } : {}),
        });
        ctx.out(`ready ${node.url}`);
        ctx.io.stderr.write(`admin key in ${stateDir}/admin.key; export DSEC_URL=${node.url}\n`);
        await new Promise<void>((resolve) => {
          const stop = () => resolve();
          process.once('SIGTERM', stop);
          process.once('SIGINT', stop);
          ctx.signal?.addEventListener('abort', stop, { once: true });
        });
        await node.close({ stopSandboxes: opts.stopSandboxes === true });
        ctx.io.stderr.write('stopped\n');
      },
    );
}
