/**
 * The memory a server spends on output its clients have not read yet: one
 * budget for every stream of a process (SECURITY J38: unread streams must
 * not grow the node). Pure bookkeeping: each stream reports how much it has
 * queued, and the budget says which to cut.
 *
 * Rules, checked each time a stream queues output (`check`):
 * - a stream with more than `maxStreamBytes` queued is cut (`stream_buffer`):
 *   its client has stopped reading;
 * - when all streams together hold more than `maxBytes`, the streams'
 *   backlogs are measured afresh and streams are cut (`output_budget`)
 *   until the total is within it: the owner (a tenant: the caller's
 *   project) whose streams hold the most memory pays, its biggest backlog
 *   first, not the stream that happened to write last. So a client that
 *   reads keeps its stream while another stalls, and one tenant's many
 *   small stalled streams cannot make another tenant's one reading stream
 *   the biggest there is.
 *
 * The cut callback must end the stream and drop what it holds (destroy its
 * socket): memory held then is at most `maxBytes` plus one write per stream.
 */
export interface OutputBudgetOptions {
  /** Queued bytes of all streams together. Default 256 MiB. */
  maxBytes?: number;
  /** Queued bytes of one stream. Default 8 MiB. */
  maxStreamBytes?: number;
}

export const OUTPUT_BUDGET_DEFAULTS = {
  maxBytes: 256 * 1024 * 1024,
  maxStreamBytes: 8 * 1024 * 1024,
} as const;

export type OutputCutReason = 'stream_buffer' | 'output_budget';

/** One stream's share of the budget. */
export interface OutputAccount {
  /** Call after queuing output: false when the stream has been cut (now or before). */
  check(): boolean;
  /** The stream ended: it holds nothing any more. */
  close(): void;
}

interface Entry {
  measure: () => number;
  cut: (reason: OutputCutReason) => void;
  owner: Owner;
  last: number;
  done: boolean;
}

/** One owner's streams and the sum of their last measurements. */
interface Owner {
  id: string;
  entries: Set<Entry>;
  total: number;
}

export class OutputBudget {
  readonly maxBytes: number;
  readonly maxStreamBytes: number;
  readonly #entries = new Set<Entry>();
  readonly #owners = new Map<string, Owner>();
  /** The sum of the entries' last measurements. */
  #total = 0;

  constructor(options: OutputBudgetOptions = {}) {
    this.maxBytes = options.maxBytes ?? OUTPUT_BUDGET_DEFAULTS.maxBytes;
    this.maxStreamBytes = options.maxStreamBytes ?? OUTPUT_BUDGET_DEFAULTS.maxStreamBytes;
  }

  /** Streams open now. */
  get streams(): number {
    return this.#entries.size;
  }

  /** Bytes queued by the open streams, measured now. */
  queuedBytes(): number {
    let sum = 0;
    for (const e of this.#entries) sum += e.measure();
    return sum;
  }

  /**
   * Registers a stream. `measure` returns the bytes it has queued now (its
   * buffers and its socket's); `cut` is called at most once, to stop it.
   * `owner` names whom the stream is charged to (the caller's project).
   */
  open(measure: () => number, cut: (reason: OutputCutReason) => void, owner = ''): OutputAccount {
    let o = this.#owners.get(owner);
    if (!o) {
      o = { id: owner, entries: new Set(), total: 0 };
      this.#owners.set(owner, o);
    }
    const entry: Entry = { measure, cut, owner: o, last: 0, done: false };
    this.#entries.add(entry);
    o.entries.add(entry);
    return {
      check: () => this.#check(entry),
      close: () => this.#drop(entry),
    };
  }

  #check(entry: Entry): boolean {
    if (entry.done) return false;
    this.#remeasure(entry);
    if (entry.last > this.maxStreamBytes) {
      this.#cut(entry, 'stream_buffer');
      return false;
    }
    if (this.#total > this.maxBytes) {
      for (const e of this.#entries) this.#remeasure(e);
      while (this.#total > this.maxBytes) {
        let most: Owner | undefined;
        for (const o of this.#owners.values()) if (!most || o.total > most.total) most = o;
        if (!most || most.total === 0) break;
        let biggest: Entry | undefined;
        for (const e of most.entries) if (!biggest || e.last > biggest.last) biggest = e;
        if (!biggest) break;
        this.#cut(biggest, 'output_budget');
      }
    }
    return !entry.done;
  }

  #remeasure(e: Entry): void {
    const now = Math.max(0, e.measure());
    this.#total += now - e.last;
    e.owner.total += now - e.last;
    e.last = now;
  }

  #cut(entry: Entry, reason: OutputCutReason): void {
    this.#drop(entry);
    entry.cut(reason);
  }

  #drop(entry: Entry): void {
    if (entry.done) return;
    entry.done = true;
    this.#entries.delete(entry);
    this.#total -= entry.last;
    const o = entry.owner;
    o.total -= entry.last;
    o.entries.delete(entry);
    if (o.entries.size === 0) this.#owners.delete(o.id);
    entry.last = 0;
  }
}
