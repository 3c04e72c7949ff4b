/**
 * How big a warm pool should be (docs/adr/0014-fncall.md), as pure functions
 * of its counts so the policy is tested without sandboxes: grow while calls
 * wait, keep a spare while there is demand, shrink to `min` when idle.
 */

export interface PoolCounts {
  /** Workers waiting for a call. */
  idle: number;
  /** Workers running a call. */
  busy: number;
  /** Workers being created (sandbox start and zygote set-up). */
  starting: number;
  /** Calls waiting for a worker. */
  queued: number;
}

export interface PoolSizing {
  /** Workers kept even with no demand (warm). */
  min: number;
  /** The most workers the pool holds (admission may refuse sooner). */
  max: number;
  /** Idle workers kept beyond the calls in flight while there is demand. */
  spare: number;
  /** Workers created at once (a burst queues for the ones starting). */
  maxStarting: number;
  /** An idle worker above the wanted size goes after this long unused. */
  idleRetireMs: number;
}

/** The number of workers the pool wants now. */
export function wantedWorkers(c: PoolCounts, s: PoolSizing): number {
  const demand = c.busy + c.queued;
  return Math.min(s.max, Math.max(s.min, demand > 0 ? demand + s.spare : 0));
}

/** How many workers to start now: up to the wanted size, at most `maxStarting` at once. */
export function workersToStart(c: PoolCounts, s: PoolSizing): number {
  const have = c.idle + c.busy + c.starting;
  return Math.max(0, Math.min(wantedWorkers(c, s) - have, s.maxStarting - c.starting));
}

/**
 * Which idle workers to retire: those unused for `idleRetireMs`, longest
 * unused first, while the pool stays above the wanted size.
 */
export function workersToRetire<W extends { idleSinceMs: number }>(
  idle: readonly W[],
  c: PoolCounts,
  s: PoolSizing,
  nowMs: number,
): W[] {
  let surplus = c.idle + c.busy + c.starting - wantedWorkers(c, s);
  const out: W[] = [];
  for (const w of [...idle].sort((a, b) => a.idleSinceMs - b.idleSinceMs)) {
    if (surplus <= 0) break;
    if (nowMs - w.idleSinceMs < s.idleRetireMs) break;
    out.push(w);
    surplus--;
  }
  return out;
}
