import type { SandboxSpec } from '@dsec/core';

/**
 * Chooses the edge a new sandbox goes to (paper 7). Placement works from a
 * periodically refreshed, possibly stale view; the edge has the final say and
 * may still refuse with `capacity_exhausted`, in which case the caller calls
 * `place` again with that edge in `exclude`.
 *
 * Contract: returns the ID of an edge that is healthy, offers `spec.backend`,
 * carries every label of `spec.edgeSelector`, is not in `exclude` and has
 * enough free capacity as far as the placer knows. An edge of the burst pool
 * (see {@link BurstOptions}) is returned only while the on-premise pool is
 * above the burst threshold and only when every layer the request needs is in
 * that edge's image store. Throws `capacity_exhausted` when there is no such
 * edge. Synchronous and cheap: it must not do I/O.
 */
export interface Placer {
  place(req: PlacementRequest): string;
}

export interface PlacementRequest {
  spec: SandboxSpec;
  exclude?: Set<string> | undefined;
  /**
   * The layers the sandbox needs, as `name` or `name:version`. Default: the
   * spec's image, workspace and toolkits. Only burst edges look at them.
   */
  layers?: readonly string[] | undefined;
  /**
   * The projects whose layers the sandbox may stack besides the platform's
   * (the create's layer view, root first; docs/adr/0019-layer-ownership.md).
   * A burst edge holds a needed layer when it lists the platform's
   * (`name:version`) or one of these projects' (`project/name:version`).
   * Absent: the platform's only.
   */
  layerView?: readonly string[] | undefined;
}

/**
 * The part of the watcher's fleet view placement needs (structurally a
 * `FleetView`). A view is an immutable snapshot: a changed fleet comes as a
 * new `edges` array (placers index a snapshot once, keyed by that array).
 */
export interface PlacementView {
  edges: readonly PlacementEdge[];
}

export interface PlacementEdge {
  edgeId: string;
  healthy: boolean;
  backends: readonly string[];
  capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
  used: { memoryMb: number; cpuCores: number; sandboxes: number };
  /** When `used` was reported (ms since epoch). Placements made before this are in `used`. */
  observedAt: number;
  /** The edge's labels (`pool`, `hardware`, …); absent: none. */
  labels?: Readonly<Record<string, string>> | undefined;
  /**
   * The layers and images in the edge's image store (`EdgeStatus.layers`), as
   * layer keys: `name:version` for the platform's, `project/name:version`
   * for a project's. A burst edge that reports none is never eligible for
   * burst work.
   */
  layers?: readonly string[] | undefined;
  /** Cordoned by an operator: never eligible, whatever its health. */
  cordoned?: boolean | undefined;
}

/**
 * Cloud bursting (paper 3.4): edges labelled `labelKey=labelValue` form the
 * burst pool. They receive a request only while the on-premise pool — the
 * healthy edges offering the request's backend that are not in the burst
 * pool — is above `utilisationThreshold`, and only when every layer the
 * request needs is in the burst edge's image store. Utilisation is the
 * fullest of sandboxes, memory and CPU: used ÷ capacity summed over the
 * on-premise pool, in-flight placements included where the placer keeps them.
 */
export interface BurstOptions {
  /** Default `pool`. */
  labelKey?: string;
  /** Default `burst`. */
  labelValue?: string;
  /** Default 0.8. */
  utilisationThreshold?: number;
}
