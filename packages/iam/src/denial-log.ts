/**
 * Denied audits (failed authentications, refused access), aggregated before
 * they reach the audit table: one row per group and minute, where a group is
 * (actor, action, target, reason), with the number of denials it stands for.
 * The target of a failed authentication is the caller's source address, so
 * a flood of bogus keys from one address is one row a minute whatever its
 * rate (SECURITY J38: a denial costs the node no database write of its own).
 *
 * Bounds: at most `groupsPerMinute` groups are kept per minute; denials past
 * that go into one overflow group per action (target `*`, reason
 * `overflow`), so a minute writes at most `groupsPerMinute` + (number of
 * actions) rows however many sources, keys and targets the denials name.
 * Memory: the groups of the open minute and of the minutes not yet written.
 *
 * Pure bookkeeping: `Iam` writes what `take` hands it, in one transaction.
 */

/** One denial, as `Iam` records it. */
export interface Denial {
  actor: string | null;
  action: string;
  target: string;
  /** Context of the first denial of a group (its `reason` is part of the group). */
  details?: Record<string, unknown> | undefined;
}

/** Denials of one group in one minute. */
export interface DenialGroup extends Denial {
  /** Start of the group's minute, ms since the epoch. */
  minuteMs: number;
  firstAtMs: number;
  lastAtMs: number;
  count: number;
}

const MINUTE_MS = 60_000;
/** The reason an overflow group carries. */
export const OVERFLOW_REASON = 'overflow';

export class DenialAggregator {
  readonly #groupsPerMinute: number;
  /** Group key → group, for every minute not yet taken. */
  readonly #groups = new Map<string, DenialGroup>();
  /** Minute → how many (non-overflow) groups it has. */
  readonly #perMinute = new Map<number, number>();

  constructor(options: { groupsPerMinute: number }) {
    this.#groupsPerMinute = Math.max(1, options.groupsPerMinute);
  }

  /** Groups waiting to be written. */
  get pending(): number {
    return this.#groups.size;
  }

  add(denial: Denial, atMs: number): void {
    const minuteMs = atMs - (atMs % MINUTE_MS);
    const reason = reasonOf(denial.details);
    const key = groupKey(minuteMs, denial.actor, denial.action, denial.target, reason);
    const existing = this.#groups.get(key);
    if (existing) {
      existing.count++;
      existing.lastAtMs = Math.max(existing.lastAtMs, atMs);
      return;
    }
    const n = this.#perMinute.get(minuteMs) ?? 0;
    if (n >= this.#groupsPerMinute) {
      this.#addOverflow(minuteMs, denial.action, atMs);
      return;
    }
    this.#perMinute.set(minuteMs, n + 1);
    this.#groups.set(key, {
      actor: denial.actor,
      action: denial.action,
      target: denial.target,
      details: denial.details,
      minuteMs,
      firstAtMs: atMs,
      lastAtMs: atMs,
      count: 1,
    });
  }

  /**
   * Removes and returns the groups of minutes that started before `beforeMs`
   * (every group with `Infinity`), oldest minute first.
   */
  take(beforeMs: number): DenialGroup[] {
    const out: DenialGroup[] = [];
    for (const [key, group] of this.#groups) {
      if (group.minuteMs >= beforeMs) continue;
      out.push(group);
      this.#groups.delete(key);
    }
    for (const minute of this.#perMinute.keys()) {
      if (minute < beforeMs) this.#perMinute.delete(minute);
    }
    return out.sort((a, b) => a.minuteMs - b.minuteMs || a.firstAtMs - b.firstAtMs);
  }

  #addOverflow(minuteMs: number, action: string, atMs: number): void {
    const key = groupKey(minuteMs, '*', action, '*', OVERFLOW_REASON);
    const existing = this.#groups.get(key);
    if (existing) {
      existing.count++;
      existing.lastAtMs = Math.max(existing.lastAtMs, atMs);
      return;
    }
    this.#groups.set(key, {
      actor: null,
      action,
      target: '*',
      details: { reason: OVERFLOW_REASON },
      minuteMs,
      firstAtMs: atMs,
      lastAtMs: atMs,
      count: 1,
    });
  }
}

function reasonOf(details: Record<string, unknown> | undefined): string {
  const r = details?.['reason'];
  return typeof r === 'string' ? r : '';
}

function groupKey(
  minuteMs: number,
  actor: string | null,
  action: string,
  target: string,
  reason: string,
): string {
  return JSON.stringify([minuteMs, actor, action, target, reason]);
}
