/**
 * Failed authentications per source (a client address): a token bucket per
 * source holding `burst` failures, refilled at `perSecond`. A source whose
 * bucket is empty is refused before its key is looked up (`rate_limited`),
 * so a flood of bogus keys costs one map lookup per request, not a database
 * query. Only failures take tokens; the refusals themselves take none, so
 * a client that waits `waitMs` gets a try.
 *
 * Memory: at most `maxSources` buckets (default 10 000, ~100 bytes each);
 * past it the least recently charged goes. A source dropped that way starts
 * over with a full bucket, so an attacker with more addresses than that gets
 * `burst` failures per address it cycles through: the cost stays a bounded
 * number of lookups per address, and is counted.
 */
export class AuthFailureLimiter {
  readonly #burst: number;
  readonly #perMs: number;
  readonly #maxSources: number;
  /** Source → tokens left at `atMs`; Map order is least recently charged first. */
  readonly #buckets = new Map<string, { tokens: number; atMs: number }>();

  constructor(options: { burst: number; perSecond: number; maxSources?: number }) {
    this.#burst = Math.max(1, options.burst);
    this.#perMs = Math.max(0, options.perSecond) / 1000;
    this.#maxSources = Math.max(1, options.maxSources ?? 10_000);
  }

  /** How long `source` must wait before its next failure is allowed; 0: now. */
  waitMs(source: string, nowMs: number): number {
    const tokens = this.#tokens(source, nowMs);
    if (tokens >= 1) return 0;
    return this.#perMs > 0 ? Math.ceil((1 - tokens) / this.#perMs) : Number.POSITIVE_INFINITY;
  }

  /** Takes one token from `source` for a failure. */
  charge(source: string, nowMs: number): void {
    const tokens = this.#tokens(source, nowMs);
    this.#buckets.delete(source);
    this.#buckets.set(source, { tokens: Math.max(0, tokens - 1), atMs: nowMs });
    if (this.#buckets.size > this.#maxSources) {
      const oldest = this.#buckets.keys().next();
      if (!oldest.done) this.#buckets.delete(oldest.value);
    }
  }

  #tokens(source: string, nowMs: number): number {
    const b = this.#buckets.get(source);
    if (!b) return this.#burst;
    return Math.min(this.#burst, b.tokens + Math.max(0, nowMs - b.atMs) * this.#perMs);
  }
}
