import { DsecError, randomId } from '@dsec/core';
import type { CommandInfo, CommandResult, RunCommandOptions } from '@dsec/core';
import type { CommandStore } from '../state/command-store.js';
import { OutputCapture } from './output-capture.js';

/** What a running command lets the registry do to it. */
export interface CommandControls {
  /** Ends it (a session call: its foreground job) and reports `killed`. */
  kill(): void;
  signal(sig: string | number): void;
  /** Present while stdin is open: returns false when the caller should wait for `drained()`. */
  write?: ((chunk: Buffer) => boolean) | undefined;
  endStdin?: (() => void) | undefined;
  drained?: (() => Promise<void>) | undefined;
}

interface Watcher {
  onStdout?: ((chunk: Buffer) => void) | undefined;
  onStderr?: ((chunk: Buffer) => void) | undefined;
}

/**
 * One running command as the registry holds it: bounded captures of its
 * output (head and tail, the same cap as its result), the clients watching
 * it live, and its controls once started.
 */
export class LiveCommand {
  readonly info: CommandInfo;
  readonly out: OutputCapture;
  readonly err: OutputCapture;
  readonly started: Promise<void>;
  result!: Promise<CommandResult>;
  readonly #watchers = new Set<Watcher>();
  #controls: CommandControls | undefined;
  #pendingKill = false;
  #markStarted!: () => void;
  #failStart!: (err: Error) => void;

  constructor(info: CommandInfo, capBytes: number) {
    this.info = info;
    this.out = new OutputCapture(capBytes);
    this.err = new OutputCapture(capBytes);
    this.started = new Promise<void>((resolve, reject) => {
      this.#markStarted = resolve;
      this.#failStart = reject;
    });
    this.started.catch(() => undefined);
  }

  get controls(): CommandControls | undefined {
    return this.#controls;
  }

  /** Called by the runner once the process runs. */
  setStarted(controls: CommandControls): void {
    this.#controls = controls;
    this.#markStarted();
    if (this.#pendingKill) controls.kill();
  }

  /** @internal */
  setStartFailed(err: Error): void {
    this.#failStart(err);
  }

  stdout(chunk: Buffer): void {
    this.out.push(chunk);
    for (const w of this.#watchers) w.onStdout?.(chunk);
  }

  stderr(chunk: Buffer): void {
    this.err.push(chunk);
    for (const w of this.#watchers) w.onStderr?.(chunk);
  }

  /** Replays what is kept so far, then forwards live output; returns the unsubscribe. */
  watch(w: Watcher, replay: boolean): () => void {
    if (replay) {
      const out = this.out.bytes();
      const err = this.err.bytes();
      if (out.length > 0) w.onStdout?.(out);
      if (err.length > 0) w.onStderr?.(err);
    }
    this.#watchers.add(w);
    return () => this.#watchers.delete(w);
  }

  kill(): void {
    if (this.#controls) this.#controls.kill();
    else this.#pendingKill = true;
  }
}

export type CommandRunner = (live: LiveCommand) => Promise<CommandResult>;

export interface CommandRegistryOptions {
  /** How long a finished command's result stays readable. Default 1 h. */
  retentionMs?: number | undefined;
  /** Finished commands kept per sandbox, newest first. Default 256. */
  maxPerSandbox?: number | undefined;
  /** Running commands per sandbox. Default 1024. */
  maxRunningPerSandbox?: number | undefined;
}

export type Begun = { live: LiveCommand; fresh: boolean } | { recorded: CommandInfo };

/**
 * The command log of an edge (paper 6.2): every command gets an ID; running
 * ones are held here, finished ones are in the `CommandStore` for the
 * retention period (bounded per sandbox). A `requestId` makes a command run
 * at most once per sandbox: a retry, even a concurrent one, gets the running
 * command (to attach to) or its recorded result, never a second run.
 */
export class CommandRegistry {
  readonly #store: CommandStore;
  readonly #live = new Map<string, LiveCommand>();
  readonly #byRequest = new Map<string, LiveCommand>();
  readonly #runningPerSandbox = new Map<string, number>();
  readonly #finishedSinceTrim = new Map<string, number>();
  readonly #retentionMs: number;
  readonly #maxPerSandbox: number;
  readonly #maxRunning: number;
  readonly #finishListeners: ((info: CommandInfo, result: CommandResult) => void)[] = [];

  constructor(store: CommandStore, options: CommandRegistryOptions = {}) {
    this.#store = store;
    this.#retentionMs = options.retentionMs ?? 3_600_000;
    this.#maxPerSandbox = options.maxPerSandbox ?? 256;
    this.#maxRunning = options.maxRunningPerSandbox ?? 1024;
    // Commands that were running when the edge went down died with its chronus connections.
    const now = new Date().toISOString();
    for (const info of store.running()) {
      store.finish({
        ...info,
        state: 'finished',
        finishedAt: now,
        result: lostResult(info, now, 'the edge restarted while the command ran'),
      });
    }
  }

  /**
   * Starts `runner` for a new command, or returns the command a `requestId`
   * already names (running: `live`, finished: `recorded`).
   */
  begin(
    sandboxId: string,
    descriptor: Pick<
      CommandInfo,
      'requestId' | 'fingerprint' | 'session' | 'argv' | 'shell' | 'line' | 'background'
    >,
    capBytes: number,
    runner: CommandRunner,
  ): Begun {
    const { requestId } = descriptor;
    if (requestId !== undefined) {
      const running = this.#byRequest.get(key(sandboxId, requestId));
      if (running) {
        sameRequest(running.info, descriptor);
        return { live: running, fresh: false };
      }
      const recorded = this.#store.findByRequest(sandboxId, requestId);
      if (recorded) return { recorded: sameRequest(recorded, descriptor) };
    }
    const count = this.#runningPerSandbox.get(sandboxId) ?? 0;
    if (count >= this.#maxRunning) {
      throw new DsecError(
        'quota_exceeded',
        `sandbox ${sandboxId} already runs ${count} commands through the platform`,
      );
    }
    const info: CommandInfo = {
      commandId: randomId('cmd'),
      sandboxId,
      ...stripUndefined(descriptor),
      state: 'running',
      startedAt: new Date().toISOString(),
    };
    const live = new LiveCommand(info, capBytes);
    this.#store.insert(info, {
      durable: descriptor.background === true || requestId !== undefined,
    });
    this.#live.set(info.commandId, live);
    if (requestId !== undefined) this.#byRequest.set(key(sandboxId, requestId), live);
    this.#runningPerSandbox.set(sandboxId, count + 1);

    live.result = (async () => {
      try {
        const result = await runner(live);
        await this.#finish(live, result);
        return result;
      } catch (err) {
        const error = err instanceof Error ? err : new Error(String(err));
        live.setStartFailed(error);
        if (live.controls === undefined) {
          // It never ran: forget it, so a retry with the same requestId may run it.
          this.#store.delete(info.commandId);
        } else {
          const now = new Date().toISOString();
          await this.#finish(live, lostResult(info, now, error.message, live));
        }
        throw err;
      } finally {
        this.#live.delete(info.commandId);
        if (requestId !== undefined) this.#byRequest.delete(key(sandboxId, requestId));
        this.#runningPerSandbox.set(sandboxId, (this.#runningPerSandbox.get(sandboxId) ?? 1) - 1);
      }
    })();
    live.result.catch(() => undefined);
    return { live, fresh: true };
  }

  /** A running command, or undefined. */
  live(sandboxId: string, commandId: string): LiveCommand | undefined {
    const live = this.#live.get(commandId);
    return live && live.info.sandboxId === sandboxId ? live : undefined;
  }

  /** Throws `command_not_found`. */
  get(sandboxId: string, commandId: string): CommandInfo {
    const live = this.live(sandboxId, commandId);
    if (live) return { ...live.info };
    const info = this.#store.get(sandboxId, commandId);
    if (!info) throw notFound(commandId);
    return info;
  }

  /** Running commands first, then finished ones, newest first. */
  list(sandboxId: string): CommandInfo[] {
    const running = [...this.#live.values()]
      .filter((l) => l.info.sandboxId === sandboxId)
      .map((l) => ({ ...l.info }));
    const ids = new Set(running.map((r) => r.commandId));
    const rest = this.#store
      .list(sandboxId, this.#maxPerSandbox + running.length)
      .filter((c) => !ids.has(c.commandId));
    return [...running, ...rest];
  }

  /** Kills every running command of a sandbox (it is stopping). */
  killAll(sandboxId: string): void {
    for (const live of this.#live.values()) if (live.info.sandboxId === sandboxId) live.kill();
  }

  /**
   * Drops results past their retention, and trims to the per-sandbox bound
   * every sandbox that finished commands since it was last trimmed (between
   * sweeps a sandbox holds at most 31 results over the bound).
   */
  sweep(now = Date.now()): void {
    this.#store.purge(new Date(now - this.#retentionMs).toISOString());
    for (const sandboxId of this.#finishedSinceTrim.keys())
      this.#store.trim(sandboxId, this.#maxPerSandbox);
    this.#finishedSinceTrim.clear();
  }

  /**
   * Calls `listener` for every command recorded as finished here, foreground
   * and background alike (`info.background` tells them apart), once each. A
   * listener that throws is ignored: the command's result stands.
   */
  onFinish(listener: (info: CommandInfo, result: CommandResult) => void): void {
    this.#finishListeners.push(listener);
  }

  /** Records the result; resolves once it is committed (it may be returned then, and not before). */
  async #finish(live: LiveCommand, result: CommandResult): Promise<void> {
    const finishedAt = new Date().toISOString();
    const finished = { state: 'finished' as const, finishedAt, result };
    await this.#store.finishGrouped({ ...live.info, ...finished });
    // Readers see it finished only once that is on disk.
    Object.assign(live.info, finished);
    for (const listener of this.#finishListeners) {
      try {
        listener({ ...live.info }, result);
      } catch {
        // A metrics hook must not turn a finished command into a failed one.
      }
    }
    const sb = live.info.sandboxId;
    const n = (this.#finishedSinceTrim.get(sb) ?? 0) + 1;
    if (n >= 32) {
      this.#store.trim(sb, this.#maxPerSandbox);
      this.#finishedSinceTrim.set(sb, 0);
    } else this.#finishedSinceTrim.set(sb, n);
  }
}

/** Waits for a command's result, watching its output meanwhile. */
export function attach(
  live: LiveCommand,
  options: RunCommandOptions,
  replay: boolean,
): Promise<CommandResult> {
  const unwatch =
    options.onStdout || options.onStderr
      ? live.watch({ onStdout: options.onStdout, onStderr: options.onStderr }, replay)
      : undefined;
  return live.result.finally(() => unwatch?.());
}

function lostResult(
  info: CommandInfo,
  nowIso: string,
  reason: string,
  live?: LiveCommand,
): CommandResult {
  return {
    commandId: info.commandId,
    exitCode: 137,
    signal: 'SIGKILL',
    outcome: 'killed',
    stdout: live ? live.out.bytes().toString('utf8') : '',
    stderr: live ? live.err.bytes().toString('utf8') : '',
    truncated: live ? live.out.truncated || live.err.truncated : false,
    stdoutBytes: live?.out.totalBytes ?? 0,
    stderrBytes: live?.err.totalBytes ?? 0,
    durationMs: Math.max(0, Date.parse(nowIso) - Date.parse(info.startedAt)),
    reason,
  };
}

/**
 * A retry must be the same request: the same `requestId` with another body
 * is refused rather than answered with the first one's result. Commands
 * recorded before fingerprints existed match anything.
 */
function sameRequest<T>(
  found: T & { fingerprint?: string | undefined },
  wanted: { fingerprint?: string | undefined; requestId?: string | undefined },
): T {
  if (found.fingerprint && wanted.fingerprint && found.fingerprint !== wanted.fingerprint) {
    throw new DsecError(
      'conflict',
      `requestId ${JSON.stringify(wanted.requestId)} was used for another command in this sandbox`,
      { field: 'requestId', details: { requestId: wanted.requestId } },
    );
  }
  return found;
}

function key(sandboxId: string, requestId: string): string {
  return `${sandboxId}\n${requestId}`;
}

function notFound(commandId: string): DsecError {
  return new DsecError('command_not_found', `no command ${JSON.stringify(commandId.slice(0, 80))}`);
}

function stripUndefined<T extends object>(o: T): T {
  const out: Record<string, unknown> = {};
  for (const k in o) if (o[k] !== undefined) out[k] = o[k];
  return out as T;
}
