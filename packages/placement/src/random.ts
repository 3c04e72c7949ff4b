import { SnapshotCache, pickEdge, resolveBurst } from './fleet-index.js';
import type { ResolvedBurst } from './fleet-index.js';
import type { BurstOptions, PlacementRequest, PlacementView, Placer } from './placer.js';

export interface RandomPlacerOptions {
  view: () => PlacementView;
  /** Uniform [0, 1) source, for deterministic runs. */
  random?: () => number;
  burst?: BurstOptions;
}

/**
 * A uniformly random edge among those that pass the same filters as
 * `PowerOfKPlacer`, ignoring load (and keeping no overlay). The baseline
 * `dsec bench placement` measures the others against.
 */
export class RandomPlacer implements Placer {
  readonly #random: () => number;
  readonly #burst: ResolvedBurst;
  readonly #snapshots: SnapshotCache;

  constructor(options: RandomPlacerOptions) {
    this.#random = options.random ?? Math.random;
    this.#burst = resolveBurst(options.burst);
    this.#snapshots = new SnapshotCache(options.view, this.#burst);
  }

  place(req: PlacementRequest): string {
    const index = this.#snapshots.current();
    const chosen = pickEdge(index, req, { k: 1, random: this.#random, burst: this.#burst });
    return index.edges[chosen]!.edgeId;
  }
}
