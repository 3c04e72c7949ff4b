import { readFile } from 'node:fs/promises';
import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import type {
  AdmissionRefusal,
  CommandOutcome,
  FnCallOutcome,
  FnCallPoolStatus,
  NodePressure,
  SandboxEventKind,
  SandboxState,
} from '@dsec/core';
import type { BlobDaemonStats } from '../ondemand/blob-daemon.js';

/**
 * The steps of a sandbox create that `dsec_create_phase_seconds` times.
 * `layers`: every layer acquired (mounted, or found mounted); `chronus`: its
 * cgroups made and the command daemon forked; `network`: namespace, veth and
 * firewall set up (these two and the writable-layer image run in parallel);
 * `runtime`: the OCI runtime run until the init is up; `attach`: the daemon
 * and the network joined to the init; `total`: the whole create on the edge,
 * queueing at the create gate included.
 */
export const CREATE_PHASES = [
  'layers',
  'chronus',
  'network',
  'runtime',
  'attach',
  'total',
] as const;
export type CreatePhase = (typeof CREATE_PHASES)[number];

/** Every state `dsec_edge_sandboxes` reports, zero included, so a drained state reads 0. */
const SANDBOX_STATES: readonly SandboxState[] = [
  'creating',
  'running',
  'stopping',
  'paused',
  'stopped',
  'failed',
];

/** What the scrape-time metrics read; each is optional, and a failing one is skipped. */
export interface EdgeMetricsSources {
  /** Sandboxes the edge's store holds, by state (ended ones within its retention window). */
  sandboxStates?: () => Promise<readonly SandboxState[]> | readonly SandboxState[];
  /** The admission view: capacity, what is held, the latest pressure sample. */
  admission?: () => {
    capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
    used: { memoryMb: number; cpuCores: number; sandboxes: number };
    pressure: NodePressure | undefined;
  };
  /** The layer mount cache's counters and sizes. */
  layerCache?: () => {
    hits: number;
    misses: number;
    mounted: number;
    inUse: number;
    bytes: number;
  };
  /** The blob daemon's `.stats` (undefined while no daemon serves). */
  blobStats?: () => Promise<BlobDaemonStats | undefined>;
  /** The FnCall pools (absent on an edge that runs no function calls). */
  fncallPools?: () => readonly FnCallPoolStatus[];
}

export interface EdgeMetricsOptions {
  /** Registry to register in; default a new one (several edges in one process never clash). */
  registry?: Registry | undefined;
  /**
   * Labels put on every series of the registry (`{ edge: 'node-1' }`), so
   * several edges scraped into one Prometheus stay apart. Default none.
   */
  defaultLabels?: Record<string, string> | undefined;
  /** Series of one scrape share one read of the blob daemon's `.stats` younger than this (default 500). */
  blobStatsReuseMs?: number | undefined;
}

/** Buckets from 1 ms to 60 s: a warm create is tens of ms, a cold remote layer seconds. */
const PHASE_BUCKETS_S = [
  0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
];
/** A scrape never waits longer than this on the blob daemon's FUSE mount. */
const BLOB_STATS_TIMEOUT_MS = 1000;
/** Series of one scrape share one read of the blob daemon's `.stats`. */
const BLOB_STATS_REUSE_MS = 500;

/**
 * Prometheus metrics of one edge (docs/observability.md lists them all).
 * Events (a refusal, a phase timed, a command finished) are counted as they
 * happen through the methods below; levels (sandboxes by state, node
 * pressure, cache counters kept by other components or processes) are read
 * from `sources` when scraped, so nothing goes stale between scrapes.
 *
 * @example
 * ```ts
 * const metrics = new EdgeMetrics({ defaultLabels: { edge: 'node-1' } });
 * const edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, metrics });
 * const text = await metrics.registry.metrics(); // Prometheus text format
 * ```
 */
export class EdgeMetrics {
  readonly registry: Registry;
  #sources: EdgeMetricsSources = {};

  readonly createPhase: Histogram<'phase'>;
  readonly admissionRefusals: Counter<'resource' | 'measure'>;
  readonly commandOutcomes: Counter<'outcome'>;
  readonly sandboxEvents: Counter<'kind'>;
  readonly sandboxEventsDropped: Counter<'kind'>;
  readonly dnsDenials: Counter;
  readonly sandboxStarts: Counter<'result'>;
  readonly fncallCalls: Counter<'runtime' | 'outcome'>;
  readonly fncallSeconds: Histogram<'runtime'>;
  readonly fncallErrors: Counter<'code'>;

  constructor(options: EdgeMetricsOptions = {}) {
    const registry = options.registry ?? new Registry();
    this.registry = registry;
    if (options.defaultLabels) registry.setDefaultLabels(options.defaultLabels);
    const registers = [registry];
    const sources = () => this.#sources;
    const blobReuseMs = options.blobStatsReuseMs ?? BLOB_STATS_REUSE_MS;

    this.createPhase = new Histogram({
      name: 'dsec_create_phase_seconds',
      help: 'Time spent in each phase of a sandbox create on the edge.',
      labelNames: ['phase'] as const,
      buckets: PHASE_BUCKETS_S,
      registers,
    });
    this.admissionRefusals = new Counter({
      name: 'dsec_admission_refusals_total',
      help: 'Creates the edge refused at admission, by the resource that ran out and its measure.',
      labelNames: ['resource', 'measure'] as const,
      registers,
    });
    this.commandOutcomes = new Counter({
      name: 'dsec_command_outcomes_total',
      help: 'Commands run to completion on the edge, by outcome (exited, signaled, timeout, oom, killed).',
      labelNames: ['outcome'] as const,
      registers,
    });
    this.sandboxEvents = new Counter({
      name: 'dsec_sandbox_events_total',
      help: 'Misbehaviour events of sandboxes, by kind, counting repeats the event log folds.',
      labelNames: ['kind'] as const,
      registers,
    });
    this.sandboxEventsDropped = new Counter({
      name: 'dsec_sandbox_events_dropped_total',
      help: "Sandbox events not stored: the event log's write queue was full, or its write failed.",
      labelNames: ['kind'] as const,
      registers,
    });
    this.dnsDenials = new Counter({
      name: 'dsec_dns_denials_total',
      help: 'DNS queries of sandboxes refused by their network policy.',
      registers,
    });
    this.sandboxStarts = new Counter({
      name: 'dsec_sandbox_starts_total',
      help: 'Sandbox starts on the edge after admission, by result (ok, failed).',
      labelNames: ['result'] as const,
      registers,
    });

    this.fncallCalls = new Counter({
      name: 'dsec_fncall_calls_total',
      help: 'Function calls the edge answered, by runtime and outcome (ok, timeout, oom, output_limit, signaled, pids_limit, runtime_error).',
      labelNames: ['runtime', 'outcome'] as const,
      registers,
    });
    this.fncallSeconds = new Histogram({
      name: 'dsec_fncall_call_seconds',
      help: 'Time from a function call reaching the edge to its answer (waiting for a worker included), by runtime.',
      labelNames: ['runtime'] as const,
      buckets: PHASE_BUCKETS_S,
      registers,
    });
    this.fncallErrors = new Counter({
      name: 'dsec_fncall_errors_total',
      help: 'Function calls the edge answered with an error instead of a result, by error code.',
      labelNames: ['code'] as const,
      registers,
    });
    new Gauge({
      name: 'dsec_fncall_workers',
      help: 'FnCall worker sandboxes on the edge, by runtime and state (idle, busy, starting).',
      labelNames: ['runtime', 'state'] as const,
      registers,
      collect() {
        const pools = sources().fncallPools?.();
        if (!pools) return;
        this.reset();
        const sums = new Map<string, { idle: number; busy: number; starting: number }>();
        for (const p of pools) {
          const s = sums.get(p.language) ?? { idle: 0, busy: 0, starting: 0 };
          s.idle += p.idle;
          s.busy += p.busy;
          s.starting += p.starting;
          sums.set(p.language, s);
        }
        for (const [runtime, s] of sums)
          for (const state of ['idle', 'busy', 'starting'] as const)
            this.set({ runtime, state }, s[state]);
      },
    });

    new Gauge({
      name: 'dsec_edge_sandboxes',
      help: 'Sandboxes on the edge by state (stopped and failed ones within the retention window).',
      labelNames: ['state'] as const,
      registers,
      async collect() {
        const read = sources().sandboxStates;
        if (!read) return;
        const counts = new Map<string, number>(SANDBOX_STATES.map((s) => [s, 0]));
        for (const s of await read()) counts.set(s, (counts.get(s) ?? 0) + 1);
        for (const [state, n] of counts) this.set({ state }, n);
      },
    });

    // Node capacity and pressure: what admission decides by (ADR 0007).
    const admissionGauge = (
      name: string,
      help: string,
      pick: (v: ReturnType<NonNullable<EdgeMetricsSources['admission']>>) => number | undefined,
    ) =>
      new Gauge({
        name,
        help,
        registers,
        collect() {
          const view = sources().admission?.();
          const value = view && pick(view);
          // Without a sample (a failed read) the last one stands: an unlabelled
          // gauge cannot be absent, and 0 would read as "no memory left".
          if (value !== undefined) this.set(value);
        },
      });
    const MB = 2 ** 20;
    admissionGauge(
      'dsec_node_capacity_sandboxes',
      'Sandboxes the edge would hold now.',
      (v) => v.capacity.sandboxes,
    );
    admissionGauge(
      'dsec_node_admitted_sandboxes',
      'Sandboxes admitted and not yet ended.',
      (v) => v.used.sandboxes,
    );
    admissionGauge(
      'dsec_node_requested_memory_bytes',
      'Sum of the memory ceilings of admitted sandboxes.',
      (v) => v.used.memoryMb * MB,
    );
    admissionGauge(
      'dsec_node_requested_cpu_cores',
      'Sum of the CPU ceilings of admitted sandboxes.',
      (v) => v.used.cpuCores,
    );
    admissionGauge('dsec_node_memory_total_bytes', 'Memory of the node.', (v) =>
      mb(v.pressure?.memoryTotalMb),
    );
    admissionGauge(
      'dsec_node_memory_available_bytes',
      'Memory available on the node (MemAvailable).',
      (v) => mb(v.pressure?.memoryAvailableMb),
    );
    admissionGauge(
      'dsec_node_sandbox_memory_bytes',
      'Memory charged to the sandboxes (working set).',
      (v) => mb(v.pressure?.sandboxMemoryMb),
    );
    admissionGauge(
      'dsec_node_cpu_pressure_percent',
      'CPU pressure of the node (PSI some avg10).',
      (v) => v.pressure?.cpuPressurePercent,
    );
    admissionGauge(
      'dsec_node_sandbox_cpu_percent',
      'CPU used by the sandboxes, in percent of all cores.',
      (v) => v.pressure?.sandboxCpuPercent,
    );
    admissionGauge('dsec_node_threads', 'Threads on the node.', (v) => v.pressure?.threads);
    admissionGauge(
      'dsec_node_threads_limit',
      'Thread limit of the node (kernel.threads-max).',
      (v) => v.pressure?.threadsLimit,
    );
    admissionGauge('dsec_node_disk_free_bytes', 'Free disk under the edge state directory.', (v) =>
      mb(v.pressure?.diskFreeMb),
    );
    new Gauge({
      name: 'dsec_node_refusing',
      help: '1 for the resource a new sandbox would be refused on now (at most one is 1).',
      labelNames: ['resource'] as const,
      registers,
      collect() {
        this.reset();
        const refusing = sources().admission?.().pressure?.refusing;
        if (refusing) this.set({ resource: refusing.resource }, 1);
      },
    });

    // Counters kept by other components: mirrored at scrape time.
    const mirrored = (
      name: string,
      help: string,
      labelNames: readonly string[],
      read: () => Promise<Record<string, number> | undefined> | Record<string, number> | undefined,
    ) =>
      new Counter({
        name,
        help,
        labelNames,
        registers,
        async collect() {
          const values = await read();
          this.reset();
          if (!values) return;
          for (const [label, n] of Object.entries(values)) {
            if (labelNames.length === 0) this.inc(n);
            else this.inc({ [labelNames[0]!]: label }, n);
          }
        },
      });
    mirrored(
      'dsec_layer_cache_lookups_total',
      'Layer acquisitions that found the layer mounted (hit) or had to mount it (miss).',
      ['result'],
      () => {
        const c = sources().layerCache?.();
        return c && { hit: c.hits, miss: c.misses };
      },
    );
    new Gauge({
      name: 'dsec_layer_cache_mounted',
      help: 'Layers mounted on the edge, and those of them in use by a sandbox.',
      labelNames: ['use'] as const,
      registers,
      collect() {
        const c = sources().layerCache?.();
        if (!c) return;
        this.set({ use: 'all' }, c.mounted);
        this.set({ use: 'in_use' }, c.inUse);
      },
    });
    let blob: { at: number; stats: Promise<BlobDaemonStats | undefined> } | undefined;
    // One read of `.stats` per scrape, shared by the series below.
    const blobStats = () => {
      const now = performance.now();
      if (!blob || now - blob.at >= blobReuseMs)
        blob = { at: now, stats: readBlobStats(sources().blobStats) };
      return blob.stats;
    };
    mirrored(
      'dsec_blob_chunk_lookups_total',
      'Chunk reads of the blob daemon served from its cache (hit) or fetched (miss); reset when the daemon restarts.',
      ['result'],
      async () => {
        const s = await blobStats();
        return s && { hit: s.cache.hits, miss: s.cache.misses };
      },
    );
    mirrored(
      'dsec_blob_fetched_bytes_total',
      'Bytes the blob daemon fetched from the image store; reset when the daemon restarts.',
      [],
      async () => {
        const s = await blobStats();
        return s && { bytes: s.cache.bytesFetched };
      },
    );
  }

  /** Where scrape-time metrics are read from; replaces earlier sources. */
  bind(sources: EdgeMetricsSources): void {
    this.#sources = sources;
  }

  observePhase(phase: CreatePhase, seconds: number): void {
    this.createPhase.observe({ phase }, seconds);
  }

  /**
   * Times `work` as `phase` when it succeeds (a failed step is not a sample
   * of how long the step takes) and returns its promise unchanged.
   */
  timePhase<T>(phase: CreatePhase, work: Promise<T>): Promise<T> {
    const start = performance.now();
    void work.then(
      () => this.observePhase(phase, (performance.now() - start) / 1000),
      () => undefined,
    );
    return work;
  }

  admissionRefused(refusal: Pick<AdmissionRefusal, 'resource' | 'measure'>): void {
    this.admissionRefusals.inc({ resource: refusal.resource, measure: refusal.measure });
  }

  started(ok: boolean): void {
    this.sandboxStarts.inc({ result: ok ? 'ok' : 'failed' });
  }

  commandFinished(outcome: CommandOutcome): void {
    this.commandOutcomes.inc({ outcome });
  }

  /** A function call answered with a result (its runtime is one the edge knows). */
  fncallFinished(runtime: string, outcome: FnCallOutcome, seconds: number): void {
    this.fncallCalls.inc({ runtime, outcome });
    this.fncallSeconds.observe({ runtime }, seconds);
  }

  /** A function call answered with an error (labelled by code only: its language may be anything). */
  fncallFailed(code: string): void {
    this.fncallErrors.inc({ code });
  }

  /** One misbehaviour event (each occurrence, folded repeats included). */
  sandboxEvent(kind: SandboxEventKind): void {
    this.sandboxEvents.inc({ kind });
    if (kind === 'dns_blocked') this.dnsDenials.inc();
  }

  /** One event the event log could not store (its queue full, or its write failed). */
  sandboxEventDropped(kind: SandboxEventKind): void {
    this.sandboxEventsDropped.inc({ kind });
  }
}

/**
 * Times consecutive phases: each call observes the time since the previous
 * call (or since the clock was made) as `phase`; `undefined` only restarts
 * the clock. A no-op without metrics.
 */
export function phaseClock(
  metrics: EdgeMetrics | undefined,
): (phase: CreatePhase | undefined) => void {
  if (!metrics) return () => undefined;
  let last = performance.now();
  return (phase) => {
    const now = performance.now();
    if (phase) metrics.observePhase(phase, (now - last) / 1000);
    last = now;
  };
}

function mb(value: number | undefined): number | undefined {
  return value === undefined ? undefined : value * 2 ** 20;
}

async function readBlobStats(
  read: (() => Promise<BlobDaemonStats | undefined>) | undefined,
): Promise<BlobDaemonStats | undefined> {
  if (!read) return undefined;
  let timer: NodeJS.Timeout | undefined;
  // A hung daemon must not hang the scrape: its series are then left out.
  const timeout = new Promise<undefined>((resolve) => {
    timer = setTimeout(() => resolve(undefined), BLOB_STATS_TIMEOUT_MS);
  });
  try {
    return await Promise.race([read().catch(() => undefined), timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** Reads a blob daemon's `.stats` file; undefined while no daemon serves the mount. */
export function blobStatsFile(path: string): () => Promise<BlobDaemonStats | undefined> {
  return async () => {
    const text = await readFile(path, 'utf8').catch(() => undefined);
    return text === undefined ? undefined : (JSON.parse(text) as BlobDaemonStats);
  };
}
