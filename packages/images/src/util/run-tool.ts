import { spawn } from 'node:child_process';
import { DsecError, throwIfAborted } from '@dsec/core';

export interface RunToolOptions {
  cwd?: string;
  env?: NodeJS.ProcessEnv;
  signal?: AbortSignal | undefined;
  /** Sent on abort (default SIGKILL); SIGTERM lets a tool run its cleanup traps. */
  killSignal?: NodeJS.Signals;
  /** Called with each complete line the tool writes (stdout and stderr). */
  onLine?: (line: string) => void;
  /**
   * Keep the whole stdout (its result is data, not chatter) up to this many
   * bytes; past it the tool is killed and the call is `resource_exhausted`.
   * Without it only the last 64 KiB are kept.
   */
  maxStdoutBytes?: number | undefined;
}

export interface RunToolResult {
  stdout: string;
  stderr: string;
}

// Enough to explain a failure without holding a chatty tool's whole output.
const KEEP_BYTES = 64 * 1024;

/**
 * Runs a host tool without a shell. A missing binary or a non-zero exit is
 * `internal` (a host fault) carrying the stderr tail; an abort kills the
 * tool and is `aborted`.
 */
export async function runTool(
  command: string,
  args: readonly string[],
  options: RunToolOptions = {},
): Promise<RunToolResult> {
  throwIfAborted(options.signal);
  return await new Promise<RunToolResult>((resolve, reject) => {
    const child = spawn(command, args, {
      cwd: options.cwd,
      env: options.env ?? process.env,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let stdout = '';
    let stderr = '';
    const partial = { stdout: '', stderr: '' };
    const keep = (acc: string, chunk: string): string => {
      const s = acc + chunk;
      return s.length > KEEP_BYTES ? s.slice(s.length - KEEP_BYTES) : s;
    };
    let overflow = false;
    let stdoutBytes = 0;
    const feed = (which: 'stdout' | 'stderr', chunk: string): void => {
      if (which === 'stdout' && options.maxStdoutBytes !== undefined) {
        if (overflow) return;
        stdout += chunk;
        stdoutBytes += Buffer.byteLength(chunk);
        if (!overflow && stdoutBytes > options.maxStdoutBytes) {
          overflow = true;
          child.kill('SIGKILL');
        }
      } else if (which === 'stdout') stdout = keep(stdout, chunk);
      else stderr = keep(stderr, chunk);
      if (!options.onLine) return;
      const lines = (partial[which] + chunk).split(/\r?\n|\r/);
      partial[which] = lines.pop() ?? '';
      for (const line of lines) if (line !== '') options.onLine(line);
    };
    child.stdout.setEncoding('utf8').on('data', (c: string) => feed('stdout', c));
    child.stderr.setEncoding('utf8').on('data', (c: string) => feed('stderr', c));

    const onAbort = (): void => {
      child.kill(options.killSignal ?? 'SIGKILL');
    };
    options.signal?.addEventListener('abort', onAbort, { once: true });

    child.once('error', (err: NodeJS.ErrnoException) => {
      options.signal?.removeEventListener('abort', onAbort);
      const message =
        err.code === 'ENOENT'
          ? `${command} not found on this host`
          : `cannot run ${command}: ${err.message}`;
      reject(new DsecError('internal', message, { cause: err }));
    });
    child.once('close', (code, sig) => {
      options.signal?.removeEventListener('abort', onAbort);
      if (options.signal?.aborted) {
        reject(new DsecError('aborted', `${command} aborted`, { cause: options.signal.reason }));
        return;
      }
      if (overflow) {
        reject(
          new DsecError(
            'resource_exhausted',
            `${command} wrote more than ${options.maxStdoutBytes} bytes`,
            { details: { command, maxStdoutBytes: options.maxStdoutBytes } },
          ),
        );
        return;
      }
      if (code === 0) {
        resolve({ stdout, stderr });
        return;
      }
      const tail = (stderr.trim() || stdout.trim()).split('\n').slice(-20).join('\n');
      const how = sig ? `was killed by ${sig}` : `exited with ${code}`;
      reject(
        new DsecError('internal', `${command} ${how}${tail ? `: ${tail}` : ''}`, {
          details: { command, exitCode: code, signal: sig },
        }),
      );
    });
  });
}
