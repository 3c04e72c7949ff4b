/**
 * Coalesces concurrent requests into batches that run one at a time: a
 * request that arrives while a batch runs joins the next batch, so a burst of
 * N requests costs a few batches instead of N serialized (or N contending)
 * runs. Each request gets its own outcome: `run` returns one settled result
 * per item, in order, so one bad item fails alone.
 */
export class MicroBatcher<I, O> {
  readonly #run: (items: I[]) => Promise<PromiseSettledResult<O>[]>;
  readonly #maxItems: number;
  #queue: { item: I; resolve: (o: O) => void; reject: (e: unknown) => void }[] = [];
  #running = false;
  #idle: Promise<void> = Promise.resolve();
  #wakeIdle: (() => void) | undefined;

  constructor(
    run: (items: I[]) => Promise<PromiseSettledResult<O>[]>,
    options: { maxItems?: number } = {},
  ) {
    this.#run = run;
    this.#maxItems = options.maxItems ?? 512;
  }

  submit(item: I): Promise<O> {
    return new Promise<O>((resolve, reject) => {
      this.#queue.push({ item, resolve, reject });
      if (!this.#running) void this.#drain();
    });
  }

  /** Resolves once every request submitted so far has its outcome. */
  idle(): Promise<void> {
    return this.#idle;
  }

  async #drain(): Promise<void> {
    this.#running = true;
    this.#idle = new Promise((resolve) => (this.#wakeIdle = resolve));
    // Let the requests of this tick (one burst of callers) join the first batch.
    await Promise.resolve();
    while (this.#queue.length > 0) {
      const batch = this.#queue.splice(0, this.#maxItems);
      let results: PromiseSettledResult<O>[];
      try {
        results = await this.#run(batch.map((b) => b.item));
      } catch (err) {
        results = batch.map(() => ({ status: 'rejected', reason: err }));
      }
      batch.forEach((b, i) => {
        const r = results[i];
        if (r?.status === 'fulfilled') b.resolve(r.value);
        else b.reject(r ? r.reason : new Error('batch returned no result'));
      });
    }
    this.#running = false;
    this.#wakeIdle?.();
  }
}

/**
 * Runs items as one unit; when the unit fails, splits it in halves and
 * retries each, so a failing item is isolated in O(log n) extra runs while
 * the others still succeed. For transactions that are all-or-nothing (an
 * `nft -f` script) and idempotent (each retry starts from a clean slate).
 */
export async function bisect<I>(
  items: I[],
  runAll: (items: I[]) => Promise<void>,
): Promise<PromiseSettledResult<void>[]> {
  try {
    await runAll(items);
    return items.map(() => ({ status: 'fulfilled', value: undefined }));
  } catch (err) {
    if (items.length === 1) return [{ status: 'rejected', reason: err }];
    const mid = Math.ceil(items.length / 2);
    return [
      ...(await bisect(items.slice(0, mid), runAll)),
      ...(await bisect(items.slice(mid), runAll)),
    ];
  }
}
