import { Counter, Histogram, Registry } from 'prom-client';

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
}
