import type {
  CommandBody,
  CommandResult,
  NetworkPolicyPatch,
  SandboxEvent,
  SandboxInfo,
  SnapshotInfo,
} from './wire.js';
import { listEvents, updateNetworkRules, type EventsOptions } from './network.js';
import { forkSandbox, setPaused, setSandboxTimeout, snapshotSandbox } from './lifecycle.js';
import { CommandEventDecoder } from './ndjson.js';
import { Commands } from './commands.js';
import { screenshot, sendInput, type DisplayInput } from './display.js';
import { COMMAND_DEADLINE_SLACK_MS, DEFAULT_COMMAND_TIMEOUT_MS } from './deadlines.js';
import { Files } from './files.js';
import { fetchPort, type SandboxFetchInit } from './port-fetch.js';
import { Session, type SessionOptions } from './session.js';
import { openTerminal, type Terminal, type TerminalOptions } from './terminal.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions, RunCommandOptions, SnapshotOptions } from './types.js';

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
    this.commands = new Commands(http, id, defaultTimeoutMs);
    this.files = new Files(http, id, defaultTimeoutMs);
  }

  /** One-shot and background commands by ID (`run`, `start`, `get`, `list`). */
  readonly commands: Commands;
  /** Files inside the sandbox (`read`, `write`, `list`, `upload`, `download`, …). */
  readonly files: Files;

  /**
   * A named shell session: state (cwd, env, variables, background jobs)
   * persists across `run` calls. Created on first use, on the server.
   */
  session(name: string, options: SessionOptions = {}): Session {
    return new Session(this.#http, this.id, name, options, this.#defaultTimeoutMs);
  }

  /** An interactive shell on a pty; `onData` gets the terminal's output. */
  terminal(onData: (chunk: Buffer) => void, options: TerminalOptions = {}): Promise<Terminal> {
    return openTerminal(this.#http, this.id, onData, options);
  }

  /** An HTTP request to a service listening on `port` inside the sandbox. */
  fetch(port: number, path = '/', init: SandboxFetchInit = {}): Promise<Response> {
    return fetchPort(this.#http, this.id, port, path, init);
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

  /**
   * Changes the sandbox's egress policy while it runs: `networkRules` are
   * merged by name (`{ npm: true }` turns npm on and keeps the rest), `allow`
   * and `deny` replace the explicit lists when given. New connections follow
   * within seconds; open ones are not cut. Other sandboxes are untouched.
   */
  async updateNetworkRules(
    patch: NetworkPolicyPatch,
    options: CallOptions = {},
  ): Promise<SandboxInfo> {
    this.info = await updateNetworkRules(this.#http, this.id, patch, {
      ...options,
      defaultTimeoutMs: this.#defaultTimeoutMs,
    });
    return this.info;
  }

  /** Audit events (denied connections, refused DNS names, caps and limits hit), oldest first. */
  events(options: EventsOptions = {}): Promise<SandboxEvent[]> {
    return listEvents(this.#http, this.id, {
      ...options,
      defaultTimeoutMs: this.#defaultTimeoutMs,
    });
  }

  /**
   * A PNG of the sandbox's screen now. Only `vm` sandboxes have a display;
   * others answer `unavailable`.
   */
  screenshot(options: CallOptions = {}): Promise<Buffer> {
    return screenshot(this.#http, this.id, options);
  }

  /**
   * Keys and pointer events to the screen, in order (`{ events: [...] }`:
   * keys by QEMU key code, buttons, pointer moves in pixels), or
   * `{ text }` typed key by key on a US layout. `unavailable` without a display.
   */
  input(input: DisplayInput, options: CallOptions = {}): Promise<void> {
    return sendInput(this.#http, this.id, input, this.#defaults(options));
  }

  /**
   * Pauses the sandbox: its processes stop and its memory goes back to the
   * host; files, processes, sessions and network state are kept. A no-op
   * when paused. The next command, session, file or port call resumes it by
   * itself, or `resume()`. Throws `sandbox_not_running` when stopped.
   */
  async pause(options: CallOptions = {}): Promise<SandboxInfo> {
    this.info = await setPaused(this.#http, this.id, true, this.#defaults(options));
    return this.info;
  }

  /** Resumes a paused sandbox; a no-op when running. Throws `sandbox_not_running` when stopped. */
  async resume(options: CallOptions = {}): Promise<SandboxInfo> {
    this.info = await setPaused(this.#http, this.id, false, this.#defaults(options));
    return this.info;
  }

  /**
   * The sandbox stops `timeoutMs` from now, later or sooner than before
   * (E2B's `setTimeout`; rounded up to whole seconds, at most 7 days).
   */
  async setTimeout(timeoutMs: number, options: CallOptions = {}): Promise<SandboxInfo> {
    this.info = await setSandboxTimeout(this.#http, this.id, timeoutMs, this.#defaults(options));
    return this.info;
  }

  /**
   * Captures the sandbox's filesystem (after a brief freeze, `scrub` paths
   * removed) as a new image; `runContainer({ image: result.image })` starts
   * from it. Deadline 120 s by default. Throws `sandbox_not_running` when
   * stopped, `conflict` when the name is taken, `permission_denied` for a
   * key without the `sandboxes:snapshot` scope.
   */
  snapshot(options: SnapshotOptions): Promise<SnapshotInfo> {
    return snapshotSandbox(this.#http, this.id, options);
  }

  /**
   * Starts `count` (1–64) new sandboxes from this one's current filesystem,
   * each with this one's spec and sharing its layers read-only. All or
   * nothing: when one cannot be created (quota, capacity) none is left.
   * The handles have no `info` until `refresh()`. Deadline 120 s by default.
   */
  async fork(count: number, options: CallOptions = {}): Promise<Sandbox[]> {
    const { ids } = await forkSandbox(this.#http, this.id, count, options);
    return ids.map((id) => new Sandbox(this.#http, id, undefined, this.#defaultTimeoutMs));
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

  #defaults(options: CallOptions): CallOptions & { defaultTimeoutMs: number } {
    return { ...options, defaultTimeoutMs: this.#defaultTimeoutMs };
  }

  async #run(
    target: Pick<CommandBody, 'argv' | 'shell'>,
    options: RunCommandOptions,
  ): Promise<CommandResult> {
    const body: CommandBody = {
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
