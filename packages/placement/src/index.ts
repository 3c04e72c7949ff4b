/**
 * @dsec/placement — picks the edge for a new sandbox (paper 7): filter by
 * health, backend and free capacity, then power-of-k-choices over the
 * watcher's view plus a local overlay of placements still in flight.
 *
 * @example
 * ```ts
 * import { PowerOfKPlacer } from '@dsec/placement';
 * const placer = new PowerOfKPlacer({ view: () => watcher.view(), k: 2 });
 * const edgeId = placer.place({ spec });               // throws capacity_exhausted
 * const other = placer.place({ spec, exclude: new Set([edgeId]) });
 * ```
 */
export { PowerOfKPlacer } from './power-of-k.js';
export type { PowerOfKOptions } from './power-of-k.js';
export type { Placer, PlacementEdge, PlacementRequest, PlacementView } from './placer.js';
