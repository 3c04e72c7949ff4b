import type { SessionResult } from './wire.js';
import { CommandRun, type OutputCallbacks } from './command-run.js';
import { commandRequest } from './commands.js';
import { COMMAND_DEADLINE_SLACK_MS, DEFAULT_COMMAND_TIMEOUT_MS } from './deadlines.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions } from './types.js';

export interface SessionRunOptions extends OutputCallbacks {
  /** Server-side timeout of this line: its foreground job is killed, the session lives on. Default 60 s. */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
  /** The line's whole stdin (otherwise /dev/null). */
  stdin?: string | undefined;
  maxOutputBytes?: number | undefined;
  requestId?: string | undefined;
}

export interface SessionOptions {
  /** The sandbox's own shell (`/bin/bash`) instead of the platform's `sh`. Used when the session is created. */
  shell?: string | undefined;
  user?: string | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
}

/**
 * A named shell session in a sandbox: cwd, environment, variables and
 * background jobs persist across `run` calls. Created on first use; calls
 * on one session run one at a time.
 */
export class Session {
  readonly name: string;
  readonly #http: HttpTransport;
  readonly #path: string;
  readonly #options: SessionOptions;
  readonly #timeoutMs: number;

  /** @internal */
  constructor(
    http: HttpTransport,
    sandboxId: string,
    name: string,
    options: SessionOptions,
    defaultTimeoutMs: number,
  ) {
    this.#http = http;
    this.name = name;
    this.#path = `/v1/sandboxes/${encodeURIComponent(sandboxId)}/sessions/${encodeURIComponent(name)}`;
    this.#options = options;
    this.#timeoutMs = defaultTimeoutMs;
  }

  /** Types one line into the session's shell; await for the result or iterate for output. */
  run(line: string, options: SessionRunOptions = {}): CommandRun<SessionResult> {
    const body = {
      line,
      stdin: options.stdin,
      timeoutMs: options.timeoutMs,
      maxOutputBytes: options.maxOutputBytes,
      requestId: options.requestId,
      ...this.#options,
    };
    return new CommandRun<SessionResult>(
      (callbacks, streaming) =>
        commandRequest<SessionResult>(
          this.#http,
          {
            method: 'POST',
            path: `${this.#path}/run`,
            body,
            signal: options.signal,
            timeoutMs:
              (options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS) + COMMAND_DEADLINE_SLACK_MS,
            idempotent: options.requestId !== undefined,
          },
          callbacks,
          streaming,
        ),
      options,
    );
  }

  /** Kills the session's shell and everything it started; closing twice is fine. */
  async close(options: CallOptions = {}): Promise<void> {
    await this.#http.json<undefined>({
      method: 'DELETE',
      path: this.#path,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }
}
