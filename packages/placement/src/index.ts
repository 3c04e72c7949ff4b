/**
 * @dsec/placement — picks the edge for a new sandbox (paper 7): filter by
 * health, backend, edge labels (`spec.edgeSelector`) and free capacity, gate
 * the burst pool on the on-premise pool's utilisation (paper 3.4), then
 * power-of-k-choices over the watcher's view plus a local overlay of
 * placements still in flight.
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
export { RandomPlacer } from './random.js';
export type { RandomPlacerOptions } from './random.js';
export { LeastLoadedPlacer } from './least-loaded.js';
export type { LeastLoadedPlacerOptions } from './least-loaded.js';
export type {
  BurstOptions,
  Placer,
  PlacementEdge,
  PlacementRequest,
  PlacementView,
} from './placer.js';
