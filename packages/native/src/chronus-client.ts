/**
 * Client of a sandbox's chronus command daemon (the protocol: packages/native/PROTOCOL.md).
 *
 * Wire format, both directions: `u32le len | u8 type | u32le stream | payload`
 * where len counts the bytes after itself (so payload = len − 5, at most 1 MiB).
 * Each SPAWN gets exactly one STARTED or SPAWN_ERROR, and after STARTED
 * exactly one EXIT, sent once the command's output is drained.
 *
 * @example
 * ```ts
 * const conn = await ChronusConnection.connect('/run/dsec/sb1.sock');
 * const cmd = conn.spawn({ argv: ['cat'], stdin: true });
 * cmd.onStdout((chunk) => console.log(chunk.toString()));
 * cmd.write('hello\n');
 * cmd.endStdin();
 * const { exitCode } = await cmd.exited; // 0
 * conn.close();
 * ```
 */
import { randomInt } from 'node:crypto';
import { createConnection } from 'node:net';
import type { Socket } from 'node:net';
import { constants as osConstants } from 'node:os';

import { DsecError } from '@dsec/core';

const T_SPAWN = 0x01;
const T_STDIN = 0x02;
const T_STDIN_EOF = 0x03;
const T_SIGNAL = 0x04;
const T_KILL_TREE = 0x05;
const T_RESIZE = 0x06;
const T_STARTED = 0x81;
const T_SPAWN_ERROR = 0x82;
const T_STDOUT = 0x83;
const T_STDERR = 0x84;
const T_EXIT = 0x85;

const F_SHELL = 1;
const F_STDIN = 2;
const F_PTY = 4;
const F_DETACHED = 8;

const HEADER = 9;
const MAX_PAYLOAD = 1 << 20;

export interface SpawnRequest {
  argv: string[];
  /** Run argv with the platform's sealed shell (busybox); argv[0] names the applet, e.g. `sh`. */
  shell?: boolean;
  env?: string[] | Record<string, string>;
  /** '' or absent: the user's home directory, or `/`. */
  cwd?: string;
  /** User name or number, resolved with the sandbox's /etc/passwd; overrides uid/gid. */
  user?: string;
  uid?: number;
  gid?: number;
  /** Feed stdin with write()/endStdin(); otherwise stdin is empty. */
  stdin?: boolean;
  /** Run on a new pty (output arrives as stdout only). */
  pty?: { rows: number; cols: number };
  /** Keep running when the connection closes (its output is then discarded). */
  detached?: boolean;
}

export interface CommandExit {
  /** Raw wait(2) status from the kernel. */
  waitStatus: number;
  exitCode: number | null;
  /** Signal name (e.g. `SIGKILL`) when the command was killed by a signal. */
  signal: string | null;
  userUsec: number;
  sysUsec: number;
  maxRssKib: number;
}

/** An Error for a failed spawn (errno from the daemon) or a dropped connection (code ECONNRESET). */
export interface ChronusError extends Error {
  errno?: number;
  code?: string;
}

const signalNames = new Map<number, string>(
  Object.entries(osConstants.signals).map(([name, num]) => [num, name] as [number, string]),
);

function errnoName(errno: number): string {
  for (const [name, value] of Object.entries(osConstants.errno)) if (value === errno) return name;
  return `errno ${errno}`;
}

export function decodeWaitStatus(status: number): Pick<CommandExit, 'exitCode' | 'signal'> {
  const sig = status & 0x7f;
  if (sig === 0) return { exitCode: (status >> 8) & 0xff, signal: null };
  return { exitCode: null, signal: signalNames.get(sig) ?? `SIG${sig}` };
}

function frame(type: number, stream: number, payload?: Buffer): Buffer {
  const len = payload?.length ?? 0;
  const header = Buffer.allocUnsafe(HEADER);
  header.writeUInt32LE(len + 5, 0);
  header.writeUInt8(type, 4);
  header.writeUInt32LE(stream, 5);
  return len ? Buffer.concat([header, payload as Buffer]) : header;
}

function cString(s: string, what: string): Buffer {
  if (s.includes('\0'))
    throw new DsecError('invalid_argument', `${what} contains a NUL byte`, { field: what });
  return Buffer.from(`${s}\0`, 'utf8');
}

function u32(n: number | undefined, what: string): number {
  const v = n ?? 0;
  if (!Number.isInteger(v) || v < 0 || v > 0xffffffff) {
    throw new DsecError('invalid_argument', `${what} must be a 32-bit unsigned integer`, {
      field: what,
    });
  }
  return v;
}

function encodeSpawn(req: SpawnRequest): Buffer {
  if (req.argv.length === 0)
    throw new DsecError('invalid_argument', 'argv must not be empty', { field: 'argv' });
  const env = Array.isArray(req.env)
    ? req.env
    : Object.entries(req.env ?? {}).map(([k, v]) => `${k}=${v}`);
  const flags =
    (req.shell ? F_SHELL : 0) |
    (req.stdin ? F_STDIN : 0) |
    (req.pty ? F_PTY : 0) |
    (req.detached ? F_DETACHED : 0);
  const head = Buffer.alloc(24);
  head.writeUInt32LE(flags, 0);
  head.writeUInt32LE(u32(req.uid, 'uid'), 4);
  head.writeUInt32LE(u32(req.gid, 'gid'), 8);
  head.writeUInt16LE((req.pty?.rows ?? 0) & 0xffff, 12);
  head.writeUInt16LE((req.pty?.cols ?? 0) & 0xffff, 14);
  head.writeUInt32LE(req.argv.length, 16);
  head.writeUInt32LE(env.length, 20);
  const parts = [
    head,
    cString(req.cwd ?? '', 'cwd'),
    cString(req.user ?? '', 'user'),
    ...req.argv.map((a, i) => cString(a, `argv.${i}`)),
    ...env.map((e, i) => cString(e, `env.${i}`)),
  ];
  const payload = Buffer.concat(parts);
  if (payload.length > MAX_PAYLOAD)
    throw new DsecError('payload_too_large', 'spawn request exceeds 1 MiB');
  return payload;
}

function deferred<T>(): {
  promise: Promise<T>;
  resolve: (v: T) => void;
  reject: (e: Error) => void;
} {
  let resolve!: (v: T) => void;
  let reject!: (e: Error) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  promise.catch(() => undefined); // callers may await only one of started/exited
  return { promise, resolve, reject };
}

type Listener = (chunk: Buffer) => void;

export interface PidsLimitEvent {
  refused: boolean;
  reclaimedProcesses: number;
  reclaimedGroups: number;
}

export interface CommandStarted {
  pid: number;
  reclaimedProcesses: number;
  reclaimedGroups: number;
}

/** One command started over a {@link ChronusConnection}. Register output callbacks before awaiting. */
export class CommandHandle {
  /**
   * The command's pid, and how many processes (in how many groups) the daemon
   * killed to make room when the fork met the sandbox's pids limit (usually 0).
   */
  readonly started: Promise<CommandStarted>;
  readonly exited: Promise<CommandExit>;
  private readonly startedD = deferred<CommandStarted>();
  private readonly exitedD = deferred<CommandExit>();
  private readonly stdoutListeners: Listener[] = [];
  private readonly stderrListeners: Listener[] = [];
  private done = false;

  /** @internal created by ChronusConnection.spawn */
  constructor(
    private readonly conn: ChronusConnection,
    readonly stream: number,
  ) {
    this.started = this.startedD.promise;
    this.exited = this.exitedD.promise;
  }

  /** Output chunks in order; chunks that arrive while no callback is registered are dropped. */
  onStdout(cb: Listener): this {
    this.stdoutListeners.push(cb);
    return this;
  }

  onStderr(cb: Listener): this {
    this.stderrListeners.push(cb);
    return this;
  }

  /** Returns false when the connection's send buffer is full: wait for `conn.drained()`. */
  write(data: Buffer | string): boolean {
    const buf = typeof data === 'string' ? Buffer.from(data, 'utf8') : data;
    let ok = true;
    for (let off = 0; off < buf.length; off += MAX_PAYLOAD) {
      if (!this.conn.send(frame(T_STDIN, this.stream, buf.subarray(off, off + MAX_PAYLOAD))))
        ok = false;
    }
    return ok;
  }

  endStdin(): void {
    this.conn.send(frame(T_STDIN_EOF, this.stream));
  }

  /** Signals the command's process group. */
  signal(sig: NodeJS.Signals | number): void {
    const num = typeof sig === 'number' ? sig : osConstants.signals[sig];
    if (num === undefined) throw new DsecError('invalid_argument', `unknown signal ${String(sig)}`);
    const p = Buffer.alloc(4);
    p.writeUInt32LE(num, 0);
    this.conn.send(frame(T_SIGNAL, this.stream, p));
  }

  /** SIGKILLs the command and every descendant, including ones that left its process group. */
  killTree(): void {
    this.conn.send(frame(T_KILL_TREE, this.stream));
  }

  resize(rows: number, cols: number): void {
    const p = Buffer.alloc(4);
    p.writeUInt16LE(rows & 0xffff, 0);
    p.writeUInt16LE(cols & 0xffff, 2);
    this.conn.send(frame(T_RESIZE, this.stream, p));
  }

  /** @internal */
  handle(type: number, payload: Buffer): boolean {
    switch (type) {
      case T_STARTED: {
        // Older daemons send the pid alone; newer ones add what reclaiming at the pids limit took.
        const started = {
          pid: payload.readUInt32LE(0),
          reclaimedProcesses: payload.length >= 12 ? payload.readUInt32LE(4) : 0,
          reclaimedGroups: payload.length >= 12 ? payload.readUInt32LE(8) : 0,
        };
        if (started.reclaimedProcesses > 0) this.conn.onPidsLimit?.({ refused: false, ...started });
        this.startedD.resolve(started);
        return false;
      }
      case T_SPAWN_ERROR: {
        const errno = payload.readInt32LE(0);
        const err: ChronusError = new Error(
          `spawn failed: ${payload.subarray(4).toString('utf8')} (${errnoName(errno)})`,
        );
        err.errno = errno;
        err.code = errnoName(errno);
        // EAGAIN from fork: the sandbox's pids limit, even after the daemon reclaimed what it could.
        if (err.code === 'EAGAIN')
          this.conn.onPidsLimit?.({ refused: true, reclaimedProcesses: 0, reclaimedGroups: 0 });
        this.fail(err);
        return true;
      }
      case T_STDOUT:
        for (const cb of this.stdoutListeners) cb(payload);
        return false;
      case T_STDERR:
        for (const cb of this.stderrListeners) cb(payload);
        return false;
      case T_EXIT: {
        const waitStatus = payload.readInt32LE(0);
        this.done = true;
        this.exitedD.resolve({
          waitStatus,
          ...decodeWaitStatus(waitStatus),
          userUsec: Number(payload.readBigUInt64LE(4)),
          sysUsec: Number(payload.readBigUInt64LE(12)),
          maxRssKib: Number(payload.readBigUInt64LE(20)),
        });
        return true;
      }
      default:
        return false;
    }
  }

  /** @internal */
  fail(err: Error): void {
    if (this.done) return;
    this.done = true;
    this.startedD.reject(err);
    this.exitedD.reject(err);
  }
}

/** One connection to a sandbox's chronus socket; any number of commands run over it at once. */
export class ChronusConnection {
  /**
   * Told when a spawn met the sandbox's pids limit: the daemon reclaimed
   * processes to start it, or (`refused`) could not free one. Set by the owner.
   */
  onPidsLimit: ((event: PidsLimitEvent) => void) | undefined;
  private readonly handles = new Map<number, CommandHandle>();
  /**
   * Stream ids start at a random point: a microVM restored from a saved
   * state can keep its old connection's commands (virtio-serial shows the
   * guest no hang-up), and a new connection counting from 1 again met
   * `stream id already in use` for ids those still held.
   */
  private nextStream = 1 + randomInt(0x7fff_ffff);
  private closedError: ChronusError | null = null;
  /** Unparsed bytes; `parts` collects chunks until the frame at the head is complete. */
  private head: Buffer = Buffer.alloc(0);
  private parts: Buffer[] = [];
  private partsLen = 0;
  private need = 0;

  private constructor(private readonly socket: Socket) {
    socket.on('data', (chunk: Buffer) => this.onData(chunk));
    socket.on('error', () => undefined); // 'close' follows and fails the handles
    socket.on('close', () => this.drop('connection to chronus closed'));
  }

  static connect(socketPath: string, signal?: AbortSignal): Promise<ChronusConnection> {
    return new Promise((resolve, reject) => {
      if (signal?.aborted) {
        reject(new DsecError('aborted', 'connect aborted', { cause: signal.reason }));
        return;
      }
      const socket = createConnection({ path: socketPath });
      const onAbort = (): void => {
        socket.destroy();
        reject(new DsecError('aborted', 'connect aborted', { cause: signal?.reason }));
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      socket.once('error', (err) => {
        signal?.removeEventListener('abort', onAbort);
        reject(
          new DsecError(
            'unavailable',
            `cannot connect to chronus at ${socketPath}: ${err.message}`,
            { cause: err },
          ),
        );
      });
      socket.once('connect', () => {
        signal?.removeEventListener('abort', onAbort);
        socket.removeAllListeners('error');
        resolve(new ChronusConnection(socket));
      });
    });
  }

  spawn(request: SpawnRequest): CommandHandle {
    const payload = encodeSpawn(request);
    const stream = this.nextStream;
    this.nextStream = stream >= 0xffff_ffff ? 1 : stream + 1;
    const handle = new CommandHandle(this, stream);
    if (this.closedError) {
      handle.fail(this.closedError);
      return handle;
    }
    this.handles.set(stream, handle);
    this.send(frame(T_SPAWN, stream, payload));
    return handle;
  }

  /** True once the connection is gone (closed here, or by the daemon). */
  get closed(): boolean {
    return this.closedError !== null;
  }

  /** Closes the connection; the daemon kills the trees of its non-detached commands. */
  close(): void {
    this.socket.destroy();
    this.drop('connection to chronus closed');
  }

  /**
   * Stops reading from the daemon: once its outbound buffer fills, it pauses
   * the output of every command on this connection (back-pressure). Use a
   * connection of its own for a stream that should be throttled by its reader.
   */
  pause(): void {
    this.socket.pause();
  }

  resume(): void {
    this.socket.resume();
  }

  /** Resolves once queued frames went out (at once when none are queued or the connection is gone). */
  drained(): Promise<void> {
    if (this.closedError || !this.socket.writableNeedDrain) return Promise.resolve();
    return new Promise((resolve) => {
      const done = (): void => {
        this.socket.off('drain', done);
        this.socket.off('close', done);
        resolve();
      };
      this.socket.once('drain', done);
      this.socket.once('close', done);
    });
  }

  /** @internal Returns false when the socket's send buffer is full. */
  send(buf: Buffer): boolean {
    if (this.closedError) return true;
    return this.socket.write(buf);
  }

  private drop(message: string): void {
    if (!this.closedError) {
      const err: ChronusError = new Error(message);
      err.code = 'ECONNRESET';
      this.closedError = err;
    }
    for (const h of this.handles.values()) h.fail(this.closedError);
    this.handles.clear();
  }

  private onData(chunk: Buffer): void {
    if (this.need > 0) {
      this.parts.push(chunk);
      this.partsLen += chunk.length;
      if (this.head.length + this.partsLen < this.need) return;
      this.head = Buffer.concat([this.head, ...this.parts], this.head.length + this.partsLen);
      this.parts = [];
      this.partsLen = 0;
    } else {
      this.head = this.head.length ? Buffer.concat([this.head, chunk]) : chunk;
    }
    this.need = 0;
    const buf = this.head;
    let off = 0;
    while (buf.length - off >= HEADER) {
      const len = buf.readUInt32LE(off);
      if (len < 5 || len - 5 > MAX_PAYLOAD) {
        this.socket.destroy();
        this.drop('chronus protocol error: bad frame length');
        return;
      }
      if (buf.length - off < 4 + len) break;
      this.dispatch(
        buf.readUInt8(off + 4),
        buf.readUInt32LE(off + 5),
        buf.subarray(off + HEADER, off + 4 + len),
      );
      off += 4 + len;
    }
    this.head = buf.subarray(off);
    if (this.head.length > 0) {
      this.need = this.head.length >= 4 ? Math.max(HEADER, 4 + this.head.readUInt32LE(0)) : HEADER;
    }
  }

  private dispatch(type: number, stream: number, payload: Buffer): void {
    const handle = this.handles.get(stream);
    if (handle?.handle(type, payload)) this.handles.delete(stream);
  }
}
