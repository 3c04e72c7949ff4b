import { DsecError } from '@dsec/core';
import type { FnCallRateLimit } from './types.js';

/** Where the limiter reads a project's limits: `Iam.fncallRateLimits` in production. */
export type FnCallRateLimitSource = (projectId: string) => Promise<FnCallRateLimit[]>;

export interface FnCallRateLimiterOptions {
  /** The limits of a project and its ancestors, nearest first (`iam.fncallRateLimits.bind(iam)`). */
  limits: FnCallRateLimitSource;
  /** Clock in milliseconds, for tests. Default `performance.now` (monotonic: a wall-clock step must not refill buckets). */
  now?: (() => number) | undefined;
  /**
   * How long a project's limits are served from memory before they are read
   * again. Quotas are only set at project creation today, so this only bounds
   * how long a future quota change takes to reach a running apiserver.
   * Default 10 000.
   */
  limitsTtlMs?: number | undefined;
  /**
   * How many apiservers share each quota: each one enforces `perSecond /
   * shares` with its own buckets, so that together they stay within the
   * quota without talking to each other. Default 1 (one apiserver).
   */
  shares?: number | undefined;
}

interface Bucket {
  /** Tokens now; one call takes one. At most `capacity`; below 0 after a batch larger than it. */
  tokens: number;
  /** Tokens per millisecond. */
  perMs: number;
  /** The burst: one second's worth (at least one token). */
  capacity: number;
  atMs: number;
}

/** Buckets kept at most; past it full ones (the same as absent ones) are dropped. */
const MAX_BUCKETS = 10_000;

/**
 * The per-project calls-per-second quota (`Quota.fncallsPerSecond`, issue
 * 14), as one token bucket per limited project, kept in memory by each
 * apiserver. A call made in project P takes one token from P's bucket and
 * from the bucket of every ancestor that has a limit (an ancestor's limit
 * bounds its whole subtree, as live-sandbox quotas do), all or none: a
 * refused call takes nothing. Each bucket holds at most one second's worth
 * of tokens (the burst) and refills continuously at the quota's rate.
 *
 * Refusal is `quota_exceeded` (429, retryable) with `details` naming the
 * limiting project, `resource: 'fncallsPerSecond'`, the `limit` and
 * `retryAfterMs`, the wait until a token is back. A quota of 0 refuses every
 * call (and `retryAfterMs` is absent: waiting does not help).
 *
 * Not durable and not shared: a restarted apiserver starts with full
 * buckets, and several apiservers each keep their own (see `shares`).
 */
export class FnCallRateLimiter {
  readonly #limits: FnCallRateLimitSource;
  readonly #now: () => number;
  readonly #limitsTtlMs: number;
  readonly #shares: number;
  readonly #buckets = new Map<string, Bucket>();
  readonly #cache = new Map<string, { limits: FnCallRateLimit[]; untilMs: number }>();

  constructor(options: FnCallRateLimiterOptions) {
    const shares = options.shares ?? 1;
    if (!(Number.isSafeInteger(shares) && shares >= 1)) {
      throw new DsecError('invalid_argument', 'shares must be an integer ≥ 1', { field: 'shares' });
    }
    this.#limits = options.limits;
    this.#now = options.now ?? (() => performance.now());
    this.#limitsTtlMs = options.limitsTtlMs ?? 10_000;
    this.#shares = shares;
  }

  /**
   * Admits `calls` calls (default 1) made in `projectId` at once, or throws
   * `quota_exceeded` without taking anything. Each call takes one token. A
   * batch larger than the burst is admitted only when the bucket is full,
   * and then leaves it in debt: later calls wait until the rate has paid
   * the batch off, so a batch costs the same quota as its calls one by one
   * (otherwise a batch over one second's worth could never be admitted).
   * Errors of the limit source (`not_found`, a database that is down) pass
   * through: the caller refuses the call then too.
   */
  async acquire(projectId: string, calls = 1): Promise<void> {
    if (!(Number.isSafeInteger(calls) && calls >= 1)) {
      throw new DsecError('invalid_argument', 'calls must be an integer ≥ 1', { field: 'calls' });
    }
    const limits = await this.#limitsOf(projectId);
    // Read the clock after the await: the buckets are checked and taken in one synchronous step.
    const now = this.#now();
    const buckets = limits.map((l) => [l, this.#bucket(l, now)] as const);
    for (const [limit, bucket] of buckets) {
      const need = Math.min(calls, bucket.capacity);
      if (need > 0 && bucket.tokens >= need) continue;
      const retryAfterMs =
        // The epsilon keeps float error (100.00000000000001) from adding a millisecond.
        bucket.perMs > 0 ? Math.ceil((need - bucket.tokens) / bucket.perMs - 1e-6) : undefined;
      throw new DsecError(
        'quota_exceeded',
        `project ${limit.name} is over its quota of ${limit.perSecond} function calls per second`,
        {
          details: {
            projectId: limit.projectId,
            resource: 'fncallsPerSecond',
            limit: limit.perSecond,
            requested: calls,
            ...(retryAfterMs !== undefined ? { retryAfterMs } : {}),
          },
        },
      );
    }
    for (const [, bucket] of buckets) bucket.tokens -= calls;
  }

  /** Drops every bucket and cached limit (a quota changed; tests). */
  reset(): void {
    this.#buckets.clear();
    this.#cache.clear();
  }

  async #limitsOf(projectId: string): Promise<FnCallRateLimit[]> {
    const now = this.#now();
    const cached = this.#cache.get(projectId);
    if (cached && cached.untilMs > now) return cached.limits;
    const limits = await this.#limits(projectId);
    if (this.#cache.size >= MAX_BUCKETS) this.#cache.clear();
    this.#cache.set(projectId, { limits, untilMs: now + this.#limitsTtlMs });
    return limits;
  }

  /** The project's bucket refilled to `now`; a new or changed limit starts full. */
  #bucket(limit: FnCallRateLimit, now: number): Bucket {
    const rate = limit.perSecond / this.#shares;
    const perMs = rate / 1000;
    // At least one token, so that a share below 1 call per second still admits calls, spaced out.
    const capacity = rate > 0 ? Math.max(1, rate) : 0;
    let b = this.#buckets.get(limit.projectId);
    if (!b || b.capacity !== capacity) {
      if (!b && this.#buckets.size >= MAX_BUCKETS) this.#dropFull(now);
      b = { tokens: capacity, perMs, capacity, atMs: now };
      this.#buckets.set(limit.projectId, b);
      return b;
    }
    // A clock that stepped back (a test, or a bad injected clock) refills nothing.
    b.tokens = Math.min(capacity, b.tokens + Math.max(0, now - b.atMs) * perMs);
    b.atMs = now;
    return b;
  }

  #dropFull(now: number): void {
    for (const [id, b] of this.#buckets) {
      if (b.tokens + (now - b.atMs) * b.perMs >= b.capacity) this.#buckets.delete(id);
    }
    // Every bucket is in use: forgetting them all errs towards admitting, never towards refusing.
    if (this.#buckets.size >= MAX_BUCKETS) this.#buckets.clear();
  }
}
