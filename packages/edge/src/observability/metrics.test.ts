import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError, type NodePressure } from '@dsec/core';
import type { BlobDaemonStats } from '../ondemand/blob-daemon.js';
import { EdgeMetrics, phaseClock, type EdgeMetricsSources } from './metrics.js';
import { metricsText, parseListenAddress, serveMetrics } from './metrics-listener.js';

/** The value of one sample line (`name{labels} value`), or undefined when absent. */
function sample(text: string, series: string): number | undefined {
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return undefined;
}

const pressure: NodePressure = {
  measuredAt: new Date(0).toISOString(),
  memoryTotalMb: 1024,
  memoryAvailableMb: 512,
  sandboxMemoryMb: 100,
  cpuPressurePercent: 3.5,
  sandboxCpuPercent: 12.5,
  threads: 900,
  threadsLimit: 100_000,
  diskFreeMb: 2048,
  refusing: { resource: 'memory', measure: 'available_mb', current: 10, limit: 64 },
};

test('sandboxes by state: every state is reported, drained ones as 0', async () => {
  const m = new EdgeMetrics();
  let states = ['running', 'running', 'paused'] as const;
  m.bind({ sandboxStates: () => states });
  let text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="running"}'), 2);
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="paused"}'), 1);
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="failed"}'), 0);
  states = ['stopped', 'stopped', 'stopped'] as unknown as typeof states;
  text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="running"}'), 0);
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="stopped"}'), 3);
});

test('create phases: a succeeded step is observed, a failed one is not', async () => {
  const m = new EdgeMetrics();
  assert.equal(await m.timePhase('network', Promise.resolve(7)), 7);
  await assert.rejects(m.timePhase('runtime', Promise.reject(new Error('runc failed'))), {
    message: 'runc failed',
  });
  const clock = phaseClock(m);
  clock('layers');
  clock(undefined);
  clock('attach');
  await new Promise((r) => setImmediate(r));
  const text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_create_phase_seconds_count{phase="network"}'), 1);
  assert.equal(sample(text, 'dsec_create_phase_seconds_count{phase="runtime"}'), undefined);
  assert.equal(sample(text, 'dsec_create_phase_seconds_count{phase="layers"}'), 1);
  assert.equal(sample(text, 'dsec_create_phase_seconds_count{phase="attach"}'), 1);
  // Every bucket holds the one sample of a phase (it took far less than 60 s).
  assert.equal(sample(text, 'dsec_create_phase_seconds_bucket{le="60",phase="network"}'), 1);
});

test('function calls: answers by runtime and outcome, their time, errors by code, workers by state', async () => {
  const m = new EdgeMetrics();
  m.fncallFinished('python', 'ok', 0.004);
  m.fncallFinished('python', 'ok', 0.006);
  m.fncallFinished('node', 'timeout', 2);
  m.fncallFailed('capacity_exhausted');
  const pool = { network: false, max: 4 };
  m.bind({
    fncallPools: () => [
      { ...pool, language: 'python', idle: 2, busy: 1, starting: 0 },
      { ...pool, language: 'python', network: true, idle: 1, busy: 0, starting: 1 },
      { ...pool, language: 'node', idle: 0, busy: 1, starting: 0 },
    ],
  });
  const text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_fncall_calls_total{runtime="python",outcome="ok"}'), 2);
  assert.equal(sample(text, 'dsec_fncall_calls_total{runtime="node",outcome="timeout"}'), 1);
  assert.equal(sample(text, 'dsec_fncall_call_seconds_count{runtime="python"}'), 2);
  assert.equal(sample(text, 'dsec_fncall_call_seconds_bucket{le="0.005",runtime="python"}'), 1);
  assert.equal(sample(text, 'dsec_fncall_errors_total{code="capacity_exhausted"}'), 1);
  // Pools of one runtime (with and without network) add up.
  assert.equal(sample(text, 'dsec_fncall_workers{runtime="python",state="idle"}'), 3);
  assert.equal(sample(text, 'dsec_fncall_workers{runtime="python",state="starting"}'), 1);
  assert.equal(sample(text, 'dsec_fncall_workers{runtime="node",state="busy"}'), 1);
});

test('refusals, command outcomes, events and DNS denials are counted with their labels', async () => {
  const m = new EdgeMetrics();
  m.admissionRefused({ resource: 'memory', measure: 'available_mb' });
  m.admissionRefused({ resource: 'memory', measure: 'available_mb' });
  m.admissionRefused({ resource: 'sandboxes', measure: 'count' });
  m.commandFinished('exited');
  m.commandFinished('oom');
  m.sandboxEvent('dns_blocked');
  m.sandboxEvent('network_denied');
  m.sandboxEventDropped('network_denied');
  m.started(true);
  m.started(false);
  const text = await m.registry.metrics();
  assert.equal(
    sample(text, 'dsec_admission_refusals_total{resource="memory",measure="available_mb"}'),
    2,
  );
  assert.equal(
    sample(text, 'dsec_admission_refusals_total{resource="sandboxes",measure="count"}'),
    1,
  );
  assert.equal(sample(text, 'dsec_command_outcomes_total{outcome="oom"}'), 1);
  assert.equal(sample(text, 'dsec_dns_denials_total'), 1);
  assert.equal(sample(text, 'dsec_sandbox_events_total{kind="network_denied"}'), 1);
  assert.equal(sample(text, 'dsec_sandbox_events_dropped_total{kind="network_denied"}'), 1);
  assert.equal(sample(text, 'dsec_sandbox_starts_total{result="failed"}'), 1);
});

test('node pressure gauges follow the admission view, and keep the last sample without one', async () => {
  const m = new EdgeMetrics();
  let withSample = true;
  m.bind({
    admission: () => ({
      capacity: { memoryMb: 4096, cpuCores: 8, sandboxes: 40 },
      used: { memoryMb: 512, cpuCores: 2, sandboxes: 3 },
      pressure: withSample ? pressure : undefined,
    }),
  });
  let text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_node_memory_available_bytes'), 512 * 2 ** 20);
  assert.equal(sample(text, 'dsec_node_cpu_pressure_percent'), 3.5);
  assert.equal(sample(text, 'dsec_node_requested_memory_bytes'), 512 * 2 ** 20);
  assert.equal(sample(text, 'dsec_node_capacity_sandboxes'), 40);
  assert.equal(sample(text, 'dsec_node_refusing{resource="memory"}'), 1);
  withSample = false;
  text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_node_memory_available_bytes'), 512 * 2 ** 20);
  assert.equal(sample(text, 'dsec_node_refusing{resource="memory"}'), undefined);
  assert.equal(sample(text, 'dsec_node_admitted_sandboxes'), 3);
});

test('layer-cache and blob-daemon counters mirror their sources at each scrape', async () => {
  const m = new EdgeMetrics({ blobStatsReuseMs: 0 });
  const layer = { hits: 5, misses: 2, mounted: 3, inUse: 1, bytes: 1 };
  const sources: EdgeMetricsSources = {
    layerCache: () => layer,
    blobStats: async () => undefined,
  };
  m.bind(sources);
  let text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_layer_cache_lookups_total{result="hit"}'), 5);
  assert.equal(sample(text, 'dsec_layer_cache_lookups_total{result="miss"}'), 2);
  assert.equal(sample(text, 'dsec_layer_cache_mounted{use="in_use"}'), 1);
  // No daemon serves: no blob series (not zeros that would read as "no misses").
  assert.equal(sample(text, 'dsec_blob_chunk_lookups_total{result="hit"}'), undefined);
  layer.hits = 6;
  text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_layer_cache_lookups_total{result="hit"}'), 6);
  // With a daemon serving, its cache's counters.
  const blob = {
    cache: { hits: 40, misses: 9, bytesFetched: 9 << 20 },
    daemon: {},
  } as unknown as BlobDaemonStats;
  m.bind({ ...sources, blobStats: async () => blob });
  text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_blob_chunk_lookups_total{result="hit"}'), 40);
  assert.equal(sample(text, 'dsec_blob_chunk_lookups_total{result="miss"}'), 9);
  assert.equal(sample(text, 'dsec_blob_fetched_bytes_total'), 9 << 20);
});

test('a hung blob daemon does not hang the scrape: its series are left out', async () => {
  const m = new EdgeMetrics();
  m.bind({ blobStats: () => new Promise<undefined>(() => undefined), sandboxStates: () => [] });
  const text = await m.registry.metrics();
  assert.equal(sample(text, 'dsec_blob_chunk_lookups_total{result="hit"}'), undefined);
  assert.equal(sample(text, 'dsec_edge_sandboxes{state="running"}'), 0);
});

test('default labels tell edges apart, and registries concatenate without losing them', async () => {
  const a = new EdgeMetrics({ defaultLabels: { edge: 'node-a' } });
  const b = new EdgeMetrics({ defaultLabels: { edge: 'node-b' } });
  a.commandFinished('exited');
  const text = await metricsText([a.registry]);
  assert.equal(sample(text, 'dsec_command_outcomes_total{outcome="exited",edge="node-a"}'), 1);
  // Two edges' registries in one process do not clash.
  b.commandFinished('timeout');
  assert.match(await b.registry.metrics(), /outcome="timeout",edge="node-b"/);
});

test('the admin listener serves GET /metrics only', async (t) => {
  const m = new EdgeMetrics();
  m.commandFinished('killed');
  const listener = await serveMetrics({ registries: [m.registry], port: 0 });
  t.after(() => listener.close());
  assert.match(listener.url, /^http:\/\/127\.0\.0\.1:\d+\/metrics$/);
  const res = await fetch(listener.url);
  assert.equal(res.status, 200);
  assert.match(res.headers.get('content-type') ?? '', /text\/plain/);
  assert.equal(sample(await res.text(), 'dsec_command_outcomes_total{outcome="killed"}'), 1);
  const other = await fetch(listener.url.replace('/metrics', '/v1/sandboxes'));
  assert.equal(other.status, 404);
  await other.text();
});

test('--metrics-listen addresses', () => {
  assert.deepEqual(parseListenAddress('0.0.0.0:9464'), { host: '0.0.0.0', port: 9464 });
  assert.deepEqual(parseListenAddress('[::1]:9464'), { host: '::1', port: 9464 });
  assert.deepEqual(parseListenAddress(':9464'), { host: '127.0.0.1', port: 9464 });
  for (const bad of ['9464', 'host:', 'host:99999', '[::1:9464']) {
    assert.throws(
      () => parseListenAddress(bad),
      (err) => isDsecError(err) && err.code === 'invalid_argument' && err.field === 'metricsListen',
    );
  }
});
