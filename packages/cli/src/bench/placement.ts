import { cpus, release, totalmem } from 'node:os';
import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { isDsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { LeastLoadedPlacer, PowerOfKPlacer, RandomPlacer } from '@dsec/placement';
import type { PlacementEdge, PlacementView, Placer } from '@dsec/placement';

/** The strategies compared, by their JSON keys. */
export const PLACEMENT_STRATEGIES = [
  'powerOfKOverlay',
  'powerOfKOverlayShared',
  'powerOfK',
  'random',
  'leastLoadedStale',
] as const;
export type PlacementStrategy = (typeof PLACEMENT_STRATEGIES)[number];

export interface PlacementBenchOptions {
  /** Simulated edges (default 160, one production scale unit). */
  nodes?: number;
  /** Requests in the burst (default 32,000, the paper's largest job). */
  requests?: number;
  /** Placement instances (apiservers) the burst is split over, round robin (default 4). */
  instances?: number;
  /** Simulated time over which the burst arrives (default 6,400 ms: 5,000 requests/s). */
  burstMs?: number;
  /** Each instance's view is refreshed this often, phases staggered (default 2,000 ms, the watcher's default). */
  viewIntervalMs?: number;
  /** Samples per power-of-k decision (default 2). */
  k?: number;
  /** Seed of the workload and of the placers' random sources (default 1). */
  seed?: number;
  strategies?: readonly PlacementStrategy[];
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface PlacementStrategyResult {
  /** max ÷ mean node load at the end of the burst; load is a node's fullest dimension. */
  imbalance: number;
  maxLoad: number;
  meanLoad: number;
  minLoad: number;
  /** Decisions per second of one instance (all decisions ÷ the time spent deciding). */
  decisionsPerSecond: number;
  /** `place()` calls, retries after refusals included. */
  decisions: number;
  placed: number;
  /** Placements the chosen edge refused because it was really full (then retried elsewhere). */
  refusals: number;
  /** Requests that found no edge in 3 attempts (the apiserver's limit). */
  failures: number;
}

export interface PlacementBenchReport {
  benchmark: 'placement';
  fleet: {
    nodes: number;
    classes: { count: number; capacity: NodeCapacity }[];
  };
  workload: {
    requests: number;
    instances: number;
    burstMs: number;
    requestsPerSecond: number;
    sizes: { memoryMb: number[]; cpuCores: number[]; weights: number[] };
    meanMemoryMb: number;
    meanCpuCores: number;
  };
  view: {
    intervalMs: number;
    /** Views each instance took during the burst, the one at t=0 included. */
    refreshesPerInstance: number;
    /** Decisions the whole fleet makes between two refreshes of one instance's view. */
    decisionsPerRefresh: number;
    /** Of those, made by the instance itself (the overlay sees these). */
    ownDecisionsPerRefresh: number;
  };
  k: number;
  results: Record<PlacementStrategy, PlacementStrategyResult>;
  targets: {
    imbalance: number;
    decisionsPerSecond: number;
    /** Both targets met by powerOfKOverlay. */
    met: boolean;
  };
  method: string;
  limitations: string;
  machine: Record<string, unknown>;
}

interface NodeCapacity {
  memoryMb: number;
  cpuCores: number;
  sandboxes: number;
}

/** Two hardware classes: every fourth node is twice the size. */
const NODE_CLASSES: readonly NodeCapacity[] = [
  { memoryMb: 256 * 1024, cpuCores: 256, sandboxes: 1000 },
  { memoryMb: 512 * 1024, cpuCores: 512, sandboxes: 2000 },
];
const SIZES = {
  memoryMb: [256, 512, 1024, 2048, 4096],
  cpuCores: [0.25, 0.5, 1, 2, 4],
  weights: [0.3, 0.3, 0.2, 0.15, 0.05],
};
/** Edges an apiserver tries per create (`SandboxService`): the first choice plus two retries. */
const MAX_ATTEMPTS = 3;
const TARGET_IMBALANCE = 1.1;
/** Timed runs per strategy (after a warm-up run of every strategy); the median rate is reported. */
const MEASURED_RUNS = 3;
const TARGET_DECISIONS_PER_SECOND = 50_000;

/** mulberry32: deterministic, so a run is reproducible from its seed. */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

interface Workload {
  /** Index into `specs` per request. */
  kinds: Uint8Array;
  specs: SandboxSpec[];
}

function makeWorkload(requests: number, seed: number): Workload {
  const specs: SandboxSpec[] = [];
  for (const memoryLimitMb of SIZES.memoryMb) {
    for (const cpuCoresLimit of SIZES.cpuCores) {
      specs.push({
        backend: 'container',
        image: 'base',
        toolkits: [],
        memoryLimitMb,
        cpuCoresLimit,
        pidsLimit: 1024,
        ttlSeconds: 3600,
        networkRules: {},
        initUser: 'root',
        env: {},
        labels: {},
      });
    }
  }
  const random = seededRandom(seed);
  const pick = () => {
    let r = random();
    for (let i = 0; i < SIZES.weights.length; i++) {
      r -= SIZES.weights[i]!;
      if (r < 0) return i;
    }
    return SIZES.weights.length - 1;
  };
  const kinds = new Uint8Array(requests);
  // Memory and CPU drawn independently: some sandboxes are memory-heavy, some CPU-heavy.
  for (let j = 0; j < requests; j++) kinds[j] = pick() * SIZES.cpuCores.length + pick();
  return { kinds, specs };
}

/** The true state of the simulated fleet: what the edges hold. */
class Fleet {
  readonly ids: string[];
  readonly capacity: NodeCapacity[];
  readonly memoryMb: Float64Array;
  readonly cpuCores: Float64Array;
  readonly sandboxes: Int32Array;
  readonly #index = new Map<string, number>();

  constructor(nodes: number) {
    this.ids = Array.from({ length: nodes }, (_, i) => `edge-${String(i).padStart(3, '0')}`);
    this.capacity = this.ids.map((_, i) => NODE_CLASSES[i % 4 === 3 ? 1 : 0]!);
    this.memoryMb = new Float64Array(nodes);
    this.cpuCores = new Float64Array(nodes);
    this.sandboxes = new Int32Array(nodes);
    this.ids.forEach((id, i) => this.#index.set(id, i));
  }

  indexOf(edgeId: string): number {
    return this.#index.get(edgeId)!;
  }

  /** The edge's own admission: it refuses what does not fit, whatever the placer thought. */
  admit(i: number, spec: SandboxSpec): boolean {
    const cap = this.capacity[i]!;
    if (
      this.sandboxes[i]! + 1 > cap.sandboxes ||
      this.memoryMb[i]! + spec.memoryLimitMb > cap.memoryMb ||
      this.cpuCores[i]! + spec.cpuCoresLimit > cap.cpuCores + 1e-9
    )
      return false;
    this.sandboxes[i]! += 1;
    this.memoryMb[i]! += spec.memoryLimitMb;
    this.cpuCores[i]! += spec.cpuCoresLimit;
    return true;
  }

  /** A watcher snapshot taken at `at`: a new immutable view. */
  snapshot(at: number): PlacementView {
    const edges: PlacementEdge[] = this.ids.map((edgeId, i) => ({
      edgeId,
      healthy: true,
      backends: ['container'],
      capacity: this.capacity[i]!,
      used: {
        memoryMb: this.memoryMb[i]!,
        cpuCores: this.cpuCores[i]!,
        sandboxes: this.sandboxes[i]!,
      },
      observedAt: at,
      labels: { hardware: i % 4 === 3 ? 'large' : 'standard' },
    }));
    return { edges };
  }

  /** Each node's fullest dimension, as placement measures load. */
  loads(): number[] {
    return this.ids.map((_, i) => {
      const cap = this.capacity[i]!;
      return Math.max(
        this.sandboxes[i]! / cap.sandboxes,
        this.memoryMb[i]! / cap.memoryMb,
        this.cpuCores[i]! / cap.cpuCores,
      );
    });
  }

  placedTotal(): number {
    return this.sandboxes.reduce((a, b) => a + b, 0);
  }
}

interface SimulationConfig {
  nodes: number;
  requests: number;
  instances: number;
  burstMs: number;
  viewIntervalMs: number;
  k: number;
  seed: number;
}

/** One refresh of one instance's view, at a simulated time. */
interface RefreshEvent {
  at: number;
  instance: number;
}

/**
 * Refresh times: instance i takes a view at t=0 and then at i·interval/instances
 * + m·interval, so the instances' views lag by different amounts at any moment
 * (as apiservers reading the registry on their own timers do).
 */
function refreshSchedule(cfg: SimulationConfig): RefreshEvent[] {
  const events: RefreshEvent[] = [];
  for (let i = 0; i < cfg.instances; i++) {
    for (
      let at = (i * cfg.viewIntervalMs) / cfg.instances;
      at < cfg.burstMs;
      at += cfg.viewIntervalMs
    ) {
      if (at > 0) events.push({ at, instance: i });
    }
  }
  return events.sort((a, b) => a.at - b.at || a.instance - b.instance);
}

function makePlacer(
  strategy: PlacementStrategy,
  view: () => PlacementView,
  now: () => number,
  k: number,
  random: () => number,
  instances: number,
): Placer {
  switch (strategy) {
    case 'powerOfKOverlay':
      return new PowerOfKPlacer({ view, k, random, now });
    case 'powerOfKOverlayShared':
      return new PowerOfKPlacer({ view, k, random, now, instances });
    case 'powerOfK':
      return new PowerOfKPlacer({ view, k, random, now, overlay: false });
    case 'random':
      return new RandomPlacer({ view, random });
    case 'leastLoadedStale':
      return new LeastLoadedPlacer({ view });
  }
}

export interface SimulationOutcome extends PlacementStrategyResult {
  /** Views taken per instance, t=0 included. */
  refreshes: number[];
  /** Final per-node usage, for checks. */
  fleet: { memoryMb: number[]; cpuCores: number[]; sandboxes: number[]; capacity: NodeCapacity[] };
}

/**
 * Runs one strategy over the burst with the real placers. Requests arrive
 * evenly over `burstMs`, request j going to instance j mod instances; each
 * instance decides from its own view, which is replaced only at its refresh
 * events by a snapshot of the true fleet at that moment. A chosen edge that is
 * really full refuses (the edge has the final say) and the instance retries
 * with that edge excluded, like the apiserver. The decision loop between two
 * refresh events is timed as a whole.
 */
export function simulatePlacement(
  strategy: PlacementStrategy,
  cfg: SimulationConfig,
  workload: Workload = makeWorkload(cfg.requests, cfg.seed),
  onWindow?: (done: number) => void,
): SimulationOutcome {
  const fleet = new Fleet(cfg.nodes);
  const views: PlacementView[] = [];
  const refreshes: number[] = [];
  let now = 0;
  const placers: Placer[] = [];
  for (let i = 0; i < cfg.instances; i++) {
    views.push(fleet.snapshot(0));
    refreshes.push(1);
    placers.push(
      makePlacer(
        strategy,
        () => views[i]!,
        () => now,
        cfg.k,
        seededRandom(cfg.seed * 7919 + i),
        cfg.instances,
      ),
    );
  }
  const events = refreshSchedule(cfg);
  const msPerRequest = cfg.burstMs / cfg.requests;
  let decisions = 0;
  let refusals = 0;
  let failures = 0;
  let elapsedNs = 0n;
  let j = 0;
  for (let e = 0; e <= events.length; e++) {
    const event = events[e];
    // Requests strictly before the event: at t_j = j·msPerRequest < event.at.
    const end =
      event === undefined
        ? cfg.requests
        : Math.min(cfg.requests, Math.ceil(event.at / msPerRequest - 1e-9));
    const t0 = process.hrtime.bigint();
    for (; j < end; j++) {
      now = j * msPerRequest;
      const placer = placers[j % cfg.instances]!;
      const spec = workload.specs[workload.kinds[j]!]!;
      let exclude: Set<string> | undefined;
      for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
        let edgeId: string;
        decisions++;
        try {
          edgeId = placer.place(exclude ? { spec, exclude } : { spec });
        } catch (err) {
          if (!isDsecError(err, 'capacity_exhausted')) throw err;
          failures++;
          break;
        }
        if (fleet.admit(fleet.indexOf(edgeId), spec)) break;
        refusals++;
        (exclude ??= new Set()).add(edgeId);
        if (attempt === MAX_ATTEMPTS - 1) failures++;
      }
    }
    elapsedNs += process.hrtime.bigint() - t0;
    onWindow?.(j);
    if (event) {
      views[event.instance] = fleet.snapshot(event.at);
      refreshes[event.instance]! += 1;
    }
  }
  const loads = fleet.loads();
  const mean = loads.reduce((a, b) => a + b, 0) / loads.length;
  const max = Math.max(...loads);
  const seconds = Number(elapsedNs) / 1e9;
  return {
    imbalance: round(max / mean, 4),
    maxLoad: round(max, 4),
    meanLoad: round(mean, 4),
    minLoad: round(Math.min(...loads), 4),
    decisionsPerSecond: Math.round(decisions / seconds),
    decisions,
    placed: fleet.placedTotal(),
    refusals,
    failures,
    refreshes,
    fleet: {
      memoryMb: [...fleet.memoryMb],
      cpuCores: [...fleet.cpuCores],
      sandboxes: [...fleet.sandboxes],
      capacity: fleet.capacity,
    },
  };
}

function round(x: number, digits: number): number {
  const f = 10 ** digits;
  return Math.round(x * f) / f;
}

/**
 * `dsec bench placement`: the real placers over a simulated fleet (no
 * sandboxes, no network). Every strategy runs once to warm the JIT, then
 * each three times measured, all with the same seed, so every run makes the same
 * decisions and only the timing differs; the median rate is reported.
 */
export async function benchPlacement(
  options: PlacementBenchOptions = {},
): Promise<PlacementBenchReport> {
  const cfg: SimulationConfig = {
    nodes: options.nodes ?? 160,
    requests: options.requests ?? 32_000,
    instances: options.instances ?? 4,
    burstMs: options.burstMs ?? 6400,
    viewIntervalMs: options.viewIntervalMs ?? 2000,
    k: options.k ?? 2,
    seed: options.seed ?? 1,
  };
  for (const [name, value] of Object.entries(cfg)) {
    if (!Number.isFinite(value) || value <= 0 || (name !== 'burstMs' && !Number.isInteger(value)))
      throw new Error(
        `bench placement: --${name} must be a positive ${name === 'burstMs' ? 'number' : 'integer'}`,
      );
  }
  const strategies = options.strategies ?? PLACEMENT_STRATEGIES;
  const workload = makeWorkload(cfg.requests, cfg.seed);
  const total = strategies.length * cfg.requests;
  const results = {} as Record<PlacementStrategy, PlacementStrategyResult>;
  let refreshes: number[] = [];
  // Warm every strategy up before timing any: they share the decision code, and
  // the one measured first would otherwise pay for the JIT's tiering.
  for (const strategy of strategies) {
    if (options.signal?.aborted) throw new Error('benchmark aborted');
    simulatePlacement(strategy, cfg, workload);
    await yieldToLoop();
  }
  for (const [s, strategy] of strategies.entries()) {
    if (options.signal?.aborted) throw new Error('benchmark aborted');
    const rates: number[] = [];
    let outcome: SimulationOutcome | undefined;
    for (let run = 0; run < MEASURED_RUNS; run++) {
      await yieldToLoop();
      outcome = simulatePlacement(strategy, cfg, workload, (done) =>
        options.onProgress?.(
          s * cfg.requests + Math.floor((run * cfg.requests + done) / MEASURED_RUNS),
          total,
        ),
      );
      rates.push(outcome.decisionsPerSecond);
    }
    const { refreshes: r, fleet: _fleet, ...result } = outcome!;
    refreshes = r;
    rates.sort((a, b) => a - b);
    results[strategy] = { ...result, decisionsPerSecond: rates[(MEASURED_RUNS - 1) / 2]! };
    await yieldToLoop();
  }
  const mean = (xs: number[]) =>
    workload.kinds.reduce((a, kind) => a + xs[kind]!, 0) / cfg.requests;
  const specMemory = workload.specs.map((s) => s.memoryLimitMb);
  const specCpu = workload.specs.map((s) => s.cpuCoresLimit);
  const perRefresh = Math.round((cfg.requests * cfg.viewIntervalMs) / cfg.burstMs);
  const best = results.powerOfKOverlay;
  const classCount = [0, 0];
  for (let i = 0; i < cfg.nodes; i++) classCount[i % 4 === 3 ? 1 : 0]! += 1;
  return {
    benchmark: 'placement',
    fleet: {
      nodes: cfg.nodes,
      classes: NODE_CLASSES.map((capacity, i) => ({ count: classCount[i]!, capacity })),
    },
    workload: {
      requests: cfg.requests,
      instances: cfg.instances,
      burstMs: cfg.burstMs,
      requestsPerSecond: Math.round((cfg.requests * 1000) / cfg.burstMs),
      sizes: SIZES,
      meanMemoryMb: round(mean(specMemory), 1),
      meanCpuCores: round(mean(specCpu), 3),
    },
    view: {
      intervalMs: cfg.viewIntervalMs,
      refreshesPerInstance: Math.min(...refreshes),
      decisionsPerRefresh: perRefresh,
      ownDecisionsPerRefresh: Math.round(perRefresh / cfg.instances),
    },
    k: cfg.k,
    results,
    targets: {
      imbalance: TARGET_IMBALANCE,
      decisionsPerSecond: TARGET_DECISIONS_PER_SECOND,
      met:
        best !== undefined &&
        best.imbalance <= TARGET_IMBALANCE &&
        best.decisionsPerSecond >= TARGET_DECISIONS_PER_SECOND,
    },
    method:
      `The real placers of @dsec/placement over a simulated fleet of ${cfg.nodes} edges (every fourth one twice the size). ` +
      `${cfg.requests} requests of varied sizes arrive evenly over ${cfg.burstMs} ms of simulated time and are split round robin over ` +
      `${cfg.instances} placement instances, each with its own placer and its own view. An instance's view is a snapshot of the ` +
      `true fleet taken every ${cfg.viewIntervalMs} ms of simulated time (phases staggered across instances), so between refreshes ` +
      `about ${perRefresh} decisions are made fleet-wide that the view does not show, ${Math.round(perRefresh / cfg.instances)} of them by the instance itself. ` +
      `A chosen edge that is really full refuses and the instance retries on another (at most ${MAX_ATTEMPTS} attempts). ` +
      `Imbalance is max ÷ mean node load at the end of the burst, load being a node's fullest dimension (sandboxes, memory, CPU). ` +
      `decisionsPerSecond is decisions ÷ the time of the decision loops on one thread (the simulator's own O(1) bookkeeping included), ` +
      `i.e. what one instance sustains; every strategy runs once to warm up, then each ${MEASURED_RUNS} times measured with the same seed ` +
      `(the same decisions every time), and the median rate is reported.`,
    limitations:
      'Simulated edges: creation is instant, nothing terminates during the burst, and edges refuse only on the three requested dimensions (not on measured pressure). One process runs every instance in turn, so the views are exact snapshots with no network delay.',
    machine: {
      cpu: cpus()[0]?.model ?? 'unknown',
      cores: cpus().length,
      memoryGiB: Math.round(totalmem() / 2 ** 30),
      kernel: release(),
      node: process.version,
    },
  };
}
