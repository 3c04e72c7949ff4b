import { DsecError } from '@dsec/core';
import { FRAME_MAC_BYTES } from './auth.js';
import type { FrameMac } from './auth.js';

/**
 * The framing of the edge protocol's streams: `u8 type | u32be length |
 * payload | 32-byte MAC`, the public API's terminal layout plus the MAC of
 * `FrameMac` (auth.ts). Command streams, terminals and ports use their own
 * type numbers (docs/edge-protocol.md).
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

/** Port stream, both ways: bytes, and the end of that side's bytes (a half-close). */
export const PORT_DATA = 0;
export const PORT_END = 1;

/**
 * A streamed request body (stdin, an upload), client → server, sent as the
 * body of its request: bytes, then the end. Each frame is checked before its
 * bytes go on, so none the client did not send reaches a command or a file,
 * and only a checked END ends the body (a cut is not an EOF).
 */
export const BODY_DATA = 0;
export const BODY_END = 1;

export const PTY_UPGRADE = 'dsec-edge-pty';
export const PORT_UPGRADE = 'dsec-edge-port';

/** Largest terminal frame accepted (a keystroke burst or a screenful is far less). */
export const MAX_PTY_FRAME_BYTES = 1 << 20;
/** Largest port frame accepted; senders cut their bytes into frames of `PORT_FRAME_BYTES`. */
export const MAX_PORT_FRAME_BYTES = 1 << 20;
export const PORT_FRAME_BYTES = 64 * 1024;
/** Largest request body frame accepted; senders cut their bytes into frames of `BODY_FRAME_BYTES`. */
export const MAX_BODY_FRAME_BYTES = 1 << 20;
export const BODY_FRAME_BYTES = 64 * 1024;
/** Largest command frame accepted: a result carries both streams' kept output. */
export const MAX_COMMAND_FRAME_BYTES = 256 << 20;

/** One frame with the next MAC of its direction. */
export function frame(mac: FrameMac, type: number, payload: Buffer): Buffer {
  const out = Buffer.allocUnsafe(5 + payload.length + FRAME_MAC_BYTES);
  out.writeUInt8(type, 0);
  out.writeUInt32BE(payload.length, 1);
  payload.copy(out, 5);
  mac.next(type, payload).copy(out, 5 + payload.length);
  return out;
}

/** Thrown by `FrameReader` on a frame whose MAC is wrong (the stream must be dropped). */
export class FrameMacError extends Error {
  constructor() {
    super('a stream frame failed its MAC');
    this.name = 'FrameMacError';
  }
}

/**
 * Splits a byte stream into frames and checks each one's MAC before
 * handing it on; throws `FrameMacError` at the first frame that fails (none
 * after it is read) and `invalid_argument` on a frame over the limit.
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
  #failed = false;

  constructor(
    readonly maxFrameBytes: number,
    readonly mac: FrameMac,
    readonly onFrame: (type: number, payload: Buffer) => void,
  ) {}

  push(chunk: Buffer): void {
    if (this.#failed) throw new FrameMacError();
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
      const end = 5 + len + FRAME_MAC_BYTES;
      if (this.#bytes < end) break;
      const all = this.#pieces.length === 1 ? head : Buffer.concat(this.#pieces, this.#bytes);
      const rest = all.subarray(end);
      this.#pieces = rest.length > 0 ? [rest] : [];
      this.#bytes = rest.length;
      const type = all.readUInt8(0);
      const payload = all.subarray(5, 5 + len);
      if (!this.mac.check(type, payload, all.subarray(5 + len, end))) {
        this.#failed = true;
        this.#pieces = [];
        this.#bytes = 0;
        throw new FrameMacError();
      }
      this.onFrame(type, payload);
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
