import { SnapshotCache, pickEdge, resolveBurst } from './fleet-index.js';
import type { ResolvedBurst } from './fleet-index.js';
import type { BurstOptions, PlacementRequest, PlacementView, Placer } from './placer.js';

export interface LeastLoadedPlacerOptions {
  view: () => PlacementView;
  burst?: BurstOptions;
}

/**
 * The globally least-loaded edge that passes the same filters as
 * `PowerOfKPlacer`, judged on the view alone (no overlay; ties go to the
 * first edge in view order). Exact on a fresh view, but between refreshes
 * every decision lands on the same edge: the herding that power-of-k and the
 * overlay exist to avoid. Kept as a placer so `dsec bench placement` measures
 * real code.
 */
export class LeastLoadedPlacer implements Placer {
  readonly #burst: ResolvedBurst;
  readonly #snapshots: SnapshotCache;

  constructor(options: LeastLoadedPlacerOptions) {
    this.#burst = resolveBurst(options.burst);
    this.#snapshots = new SnapshotCache(options.view, this.#burst);
  }

  place(req: PlacementRequest): string {
    const index = this.#snapshots.current();
    const chosen = pickEdge(index, req, { k: Infinity, burst: this.#burst });
    return index.edges[chosen]!.edgeId;
  }
}
