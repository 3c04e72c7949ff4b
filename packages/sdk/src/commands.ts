import type { Readable } from 'node:stream';
import { DsecError } from '@dsec/core';
import type { CommandInfo, CommandResult } from './wire.js';
import { CommandRun, type OutputCallbacks } from './command-run.js';
import { CommandEventDecoder } from './ndjson.js';
import type { HttpTransport, RequestOptions } from './transport.js';
import type { CallOptions } from './types.js';

/** The server's default command timeout, and the client's slack on top of it. */
const DEFAULT_COMMAND_TIMEOUT_MS = 60_000;
const DEADLINE_SLACK_MS = 30_000;
/** Waiting on a background command or its output has no deadline of its own unless given. */
const LONG_WAIT_MS = 7 * 24 * 3600 * 1000;

export interface CommandOptions extends OutputCallbacks {
  /** Server-side timeout; the whole process tree is killed then (default 60 s). */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
  user?: string | undefined;
  /** Whole stdin, sent then closed (unless `stdinOpen`). */
  stdin?: string | undefined;
  /** Cap on captured bytes per stream (default 1 MiB); head and tail are kept. */
  maxOutputBytes?: number | undefined;
  /** Idempotency key: runs at most once per sandbox; a retry gets the same command's result. */
  requestId?: string | undefined;
}

export interface StartOptions extends Omit<CommandOptions, 'onStdout' | 'onStderr'> {
  /** Keep stdin open for `sendStdin` until `closeStdin` (default: stdin is empty or `stdin`). */
  stdinOpen?: boolean | undefined;
}

/** Sends a command-shaped request and decodes a plain or NDJSON answer. @internal */
export function commandRequest<R extends CommandResult>(
  http: HttpTransport,
  request: RequestOptions,
  callbacks: OutputCallbacks,
  streaming: boolean,
): Promise<R> {
  if (!streaming) return http.json<R>(request);
  const out = callbacks.onStdout ?? (() => {});
  const err = callbacks.onStderr ?? (() => {});
  const decoder = new CommandEventDecoder(out, err);
  return http.stream<R>({
    ...request,
    accept: 'application/x-ndjson',
    onChunk: (chunk) => decoder.push(chunk),
    onEnd: () => decoder.end(),
    onJson: (body) => {
      const result = body as R;
      if (result.stdout) out(result.stdout);
      if (result.stderr) err(result.stderr);
      return result;
    },
  });
}

/**
 * `sandbox.commands`: one-shot and background commands, through the
 * sandbox's command log (every command has an ID; results stay readable for
 * a while, and a `requestId` makes a command run at most once).
 */
export class Commands {
  readonly #http: HttpTransport;
  readonly #base: string;
  readonly #timeoutMs: number;

  /** @internal */
  constructor(http: HttpTransport, sandboxId: string, defaultTimeoutMs: number) {
    this.#http = http;
    this.#base = `/v1/sandboxes/${encodeURIComponent(sandboxId)}/commands`;
    this.#timeoutMs = defaultTimeoutMs;
  }

  /**
   * Runs a command: a string is a shell line (the platform's shell), an array
   * is argv. Await it for the `CommandResult`, or iterate it for output events.
   * A non-zero exit is a result, not an error.
   */
  run(command: string | string[], options: CommandOptions = {}): CommandRun {
    const body = { ...target(command), ...specOf(options) };
    return new CommandRun(
      (callbacks, streaming) =>
        commandRequest(
          this.#http,
          {
            method: 'POST',
            path: this.#base,
            body,
            signal: options.signal,
            timeoutMs: (options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS) + DEADLINE_SLACK_MS,
            idempotent: options.requestId !== undefined,
          },
          callbacks,
          streaming,
        ),
      options,
    );
  }

  /**
   * Runs a command and hands its stdout to `onStdout` as raw bytes, without
   * the per-chunk framing `run` uses: the fast path for bulk output (logs,
   * archives, generated data). Resolves with the `CommandResult`, whose
   * `stdout` and `stderr` are empty here; read them with `get(commandId)`.
   */
  async stream(
    command: string | string[],
    options: Omit<CommandOptions, 'onStdout' | 'onStderr'> & { onStdout: (chunk: Buffer) => void },
  ): Promise<CommandResult> {
    const body = Buffer.from(JSON.stringify({ ...target(command), ...specOf(options) }));
    const res = await this.#http.raw({
      method: 'POST',
      path: this.#base,
      headers: { accept: 'application/octet-stream', 'content-type': 'application/json' },
      body,
      signal: options.signal,
      timeoutMs: (options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS) + DEADLINE_SLACK_MS,
    });
    for await (const chunk of res) options.onStdout(chunk as Buffer);
    const decode = (v: unknown) =>
      JSON.parse(Buffer.from(String(v), 'base64').toString('utf8')) as unknown;
    if (res.trailers['x-dsec-error']) {
      const e = decode(res.trailers['x-dsec-error']) as { code: string; message: string };
      throw DsecError.fromBody({ error: e });
    }
    if (!res.trailers['x-dsec-result'])
      throw new DsecError('unavailable', 'the command stream ended early');
    return decode(res.trailers['x-dsec-result']) as CommandResult;
  }

  /** Starts a background command and returns its handle at once. */
  async start(command: string | string[], options: StartOptions = {}): Promise<CommandHandle> {
    const info = await this.#http.json<CommandInfo>({
      method: 'POST',
      path: this.#base,
      body: {
        ...target(command),
        ...specOf(options),
        background: true,
        stdinOpen: options.stdinOpen,
      },
      signal: options.signal,
      timeoutMs: this.#timeoutMs,
      idempotent: options.requestId !== undefined,
    });
    return new CommandHandle(this.#http, this.#base, info, this.#timeoutMs);
  }

  /** Reconnects to a command by ID (running or finished within the retention); throws `command_not_found`. */
  async get(commandId: string, options: CallOptions = {}): Promise<CommandHandle> {
    const handle = new CommandHandle(this.#http, this.#base, undefined, this.#timeoutMs, commandId);
    await handle.refresh(options);
    return handle;
  }

  /** Running commands, then finished ones still retained, newest first. */
  async list(options: CallOptions = {}): Promise<CommandInfo[]> {
    const r = await this.#http.json<{ commands: CommandInfo[] }>({
      method: 'GET',
      path: this.#base,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
    return r.commands;
  }
}

/** A command by ID: wait, kill, signal, stdin, output — also after the client reconnects. */
export class CommandHandle {
  readonly id: string;
  /** Last known state. */
  info: CommandInfo | undefined;
  readonly #http: HttpTransport;
  readonly #path: string;
  readonly #timeoutMs: number;

  /** @internal */
  constructor(
    http: HttpTransport,
    base: string,
    info: CommandInfo | undefined,
    defaultTimeoutMs: number,
    id?: string,
  ) {
    this.#http = http;
    this.info = info;
    this.id = info?.commandId ?? id ?? '';
    this.#path = `${base}/${encodeURIComponent(this.id)}`;
    this.#timeoutMs = defaultTimeoutMs;
  }

  async refresh(options: CallOptions = {}): Promise<CommandInfo> {
    this.info = await this.#call<CommandInfo>('GET', '', options, undefined, true);
    return this.info;
  }

  /**
   * Waits for the result. With `timeoutMs` the server gives up after that long
   * (`deadline_exceeded`; the command keeps running).
   */
  wait(options: CallOptions = {}): Promise<CommandResult> {
    const q = options.timeoutMs !== undefined ? `?timeoutMs=${options.timeoutMs}` : '';
    return this.#http.json<CommandResult>({
      method: 'GET',
      path: `${this.#path}/wait${q}`,
      signal: options.signal,
      timeoutMs: (options.timeoutMs ?? LONG_WAIT_MS) + DEADLINE_SLACK_MS,
      idempotent: true,
    });
  }

  /** Kills the command's whole process tree; its outcome becomes `killed`. */
  async kill(options: CallOptions = {}): Promise<void> {
    await this.#call('POST', '/kill', options, undefined, true);
  }

  /** Sends a signal (`SIGTERM`, `SIGINT`, a number) to the command's process group. */
  async signal(sig: string | number, options: CallOptions = {}): Promise<void> {
    await this.#call('POST', '/signal', options, { signal: sig });
  }

  /** Streams bytes to the command's stdin (started with `stdinOpen`), with back-pressure. */
  async sendStdin(
    data: string | Buffer | Readable,
    options: CallOptions & { eof?: boolean | undefined } = {},
  ): Promise<{ bytes: number }> {
    const body = typeof data === 'string' ? Buffer.from(data) : data;
    const res = await this.#http.raw({
      method: 'POST',
      path: `${this.#path}/stdin${options.eof ? '?eof=1' : ''}`,
      headers: { 'content-type': 'application/octet-stream' },
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? LONG_WAIT_MS,
    });
    return JSON.parse((await readAll(res)).toString('utf8')) as { bytes: number };
  }

  /** Closes the command's stdin (it reads EOF). */
  async closeStdin(options: CallOptions = {}): Promise<void> {
    await this.#call('POST', '/stdin?eof=1', options);
  }

  /**
   * The command's output: what was kept so far (head and tail within the
   * cap), then live output; await it for the result, iterate it for events.
   */
  output(options: OutputCallbacks & CallOptions = {}): CommandRun {
    return new CommandRun(
      (callbacks) =>
        commandRequest(
          this.#http,
          {
            method: 'GET',
            path: `${this.#path}/output`,
            signal: options.signal,
            timeoutMs: options.timeoutMs ?? LONG_WAIT_MS,
            idempotent: true,
          },
          callbacks,
          true,
        ),
      options,
    );
  }

  #call<T>(
    method: 'GET' | 'POST',
    suffix: string,
    options: CallOptions,
    body?: unknown,
    idempotent = false,
  ): Promise<T> {
    return this.#http.json<T>({
      method,
      path: `${this.#path}${suffix}`,
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent,
    });
  }
}

function target(command: string | string[]): { shell: string } | { argv: string[] } {
  if (typeof command === 'string') return { shell: command };
  if (!Array.isArray(command) || command.length === 0) {
    throw new DsecError('invalid_argument', 'a command is a shell string or a non-empty argv', {
      field: 'argv',
    });
  }
  return { argv: command };
}

function specOf(o: StartOptions) {
  return {
    env: o.env,
    cwd: o.cwd,
    user: o.user,
    stdin: o.stdin,
    timeoutMs: o.timeoutMs,
    maxOutputBytes: o.maxOutputBytes,
    requestId: o.requestId,
  };
}

export async function readAll(stream: NodeJS.ReadableStream): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(typeof c === 'string' ? Buffer.from(c) : c);
  return Buffer.concat(chunks);
}
