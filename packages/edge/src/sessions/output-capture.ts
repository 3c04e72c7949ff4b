/**
 * Bounded capture of one output stream (paper 6.4: an agent's `yes` once
 * filled tens of gigabytes). Keeps the first half of the cap and a ring of the
 * last half; everything between is counted and dropped, so memory never grows
 * past `capBytes` however long the command writes.
 */
export class OutputCapture {
  readonly #headCap: number;
  readonly #tailCap: number;
  #head: Buffer[] = [];
  #headBytes = 0;
  #tail: Buffer[] = [];
  #tailBytes = 0;
  #total = 0;

  constructor(capBytes: number) {
    this.#headCap = Math.ceil(capBytes / 2);
    this.#tailCap = capBytes - this.#headCap;
  }

  push(chunk: Buffer): void {
    this.#total += chunk.length;
    if (this.#headBytes < this.#headCap) {
      const take = Math.min(chunk.length, this.#headCap - this.#headBytes);
      this.#head.push(chunk.subarray(0, take));
      this.#headBytes += take;
      chunk = chunk.subarray(take);
    }
    if (chunk.length === 0 || this.#tailCap === 0) return;
    if (chunk.length >= this.#tailCap) {
      // Copy so a huge chunk's backing memory is not kept alive.
      this.#tail = [Buffer.from(chunk.subarray(chunk.length - this.#tailCap))];
      this.#tailBytes = this.#tailCap;
      return;
    }
    this.#tail.push(chunk);
    this.#tailBytes += chunk.length;
    while (this.#tailBytes > this.#tailCap) {
      const first = this.#tail[0]!;
      const excess = this.#tailBytes - this.#tailCap;
      if (first.length <= excess) {
        this.#tail.shift();
        this.#tailBytes -= first.length;
      } else {
        this.#tail[0] = first.subarray(excess);
        this.#tailBytes -= excess;
      }
    }
  }

  get totalBytes(): number {
    return this.#total;
  }

  get truncated(): boolean {
    return this.#total > this.#headBytes + this.#tailBytes;
  }

  /** The kept bytes: the head, then the tail (adjacent when nothing was dropped). */
  bytes(): Buffer {
    return Buffer.concat([...this.#head, ...this.#tail]);
  }
}
