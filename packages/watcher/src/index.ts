/**
 * @dsec/watcher — probes every edge's `status()` on a timer and keeps the
 * fleet view (per edge, per backend, per project) that placement and the
 * apiserver read. Stateless: a restart rebuilds the view on the next probe.
 * A process that does not probe builds the same view from the probe records
 * a watcher left in a registry (`viewFromRecords`).
 *
 * @example
 * ```ts
 * import { Watcher, viewFromRecords } from '@dsec/watcher';
 * const watcher = new Watcher({
 *   edges: () => registry.clients(),         // edges may join and leave between rounds
 *   intervalMs: 2000,
 *   failuresBeforeDown: 2,
 *   onProbe: (edgeId, result) => registry.recordProbe(edgeId, result),
 * });
 * await watcher.refresh();   // first view now
 * watcher.start();           // then every 2 s
 * watcher.view().edges.filter((e) => e.healthy);
 * watcher.stop();
 * // elsewhere, without probing:
 * const view = viewFromRecords(await registry.list(), { staleAfterMs: 10_000 });
 * ```
 */
export { Watcher, buildFleetView, viewFromRecords } from './watcher.js';
export type {
  EdgeProbeRecord,
  EdgeView,
  FleetView,
  ProbeResult,
  ViewFromRecordsOptions,
  WatcherOptions,
} from './watcher.js';
