import { Command, CommanderError } from 'commander';
import { CliContext, attachContext } from './context.js';
import type { CliIo } from './context.js';
import { reportError } from './report-error.js';
import { register as registerSandbox } from './commands/sandbox.js';
import { register as registerSandboxNetwork } from './commands/sandbox-network.js';
import { register as registerImage } from './commands/image.js';
import { register as registerProject } from './commands/project.js';
import { register as registerKey } from './commands/key.js';
import { register as registerVolume } from './commands/volume.js';
import { register as registerUp } from './commands/up.js';
import { register as registerImageBuild } from './commands/image-build.js';
import { register as registerBench } from './commands/bench.js';
import { register as registerServe } from './commands/serve.js';
import { register as registerCluster } from './commands/cluster.js';
import { register as registerEval } from './commands/eval.js';
import { register as registerFnCall } from './commands/fncall.js';
import { register as registerDoctor } from './commands/doctor.js';
import { register as registerVersion } from './commands/version.js';
import { register as registerCompletion } from './commands/completion.js';

/**
 * One `register(program)` per noun, in help order. To add a command, add a
 * file under commands/ that exports `register(program: Command)` and list it
 * here; its actions get the run's context with `contextOf(command)`.
 */
const COMMANDS: Array<(program: Command) => void> = [
  registerSandbox,
  registerSandboxNetwork,
  registerImage,
  registerImageBuild,
  registerVolume,
  registerProject,
  registerKey,
  registerUp,
  registerServe,
  registerCluster,
  registerEval,
  registerFnCall,
  registerBench,
  registerDoctor,
  registerVersion,
  registerCompletion,
];

export const VERSION = '0.1.0';

/**
 * Runs the `dsec` CLI on `argv` (without `node` and the script) and resolves
 * with the process exit code. Never calls `process.exit`; output goes to
 * `io.stdout` / `io.stderr` (default the process streams).
 */
export async function main(argv: string[], io: Partial<CliIo> = {}): Promise<number> {
  const cliIo: CliIo = {
    stdout: io.stdout ?? process.stdout,
    stderr: io.stderr ?? process.stderr,
    env: io.env ?? process.env,
    signal: io.signal,
  };
  const program = new Command('dsec');
  const ctx = new CliContext(cliIo, program);
  attachContext(program, ctx);

  // Settings made before subcommands are added are inherited by them.
  program
    .description('DSec: self-hosted sandboxes for agent training and evaluation')
    .version(VERSION, '-V, --version')
    .option('--url <url>', 'apiserver URL (env DSEC_URL, default http://127.0.0.1:7420)')
    .option('--api-key <key>', 'API key (env DSEC_API_KEY, else <state-dir>/admin.key)')
    .option('--state-dir <dir>', 'local cluster state (env DSEC_STATE_DIR, default /var/lib/dsec)')
    .option(
      '--image-store <location>',
      'where layers live: a path, dir:/path or s3://bucket/prefix?endpoint=URL (env DSEC_IMAGE_STORE, default <state-dir>/images)',
    )
    .option('--json', 'print machine-readable JSON')
    .exitOverride()
    .configureOutput({
      writeOut: (s) => cliIo.stdout.write(s),
      writeErr: (s) => cliIo.stderr.write(s),
    })
    .configureHelp({ showGlobalOptions: true })
    .showHelpAfterError('(add --help for usage)')
    .showSuggestionAfterError();

  for (const register of COMMANDS) register(program);

  try {
    await program.parseAsync(argv, { from: 'user' });
    return ctx.exitCode;
  } catch (err) {
    // commander already printed its usage errors (and help/version output).
    if (err instanceof CommanderError) return err.exitCode;
    return reportError(err, ctx);
  } finally {
    ctx.close();
  }
}
