import type { BackendKind, EdgeApi, EdgeStatus } from '@dsec/core';

/** What the watcher knows about one edge. */
export interface EdgeView {
  edgeId: string;
  /** False after a failed probe, or when the edge says so itself. */
  healthy: boolean;
  /** The last status the edge reported; undefined before its first successful probe. */
  status: EdgeStatus | undefined;
  backends: BackendKind[];
  capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
  used: { memoryMb: number; cpuCores: number; sandboxes: number };
  /** When `used` was last reported (ms since epoch; 0 if never). */
  observedAt: number;
  lastProbeAt: number;
  consecutiveFailures: number;
  lastError?: string | undefined;
}

interface Totals {
  edges: number;
  healthyEdges: number;
  capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
  used: { memoryMb: number; cpuCores: number; sandboxes: number };
}

/** A snapshot of the fleet (paper 3.3): per edge, per backend and per project. */
export interface FleetView {
  refreshedAt: number;
  edges: EdgeView[];
  /** Totals over the edges offering each backend (healthy edges only in capacity/used). */
  byBackend: Partial<Record<BackendKind, Totals>>;
  /** Running sandboxes per project over healthy edges. */
  byProject: Record<string, number>;
  totals: Totals;
}

export interface WatcherOptions {
  /** The edges to probe: a live map, or a function returning the current set. */
  edges: Map<string, EdgeApi> | (() => Iterable<EdgeApi>);
  /** Probe period. Default 2000. */
  intervalMs?: number;
  /** A probe that takes longer counts as failed. Default 1500. */
  probeTimeoutMs?: number;
  now?: () => number;
  onProbeError?: (edgeId: string, err: unknown) => void;
}

const ZERO = () => ({ memoryMb: 0, cpuCores: 0, sandboxes: 0 });

/**
 * Polls `EdgeApi.status()` of every edge and keeps the fleet view placement
 * works from. Holds no durable state: after a restart the first `refresh()`
 * rebuilds everything.
 *
 * Lifecycle: `new Watcher(opts)` → `start()` (probes now, then every
 * `intervalMs`) → `view()` any time → `stop()`. `refresh()` probes once on
 * demand (tests, or right after start-up). An edge is marked unhealthy after
 * one failed probe and healthy again after the next successful one.
 */
export class Watcher {
  readonly #options: WatcherOptions;
  readonly #intervalMs: number;
  readonly #probeTimeoutMs: number;
  readonly #now: () => number;
  readonly #edges = new Map<string, EdgeView>();
  #view: FleetView;
  #timer: NodeJS.Timeout | undefined;
  #inFlight: Promise<FleetView> | undefined;
  #stopped = new AbortController();

  constructor(options: WatcherOptions) {
    this.#options = options;
    this.#intervalMs = options.intervalMs ?? 2000;
    this.#probeTimeoutMs = options.probeTimeoutMs ?? 1500;
    this.#now = options.now ?? Date.now;
    this.#view = this.#build(0);
  }

  /** The latest snapshot; cheap, never blocks. */
  view(): FleetView {
    return this.#view;
  }

  /** Starts periodic probing; the first probe runs at once. Idempotent. */
  start(): void {
    if (this.#timer) return;
    this.#stopped = new AbortController();
    const tick = () => {
      this.refresh()
        .catch(() => {})
        .finally(() => {
          if (!this.#stopped.signal.aborted) this.#timer = setTimeout(tick, this.#intervalMs);
        });
    };
    this.#timer = setTimeout(tick, 0);
  }

  /** Stops probing and cancels a probe in flight. */
  stop(): void {
    this.#stopped.abort();
    if (this.#timer) clearTimeout(this.#timer);
    this.#timer = undefined;
  }

  /** Probes every edge once (joining a probe already running) and returns the new view. */
  refresh(signal?: AbortSignal): Promise<FleetView> {
    this.#inFlight ??= this.#probeAll(signal).finally(() => {
      this.#inFlight = undefined;
    });
    return this.#inFlight;
  }

  async #probeAll(signal?: AbortSignal): Promise<FleetView> {
    const apis = this.#currentEdges();
    const seen = new Set(apis.map((e) => e.edgeId));
    for (const id of this.#edges.keys()) if (!seen.has(id)) this.#edges.delete(id);
    await Promise.all(apis.map((api) => this.#probe(api, signal)));
    this.#view = this.#build(this.#now());
    return this.#view;
  }

  async #probe(api: EdgeApi, signal?: AbortSignal): Promise<void> {
    // A ref'd timer, unlike AbortSignal.timeout, keeps a hung probe from being forgotten.
    const deadline = new AbortController();
    const timer = setTimeout(
      () => deadline.abort(new Error(`probe timed out after ${this.#probeTimeoutMs} ms`)),
      this.#probeTimeoutMs,
    );
    const signals = [deadline.signal, this.#stopped.signal];
    if (signal) signals.push(signal);
    const probeSignal = AbortSignal.any(signals);
    const prev = this.#edges.get(api.edgeId);
    const at = this.#now();
    try {
      const status = await raceAbort(api.status(probeSignal), probeSignal);
      if (status.edgeId !== api.edgeId) throw new Error(`edge reported id ${status.edgeId}`);
      this.#edges.set(api.edgeId, {
        edgeId: api.edgeId,
        healthy: status.healthy,
        status,
        backends: [...status.backends],
        capacity: { ...status.capacity },
        used: { ...status.used },
        observedAt: at,
        lastProbeAt: at,
        consecutiveFailures: 0,
      });
    } catch (err) {
      this.#options.onProbeError?.(api.edgeId, err);
      this.#edges.set(api.edgeId, {
        edgeId: api.edgeId,
        healthy: false,
        status: prev?.status,
        backends: prev?.backends ?? [],
        capacity: prev?.capacity ?? ZERO(),
        used: prev?.used ?? ZERO(),
        observedAt: prev?.observedAt ?? 0,
        lastProbeAt: at,
        consecutiveFailures: (prev?.consecutiveFailures ?? 0) + 1,
        lastError: err instanceof Error ? err.message : String(err),
      });
    } finally {
      clearTimeout(timer);
    }
  }

  #currentEdges(): EdgeApi[] {
    const src = this.#options.edges;
    return typeof src === 'function' ? [...src()] : [...src.values()];
  }

  #build(at: number): FleetView {
    const edges = [...this.#edges.values()].sort((a, b) => a.edgeId.localeCompare(b.edgeId));
    const totals = newTotals();
    const byBackend: FleetView['byBackend'] = {};
    const byProject: Record<string, number> = {};
    for (const e of edges) {
      addTo(totals, e);
      for (const b of e.backends) addTo((byBackend[b] ??= newTotals()), e);
      if (!e.healthy || !e.status) continue;
      for (const [p, n] of Object.entries(e.status.sandboxesByProject))
        byProject[p] = (byProject[p] ?? 0) + n;
    }
    return { refreshedAt: at, edges, byBackend, byProject, totals };
  }
}

function newTotals(): Totals {
  return { edges: 0, healthyEdges: 0, capacity: ZERO(), used: ZERO() };
}

function addTo(t: Totals, e: EdgeView): void {
  t.edges++;
  if (!e.healthy) return;
  t.healthyEdges++;
  for (const k of ['memoryMb', 'cpuCores', 'sandboxes'] as const) {
    t.capacity[k] += e.capacity[k];
    t.used[k] += e.used[k];
  }
}

/** Settles with `p`, or rejects when `signal` fires first (an edge that ignores its signal). */
function raceAbort<T>(p: Promise<T>, signal: AbortSignal): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const onAbort = () =>
      reject(signal.reason instanceof Error ? signal.reason : new Error('probe aborted'));
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    p.then(resolve, reject).finally(() => signal.removeEventListener('abort', onAbort));
  });
}
