import { connect, type Socket } from 'node:net';
import { DsecError } from '@dsec/core';

/** One QMP event (`{"event": ..., "data": ..., "timestamp": ...}`). */
export interface QmpEvent {
  event: string;
  data?: Record<string, unknown> | undefined;
}

export interface QmpConnectOptions {
  /** Connecting plus the greeting and `qmp_capabilities` (default 5 s). */
  timeoutMs?: number | undefined;
}

export interface QmpExecuteOptions {
  /** Default 10 s; the command's answer is dropped after it. */
  timeoutMs?: number | undefined;
}

const DEFAULT_CONNECT_MS = 5_000;
const DEFAULT_COMMAND_MS = 10_000;
/** A QMP line longer than this is not QEMU talking: the connection is closed. */
const MAX_LINE_BYTES = 16 * 2 ** 20;

interface Pending {
  resolve: (v: unknown) => void;
  reject: (e: Error) => void;
  timer: NodeJS.Timeout;
}

/**
 * A client of QEMU's machine protocol (QMP) on a unix socket: the greeting,
 * the `qmp_capabilities` handshake, commands matched to their answers by
 * `id`, and asynchronous events. Every wait has a deadline, since a QEMU
 * that hangs must not hang the edge. Errors are `DsecError('unavailable')`
 * carrying QEMU's error class and description.
 */
export class QmpClient {
  readonly #socket: Socket;
  readonly #pending = new Map<string, Pending>();
  readonly #listeners = new Set<(e: QmpEvent) => void>();
  /** Called once when the connection ends (ends every waitEvent at once). */
  readonly #closeWaiters = new Set<() => void>();
  #nextId = 1;
  #buffer = '';
  #closedError: Error | undefined;
  #greeting: ((v: Record<string, unknown>) => void) | undefined;

  private constructor(socket: Socket) {
    this.#socket = socket;
    socket.setEncoding('utf8');
    socket.on('data', (chunk: string) => this.#onData(chunk));
    socket.on('error', (err) => this.#fail(unavailable(`qmp: ${err.message}`)));
    socket.on('close', () => this.#fail(unavailable('qmp: connection closed')));
  }

  /** Connects, reads the greeting and leaves negotiation mode. */
  static async connect(path: string, options: QmpConnectOptions = {}): Promise<QmpClient> {
    const timeoutMs = options.timeoutMs ?? DEFAULT_CONNECT_MS;
    const socket = connect(path);
    const client = new QmpClient(socket);
    let timer: NodeJS.Timeout | undefined;
    try {
      await new Promise<void>((resolve, reject) => {
        timer = setTimeout(
          () => reject(unavailable(`qmp: no greeting on ${path} within ${timeoutMs} ms`)),
          timeoutMs,
        );
        socket.once('error', (err) => reject(unavailable(`qmp: ${path}: ${err.message}`)));
        socket.once('close', () => reject(unavailable(`qmp: ${path} closed before its greeting`)));
        client.#greeting = (g) => {
          if (g.QMP && typeof g.QMP === 'object') resolve();
          else reject(unavailable(`qmp: ${path} sent no QMP greeting`));
        };
      });
      await client.execute('qmp_capabilities', undefined, { timeoutMs });
      return client;
    } catch (err) {
      client.close();
      throw err;
    } finally {
      clearTimeout(timer);
    }
  }

  get closed(): boolean {
    return this.#closedError !== undefined;
  }

  /** Runs a command; resolves with its `return` value. */
  execute<T = unknown>(
    command: string,
    args?: Record<string, unknown>,
    options: QmpExecuteOptions = {},
  ): Promise<T> {
    if (this.#closedError) return Promise.reject(this.#closedError);
    const id = String(this.#nextId++);
    const timeoutMs = options.timeoutMs ?? DEFAULT_COMMAND_MS;
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#pending.delete(id);
        reject(
          new DsecError('deadline_exceeded', `qmp: ${command} got no answer in ${timeoutMs} ms`),
        );
      }, timeoutMs);
      this.#pending.set(id, { resolve: resolve as (v: unknown) => void, reject, timer });
      this.#socket.write(
        JSON.stringify({ execute: command, ...(args ? { arguments: args } : {}), id }) + '\n',
      );
    });
  }

  /** Calls `listener` for every event from now on; returns how to stop. */
  onEvent(listener: (e: QmpEvent) => void): () => void {
    this.#listeners.add(listener);
    return () => this.#listeners.delete(listener);
  }

  /**
   * The first event named `name` (for which `match` holds) from now on.
   * Subscribe before the command that causes it, or it may be missed.
   */
  waitEvent(
    name: string,
    timeoutMs: number,
    match: (e: QmpEvent) => boolean = () => true,
  ): Promise<QmpEvent> {
    return new Promise((resolve, reject) => {
      const done = (err: Error | undefined, e?: QmpEvent) => {
        clearTimeout(timer);
        off();
        this.#closeWaiters.delete(onClose);
        if (err) reject(err);
        else resolve(e!);
      };
      const timer = setTimeout(
        () => done(new DsecError('deadline_exceeded', `qmp: no ${name} event in ${timeoutMs} ms`)),
        timeoutMs,
      );
      const off = this.onEvent((e) => {
        if (e.event === name && match(e)) done(undefined, e);
      });
      const onClose = () => done(this.#closedError ?? unavailable('qmp: connection closed'));
      this.#closeWaiters.add(onClose);
      if (this.#closedError) done(this.#closedError);
    });
  }

  close(): void {
    this.#fail(unavailable('qmp: connection closed'));
    this.#socket.destroy();
  }

  #onData(chunk: string): void {
    this.#buffer += chunk;
    if (this.#buffer.length > MAX_LINE_BYTES) {
      this.#fail(unavailable('qmp: oversized message'));
      this.#socket.destroy();
      return;
    }
    let nl: number;
    while ((nl = this.#buffer.indexOf('\n')) >= 0) {
      const line = this.#buffer.slice(0, nl).trim();
      this.#buffer = this.#buffer.slice(nl + 1);
      if (line) this.#onMessage(line);
    }
  }

  #onMessage(line: string): void {
    let msg: Record<string, unknown>;
    try {
      msg = JSON.parse(line) as Record<string, unknown>;
    } catch {
      this.#fail(unavailable(`qmp: malformed message: ${line.slice(0, 200)}`));
      this.#socket.destroy();
      return;
    }
    if (this.#greeting) {
      const g = this.#greeting;
      this.#greeting = undefined;
      g(msg);
      return;
    }
    if (typeof msg.event === 'string') {
      const e: QmpEvent = {
        event: msg.event,
        data: msg.data as Record<string, unknown> | undefined,
      };
      for (const l of [...this.#listeners]) l(e);
      return;
    }
    const id = typeof msg.id === 'string' ? msg.id : undefined;
    const p = id !== undefined ? this.#pending.get(id) : undefined;
    if (!p || id === undefined) return; // an answer after its deadline
    this.#pending.delete(id);
    clearTimeout(p.timer);
    if ('error' in msg) {
      const e = msg.error as { class?: string; desc?: string };
      p.reject(
        new DsecError('unavailable', `qmp: ${e.desc ?? 'error'}`, {
          details: { qmpClass: e.class ?? 'GenericError' },
        }),
      );
    } else p.resolve(msg.return);
  }

  #fail(err: Error): void {
    if (this.#closedError) return;
    this.#closedError = err;
    for (const [id, p] of this.#pending) {
      clearTimeout(p.timer);
      this.#pending.delete(id);
      p.reject(err);
    }
    for (const w of [...this.#closeWaiters]) w();
  }
}

function unavailable(message: string): DsecError {
  return new DsecError('unavailable', message);
}
