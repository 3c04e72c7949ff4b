import { constants } from 'node:os';
import { DsecError } from '@dsec/core';
import type { CommandOutcome, CommandResult, CommandSpec, RunCommandOptions } from '@dsec/core';
import type { ChronusConnection } from '@dsec/native';
import type { SandboxRecord } from '../state/edge-store.js';
import { isPidsRefusal, pidsExhausted } from './exhaustion.js';
import { OutputCapture } from './output-capture.js';

export const DEFAULT_TIMEOUT_MS = 60_000;
export const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;
const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

export interface RunOnChronusOptions extends RunCommandOptions {
  commandId: string;
  /** Whether the kernel's OOM killer struck the sandbox since this was last asked. */
  wasOomKilled: () => Promise<boolean>;
}

/**
 * Runs one command through a sandbox's chronus daemon: output is streamed to
 * the callbacks as it comes and captured up to the cap; the timeout and the
 * caller's abort kill the whole process tree; the exit code comes from the
 * kernel's wait status, never from parsing output.
 */
export async function runOnChronus(
  conn: ChronusConnection,
  rec: SandboxRecord,
  command: CommandSpec,
  options: RunOnChronusOptions,
): Promise<CommandResult> {
  const started = Date.now();
  const cap = command.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
  const out = new OutputCapture(cap);
  const err = new OutputCapture(cap);
  const argv = command.shell !== undefined ? ['sh', '-c', command.shell] : (command.argv ?? []);
  const env = { PATH: DEFAULT_PATH, ...rec.spec.env, ...command.env };

  const handle = conn.spawn({
    argv,
    shell: command.shell !== undefined,
    env,
    cwd: command.cwd ?? '',
    user: command.user ?? rec.spec.initUser,
    stdin: command.stdin !== undefined,
  });
  handle.onStdout((chunk) => {
    out.push(chunk);
    options.onStdout?.(chunk);
  });
  handle.onStderr((chunk) => {
    err.push(chunk);
    options.onStderr?.(chunk);
  });

  try {
    await handle.started;
  } catch (e) {
    if (isPidsRefusal(e)) throw pidsExhausted(rec.spec.pidsLimit, e);
    const errno = (e as { code?: string }).code;
    throw new DsecError(
      'invalid_argument',
      `cannot start ${JSON.stringify(argv[0] ?? '')}: ${(e as Error).message}`,
      {
        field: command.shell !== undefined ? 'shell' : 'argv',
        details: errno ? { errno } : undefined,
      },
    );
  }
  if (command.stdin !== undefined) {
    handle.write(Buffer.from(command.stdin));
    handle.endStdin();
  }

  let ended: CommandOutcome | undefined;
  const stop = (outcome: CommandOutcome) => {
    if (ended) return;
    ended = outcome;
    handle.killTree();
  };
  const timer = setTimeout(() => stop('timeout'), command.timeoutMs ?? DEFAULT_TIMEOUT_MS);
  const onAbort = () => stop('killed');
  options.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    const exit = await handle.exited;
    let outcome: CommandOutcome = ended ?? (exit.signal ? 'signaled' : 'exited');
    if (exit.signal === 'SIGKILL' && outcome === 'signaled' && (await options.wasOomKilled()))
      outcome = 'oom';
    const signalNumber = exit.signal
      ? (constants.signals[exit.signal as keyof typeof constants.signals] ?? 0)
      : 0;
    return {
      commandId: options.commandId,
      exitCode: exit.exitCode ?? 128 + signalNumber,
      signal: exit.signal ?? undefined,
      outcome,
      stdout: out.bytes().toString('utf8'),
      stderr: err.bytes().toString('utf8'),
      truncated: out.truncated || err.truncated,
      stdoutBytes: out.totalBytes,
      stderrBytes: err.totalBytes,
      durationMs: Date.now() - started,
    };
  } catch (e) {
    throw new DsecError(
      'unavailable',
      `lost the sandbox's command channel: ${(e as Error).message}`,
      { cause: e },
    );
  } finally {
    clearTimeout(timer);
    options.signal?.removeEventListener('abort', onAbort);
  }
}
