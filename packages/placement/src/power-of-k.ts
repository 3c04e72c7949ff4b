import { SnapshotCache, pickEdge, resolveBurst } from './fleet-index.js';
import type { ResolvedBurst } from './fleet-index.js';
import { InflightOverlay } from './overlay.js';
import type { BurstOptions, PlacementRequest, PlacementView, Placer } from './placer.js';

export interface PowerOfKOptions {
  /** The current fleet view, e.g. `() => watcher.view()`. */
  view: () => PlacementView;
  /** How many fitting edges to sample. Default 2. */
  k?: number;
  /** Uniform [0, 1) source, for deterministic tests. */
  random?: () => number;
  now?: () => number;
  /**
   * Count this placer's own placements until the view shows them (default
   * true). Off only to measure what the overlay is worth.
   */
  overlay?: boolean;
  /**
   * An in-flight placement stays in the overlay until the edge reports a
   * status observed after it, or at most this long. Default 30 000.
   */
  overlayTtlMs?: number;
  /**
   * Placement instances that share the traffic about evenly (apiservers
   * behind one load balancer). Each sees only its own in-flight placements,
   * so when ranking edges (and gating the burst pool) it counts each of them
   * this many times, an estimate of what all instances placed since the view
   * was taken. Room is still checked against its own placements only.
   * Helps when views lag by thousands of decisions (the instances then all
   * fill the same edges the shared view shows as emptiest); with fresh views
   * it mostly amplifies noise (`dsec bench placement`, docs/benchmarks.md).
   * Default 1.
   */
  instances?: number;
  /** The burst pool and its threshold (default `pool=burst`, 0.8). */
  burst?: BurstOptions;
}

/**
 * Power-of-k-choices placement (paper 7): sample `k` of the edges that pass
 * the filters (health, backend, `edgeSelector`, burst gate, room for the
 * spec) uniformly, and take the least loaded. Sampling instead of taking the
 * global minimum keeps many concurrent apiservers from stampeding the same
 * edge off the same stale view. A local overlay adds placements made since
 * the edge's last report, so a burst from this process sees its own effect.
 *
 * A decision costs O(k) when most edges fit: the view is indexed once per
 * snapshot and edges are drawn at random until `k` fit, falling back to
 * looking at every edge of the backend when the draws miss.
 */
export class PowerOfKPlacer implements Placer {
  readonly #k: number;
  readonly #random: () => number;
  readonly #now: () => number;
  readonly #burst: ResolvedBurst;
  readonly #overlay: InflightOverlay | undefined;
  readonly #inflightWeight: number;
  readonly #snapshots: SnapshotCache;

  constructor(options: PowerOfKOptions) {
    this.#k = Math.max(1, options.k ?? 2);
    this.#random = options.random ?? Math.random;
    this.#now = options.now ?? Date.now;
    this.#burst = resolveBurst(options.burst);
    this.#inflightWeight = Math.max(1, options.instances ?? 1);
    const overlay =
      options.overlay === false ? undefined : new InflightOverlay(options.overlayTtlMs ?? 30_000);
    this.#overlay = overlay;
    this.#snapshots = new SnapshotCache(options.view, this.#burst, (index) => overlay?.bind(index));
  }

  place(req: PlacementRequest): string {
    const now = this.#now();
    const index = this.#snapshots.current();
    const overlay = this.#overlay;
    overlay?.expire(now);
    const chosen = pickEdge(index, req, {
      k: this.#k,
      random: this.#random,
      inflight: overlay?.states,
      inflightWeight: this.#inflightWeight,
      burst: this.#burst,
    });
    overlay?.add(chosen, now, req.spec.memoryLimitMb, req.spec.cpuCoresLimit);
    return index.edges[chosen]!.edgeId;
  }

  /** Placements not yet visible in the view (for metrics and tests). */
  inflightCount(edgeId?: string): number {
    if (!this.#overlay) return 0;
    this.#snapshots.current();
    this.#overlay.expire(this.#now());
    return this.#overlay.count(edgeId);
  }
}
