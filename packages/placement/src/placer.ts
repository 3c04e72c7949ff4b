import type { SandboxSpec } from '@dsec/core';

/**
 * Chooses the edge a new sandbox goes to (paper 7). Placement works from a
 * periodically refreshed, possibly stale view; the edge has the final say and
 * may still refuse with `capacity_exhausted`, in which case the caller calls
 * `place` again with that edge in `exclude`.
 *
 * Contract: returns the ID of a healthy edge offering `spec.backend` with
 * enough free capacity as far as the placer knows, never one in `exclude`;
 * throws `capacity_exhausted` when there is none. Synchronous and cheap: it
 * must not do I/O.
 */
export interface Placer {
  place(req: PlacementRequest): string;
}

export interface PlacementRequest {
  spec: SandboxSpec;
  exclude?: Set<string> | undefined;
}

/** The part of the watcher's fleet view placement needs (structurally a `FleetView`). */
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
}
