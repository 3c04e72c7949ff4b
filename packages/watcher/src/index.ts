/**
 * @dsec/watcher — probes every edge's `status()` on a timer and keeps the
 * fleet view (per edge, per backend, per project) that placement and the
 * apiserver read. Stateless: a restart rebuilds the view on the next probe.
 *
 * @example
 * ```ts
 * import { Watcher } from '@dsec/watcher';
 * const watcher = new Watcher({ edges: edgeMap, intervalMs: 2000 });
 * await watcher.refresh();   // first view now
 * watcher.start();           // then every 2 s
 * watcher.view().edges.filter((e) => e.healthy);
 * watcher.stop();
 * ```
 */
export { Watcher } from './watcher.js';
export type { EdgeView, FleetView, WatcherOptions } from './watcher.js';
