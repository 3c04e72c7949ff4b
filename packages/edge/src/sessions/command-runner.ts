import { constants } from 'node:os';
import { DsecError, DEFAULT_COMMAND_TIMEOUT_MS } from '@dsec/core';
import type { CommandOutcome, CommandResult, StartCommandSpec } from '@dsec/core';
import type { CommandExit, SandboxChannel } from '../backends/channel.js';
import type { SandboxRecord } from '../state/edge-store.js';
import type { LiveCommand } from './command-registry.js';
import { isPidsRefusal, pidsExhausted } from './exhaustion.js';
import { imageDefaults } from './image-defaults.js';
import { callUser, isUserRefusal, userRefused } from './spawn-user.js';

export const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

/**
 * Runs one argv or shell-line command through chronus for the command log:
 * output goes to the live command (bounded captures plus live watchers),
 * stdin may stay open for streamed chunks, the timeout and `kill` end the
 * whole process tree, and the exit code is the kernel's wait status.
 */
export async function runChronusCommand(
  conn: SandboxChannel,
  rec: SandboxRecord,
  spec: StartCommandSpec,
  live: LiveCommand,
  oomKilled: () => Promise<boolean>,
): Promise<CommandResult> {
  const started = Date.now();
  const argv = spec.shell !== undefined ? ['sh', '-c', spec.shell] : (spec.argv ?? []);
  const wantsStdin = spec.stdin !== undefined || spec.stdinOpen === true;
  const { user, userField } = callUser(spec.user, rec.spec.initUser);
  // The image's own Env and WorkingDir (a registry image's conda PATH, its /testbed) come first.
  const image = imageDefaults(rec.layers);
  const handle = conn.spawn({
    argv,
    shell: spec.shell !== undefined,
    env: { PATH: DEFAULT_PATH, ...image.env, ...rec.spec.env, ...spec.env },
    cwd: spec.cwd ?? image.cwd ?? '',
    user,
    stdin: wantsStdin,
  });
  handle.onStdout((chunk) => live.stdout(chunk));
  handle.onStderr((chunk) => live.stderr(chunk));
  try {
    await handle.started;
  } catch (e) {
    if (isPidsRefusal(e)) throw pidsExhausted(rec.spec.pidsLimit, e);
    if (isUserRefusal(e)) throw userRefused(user, userField, e);
    const errno = (e as { code?: string }).code;
    throw new DsecError(
      errno === 'ECONNRESET' ? 'unavailable' : 'invalid_argument',
      `cannot start ${JSON.stringify(argv[0] ?? '')}: ${(e as Error).message}`,
      {
        field: spec.shell !== undefined ? 'shell' : 'argv',
        details: errno ? { errno } : undefined,
        cause: e,
      },
    );
  }

  let ended: CommandOutcome | undefined;
  const stop = (outcome: CommandOutcome) => {
    if (ended) return;
    ended = outcome;
    handle.killTree();
  };
  let stdinOpen = wantsStdin;
  const endStdin = () => {
    if (!stdinOpen) return;
    stdinOpen = false;
    handle.endStdin();
  };
  if (spec.stdin !== undefined) handle.write(Buffer.from(spec.stdin));
  if (!spec.stdinOpen) endStdin();
  live.setStarted({
    kill: () => stop('killed'),
    signal: (sig) => handle.signal(sig as NodeJS.Signals | number),
    write: (chunk) => {
      if (!stdinOpen) throw new DsecError('conflict', 'the command’s stdin is closed');
      return handle.write(chunk);
    },
    endStdin,
    drained: () => conn.drained(),
  });

  const timer = setTimeout(() => stop('timeout'), spec.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS);
  let exit: CommandExit;
  try {
    exit = await handle.exited;
  } catch (e) {
    // A backend's own reason keeps its code (a microVM paused under the command).
    if (e instanceof DsecError) throw e;
    throw new DsecError(
      'unavailable',
      `lost the sandbox's command channel: ${(e as Error).message}`,
      { cause: e },
    );
  } finally {
    clearTimeout(timer);
    stdinOpen = false;
  }
  let outcome: CommandOutcome = ended ?? (exit.signal ? 'signaled' : 'exited');
  if (exit.signal === 'SIGKILL' && outcome === 'signaled' && (await oomKilled())) outcome = 'oom';
  return resultOf(live, exit, outcome, started);
}

export function resultOf(
  live: LiveCommand,
  exit: Pick<CommandExit, 'exitCode' | 'signal'>,
  outcome: CommandOutcome,
  startedMs: number,
): CommandResult {
  const signalNumber = exit.signal
    ? (constants.signals[exit.signal as keyof typeof constants.signals] ?? 0)
    : 0;
  return {
    commandId: live.info.commandId,
    exitCode: exit.exitCode ?? 128 + signalNumber,
    signal: exit.signal ?? undefined,
    outcome,
    stdout: live.out.bytes().toString('utf8'),
    stderr: live.err.bytes().toString('utf8'),
    truncated: live.out.truncated || live.err.truncated,
    stdoutBytes: live.out.totalBytes,
    stderrBytes: live.err.totalBytes,
    durationMs: Date.now() - startedMs,
  };
}
