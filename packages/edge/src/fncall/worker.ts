import { DsecError } from '@dsec/core';
import type { FnCallOutcome, SandboxSpec } from '@dsec/core';
import type { SandboxChannel, SandboxCommand } from '../backends/channel.js';
import type { FnCallRuntime } from './runtimes.js';
import { ZYGOTE_BOOT, ZYGOTE_PY } from './zygote.js';

/** What the pools need of the edge: its own create and stop paths and the sandbox's command channel. */
export interface FnCallHost {
  /** Creates a worker sandbox through the edge's create path (admission included). */
  create(id: string, spec: SandboxSpec, signal?: AbortSignal): Promise<void>;
  stop(id: string): Promise<void>;
  /** A dedicated channel (chronus for containers) to the sandbox, owned by the caller. */
  channel(id: string): Promise<SandboxChannel>;
  /** Whether the OOM killer struck the sandbox since this was last asked. */
  oomKilled(id: string): Promise<boolean>;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/** A call as the zygote reads it (one JSON line). */
export interface ZygoteCall {
  id: number;
  code: string;
  stdin: string;
  files: Record<string, string>;
  args: string[];
  env: Record<string, string>;
  timeoutMs: number;
  memoryMb: number;
  maxOutputBytes: number;
  nproc: number;
  fsizeMb: number;
}

/** The zygote's answer to one call. */
export interface ZygoteDone {
  exitCode: number;
  signal: string | null;
  outcome: FnCallOutcome;
  stdout: string;
  stderr: string;
  stdoutBytes: number;
  stderrBytes: number;
  truncated: boolean;
  durationMs: number;
  /** Processes of the call still alive when its main process ended (all killed since). */
  leftover: number;
  /** The zygote could not clean up after the call: the worker must go. */
  retire: boolean;
  reason?: string | undefined;
}

/** A call's end as the pool sees it: the zygote answered, or the worker died (before or after the start). */
export type WorkerRun =
  { kind: 'done'; done: ZygoteDone } | { kind: 'died'; started: boolean; reason: string };

export interface ZygoteConfig {
  uid: number;
  mode: FnCallRuntime['mode'];
  command: string[];
  entry: string;
  env: Record<string, string>;
  memoryMb: number;
  nproc: number;
  fsizeMb: number;
  preload: string[];
  /** Whether the zygote watches its scratch places with inotify (FnCallPools' budget). */
  watchScratch: boolean;
}

/** How long a worker may take from its sandbox's start to the zygote's `ready`. */
const READY_TIMEOUT_MS = 60_000;
/** Past a call's own timeout, how long the zygote may take to kill, clean and answer. */
const ANSWER_GRACE_MS = 15_000;

interface Pending {
  id: number;
  started: boolean;
  resolve: (r: WorkerRun) => void;
  timer: NodeJS.Timeout;
}

/**
 * One worker: a sandbox with its zygote started and waiting, running one call
 * at a time. It dies when its zygote's command ends (the call killed it, the
 * sandbox was stopped, the TTL ran out); the pool then replaces it.
 */
export class Worker {
  idleSinceMs = Date.now();
  calls = 0;
  #dead: string | undefined;
  #pending: Pending | undefined;
  #nextId = 1;
  #out: Buffer[] = [];
  #stderrTail = '';
  #onDeath: ((w: Worker) => void) | undefined;

  private constructor(
    readonly id: string,
    readonly host: FnCallHost,
    readonly conn: SandboxChannel,
    readonly handle: SandboxCommand,
  ) {}

  /**
   * Creates the sandbox and starts the zygote; resolves once it is ready.
   * On any failure the sandbox is stopped again.
   */
  static async start(
    host: FnCallHost,
    id: string,
    spec: SandboxSpec,
    config: ZygoteConfig,
    signal?: AbortSignal,
  ): Promise<Worker> {
    await host.create(id, spec, signal);
    let conn: SandboxChannel | undefined;
    try {
      conn = await host.channel(id);
      const handle = conn.spawn({
        argv: ['python3', '-c', ZYGOTE_BOOT, ZYGOTE_PY, JSON.stringify(config)],
        env: { PATH: config.env['PATH'] ?? '/usr/bin:/bin', LANG: 'C.UTF-8' },
        user: 'root',
        cwd: '/',
        stdin: true,
      });
      const w = new Worker(id, host, conn, handle);
      await w.#waitReady();
      return w;
    } catch (err) {
      conn?.close();
      await host.stop(id).catch(() => undefined);
      throw err;
    }
  }

  #waitReady(): Promise<void> {
    return new Promise((resolve, reject) => {
      let ready = false;
      const timer = setTimeout(() => {
        fail(`the zygote was not ready within ${READY_TIMEOUT_MS} ms`);
      }, READY_TIMEOUT_MS);
      const fail = (why: string) => {
        if (ready) return;
        ready = true;
        clearTimeout(timer);
        reject(new DsecError('internal', `fncall worker ${this.id}: ${why}: ${this.#stderrTail}`));
      };
      this.handle.onStderr((chunk) => {
        this.#stderrTail = (this.#stderrTail + chunk.toString('utf8')).slice(-2000);
      });
      const onLine = (line: string) => {
        const msg = JSON.parse(line) as { t: string; id?: number } & Partial<ZygoteDone>;
        if (msg.t === 'ready' && !ready) {
          ready = true;
          clearTimeout(timer);
          resolve();
        } else this.#onMessage(msg);
      };
      this.handle.onStdout((chunk) => this.#lines(chunk, onLine));
      this.handle.started.catch((e: unknown) => fail(`cannot start the zygote: ${String(e)}`));
      this.handle.exited.then(
        (exit) => {
          fail(`the zygote exited (${exit.signal ?? exit.exitCode})`);
          this.#die(`the worker's zygote exited (${exit.signal ?? `code ${exit.exitCode}`})`);
        },
        (e: unknown) => {
          fail(String(e));
          this.#die(`lost the worker's command channel: ${String(e)}`);
        },
      );
    });
  }

  /** Hands each complete line of the stdout stream to `onLine` (a loop, not a generator: it runs per answer). */
  #lines(chunk: Buffer, onLine: (line: string) => void): void {
    let start = 0;
    let nl = chunk.indexOf(10);
    while (nl !== -1) {
      let line: string;
      if (this.#out.length === 0) line = chunk.toString('utf8', start, nl);
      else {
        this.#out.push(chunk.subarray(start, nl));
        line = Buffer.concat(this.#out).toString('utf8');
        this.#out = [];
      }
      onLine(line);
      start = nl + 1;
      nl = chunk.indexOf(10, start);
    }
    if (start < chunk.length) this.#out.push(chunk.subarray(start));
  }

  #onMessage(msg: { t: string; id?: number } & Partial<ZygoteDone>): void {
    const p = this.#pending;
    if (!p || msg.id !== p.id) return;
    if (msg.t === 'started') p.started = true;
    else if (msg.t === 'done') {
      this.#pending = undefined;
      clearTimeout(p.timer);
      p.resolve({ kind: 'done', done: msg as ZygoteDone });
    }
  }

  get dead(): boolean {
    return this.#dead !== undefined;
  }

  /** Called once when the worker dies while the pool holds it. */
  set onDeath(cb: (w: Worker) => void) {
    this.#onDeath = cb;
  }

  #die(reason: string): void {
    if (this.#dead !== undefined) return;
    this.#dead = reason;
    const p = this.#pending;
    this.#pending = undefined;
    if (p) {
      clearTimeout(p.timer);
      p.resolve({ kind: 'died', started: p.started, reason });
    }
    this.#onDeath?.(this);
  }

  /** Runs one call; never rejects: a dead worker answers `died`. */
  run(call: Omit<ZygoteCall, 'id'>): Promise<WorkerRun> {
    if (this.#dead !== undefined)
      return Promise.resolve({ kind: 'died', started: false, reason: this.#dead });
    if (this.#pending) throw new DsecError('internal', `fncall worker ${this.id} is busy`);
    this.calls++;
    const id = this.#nextId++;
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        // The zygote did not answer in time: it is wedged. The sandbox goes.
        this.#die('the worker did not answer within the call timeout');
        void this.retire();
      }, call.timeoutMs + ANSWER_GRACE_MS);
      this.#pending = { id, started: false, resolve, timer };
      this.handle.write(`${JSON.stringify({ ...call, id })}\n`);
    });
  }

  /** Stops the sandbox (and so the zygote and every process of calls). */
  async retire(): Promise<void> {
    this.#die('the worker was retired');
    this.conn.close();
    await this.host.stop(this.id);
  }
}
