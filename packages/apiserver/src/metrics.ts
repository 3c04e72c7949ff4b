import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { AuthStats } from '@dsec/iam';

/** Where the bound metrics read their values (set by `buildApiServer`). */
export interface BoundSources {
  /** IAM's counters (failed authentications, denials). */
  authStats?: () => AuthStats;
  /** Open connections of the listener. */
  openConnections?: () => number;
  /** Streams open and the bytes they have queued. */
  streams?: () => { open: number; queuedBytes: number };
}

/**
 * Prometheus metrics of one apiserver. Each server owns its registry, so
 * several servers in one process (tests, an in-process cluster) never clash.
 * Route labels use the route pattern, never the raw URL, to bound cardinality.
 */
export class ApiMetrics {
  readonly registry = new Registry();
  /**
   * Registries served with this one at `/metrics`: the in-process edge's in
   * `dsec up`. Their metric names must differ from these.
   */
  readonly included: Registry[] = [];

  /** This registry and the included ones. */
  registries(): Registry[] {
    return [this.registry, ...this.included];
  }

  /** The Prometheus text of this registry and the included ones. */
  async text(): Promise<string> {
    const parts = await Promise.all(this.registries().map((r) => r.metrics()));
    return parts.join('\n');
  }

  readonly requests = new Counter({
    name: 'dsec_http_requests_total',
    help: 'HTTP requests by method, route pattern and status.',
    labelNames: ['method', 'route', 'status'] as const,
    registers: [this.registry],
  });
  readonly latency = new Histogram({
    name: 'dsec_http_request_duration_seconds',
    help: 'HTTP request latency by method and route pattern.',
    labelNames: ['method', 'route'] as const,
    buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
    registers: [this.registry],
  });
  /** One answered request: its count by status and its latency, under its route pattern. */
  record(method: string, route: string, status: number, seconds: number): void {
    this.requests.inc({ method, route, status: String(status) });
    this.latency.observe({ method, route }, seconds);
  }
  readonly sandboxesCreated = new Counter({
    name: 'dsec_sandboxes_created_total',
    help: 'Sandboxes created, by backend.',
    labelNames: ['backend'] as const,
    registers: [this.registry],
  });
  readonly sandboxCreateFailures = new Counter({
    name: 'dsec_sandbox_create_failures_total',
    help: 'Sandbox creates that failed, by error code.',
    labelNames: ['code'] as const,
    registers: [this.registry],
  });
  readonly placementRetries = new Counter({
    name: 'dsec_placement_retries_total',
    help: 'Creates retried on another edge after the first refused.',
    registers: [this.registry],
  });

  // ---- bounds per caller (docs/security.md, "Bounded work per caller") ----

  /** Set by the server: where the collected series below read from. */
  readonly sources: BoundSources = {};

  readonly authFailures = countersFrom(
    this.registry,
    'dsec_auth_failures_total',
    'Failed authentications by reason (missing, malformed, unknown, revoked, rate_limited).',
    'reason',
    () => this.sources.authStats?.().failures,
  );
  readonly accessDenials = countersFrom(
    this.registry,
    'dsec_access_denials_total',
    'Requests of authenticated callers denied, by audited action.',
    'action',
    () => this.sources.authStats?.().denials,
  );
  readonly connections = new Gauge({
    name: 'dsec_http_connections',
    help: 'Open connections of the API listener.',
    registers: [this.registry],
    collect: (): void => {
      const open = this.sources.openConnections;
      if (open) this.connections.set(open());
    },
  });
  readonly connectionEvents = new Counter({
    name: 'dsec_http_connections_closed_total',
    help: 'Connections refused or closed by the connection caps, by reason.',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });
  readonly requestsRefused = new Counter({
    name: 'dsec_http_requests_refused_total',
    help: 'Requests refused before any route by a bound (host, url_too_long, requests_per_key, streams_per_key).',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });
  readonly streamsCut = new Counter({
    name: 'dsec_streams_cut_total',
    help: 'Output streams cut with their connection because the client did not read, by reason.',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });
  readonly streamsOpen = new Gauge({
    name: 'dsec_streams_open',
    help: 'Output streams open.',
    registers: [this.registry],
    collect: (): void => {
      const streams = this.sources.streams;
      if (streams) this.streamsOpen.set(streams().open);
    },
  });
  readonly streamQueuedBytes = new Gauge({
    name: 'dsec_stream_queued_bytes',
    help: 'Output queued for clients that have not read it yet, all streams together.',
    registers: [this.registry],
    collect: (): void => {
      const streams = this.sources.streams;
      if (streams) this.streamQueuedBytes.set(streams().queuedBytes);
    },
  });
}

/**
 * A counter whose values are another component's own monotonic counters
 * (IAM's), read at every scrape: nothing to keep in step by hand.
 */
function countersFrom(
  registry: Registry,
  name: string,
  help: string,
  label: string,
  read: () => Record<string, number> | undefined,
): Counter<string> {
  const counter: Counter<string> = new Counter({
    name,
    help,
    labelNames: [label],
    registers: [registry],
    collect: (): void => {
      const values = read();
      if (!values) return;
      counter.reset();
      for (const [value, n] of Object.entries(values)) counter.inc({ [label]: value }, n);
    },
  });
  return counter;
}
