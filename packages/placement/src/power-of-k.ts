import { DsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import type { PlacementEdge, PlacementRequest, PlacementView, Placer } from './placer.js';

export interface PowerOfKOptions {
  /** The current fleet view, e.g. `() => watcher.view()`. */
  view: () => PlacementView;
  /** How many fitting edges to sample. Default 2. */
  k?: number;
  /** Uniform [0, 1) source, for deterministic tests. */
  random?: () => number;
  now?: () => number;
  /**
   * An in-flight placement stays in the overlay until the edge reports a
   * status observed after it, or at most this long. Default 30 000.
   */
  overlayTtlMs?: number;
}

interface Inflight {
  edgeId: string;
  at: number;
  memoryMb: number;
  cpuCores: number;
}

/**
 * Power-of-k-choices placement (paper 7): filter edges to the healthy ones
 * that offer the backend and have room, sample `k` of them uniformly, and
 * take the least loaded. Sampling instead of taking the global minimum keeps
 * many concurrent apiservers from stampeding the same edge off the same
 * stale view. A local overlay adds placements made since the edge's last
 * report, so a burst from this process sees its own effect.
 */
export class PowerOfKPlacer implements Placer {
  readonly #view: () => PlacementView;
  readonly #k: number;
  readonly #random: () => number;
  readonly #now: () => number;
  readonly #overlayTtlMs: number;
  #inflight: Inflight[] = [];

  constructor(options: PowerOfKOptions) {
    this.#view = options.view;
    this.#k = Math.max(1, options.k ?? 2);
    this.#random = options.random ?? Math.random;
    this.#now = options.now ?? Date.now;
    this.#overlayTtlMs = options.overlayTtlMs ?? 30_000;
  }

  place(req: PlacementRequest): string {
    const { spec, exclude } = req;
    const now = this.#now();
    const edges = this.#view().edges;
    this.#prune(edges, now);
    const candidates: { edge: PlacementEdge; load: number }[] = [];
    for (const edge of edges) {
      if (!edge.healthy || exclude?.has(edge.edgeId) || !edge.backends.includes(spec.backend))
        continue;
      const used = this.#usedWithOverlay(edge);
      if (!fits(edge, used, spec)) continue;
      candidates.push({ edge, load: load(edge, used, spec) });
    }
    if (candidates.length === 0) {
      throw new DsecError('capacity_exhausted', `no edge has room for a ${spec.backend} sandbox`, {
        details: { backend: spec.backend, edges: edges.length, excluded: exclude?.size ?? 0 },
      });
    }
    let best: { edge: PlacementEdge; load: number } | undefined;
    // Partial Fisher–Yates: the first k slots become a uniform sample without replacement.
    const k = Math.min(this.#k, candidates.length);
    for (let i = 0; i < k; i++) {
      const j = i + Math.floor(this.#random() * (candidates.length - i));
      const pick = candidates[j]!;
      candidates[j] = candidates[i]!;
      candidates[i] = pick;
      if (!best || pick.load < best.load) best = pick;
    }
    const chosen = best!.edge.edgeId;
    this.#inflight.push({
      edgeId: chosen,
      at: now,
      memoryMb: spec.memoryLimitMb,
      cpuCores: spec.cpuCoresLimit,
    });
    return chosen;
  }

  /** Placements not yet visible in the view (for metrics and tests). */
  inflightCount(edgeId?: string): number {
    return edgeId === undefined
      ? this.#inflight.length
      : this.#inflight.filter((p) => p.edgeId === edgeId).length;
  }

  #prune(edges: readonly PlacementEdge[], now: number): void {
    const observed = new Map(edges.map((e) => [e.edgeId, e.observedAt]));
    this.#inflight = this.#inflight.filter(
      (p) => p.at + this.#overlayTtlMs > now && (observed.get(p.edgeId) ?? 0) <= p.at,
    );
  }

  #usedWithOverlay(edge: PlacementEdge): PlacementEdge['used'] {
    const used = { ...edge.used };
    for (const p of this.#inflight) {
      if (p.edgeId !== edge.edgeId) continue;
      used.memoryMb += p.memoryMb;
      used.cpuCores += p.cpuCores;
      used.sandboxes += 1;
    }
    return used;
  }
}

function fits(edge: PlacementEdge, used: PlacementEdge['used'], spec: SandboxSpec): boolean {
  return (
    used.sandboxes + 1 <= edge.capacity.sandboxes &&
    used.memoryMb + spec.memoryLimitMb <= edge.capacity.memoryMb &&
    used.cpuCores + spec.cpuCoresLimit <= edge.capacity.cpuCores + 1e-9
  );
}

/** The edge's utilisation after this placement: the fullest of its three dimensions. */
function load(edge: PlacementEdge, used: PlacementEdge['used'], spec: SandboxSpec): number {
  const frac = (u: number, c: number) => (c > 0 ? u / c : 1);
  return Math.max(
    frac(used.sandboxes + 1, edge.capacity.sandboxes),
    frac(used.memoryMb + spec.memoryLimitMb, edge.capacity.memoryMb),
    frac(used.cpuCores + spec.cpuCoresLimit, edge.capacity.cpuCores),
  );
}
