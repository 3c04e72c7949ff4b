const EMPTY = Buffer.alloc(0);
const RS = 0x1e;

/**
 * Finds the end-of-call marker a session shell prints after each line,
 * `\x1eDSEC:<nonce>:<status>\x1e`, in one output stream. Bytes before it are
 * the command's output; bytes that could be the start of a marker split
 * across chunks are held back until the next chunk shows what they are. The
 * nonce is fresh per call and never shown to the command, so output alone
 * cannot end a call or choose its status (docs/adr/0004-shell-sessions.md).
 */
export class MarkerScanner {
  readonly #prefix: Buffer;
  #held: Buffer = EMPTY;
  #status: number | undefined;

  constructor(nonce: string) {
    this.#prefix = Buffer.from(`\x1eDSEC:${nonce}:`, 'latin1');
  }

  get done(): boolean {
    return this.#status !== undefined;
  }

  get status(): number | undefined {
    return this.#status;
  }

  /** Returns the part of `chunk` that is command output (nothing once the marker was seen). */
  push(chunk: Buffer): Buffer {
    if (this.done) return EMPTY;
    const buf = this.#held.length > 0 ? Buffer.concat([this.#held, chunk]) : chunk;
    this.#held = EMPTY;
    const at = buf.indexOf(this.#prefix);
    if (at >= 0) {
      const from = at + this.#prefix.length;
      const end = buf.indexOf(RS, from);
      if (end < 0) {
        if (buf.length - from > 16) {
          // Not a status after all (cannot happen with our printf); treat as output.
          return buf;
        }
        this.#held = Buffer.from(buf.subarray(at));
        return buf.subarray(0, at);
      }
      const text = buf.subarray(from, end).toString('latin1');
      const status = /^[0-9]{1,5}$/.test(text) ? Number(text) : 255;
      this.#status = status;
      return buf.subarray(0, at);
    }
    const keep = this.#partialAtEnd(buf);
    if (keep > 0) this.#held = Buffer.from(buf.subarray(buf.length - keep));
    return buf.subarray(0, buf.length - keep);
  }

  /** What was held back (the stream ended without a marker). */
  flush(): Buffer {
    const held = this.#held;
    this.#held = EMPTY;
    return held;
  }

  /** Length of the longest tail of `buf` that is a proper prefix of the marker prefix. */
  #partialAtEnd(buf: Buffer): number {
    const p = this.#prefix;
    // The prefix holds one RS, at its start: only the last RS in the window can begin it.
    const windowStart = Math.max(0, buf.length - (p.length - 1));
    const j = buf.lastIndexOf(RS);
    if (j < windowStart) return 0;
    const tail = buf.subarray(j);
    return p.subarray(0, tail.length).equals(tail) ? tail.length : 0;
  }
}
