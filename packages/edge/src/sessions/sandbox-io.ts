import type { Duplex, Readable } from 'node:stream';
import {
  checkSandboxUser,
  DsecError,
  requestFingerprint,
  DEFAULT_MAX_OUTPUT_BYTES,
} from '@dsec/core';
import type {
  CommandInfo,
  CommandResult,
  FileInfo,
  FileOptions,
  PtyOptions,
  PtySession,
  RunCommandOptions,
  SandboxIoApi,
  SessionInfo,
  SessionResult,
  SessionRunSpec,
  StartCommandSpec,
} from '@dsec/core';
import type { PidsLimitEvent, SandboxChannel } from '../backends/channel.js';
import type { Backend } from '../backends/backend.js';
import { CommandStore } from '../state/command-store.js';
import type { SandboxRecord } from '../state/edge-store.js';
import { attach, CommandRegistry, type Begun, type LiveCommand } from './command-registry.js';
import { runChronusCommand } from './command-runner.js';
import * as files from './files.js';
import { connectPort, openPty } from './port-and-pty.js';
import { ShellSession } from './shell-session.js';
import { imageDefaults } from './image-defaults.js';
import { callUser } from './spawn-user.js';

export interface SandboxIoOptions {
  /** The edge's SQLite file; the command log is its own table there. */
  dbFile: string;
  backend: Backend;
  /**
   * The sandbox's record if it is running; throws `sandbox_not_found` /
   * `sandbox_not_running`, and `sandbox_not_found` for another project's
   * sandbox when `projectId` is given. Every call of this layer passes here
   * (or through the short record cache): a paused sandbox is resumed before
   * the promise resolves (docs/adr/0012-pause-and-resume.md).
   */
  running: (sandboxId: string, projectId?: string) => SandboxRecord | Promise<SandboxRecord>;
  /** How long finished commands stay readable. Default 1 h. */
  commandRetentionMs?: number | undefined;
  /** Finished commands kept per sandbox. Default 256. */
  maxCommandsPerSandbox?: number | undefined;
  /** Sessions per sandbox. Default 64. */
  maxSessionsPerSandbox?: number | undefined;
  /** A spawn met the sandbox's pids limit (processes were reclaimed, or none could be). */
  onPidsLimit?: ((rec: SandboxRecord, event: PidsLimitEvent) => void) | undefined;
}

const RECORD_CACHE_MS = 1000;
const SESSION_NAME = /^[A-Za-z0-9._-]{1,64}$/;

/**
 * The edge's in-sandbox interface (`SandboxIoApi`): the command log,
 * background commands, shell sessions, files, ports and terminals of every
 * sandbox on this edge, all through each sandbox's channel (backends/channel.ts).
 */
export class SandboxIo implements SandboxIoApi {
  readonly registry: CommandRegistry;
  readonly #o: SandboxIoOptions;
  readonly #store: CommandStore;
  readonly #sessions = new Map<string, Map<string, ShellSession>>();
  readonly #sweeper: NodeJS.Timeout;
  /** Running sandboxes' records, briefly: reading the edge store on every call costs more than the exec. */
  readonly #records = new Map<string, { rec: SandboxRecord; atMs: number }>();

  constructor(options: SandboxIoOptions) {
    this.#o = options;
    this.#store = new CommandStore(options.dbFile);
    this.registry = new CommandRegistry(this.#store, {
      retentionMs: options.commandRetentionMs,
      maxPerSandbox: options.maxCommandsPerSandbox,
    });
    this.registry.sweep();
    this.#sweeper = setInterval(() => this.registry.sweep(), 60_000);
    this.#sweeper.unref();
  }

  close(): void {
    clearInterval(this.#sweeper);
    this.#store.close();
  }

  /** The sandbox is being paused: the next call must ask `running` again (and so resume it). */
  forgetRecord(sandboxId: string): void {
    this.#records.delete(sandboxId);
  }

  /** The sandbox is stopping: its sessions and running commands go with it. */
  forgetSandbox(sandboxId: string): void {
    this.#records.delete(sandboxId);
    for (const s of this.#sessions.get(sandboxId)?.values() ?? []) s.close();
    this.#sessions.delete(sandboxId);
    this.registry.killAll(sandboxId);
  }

  // ---- commands ----

  async runCommand(
    sandboxId: string,
    spec: StartCommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    const rec = await this.#rec(sandboxId, options.projectId);
    if (spec.user !== undefined) checkSandboxUser(spec.user, 'user');
    const begun = this.registry.begin(
      sandboxId,
      {
        requestId: spec.requestId,
        fingerprint: commandFingerprint(spec, false),
        argv: spec.argv,
        shell: spec.shell,
        background: false,
      },
      spec.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES,
      (live) => this.#runArgv(rec, spec, live),
    );
    return this.#follow(begun, spec.requestId, options);
  }

  async startCommand(sandboxId: string, spec: StartCommandSpec): Promise<CommandInfo> {
    const rec = await this.#rec(sandboxId);
    if (spec.user !== undefined) checkSandboxUser(spec.user, 'user');
    const begun = this.registry.begin(
      sandboxId,
      {
        requestId: spec.requestId,
        fingerprint: commandFingerprint(spec, true),
        argv: spec.argv,
        shell: spec.shell,
        background: true,
      },
      spec.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES,
      (live) => this.#runArgv(rec, spec, live),
    );
    if ('recorded' in begun) return begun.recorded;
    await begun.live.started;
    return { ...begun.live.info };
  }

  async getCommand(sandboxId: string, commandId: string): Promise<CommandInfo> {
    return this.registry.get(sandboxId, commandId);
  }

  async listCommands(sandboxId: string): Promise<CommandInfo[]> {
    return this.registry.list(sandboxId);
  }

  async waitCommand(
    sandboxId: string,
    commandId: string,
    options: { timeoutMs?: number | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<CommandResult> {
    const live = this.registry.live(sandboxId, commandId);
    if (!live) return finishedResult(this.registry.get(sandboxId, commandId));
    return raceDeadline(live.result, options.timeoutMs, options.signal);
  }

  async watchCommand(
    sandboxId: string,
    commandId: string,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    const live = this.registry.live(sandboxId, commandId);
    if (!live) {
      const result = finishedResult(this.registry.get(sandboxId, commandId));
      if (result.stdout) options.onStdout?.(Buffer.from(result.stdout));
      if (result.stderr) options.onStderr?.(Buffer.from(result.stderr));
      return result;
    }
    return raceDeadline(attach(live, options, true), undefined, options.signal);
  }

  async killCommand(sandboxId: string, commandId: string): Promise<void> {
    const live = this.registry.live(sandboxId, commandId);
    if (live) live.kill();
    else this.registry.get(sandboxId, commandId); // not_found, or finished: nothing to do
  }

  async signalCommand(sandboxId: string, commandId: string, sig: string | number): Promise<void> {
    const live = this.#running(sandboxId, commandId);
    await live.started;
    live.controls?.signal(sig);
  }

  async writeStdin(
    sandboxId: string,
    commandId: string,
    data: Readable | Buffer | undefined,
    options: { eof?: boolean | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<{ bytes: number }> {
    const live = this.#running(sandboxId, commandId);
    await live.started;
    const c = live.controls;
    if (!c?.write || !c.endStdin) {
      throw new DsecError('conflict', 'this command takes no streamed stdin');
    }
    let bytes = 0;
    const put = async (chunk: Buffer) => {
      bytes += chunk.length;
      if (!c.write!(chunk)) await c.drained?.();
    };
    if (Buffer.isBuffer(data)) await put(data);
    else if (data) {
      for await (const chunk of data) {
        if (options.signal?.aborted) throw new DsecError('aborted', 'operation aborted');
        if (this.registry.live(sandboxId, commandId) === undefined) break;
        await put(chunk as Buffer);
      }
    }
    if (options.eof) c.endStdin();
    return { bytes };
  }

  // ---- sessions ----

  async runInSession(
    sandboxId: string,
    name: string,
    spec: SessionRunSpec,
    options: RunCommandOptions = {},
  ): Promise<SessionResult> {
    const rec = await this.#rec(sandboxId, options.projectId);
    const session = this.#session(rec, name, spec);
    const begun = this.registry.begin(
      sandboxId,
      {
        requestId: spec.requestId,
        fingerprint: commandFingerprint({ session: name, ...spec }, false),
        session: name,
        line: spec.line,
        background: false,
      },
      spec.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES,
      (live) => session.run(spec, live),
    );
    return (await this.#follow(begun, spec.requestId, options)) as SessionResult;
  }

  async listSessions(sandboxId: string): Promise<SessionInfo[]> {
    await this.#rec(sandboxId);
    return [...(this.#sessions.get(sandboxId)?.values() ?? [])].map((s) => s.info());
  }

  async closeSession(sandboxId: string, name: string): Promise<void> {
    await this.#rec(sandboxId);
    const byName = this.#sessions.get(sandboxId);
    byName?.get(name)?.close();
    byName?.delete(name);
  }

  // ---- files ----

  async readFile(sandboxId: string, path: string, options: FileOptions = {}): Promise<Readable> {
    const { conn, ...ctx } = await this.#dedicated(sandboxId, options);
    return files.readFileStream(conn, path, { ...ctx, signal: options.signal });
  }

  async writeFile(
    sandboxId: string,
    path: string,
    body: Readable | Buffer,
    options: FileOptions & { mode?: number | undefined } = {},
  ): Promise<FileInfo> {
    const once = async () => {
      const { conn, ...ctx } = await this.#dedicated(sandboxId, options);
      try {
        return await files.writeFileStream(conn, path, body, { ...options, ...ctx });
      } finally {
        conn.close();
      }
    };
    // A stream cannot be sent twice; a buffer can (the script writes a temp file, then renames).
    return Buffer.isBuffer(body) ? whileForkRefused(once) : once();
  }

  async statFile(sandboxId: string, path: string, options: FileOptions = {}): Promise<FileInfo> {
    return whileForkRefused(async () => {
      const { conn, ...ctx } = await this.#shared(sandboxId, options);
      return files.statFile(conn, path, { ...ctx, signal: options.signal });
    });
  }

  async listDir(sandboxId: string, path: string, options: FileOptions = {}): Promise<FileInfo[]> {
    return whileForkRefused(async () => {
      const { conn, ...ctx } = await this.#shared(sandboxId, options);
      return files.listDir(conn, path, { ...ctx, signal: options.signal });
    });
  }

  async mkdir(
    sandboxId: string,
    path: string,
    options: FileOptions & { parents?: boolean | undefined; mode?: number | undefined } = {},
  ): Promise<void> {
    await whileForkRefused(async () => {
      const { conn, ...ctx } = await this.#shared(sandboxId, options);
      await files.makeDir(conn, path, { ...options, ...ctx });
    });
  }

  async remove(
    sandboxId: string,
    path: string,
    options: FileOptions & { recursive?: boolean | undefined } = {},
  ): Promise<void> {
    const { conn, ...ctx } = await this.#shared(sandboxId, options);
    await files.removePath(conn, path, { ...options, ...ctx });
  }

  async rename(
    sandboxId: string,
    from: string,
    to: string,
    options: FileOptions & { overwrite?: boolean | undefined } = {},
  ): Promise<void> {
    const { conn, ...ctx } = await this.#shared(sandboxId, options);
    await files.renamePath(conn, from, to, { ...options, ...ctx });
  }

  // ---- ports and terminals ----

  async connectPort(sandboxId: string, port: number): Promise<Duplex> {
    const { conn, user } = await this.#dedicated(sandboxId, {});
    return connectPort(conn, port, user);
  }

  async openPty(sandboxId: string, options: PtyOptions = {}): Promise<PtySession> {
    const rec = await this.#rec(sandboxId);
    if (options.user !== undefined) checkSandboxUser(options.user, 'user');
    const conn = await this.#channel(rec, true);
    const image = imageDefaults(rec.layers);
    return openPty(conn, {
      ...options,
      ...callUser(options.user, rec.spec.initUser),
      env: { ...image.env, ...rec.spec.env, ...options.env },
      ...(options.cwd === undefined && image.cwd !== undefined ? { cwd: image.cwd } : {}),
    });
  }

  // ---- internals ----

  #runArgv(rec: SandboxRecord, spec: StartCommandSpec, live: LiveCommand): Promise<CommandResult> {
    return this.#channel(rec, false).then((conn) =>
      runChronusCommand(conn, rec, spec, live, async () =>
        this.#o.backend.oomKilled ? this.#o.backend.oomKilled(rec) : false,
      ),
    );
  }

  /**
   * Waits for a command begun (or found) by `begin`. A caller that goes away
   * kills a command it started without a `requestId`; with one, the command
   * keeps running so a retry can attach to it.
   */
  async #follow(
    begun: Begun,
    requestId: string | undefined,
    options: RunCommandOptions,
  ): Promise<CommandResult> {
    if ('recorded' in begun) {
      const result = finishedResult(begun.recorded);
      if (result.stdout) options.onStdout?.(Buffer.from(result.stdout));
      if (result.stderr) options.onStderr?.(Buffer.from(result.stderr));
      return result;
    }
    const { live, fresh } = begun;
    const signal = options.signal;
    const result = attach(live, options, !fresh);
    if (!signal) return result;
    if (requestId === undefined && fresh) {
      const onAbort = () => live.kill();
      if (signal.aborted) onAbort();
      signal.addEventListener('abort', onAbort, { once: true });
      return result.finally(() => signal.removeEventListener('abort', onAbort));
    }
    return raceDeadline(result, undefined, signal);
  }

  #rec(sandboxId: string, projectId?: string): SandboxRecord | Promise<SandboxRecord> {
    const now = Date.now();
    const cached = this.#records.get(sandboxId);
    if (
      cached &&
      now - cached.atMs < RECORD_CACHE_MS &&
      (projectId === undefined || cached.rec.projectId === projectId)
    )
      return cached.rec;
    const found = this.#o.running(sandboxId, projectId);
    if (!(found instanceof Promise)) {
      this.#records.set(sandboxId, { rec: found, atMs: now });
      return found;
    }
    // Resumed first; cached from when it runs.
    return found.then((rec) => {
      this.#records.set(sandboxId, { rec, atMs: Date.now() });
      return rec;
    });
  }

  #session(rec: SandboxRecord, name: string, spec: SessionRunSpec): ShellSession {
    if (!SESSION_NAME.test(name)) {
      throw new DsecError('invalid_argument', 'session names are 1–64 chars of [A-Za-z0-9._-]', {
        field: 'session',
      });
    }
    let byName = this.#sessions.get(rec.id);
    if (!byName) this.#sessions.set(rec.id, (byName = new Map()));
    let session = byName.get(name);
    if (!session) {
      if (spec.user !== undefined) checkSandboxUser(spec.user, 'user');
      if (byName.size >= (this.#o.maxSessionsPerSandbox ?? 64)) {
        throw new DsecError('quota_exceeded', `sandbox ${rec.id} has ${byName.size} sessions`);
      }
      session = new ShellSession({
        name,
        channel: () => this.#channel(rec, false),
        shell: spec.shell,
        ...callUser(spec.user, rec.spec.initUser),
        env: { ...imageDefaults(rec.layers).env, ...rec.spec.env, ...spec.env },
        cwd: spec.cwd ?? imageDefaults(rec.layers).cwd,
        pidsLimit: rec.spec.pidsLimit,
      });
      byName.set(name, session);
    }
    return session;
  }

  #running(sandboxId: string, commandId: string): LiveCommand {
    const live = this.registry.live(sandboxId, commandId);
    if (live) return live;
    this.registry.get(sandboxId, commandId); // throws command_not_found
    throw new DsecError('conflict', `command ${commandId} has finished`);
  }

  async #channel(rec: SandboxRecord, dedicated: boolean): Promise<SandboxChannel> {
    const onPidsLimit = this.#o.onPidsLimit;
    // A sandbox at its pids limit after refused forks (a fork bomb): leftovers go first.
    const relief = this.#o.backend.relieve?.(rec);
    if (relief) {
      const event = await relief;
      if (event.reclaimedProcesses > 0) onPidsLimit?.(rec, event);
    }
    const conn = await this.#o.backend.channel(rec, { dedicated });
    if (onPidsLimit && !conn.onPidsLimit) conn.onPidsLimit = (event) => onPidsLimit(rec, event);
    return conn;
  }

  async #shared(sandboxId: string, options: FileOptions) {
    const rec = await this.#rec(sandboxId);
    return { conn: await this.#channel(rec, false), ...this.#fileContext(rec, options) };
  }

  async #dedicated(sandboxId: string, options: FileOptions) {
    const rec = await this.#rec(sandboxId);
    return { conn: await this.#channel(rec, true), ...this.#fileContext(rec, options) };
  }

  /** Who file calls run as, and the limits their `resource_exhausted` errors name. */
  #fileContext(rec: SandboxRecord, options: FileOptions) {
    if (options.user !== undefined) checkSandboxUser(options.user, 'user');
    return {
      ...callUser(options.user, rec.spec.initUser),
      pidsLimit: rec.spec.pidsLimit,
      diskLimitMb: rec.spec.diskLimitMb,
    };
  }
}

function finishedResult(info: CommandInfo): CommandResult {
  if (!info.result) throw new DsecError('conflict', `command ${info.commandId} has no result`);
  return info.result;
}

/** Rejects with `deadline_exceeded` after `timeoutMs`, `aborted` on `signal`; the work goes on. */
function raceDeadline<T>(
  p: Promise<T>,
  timeoutMs: number | undefined,
  signal: AbortSignal | undefined,
): Promise<T> {
  if (timeoutMs === undefined && !signal) return p;
  return new Promise<T>((resolve, reject) => {
    const timer =
      timeoutMs === undefined
        ? undefined
        : setTimeout(
            () => reject(new DsecError('deadline_exceeded', `still running after ${timeoutMs} ms`)),
            timeoutMs,
          );
    const onAbort = () => reject(new DsecError('aborted', 'operation aborted'));
    if (signal?.aborted) onAbort();
    signal?.addEventListener('abort', onAbort, { once: true });
    p.then(resolve, reject).finally(() => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
    });
  });
}

/**
 * What binds a command's `requestId` to its request: everything the caller
 * sent except the key itself. Only commands with a `requestId` need one.
 */
function commandFingerprint<T extends { requestId?: string | undefined }>(
  spec: T,
  background: boolean,
): string | undefined {
  if (spec.requestId === undefined) return undefined;
  const { requestId: _key, ...request } = spec;
  return requestFingerprint({ ...request, background });
}

/** Waits between tries of a file call whose script could not fork (the sandbox at its pids limit). */
const FORK_RETRY_DELAYS_MS = [50, 100, 200, 400];

/**
 * A file call's script starts (the spawn reclaims processes when the sandbox
 * is full) but may then fail to fork its own tools when a fork bomb has
 * taken the pids freed meanwhile. Calls that change nothing before their
 * last step (stat, list, mkdir, a write from a buffer) are tried again a few
 * times, each spawn reclaiming afresh; the last refusal is returned.
 */
async function whileForkRefused<T>(call: () => Promise<T>): Promise<T> {
  for (const delayMs of FORK_RETRY_DELAYS_MS) {
    try {
      return await call();
    } catch (err) {
      if (!(err instanceof DsecError && err.details?.during === 'call')) throw err;
      await new Promise((r) => setTimeout(r, delayMs));
    }
  }
  return call();
}
