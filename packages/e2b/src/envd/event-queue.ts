/**
 * Turns callback output (a command's stdout, a terminal, a watcher) into the
 * async iterable a Connect server stream yields, with a bound: a client that
 * stops reading must not grow the apiserver's memory, so past `maxBytes`
 * queued the queue fails with `overflow()`'s error and `onOverflow` fires
 * (the producer stops there).
 */
export class EventQueue<T> implements AsyncIterable<T> {
  readonly #items: { item: T; bytes: number }[] = [];
  #bytes = 0;
  #done = false;
  #error: unknown = undefined;
  #wake: (() => void) | undefined;
  #lastPushAt = Date.now();

  constructor(
    readonly maxBytes: number,
    readonly overflow: () => unknown,
    readonly onOverflow?: () => void,
  ) {}

  get idleMs(): number {
    return Date.now() - this.#lastPushAt;
  }

  push(item: T, bytes = 0): void {
    if (this.#done) return;
    if (this.#bytes + bytes > this.maxBytes) {
      this.end(this.overflow());
      this.onOverflow?.();
      return;
    }
    this.#items.push({ item, bytes });
    this.#bytes += bytes;
    this.#lastPushAt = Date.now();
    this.#signal();
  }

  /** Ends the stream after what is queued; with an error, the reader gets it after the queued items. */
  end(error?: unknown): void {
    if (this.#done) return;
    this.#done = true;
    this.#error = error;
    this.#signal();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<T> {
    for (;;) {
      const next = this.#items.shift();
      if (next) {
        this.#bytes -= next.bytes;
        yield next.item;
        continue;
      }
      if (this.#done) {
        // eslint-disable-next-line @typescript-eslint/only-throw-error -- whatever the producer ended with (ConnectErrors here)
        if (this.#error !== undefined) throw this.#error;
        return;
      }
      await new Promise<void>((resolve) => (this.#wake = resolve));
    }
  }

  #signal(): void {
    const wake = this.#wake;
    this.#wake = undefined;
    wake?.();
  }
}

/**
 * Interval of keepalive events a stream sends while quiet, from the SDKs'
 * `Keepalive-Ping-Interval` header (seconds); default 50 s, as envd's.
 */
export function keepaliveMs(header: string | null): number {
  const s = header === null ? NaN : Number(header);
  return Number.isInteger(s) && s >= 1 && s <= 3600 ? s * 1000 : 50_000;
}
