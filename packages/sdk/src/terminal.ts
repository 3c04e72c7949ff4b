import type { Duplex } from 'node:stream';
import type { HttpTransport } from './transport.js';

const DATA = 0;
const RESIZE = 1;
const EOF = 2;
const EXIT = 3;

export interface TerminalOptions {
  rows?: number | undefined;
  cols?: number | undefined;
  /** The sandbox's own shell (`/bin/bash`); default the platform's `sh`. */
  shell?: string | undefined;
  user?: string | undefined;
  /** `TERM` inside (default xterm-256color). */
  term?: string | undefined;
  signal?: AbortSignal | undefined;
  timeoutMs?: number | undefined;
}

/**
 * An interactive shell on a pty in the sandbox (`dsec sandbox shell`): raw
 * bytes both ways plus window-size changes, over an HTTP upgrade
 * (`Upgrade: dsec-pty`, frames `u8 type | u32be length | payload`).
 */
export class Terminal {
  /** Resolves with the shell's exit code when it ends (or -1 if the connection dropped). */
  readonly exited: Promise<number>;
  readonly #socket: Duplex;

  /** @internal */
  constructor(socket: Duplex, onData: (chunk: Buffer) => void) {
    this.#socket = socket;
    let buf: Buffer = Buffer.alloc(0);
    let code = -1;
    this.exited = new Promise((resolve) => {
      socket.on('data', (chunk: Buffer) => {
        buf = buf.length ? Buffer.concat([buf, chunk]) : chunk;
        while (buf.length >= 5) {
          const len = buf.readUInt32BE(1);
          if (buf.length < 5 + len) break;
          const type = buf.readUInt8(0);
          const payload = buf.subarray(5, 5 + len);
          if (type === DATA) onData(payload);
          else if (type === EXIT && payload.length >= 4) code = payload.readInt32BE(0);
          buf = buf.subarray(5 + len);
        }
      });
      socket.on('close', () => resolve(code));
      socket.on('error', () => undefined);
    });
  }

  write(data: string | Buffer): void {
    this.#send(DATA, typeof data === 'string' ? Buffer.from(data) : data);
  }

  resize(rows: number, cols: number): void {
    const p = Buffer.alloc(4);
    p.writeUInt16BE(rows & 0xffff, 0);
    p.writeUInt16BE(cols & 0xffff, 2);
    this.#send(RESIZE, p);
  }

  /** Sends end-of-input (^D). */
  end(): void {
    this.#send(EOF, Buffer.alloc(0));
  }

  close(): void {
    this.#socket.destroy();
  }

  #send(type: number, payload: Buffer): void {
    const h = Buffer.alloc(5);
    h.writeUInt8(type, 0);
    h.writeUInt32BE(payload.length, 1);
    this.#socket.write(Buffer.concat([h, payload]));
  }
}

export async function openTerminal(
  http: HttpTransport,
  sandboxId: string,
  onData: (chunk: Buffer) => void,
  options: TerminalOptions = {},
): Promise<Terminal> {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries({
    rows: options.rows,
    cols: options.cols,
    shell: options.shell,
    user: options.user,
    term: options.term,
  })) {
    if (v !== undefined) q.set(k, String(v));
  }
  const socket = await http.upgrade(
    `/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty?${q.toString()}`,
    'dsec-pty',
    { signal: options.signal, timeoutMs: options.timeoutMs ?? 30_000 },
  );
  return new Terminal(socket, onData);
}
