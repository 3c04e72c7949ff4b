import type { CommandResult, CommandSpec, SandboxInfo } from '@dsec/core';
import { CommandEventDecoder } from './ndjson.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions, RunCommandOptions } from './types.js';

/** The server's default command timeout (docs/CONVENTIONS.md, `CommandBody`). */
export const DEFAULT_COMMAND_TIMEOUT_MS = 60_000;
/** Slack on top of the command timeout before the client gives up on the answer. */
export const COMMAND_DEADLINE_SLACK_MS = 30_000;

/**
 * A handle on one sandbox. Holding it costs nothing on the server: the
 * sandbox lives until `stop()` or its TTL, whether or not the handle exists.
 * State persists across commands (files, installed packages, services).
 */
export class Sandbox {
  readonly id: string;
  /** Last known state; undefined for a handle made from an ID until `refresh()`. */
  info: SandboxInfo | undefined;
  readonly #http: HttpTransport;
  readonly #defaultTimeoutMs: number;

  /** @internal Use `DSecClient.runContainer` or `DSecClient.sandbox`. */
  constructor(
    http: HttpTransport,
    id: string,
    info: SandboxInfo | undefined,
    defaultTimeoutMs: number,
  ) {
    this.#http = http;
    this.id = id;
    this.info = info;
    this.#defaultTimeoutMs = defaultTimeoutMs;
  }

  /**
   * Runs a shell line (by the platform's shell, not the sandbox's /bin/sh) and
   * waits for it to end. A non-zero exit is a result, not an error.
   * Throws `sandbox_not_found`, `sandbox_not_running`, `invalid_argument`,
   * `aborted`, `deadline_exceeded`, `unavailable`.
   */
  runShell(command: string, options: RunCommandOptions = {}): Promise<CommandResult> {
    return this.#run({ shell: command }, options);
  }

  /** Runs a program with arguments, no shell involved; see `runShell`. */
  exec(argv: string[], options: RunCommandOptions = {}): Promise<CommandResult> {
    return this.#run({ argv }, options);
  }

  /** Re-reads the sandbox's state. */
  async refresh(options: CallOptions = {}): Promise<SandboxInfo> {
    this.info = await this.#http.json<SandboxInfo>({
      method: 'GET',
      path: `/v1/sandboxes/${encodeURIComponent(this.id)}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#defaultTimeoutMs,
      idempotent: true,
    });
    return this.info;
  }

  /** Stops the sandbox and releases its resources; stopping a stopped sandbox is a no-op. */
  async stop(options: CallOptions = {}): Promise<void> {
    await this.#http.json<undefined>({
      method: 'DELETE',
      path: `/v1/sandboxes/${encodeURIComponent(this.id)}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#defaultTimeoutMs,
      idempotent: true,
    });
    if (this.info) this.info = { ...this.info, state: 'stopped' };
  }

  async #run(
    target: Pick<CommandSpec, 'argv' | 'shell'>,
    options: RunCommandOptions,
  ): Promise<CommandResult> {
    const body: CommandSpec = {
      ...target,
      env: options.env,
      cwd: options.cwd,
      user: options.user,
      stdin: options.stdin,
      timeoutMs: options.timeoutMs,
      maxOutputBytes: options.maxOutputBytes,
    };
    const request = {
      method: 'POST' as const,
      path: `/v1/sandboxes/${encodeURIComponent(this.id)}/commands`,
      body,
      signal: options.signal,
      timeoutMs: (options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS) + COMMAND_DEADLINE_SLACK_MS,
    };
    const { onStdout, onStderr } = options;
    if (!onStdout && !onStderr) return this.#http.json<CommandResult>(request);

    const out = onStdout ?? (() => {});
    const err = onStderr ?? (() => {});
    const decoder = new CommandEventDecoder(out, err);
    return this.#http.stream<CommandResult>({
      ...request,
      accept: 'application/x-ndjson',
      onChunk: (chunk) => decoder.push(chunk),
      onEnd: () => decoder.end(),
      // A server that does not stream answers with the plain result: deliver
      // its output through the callbacks all at once so callers see the same.
      onJson: (body) => {
        const result = body as CommandResult;
        if (result.stdout) out(result.stdout);
        if (result.stderr) err(result.stderr);
        return result;
      },
    });
  }
}
