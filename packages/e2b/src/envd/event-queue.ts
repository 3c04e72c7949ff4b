import type { StreamBacklog } from './rpc-context.js';

/** The errors queues ended with because their reader fell behind. */
const overflowErrors = new WeakSet<object>();

/** Whether a stream ended because its client did not read it (its connection is then reset). */
export function isQueueOverflow(err: unknown): boolean {
  return typeof err === 'object' && err !== null && overflowErrors.has(err);
}

/**
 * Turns callback output (a command's stdout, a terminal, a watcher) into the
 * async iterable a Connect server stream yields, with a bound: a client that
 * stops reading must not grow the apiserver's memory, so past `maxBytes`
 * queued, or when the apiserver's output budget cuts the stream
 * (`backlog.check()` false), the queue drops what it holds, fails with
 * `overflow()`'s error (`isQueueOverflow`) and `onOverflow` fires (the
 * producer stops there).
 */
export class EventQueue<T> implements AsyncIterable<T> {
  #items: { item: T; bytes: number }[] = [];
  #bytes = 0;
  #done = false;
  #error: unknown = undefined;
  #wake: (() => void) | undefined;
  #lastPushAt = Date.now();

  constructor(
    readonly maxBytes: number,
    readonly overflow: () => unknown,
    readonly onOverflow?: () => void,
    readonly backlog?: StreamBacklog,
  ) {
    if (backlog) backlog.measure = () => this.#bytes;
  }

  get idleMs(): number {
    return Date.now() - this.#lastPushAt;
  }

  /** Bytes queued now. */
  get bytes(): number {
    return this.#bytes;
  }

  push(item: T, bytes = 0): void {
    if (this.#done) return;
    if (this.#bytes + bytes > this.maxBytes) {
      this.#overflowed();
      return;
    }
    this.#items.push({ item, bytes });
    this.#bytes += bytes;
    this.#lastPushAt = Date.now();
    if (this.backlog && !this.backlog.check()) {
      this.#overflowed();
      return;
    }
    this.#signal();
  }

  /** The reader fell behind: nothing queued is kept, and the stream fails at once. */
  #overflowed(): void {
    this.#items = [];
    this.#bytes = 0;
    const error = this.overflow();
    if (typeof error === 'object' && error !== null) overflowErrors.add(error);
    this.end(error);
    this.onOverflow?.();
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
