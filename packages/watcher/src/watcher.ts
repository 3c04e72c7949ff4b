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
  /** The edge's labels (`pool`, `hardware`, …) from its last status. */
  labels: Record<string, string>;
  /** Layers in the edge's image store, when it reports them (burst placement reads these). */
  layers?: string[] | undefined;
  /** When `used` was last reported (ms since epoch; 0 if never). */
  observedAt: number;
  lastProbeAt: number;
  consecutiveFailures: number;
  lastError?: string | undefined;
  /** Cordoned by an operator (`dsec edge cordon`): placement sends it nothing new. */
  cordoned?: boolean | undefined;
}

/** What one probe found, as `onProbe` receives it (and a registry may store it). */
export interface ProbeResult {
  /**
   * The watcher's verdict after this probe: a failed probe turns a healthy
   * edge down only at `failuresBeforeDown` failures in a row.
   */
  healthy: boolean;
  /** When the probe started (ms since epoch). */
  at: number;
  /** The status the edge reported; absent when the probe failed. */
  status?: EdgeStatus | undefined;
  /** Why the probe failed; absent when it succeeded. */
  error?: string | undefined;
  consecutiveFailures: number;
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
  /**
   * Failed probes in a row before a healthy edge is marked down. Default 1.
   * One successful probe marks it up again. `Infinity` for an edge in the
   * watcher's own process (single node): a slow probe there is a busy event
   * loop, not a lost edge; only the edge's own `healthy: false` turns it down.
   */
  failuresBeforeDown?: number;
  now?: () => number;
  /**
   * Called after every probe (e.g. to record it in an edge registry). A hook
   * that throws or rejects is reported through `onProbeError`; it never
   * changes the edge's health and is not awaited.
   */
  onProbe?: (edgeId: string, result: ProbeResult) => void | Promise<void>;
  onProbeError?: (edgeId: string, err: unknown) => void;
  /** Logs an edge going down (warn, with the probe's error) or coming up (info). */
  log?:
    ((msg: string, fields: Record<string, unknown>, level?: 'info' | 'warn') => void) | undefined;
}

const ZERO = () => ({ memoryMb: 0, cpuCores: 0, sandboxes: 0 });

/**
 * Polls `EdgeApi.status()` of every edge and keeps the fleet view placement
 * works from. Works through any `EdgeApi` (in-process edges, or `RemoteEdge`
 * clients of edges elsewhere). Holds no durable state: after a restart the
 * first `refresh()` rebuilds everything, and `onProbe` lets a registry keep
 * what it finds for processes that do not probe (see `viewFromRecords`).
 *
 * Lifecycle: `new Watcher(opts)` → `start()` (probes now, then every
 * `intervalMs`) → `view()` any time → `stop()`. `refresh()` probes once on
 * demand (tests, or right after start-up).
 *
 * The edge set is read at the start of every round: edges that joined are
 * probed in it, edges that left drop out of the view at once. An edge is
 * marked down after `failuresBeforeDown` failed probes in a row (or when it
 * reports itself unhealthy) and up again after one successful probe.
 */
export class Watcher {
  readonly #options: WatcherOptions;
  readonly #intervalMs: number;
  readonly #probeTimeoutMs: number;
  readonly #failuresBeforeDown: number;
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
    this.#failuresBeforeDown = Math.max(1, Math.floor(options.failuresBeforeDown ?? 1));
    this.#now = options.now ?? Date.now;
    this.#view = buildFleetView([], 0);
  }

  /** The latest snapshot, built when a probe round ends; O(1), never blocks. Do not mutate it. */
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
    const apis = new Map<string, EdgeApi>();
    for (const api of this.#currentEdges()) apis.set(api.edgeId, api);
    let left = false;
    for (const id of this.#edges.keys()) {
      if (apis.has(id)) continue;
      this.#edges.delete(id);
      left = true;
    }
    // An edge that left must not be placed on while the slowest probe of this round runs.
    if (left) this.#view = buildFleetView([...this.#edges.values()], this.#view.refreshedAt);
    await Promise.all([...apis.values()].map((api) => this.#probe(api, signal)));
    this.#view = buildFleetView([...this.#edges.values()], this.#now());
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
    const at = this.#now();
    let view: EdgeView;
    let result: ProbeResult;
    try {
      const status = await raceAbort(api.status(probeSignal), probeSignal);
      if (status.edgeId !== api.edgeId) throw new Error(`edge reported id ${status.edgeId}`);
      view = edgeViewOf(api.edgeId, status, at, at);
      result = { healthy: view.healthy, at, status, consecutiveFailures: 0 };
    } catch (err) {
      this.#options.onProbeError?.(api.edgeId, err);
      const prev = this.#edges.get(api.edgeId);
      const failures = (prev?.consecutiveFailures ?? 0) + 1;
      const error = err instanceof Error ? err.message : String(err);
      view = {
        ...(prev ?? edgeViewOf(api.edgeId, undefined, 0, at)),
        healthy: prev?.healthy === true && failures < this.#failuresBeforeDown,
        lastProbeAt: at,
        consecutiveFailures: failures,
        lastError: error,
      };
      result = { healthy: view.healthy, at, error, consecutiveFailures: failures };
    } finally {
      clearTimeout(timer);
    }
    const was = this.#edges.get(api.edgeId)?.healthy;
    this.#edges.set(api.edgeId, view);
    if (was !== view.healthy && (was !== undefined || !view.healthy)) {
      this.#options.log?.(
        view.healthy ? 'edge up' : 'edge down',
        { edgeId: api.edgeId, ...(view.lastError ? { err: view.lastError } : {}) },
        view.healthy ? 'info' : 'warn',
      );
    }
    this.#report(api.edgeId, result);
  }

  #report(edgeId: string, result: ProbeResult): void {
    const hook = this.#options.onProbe;
    if (!hook) return;
    const fail = (err: unknown) => this.#options.onProbeError?.(edgeId, err);
    try {
      const pending = hook(edgeId, result);
      if (pending) pending.catch(fail);
    } catch (err) {
      fail(err);
    }
  }

  #currentEdges(): EdgeApi[] {
    const src = this.#options.edges;
    return typeof src === 'function' ? [...src()] : [...src.values()];
  }
}

/** One edge as the registry keeps it (what a watcher's `onProbe` reported). */
export interface EdgeProbeRecord {
  edgeId: string;
  /** The watcher's verdict after its last probe. */
  healthy: boolean;
  /** The last status the edge reported, if it ever answered. */
  status?: EdgeStatus | undefined;
  /** When the edge was last probed (ms since epoch; 0 if never). */
  lastProbeAt: number;
  /** When `status` was reported, if known; default `lastProbeAt`. */
  observedAt?: number | undefined;
  consecutiveFailures?: number | undefined;
  lastError?: string | undefined;
}

export interface ViewFromRecordsOptions {
  /** Current time for the staleness check (ms since epoch). Default `Date.now()`. */
  now?: number;
  /**
   * An edge whose last probe is older than this counts as down (the watcher
   * that records probes may itself be gone). Default: never stale.
   */
  staleAfterMs?: number;
}

/**
 * A fleet view from persisted probe records, for a process that places
 * without probing (a stateless apiserver reading the registry a separate
 * watcher writes). Pure: the same records give the same view. An edge
 * without a status is down: nothing is known about its capacity.
 */
export function viewFromRecords(
  records: readonly EdgeProbeRecord[],
  options: ViewFromRecordsOptions = {},
): FleetView {
  const now = options.now ?? Date.now();
  const staleAfterMs = options.staleAfterMs;
  let refreshedAt = 0;
  const edges = records.map((r) => {
    refreshedAt = Math.max(refreshedAt, r.lastProbeAt);
    const view = edgeViewOf(r.edgeId, r.status, r.observedAt ?? r.lastProbeAt, r.lastProbeAt);
    const stale = staleAfterMs !== undefined && now - r.lastProbeAt > staleAfterMs;
    view.healthy = r.healthy && view.healthy && !stale;
    view.consecutiveFailures = r.consecutiveFailures ?? 0;
    const error = stale ? `no probe for ${now - r.lastProbeAt} ms` : r.lastError;
    if (error !== undefined) view.lastError = error;
    return view;
  });
  return buildFleetView(edges, refreshedAt);
}

/** The view of an edge that reported `status` (or never did). */
function edgeViewOf(
  edgeId: string,
  status: EdgeStatus | undefined,
  observedAt: number,
  lastProbeAt: number,
): EdgeView {
  return {
    edgeId,
    healthy: status?.healthy === true,
    status,
    backends: status ? [...status.backends] : [],
    capacity: status ? { ...status.capacity } : ZERO(),
    used: status ? { ...status.used } : ZERO(),
    labels: status ? { ...status.labels } : {},
    ...(status?.layers ? { layers: [...status.layers] } : {}),
    observedAt: status ? observedAt : 0,
    lastProbeAt,
    consecutiveFailures: 0,
  };
}

/** Per-edge, per-backend and per-project totals over `edges` (sorted by ID in the result). */
export function buildFleetView(edges: EdgeView[], at: number): FleetView {
  edges.sort((a, b) => (a.edgeId < b.edgeId ? -1 : a.edgeId > b.edgeId ? 1 : 0));
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
