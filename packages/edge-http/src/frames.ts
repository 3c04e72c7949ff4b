import { DsecError } from '@dsec/core';

/**
 * The framing of the edge protocol's streams: `u8 type | u32be length |
 * payload`, the same layout as the public API's terminal stream. Command
 * streams and terminals use their own type numbers (docs/edge-protocol.md).
 */

/** Content type of a command stream (`application/vnd.dsec.edge-frames`). */
export const FRAMES_CONTENT_TYPE = 'application/vnd.dsec.edge-frames';

/** Command stream, server → client. */
export const CMD_STDOUT = 0;
export const CMD_STDERR = 1;
/** JSON `CommandResult` (or `SessionResult`); the last frame. */
export const CMD_RESULT = 2;
/** JSON `{ error: { code, message, field?, details? } }`; the last frame. */
export const CMD_ERROR = 3;

/** Terminal stream: DATA both ways; RESIZE, EOF, KILL client → server; EXIT server → client. */
export const PTY_DATA = 0;
export const PTY_RESIZE = 1;
export const PTY_EOF = 2;
/** `i32be exit code`, then the signal name in UTF-8 when the shell died of one. */
export const PTY_EXIT = 3;
export const PTY_KILL = 4;

export const PTY_UPGRADE = 'dsec-edge-pty';
export const PORT_UPGRADE = 'dsec-edge-port';

/** Largest terminal frame accepted (a keystroke burst or a screenful is far less). */
export const MAX_PTY_FRAME_BYTES = 1 << 20;
/** Largest command frame accepted: a result carries both streams' kept output. */
export const MAX_COMMAND_FRAME_BYTES = 256 << 20;

export function frame(type: number, payload: Buffer): Buffer {
  const out = Buffer.allocUnsafe(5 + payload.length);
  out.writeUInt8(type, 0);
  out.writeUInt32BE(payload.length, 1);
  payload.copy(out, 5);
  return out;
}

/**
 * Splits a byte stream into frames; throws `invalid_argument` on a frame over the limit.
 *
 * Pieces are kept as they come and joined once, when the frame they make is
 * whole: joining on every piece copied all gathered so far each time, n²/2
 * pieces' worth for a frame of n, and a frame's pieces are socket reads of
 * at most 64 KiB (a 32 MiB command result took 43 s of the reader's event
 * loop). Now each byte is copied at most three times: when its frame is
 * joined, and, for the few bytes of a next frame that came in the same
 * piece, once more with that frame and once with its split header.
 */
export class FrameReader {
  /** Unconsumed pieces, oldest first; together `#bytes` long. */
  #pieces: Buffer[] = [];
  #bytes = 0;

  constructor(
    readonly maxFrameBytes: number,
    readonly onFrame: (type: number, payload: Buffer) => void,
  ) {}

  push(chunk: Buffer): void {
    if (chunk.length === 0) return;
    this.#pieces.push(chunk);
    this.#bytes += chunk.length;
    while (this.#bytes >= 5) {
      // A header split across pieces: join them once (this frame's first piece is then whole).
      if (this.#pieces[0]!.length < 5) this.#pieces = [Buffer.concat(this.#pieces, this.#bytes)];
      const head = this.#pieces[0]!;
      const len = head.readUInt32BE(1);
      if (len > this.maxFrameBytes) {
        throw new DsecError('invalid_argument', `stream frame of ${len} bytes is too large`);
      }
      if (this.#bytes < 5 + len) break;
      const all = this.#pieces.length === 1 ? head : Buffer.concat(this.#pieces, this.#bytes);
      const rest = all.subarray(5 + len);
      this.#pieces = rest.length > 0 ? [rest] : [];
      this.#bytes = rest.length;
      this.onFrame(all.readUInt8(0), all.subarray(5, 5 + len));
    }
  }

  /** Bytes of an unfinished frame (non-zero when a stream ends mid-frame). */
  get pending(): number {
    return this.#bytes;
  }
}

export function exitPayload(exitCode: number, signal: string | undefined): Buffer {
  const code = Buffer.alloc(4);
  code.writeInt32BE(exitCode, 0);
  return signal ? Buffer.concat([code, Buffer.from(signal)]) : code;
}

export function parseExit(payload: Buffer): { exitCode: number; signal?: string | undefined } {
  if (payload.length < 4) return { exitCode: 255, signal: undefined };
  const signal = payload.length > 4 ? payload.subarray(4).toString('utf8') : undefined;
  return { exitCode: payload.readInt32BE(0), signal };
}
