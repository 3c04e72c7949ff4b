import type { CliContext } from '../context.js';

/**
 * Long-running commands (`dsec up`, `dsec serve …`) print `ready <url>`, then
 * wait here for SIGTERM or SIGINT (or, with `exitWithStdin`, for stdin to
 * close: the pipe a parent `dsec up --edges` holds), shut down, and print
 * `stopped`. Shutdown closes every handle, so the process then ends by itself;
 * a second signal ends it at once, and should a handle ever leak, a last guard
 * exits anyway `EXIT_GUARD_MS` after `stopped` and names what was still open.
 */
const EXIT_GUARD_MS = 5000;

export async function runUntilStopped(
  ctx: CliContext,
  name: string,
  close: () => Promise<void>,
  options: { exitWithStdin?: boolean | undefined } = {},
): Promise<void> {
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
    if (options.exitWithStdin) {
      process.stdin.once('end', stop);
      process.stdin.once('error', stop);
      process.stdin.resume();
    }
  });
  if (options.exitWithStdin) process.stdin.destroy();
  await close();
  ctx.io.stderr.write('stopped\n');
  // Unref'd: it never delays a clean exit, it only bounds a leaked one.
  setTimeout(() => {
    const open = process.getActiveResourcesInfo().filter((r) => r !== 'Timeout');
    ctx.io.stderr.write(`${name}: exiting with handles still open: ${open.join(', ')}\n`);
    process.exit(process.exitCode ?? 0);
  }, EXIT_GUARD_MS).unref();
}
