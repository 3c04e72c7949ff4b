import { DsecError, formatLayerKey, parseLayerKey } from '@dsec/core';
import type { BurstOptions, PlacementEdge, PlacementRequest, PlacementView } from './placer.js';

export interface Usage {
  memoryMb: number;
  cpuCores: number;
  sandboxes: number;
}

/** The edges of one snapshot that offer one backend. */
export interface BackendPool {
  /** Indices into `FleetIndex.edges` of the healthy edges outside the burst pool. */
  onPrem: number[];
  /** `onPrem` and the healthy burst edges. */
  all: number[];
  hasBurst: boolean;
  /** Sums over `onPrem`, as the view reports them. */
  capacity: Usage;
  used: Usage;
  /** Sums over `onPrem` of placements in flight (kept up to date by an `Overlay`). */
  inflight: Usage;
}

/** Per-edge placements in flight; `InflightOverlay` owns these. */
export interface EdgeInflight {
  memoryMb: number;
  cpuCores: number;
  sandboxes: number;
}

export interface ResolvedBurst {
  labelKey: string;
  labelValue: string;
  utilisationThreshold: number;
}

export function resolveBurst(options: BurstOptions | undefined): ResolvedBurst {
  return {
    labelKey: options?.labelKey ?? 'pool',
    labelValue: options?.labelValue ?? 'burst',
    utilisationThreshold: options?.utilisationThreshold ?? 0.8,
  };
}

const zero = (): Usage => ({ memoryMb: 0, cpuCores: 0, sandboxes: 0 });

/**
 * One view snapshot indexed for placement: per backend, the healthy edges in
 * and outside the burst pool and the on-premise sums. Built once per snapshot
 * (O(edges)) so a decision touches only the edges it samples. Each placer
 * keeps its own: the index arrays are shuffled in place by sampling.
 */
export class FleetIndex {
  readonly edges: readonly PlacementEdge[];
  /** 1 where the edge is in the burst pool. */
  readonly burst: Uint8Array;
  readonly pools = new Map<string, BackendPool>();
  /** For each edge, the pools it is on-premise in. */
  readonly onPremPools: BackendPool[][];
  readonly #layerSets: (Set<string> | null | undefined)[];

  constructor(view: PlacementView, burst: ResolvedBurst) {
    const edges = view.edges;
    this.edges = edges;
    this.burst = new Uint8Array(edges.length);
    this.onPremPools = [];
    this.#layerSets = new Array<Set<string> | null | undefined>(edges.length);
    for (let i = 0; i < edges.length; i++) {
      const e = edges[i]!;
      const isBurst = e.labels?.[burst.labelKey] === burst.labelValue;
      this.burst[i] = isBurst ? 1 : 0;
      const onPrem: BackendPool[] = [];
      this.onPremPools.push(onPrem);
      if (!e.healthy || e.cordoned) continue;
      for (const b of new Set(e.backends)) {
        let pool = this.pools.get(b);
        if (!pool) {
          pool = {
            onPrem: [],
            all: [],
            hasBurst: false,
            capacity: zero(),
            used: zero(),
            inflight: zero(),
          };
          this.pools.set(b, pool);
        }
        pool.all.push(i);
        if (isBurst) {
          pool.hasBurst = true;
          continue;
        }
        pool.onPrem.push(i);
        onPrem.push(pool);
        addUsage(pool.capacity, e.capacity);
        addUsage(pool.used, e.used);
      }
    }
  }

  /**
   * True when every layer in `needed` (normalised) is in edge `i`'s store,
   * the platform's or that of a project of `view` (`PlacementRequest.layerView`):
   * another tenant's layer of the name never counts.
   */
  hasLayers(i: number, needed: readonly string[], view: readonly string[] = []): boolean {
    let set = this.#layerSets[i];
    if (set === undefined) {
      const layers = this.edges[i]!.layers;
      set = layers && layers.length > 0 ? new Set(layers.map(normaliseLayer)) : null;
      this.#layerSets[i] = set;
    }
    if (set === null) return false;
    for (const l of needed) {
      if (set.has(l)) continue;
      if (!view.some((p) => set.has(`${p}/${l}`))) return false;
    }
    return true;
  }
}

function addUsage(to: Usage, u: Usage): void {
  to.memoryMb += u.memoryMb;
  to.cpuCores += u.cpuCores;
  to.sandboxes += u.sandboxes;
}

/** `base` and `base:latest` name the same layer; so do `prj/base` and `prj/base:latest`. */
export function normaliseLayer(ref: string): string {
  const parsed = parseLayerKey(ref);
  return parsed ? formatLayerKey(parsed) : ref;
}

/** The layers a request needs, normalised: `req.layers`, or the spec's image, workspace and toolkits. */
export function requiredLayers(req: PlacementRequest): string[] {
  const { spec } = req;
  const refs = req.layers ?? [
    spec.image,
    ...(spec.workspace ? [spec.workspace] : []),
    ...spec.toolkits,
  ];
  return refs.map(normaliseLayer);
}

/**
 * The on-premise pool's utilisation: the fullest dimension, in-flight
 * placements included (each counted `inflightWeight` times).
 */
export function poolUtilisation(pool: BackendPool, inflightWeight = 1): number {
  const frac = (u: number, c: number) => (c > 0 ? u / c : 1);
  const { used, inflight, capacity } = pool;
  const w = inflightWeight;
  return Math.max(
    frac(used.sandboxes + w * inflight.sandboxes, capacity.sandboxes),
    frac(used.memoryMb + w * inflight.memoryMb, capacity.memoryMb),
    frac(used.cpuCores + w * inflight.cpuCores, capacity.cpuCores),
  );
}

export interface PickOptions {
  /** Stop after this many fitting edges (Infinity: look at all). */
  k: number;
  /** Visit edges in uniformly random order; absent: in view order. */
  random?: (() => number) | undefined;
  /** In-flight placements per edge index (absent: the view alone). */
  inflight?: readonly EdgeInflight[] | undefined;
  /**
   * How many times an in-flight placement counts when ranking edges and
   * gating the burst pool (not when checking room). Default 1.
   */
  inflightWeight?: number | undefined;
  burst: ResolvedBurst;
}

/**
 * The decision every placer shares: among the edges that pass the filters
 * (health, backend, selector, exclude, burst gate and layers, room for the
 * spec) look at up to `k` — in random order when `random` is given, which
 * makes them a uniform sample of the fitting edges — and return the index of
 * the least loaded one. Sampling is a partial Fisher–Yates over the pool's
 * index array, so with few misses it touches about `k` edges, and when the
 * samples miss it degrades into a full scan before giving up. Throws
 * `capacity_exhausted` when no edge fits.
 */
export function pickEdge(index: FleetIndex, req: PlacementRequest, options: PickOptions): number {
  const { spec, exclude } = req;
  const pool = index.pools.get(spec.backend);
  let order = pool?.onPrem;
  const extra = (options.inflightWeight ?? 1) - 1;
  if (pool?.hasBurst && poolUtilisation(pool, extra + 1) > options.burst.utilisationThreshold) {
    order = pool.all;
  }
  const selector =
    spec.edgeSelector && Object.keys(spec.edgeSelector).length > 0
      ? Object.entries(spec.edgeSelector)
      : undefined;
  const { k, random, inflight } = options;
  const edges = index.edges;
  let needed: string[] | undefined;
  let best = -1;
  let bestLoad = Infinity;
  let found = 0;
  const n = order?.length ?? 0;
  for (let i = 0; i < n && found < k; i++) {
    let e: number;
    if (random) {
      const j = i + Math.floor(random() * (n - i));
      e = order![j]!;
      order![j] = order![i]!;
      order![i] = e;
    } else {
      e = order![i]!;
    }
    const edge = edges[e]!;
    if (exclude?.has(edge.edgeId)) continue;
    if (selector && !matchesSelector(edge, selector)) continue;
    if (index.burst[e]) {
      needed ??= requiredLayers(req);
      if (!index.hasLayers(e, needed, req.layerView)) continue;
    }
    const f = inflight?.[e];
    const sandboxes = edge.used.sandboxes + (f ? f.sandboxes : 0) + 1;
    const memoryMb = edge.used.memoryMb + (f ? f.memoryMb : 0) + spec.memoryLimitMb;
    const cpuCores = edge.used.cpuCores + (f ? f.cpuCores : 0) + spec.cpuCoresLimit;
    const cap = edge.capacity;
    if (sandboxes > cap.sandboxes || memoryMb > cap.memoryMb || cpuCores > cap.cpuCores + 1e-9)
      continue;
    found++;
    // The edge's utilisation after this placement: the fullest of its three dimensions.
    let ls = sandboxes;
    let lm = memoryMb;
    let lc = cpuCores;
    if (f && extra !== 0) {
      ls += extra * f.sandboxes;
      lm += extra * f.memoryMb;
      lc += extra * f.cpuCores;
    }
    const load = Math.max(
      cap.sandboxes > 0 ? ls / cap.sandboxes : 1,
      cap.memoryMb > 0 ? lm / cap.memoryMb : 1,
      cap.cpuCores > 0 ? lc / cap.cpuCores : 1,
    );
    if (load < bestLoad) {
      best = e;
      bestLoad = load;
    }
  }
  if (best < 0) {
    throw new DsecError('capacity_exhausted', `no edge has room for a ${spec.backend} sandbox`, {
      details: {
        backend: spec.backend,
        edges: edges.length,
        excluded: exclude?.size ?? 0,
        ...(selector ? { edgeSelector: spec.edgeSelector } : {}),
      },
    });
  }
  return best;
}

function matchesSelector(edge: PlacementEdge, selector: [string, string][]): boolean {
  const labels = edge.labels;
  if (!labels) return false;
  for (const [key, value] of selector) {
    if (!Object.hasOwn(labels, key) || labels[key] !== value) return false;
  }
  return true;
}

/**
 * The index of the current snapshot, rebuilt when the view hands out a new
 * `edges` array (and only then: a view is an immutable snapshot).
 */
export class SnapshotCache {
  readonly #view: () => PlacementView;
  readonly #burst: ResolvedBurst;
  readonly #onNew: ((index: FleetIndex) => void) | undefined;
  #edges: readonly PlacementEdge[] | undefined;
  #index: FleetIndex | undefined;

  constructor(
    view: () => PlacementView,
    burst: ResolvedBurst,
    onNew?: (index: FleetIndex) => void,
  ) {
    this.#view = view;
    this.#burst = burst;
    this.#onNew = onNew;
  }

  current(): FleetIndex {
    const view = this.#view();
    if (this.#index && view.edges === this.#edges) return this.#index;
    const index = new FleetIndex(view, this.#burst);
    this.#edges = view.edges;
    this.#index = index;
    this.#onNew?.(index);
    return index;
  }
}
