import type { BackendPool, EdgeInflight, FleetIndex } from './fleet-index.js';

interface Entry {
  edge: EdgeState;
  at: number;
  memoryMb: number;
  cpuCores: number;
  live: boolean;
}

interface EdgeState extends EdgeInflight {
  /** This edge's entries in placement order; those before `head` are gone. */
  entries: Entry[];
  head: number;
  /** The bound snapshot's pools this edge is on-premise in (their `inflight` sums include it). */
  pools: BackendPool[];
}

/** Compact a queue once this many leading slots are dead and they are half of it. */
const COMPACT_AT = 256;

/**
 * Placements this placer made that the view does not show yet (paper 7), so
 * that a burst from one process sees its own effect. A placement leaves the
 * overlay when its edge reports a status observed after it, or after `ttlMs`.
 *
 * Everything is incremental so a decision stays O(k): per-edge sums are kept
 * as placements come and go, each pool's on-premise sum likewise, expiry walks
 * one queue in time order, and the observed-after check runs per edge when a
 * new snapshot is bound. Assumes `now` does not go backwards (a clock that
 * does only keeps placements in the overlay a little longer).
 */
export class InflightOverlay {
  readonly #ttlMs: number;
  readonly #byEdge = new Map<string, EdgeState>();
  #queue: Entry[] = [];
  #head = 0;
  /** In-flight sums per edge index of the bound snapshot. */
  states: EdgeState[] = [];

  constructor(ttlMs: number) {
    this.#ttlMs = ttlMs;
  }

  /** Switches to a new snapshot: drops what its edges already report, recomputes pool sums. */
  bind(index: FleetIndex): void {
    for (const st of this.#byEdge.values()) st.pools = [];
    const states: EdgeState[] = new Array<EdgeState>(index.edges.length);
    const bound = new Set<EdgeState>();
    for (let i = 0; i < index.edges.length; i++) {
      const edge = index.edges[i]!;
      let st = this.#byEdge.get(edge.edgeId);
      if (!st) {
        st = { memoryMb: 0, cpuCores: 0, sandboxes: 0, entries: [], head: 0, pools: [] };
        this.#byEdge.set(edge.edgeId, st);
      }
      while (st.head < st.entries.length) {
        const e = st.entries[st.head]!;
        if (e.live && e.at >= edge.observedAt) break;
        if (e.live) this.#remove(e);
        st.head++;
      }
      compactEdge(st);
      st.pools = index.onPremPools[i]!;
      for (const p of st.pools) {
        p.inflight.memoryMb += st.memoryMb;
        p.inflight.cpuCores += st.cpuCores;
        p.inflight.sandboxes += st.sandboxes;
      }
      states[i] = st;
      bound.add(st);
    }
    for (const [id, st] of this.#byEdge) {
      if (!bound.has(st) && st.sandboxes === 0) this.#byEdge.delete(id);
    }
    this.states = states;
  }

  /** Drops placements older than the TTL. */
  expire(now: number): void {
    const q = this.#queue;
    while (this.#head < q.length) {
      const e = q[this.#head]!;
      if (e.at + this.#ttlMs > now) break;
      if (e.live) {
        this.#remove(e);
        const st = e.edge;
        while (st.head < st.entries.length && !st.entries[st.head]!.live) st.head++;
        compactEdge(st);
      }
      this.#head++;
    }
    if (this.#head >= COMPACT_AT && this.#head * 2 >= q.length) {
      this.#queue = q.slice(this.#head);
      this.#head = 0;
    }
  }

  /** Records a placement on edge slot `i` of the bound snapshot. */
  add(i: number, at: number, memoryMb: number, cpuCores: number): void {
    const st = this.states[i]!;
    const e: Entry = { edge: st, at, memoryMb, cpuCores, live: true };
    st.entries.push(e);
    this.#queue.push(e);
    st.memoryMb += memoryMb;
    st.cpuCores += cpuCores;
    st.sandboxes += 1;
    for (const p of st.pools) {
      p.inflight.memoryMb += memoryMb;
      p.inflight.cpuCores += cpuCores;
      p.inflight.sandboxes += 1;
    }
  }

  count(edgeId?: string): number {
    if (edgeId !== undefined) return this.#byEdge.get(edgeId)?.sandboxes ?? 0;
    let n = 0;
    for (const st of this.#byEdge.values()) n += st.sandboxes;
    return n;
  }

  #remove(e: Entry): void {
    e.live = false;
    const st = e.edge;
    st.sandboxes -= 1;
    // Reset at zero so float sums (0.1 CPU and the like) do not drift over a long run.
    st.memoryMb = st.sandboxes === 0 ? 0 : st.memoryMb - e.memoryMb;
    st.cpuCores = st.sandboxes === 0 ? 0 : st.cpuCores - e.cpuCores;
    for (const p of st.pools) {
      p.inflight.memoryMb -= e.memoryMb;
      p.inflight.cpuCores -= e.cpuCores;
      p.inflight.sandboxes -= 1;
    }
  }
}

function compactEdge(st: EdgeState): void {
  if (st.head === st.entries.length) {
    st.entries = [];
    st.head = 0;
  } else if (st.head >= COMPACT_AT && st.head * 2 >= st.entries.length) {
    st.entries = st.entries.slice(st.head);
    st.head = 0;
  }
}
