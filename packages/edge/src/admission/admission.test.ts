import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { AdmissionController } from './admission-controller.js';
import {
  decide,
  measuredRoom,
  resolveAdmissionLimits,
  type AdmissionLedger,
  type AdmissionLimits,
  type PressureSample,
} from './admission-policy.js';
import { HostPressure, type PressureSource } from './host-pressure.js';

/** The node: 2 cores, 24 GiB. */
const NODE = { memoryMb: 24 * 1024, cores: 2 };
const LIMITS = resolveAdmissionLimits({}, NODE);
const IDLE: PressureSample = {
  takenAtMs: 0,
  memoryTotalMb: NODE.memoryMb,
  memoryAvailableMb: 23 * 1024,
  sandboxMemoryMb: 0,
  cpuPressurePercent: 1,
  cpuPressureSource: 'psi',
  sandboxCpuPercent: 5,
  cores: 2,
  threads: 200,
  threadsLimit: 32_768,
  diskFreeMb: 80_000,
  diskTotalMb: 250_000,
};
const EMPTY: AdmissionLedger = {
  sandboxes: 0,
  requestedMemoryMb: 0,
  requestedCpuCores: 0,
  unsettled: 0,
};
const ONE_CPU = { memoryLimitMb: 512, cpuCoresLimit: 1 };

function ledger(n: number, unsettled = 0): AdmissionLedger {
  return {
    sandboxes: n,
    requestedMemoryMb: n * 512,
    requestedCpuCores: n,
    unsettled,
  };
}

test('defaults admit 1,000 idle one-CPU 512 MiB sandboxes on a 2-core, 24 GiB node', () => {
  // What 1,000 idle sandboxes measure at today's ~6.4 MiB each of platform memory.
  const busy: PressureSample = {
    ...IDLE,
    memoryAvailableMb: IDLE.memoryAvailableMb - 1000 * 7,
    sandboxMemoryMb: 1000 * 0.5,
    threads: IDLE.threads + 1000 * 3,
  };
  assert.equal(decide(LIMITS, ledger(999), busy, ONE_CPU), undefined);
  assert.ok(LIMITS.maxRequestedCpuCores >= 1000 && LIMITS.maxRequestedMemoryMb >= 1000 * 512);
  assert.ok(LIMITS.maxSandboxes >= 1000);
});

test('each check names its resource, measure, value and limit', () => {
  const cases: {
    name: string;
    limits?: Partial<AdmissionLimits>;
    ledger?: AdmissionLedger;
    sample?: Partial<PressureSample>;
    resource: string;
    measure: string;
  }[] = [
    {
      name: 'cap',
      limits: { maxSandboxes: 3 },
      ledger: ledger(3),
      resource: 'sandboxes',
      measure: 'live',
    },
    {
      name: 'requested memory',
      limits: { maxRequestedMemoryMb: 1024 },
      ledger: ledger(2),
      resource: 'memory',
      measure: 'requested_mb',
    },
    {
      name: 'requested cpu',
      limits: { maxRequestedCpuCores: 2 },
      ledger: ledger(2),
      resource: 'cpu',
      measure: 'requested_cores',
    },
    {
      name: 'available memory',
      sample: { memoryAvailableMb: LIMITS.minFreeMemoryMb + 4 },
      resource: 'memory',
      measure: 'available_mb',
    },
    {
      name: 'charged memory',
      limits: { maxSandboxMemoryMb: 300 },
      sample: { sandboxMemoryMb: 299 },
      resource: 'memory',
      measure: 'charged_mb',
    },
    {
      name: 'cpu pressure while the sandboxes use the CPUs',
      sample: { cpuPressurePercent: 95, sandboxCpuPercent: 80 },
      resource: 'cpu',
      measure: 'pressure_percent',
    },
    {
      name: 'threads',
      sample: { threads: 32_768 * 0.8 - 2 },
      resource: 'pids',
      measure: 'threads',
    },
    { name: 'disk', sample: { diskFreeMb: 1024 }, resource: 'disk', measure: 'free_mb' },
  ];
  for (const c of cases) {
    const limits = { ...LIMITS, ...c.limits };
    const sample = { ...IDLE, ...c.sample };
    const refusal = decide(limits, c.ledger ?? EMPTY, sample, ONE_CPU);
    assert.equal(refusal?.resource, c.resource, c.name);
    assert.equal(refusal?.measure, c.measure, c.name);
    assert.equal(typeof refusal?.current, 'number', c.name);
    assert.equal(typeof refusal?.limit, 'number', c.name);
    // One sandbox less (or a healthier reading) is admitted: the check is at its edge.
    const relaxed = decide(
      { ...limits, maxSandboxes: limits.maxSandboxes + 1 },
      c.ledger ? ledger(c.ledger.sandboxes - 1) : EMPTY,
      c.sample ? IDLE : sample,
      ONE_CPU,
    );
    assert.equal(relaxed, undefined, `${c.name}: relaxed`);
  }
});

test('CPU pressure refuses only while the sandboxes use the CPUs', () => {
  // The platform's own create burst, or one sandbox stalled on its own quota: pressure, idle sandboxes.
  const burst = { ...IDLE, cpuPressurePercent: 100, sandboxCpuPercent: 10 };
  assert.equal(decide(LIMITS, EMPTY, burst, ONE_CPU), undefined);
  const saturated = { ...IDLE, cpuPressurePercent: 100, sandboxCpuPercent: 95 };
  assert.equal(decide(LIMITS, EMPTY, saturated, ONE_CPU)?.resource, 'cpu');
  const calm = { ...IDLE, cpuPressurePercent: 20, sandboxCpuPercent: 95 };
  assert.equal(decide(LIMITS, EMPTY, calm, ONE_CPU), undefined);
});

test('sandboxes the sample does not show yet count at the assumed size', () => {
  // Room for exactly 10 new sandboxes of 8 MiB above the free-memory floor.
  const sample = { ...IDLE, memoryAvailableMb: LIMITS.minFreeMemoryMb + 10 * 8 };
  assert.equal(decide(LIMITS, ledger(0, 9), sample, ONE_CPU), undefined);
  assert.equal(decide(LIMITS, ledger(0, 10), sample, ONE_CPU)?.measure, 'available_mb');
  assert.equal(measuredRoom(LIMITS, ledger(0, 0), sample), 10);
  assert.equal(measuredRoom(LIMITS, ledger(0, 4), sample), 6);
});

test('without a sample only the cap and the ratios are checked', () => {
  assert.equal(decide(LIMITS, EMPTY, undefined, ONE_CPU), undefined);
  assert.equal(
    decide({ ...LIMITS, maxSandboxes: 1 }, ledger(1), undefined, ONE_CPU)?.resource,
    'sandboxes',
  );
});

test('the disk floor defaults to min(1 GiB, 5 % of the filesystem)', () => {
  // 64 MiB: the floor is 3.2 MiB, and the new sandbox is assumed to take 1 MiB.
  const small = { ...IDLE, diskTotalMb: 64, diskFreeMb: 5 };
  assert.equal(decide(LIMITS, EMPTY, small, ONE_CPU), undefined);
  assert.equal(decide(LIMITS, EMPTY, { ...small, diskFreeMb: 4 }, ONE_CPU)?.resource, 'disk');
  assert.equal(
    decide({ ...LIMITS, minFreeDiskMb: 0 }, EMPTY, { ...small, diskFreeMb: 0 }, ONE_CPU),
    undefined,
    'a floor of 0 is off',
  );
});

/** A source that returns what the test sets and counts its reads; `hold` delays the next read. */
class FakeSource implements PressureSource {
  sample: PressureSample = IDLE;
  reads = 0;
  gate: Promise<void> | undefined;
  async read(): Promise<PressureSample> {
    this.reads++;
    const snapshot = { ...this.sample };
    await this.gate;
    return snapshot;
  }
}

function controller(source: PressureSource, limits: Partial<AdmissionLimits> = {}) {
  let now = 1_000_000;
  const c = new AdmissionController({
    edgeId: 'e1',
    limits: { ...LIMITS, ...limits },
    source,
    sampleIntervalMs: 250,
    now: () => now,
  });
  return { c, advance: (ms: number) => (now += ms) };
}

test('a burst of 1,000 creates reads the host once per interval, not per create', async () => {
  const source = new FakeSource();
  const { c, advance } = controller(source);
  await Promise.all(
    Array.from({ length: 1000 }, async (_, i) => {
      await c.refresh();
      c.admit(`sb-${i}`, ONE_CPU);
    }),
  );
  assert.equal(source.reads, 1);
  assert.equal(c.ledger().sandboxes, 1000);
  await c.refresh();
  assert.equal(source.reads, 1, 'still fresh');
  advance(250);
  await c.refresh();
  assert.equal(source.reads, 2);
});

test('admission is synchronous: the last slot goes to exactly one of many concurrent creates', async () => {
  const source = new FakeSource();
  const { c } = controller(source, { maxSandboxes: 5 });
  const outcomes = await Promise.allSettled(
    Array.from({ length: 50 }, async (_, i) => {
      await c.refresh();
      c.admit(`sb-${i}`, ONE_CPU);
    }),
  );
  assert.equal(outcomes.filter((o) => o.status === 'fulfilled').length, 5);
  const refused = outcomes.find((o) => o.status === 'rejected');
  assert.ok(refused && isDsecError(refused.reason, 'capacity_exhausted'));
  assert.deepEqual(
    {
      resource: refused.reason.details?.resource,
      current: refused.reason.details?.current,
      limit: refused.reason.details?.limit,
    },
    { resource: 'sandboxes', current: 6, limit: 5 },
  );
  c.release('sb-0');
  c.release('sb-0');
  c.admit('sb-again', ONE_CPU);
  assert.equal(c.ledger().sandboxes, 5);
});

test('a started sandbox stays unsettled until a sample that began after its start', async () => {
  const source = new FakeSource();
  const { c, advance } = controller(source);
  await c.refresh();
  c.admit('a', ONE_CPU);
  assert.equal(c.ledger().unsettled, 1);
  // A read begins while `a` is still starting, and completes after it settled.
  advance(250);
  let open!: () => void;
  source.gate = new Promise((resolve) => (open = resolve));
  const reading = c.refresh();
  c.settle('a');
  open();
  await reading;
  assert.equal(c.ledger().unsettled, 1, 'that read may have missed it');
  source.gate = undefined;
  advance(250);
  await c.refresh();
  assert.equal(c.ledger().unsettled, 0);
});

test('pressure in a sample refuses until a later sample shows relief; a failed read keeps admitting by count', async () => {
  const source = new FakeSource();
  const { c, advance } = controller(source, { maxSandboxMemoryMb: 100 });
  source.sample = { ...IDLE, sandboxMemoryMb: 120 };
  await c.refresh();
  assert.throws(
    () => c.admit('a', ONE_CPU),
    (e) => isDsecError(e, 'capacity_exhausted') && e.details?.measure === 'charged_mb',
  );
  assert.equal(c.view().capacity.sandboxes, 0, 'placement sees no room');
  assert.equal(c.view().pressure?.refusing?.resource, 'memory');
  source.sample = { ...IDLE, sandboxMemoryMb: 10 };
  advance(250);
  await c.refresh();
  c.admit('a', ONE_CPU);
  const failing: PressureSource = { read: () => Promise.reject(new Error('no /proc')) };
  const other = controller(failing);
  await other.c.refresh();
  other.c.admit('b', ONE_CPU);
  assert.equal(other.c.view().pressure, undefined);
});

test('adopt replaces the ledger with what survived a restart', () => {
  const { c } = controller(new FakeSource());
  c.admit('gone', ONE_CPU);
  c.adopt([{ id: 'kept', request: { memoryLimitMb: 256, cpuCoresLimit: 0.5 } }]);
  assert.deepEqual(c.ledger(), {
    sandboxes: 1,
    requestedMemoryMb: 256,
    requestedCpuCores: 0.5,
    unsettled: 0,
  });
});

test('HostPressure reads meminfo, PSI, stat, loadavg and the kernel limits', async () => {
  const proc = await mkdtemp(join(tmpdir(), 'dsec-fake-proc-'));
  try {
    await mkdir(join(proc, 'pressure'));
    await mkdir(join(proc, 'sys', 'kernel'), { recursive: true });
    const files: Record<string, string> = {
      meminfo: 'MemTotal:       24683520 kB\nMemFree:  100 kB\nMemAvailable:   20480000 kB\n',
      loadavg: '0.50 0.40 0.30 3/1234 999\n',
      'pressure/cpu':
        'some avg10=50.00 avg60=42.50 avg300=1.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n',
      'sys/kernel/pid_max': '32768\n',
      'sys/kernel/threads-max': '192729\n',
    };
    for (const [f, text] of Object.entries(files)) await writeFile(join(proc, f), text);
    let nowMs = 1_000_000;
    let cpuNs = 0;
    const host = new HostPressure({
      stateDir: proc,
      procRoot: proc,
      sandboxMemoryBytes: async () => 3 * 2 ** 20,
      sandboxCpuNs: async () => cpuNs,
      now: () => nowMs,
    });
    const first = await host.read();
    assert.equal(first.sandboxCpuPercent, 0, 'no interval yet');
    // The sandboxes use every core for 10 s (one time constant): 1 − 1/e of the way to 100 %.
    nowMs += 10_000;
    cpuNs += 10_000 * 1e6 * first.cores;
    const s = await host.read();
    assert.equal(s.takenAtMs, nowMs);
    assert.ok(
      Math.abs(s.sandboxCpuPercent - 100 * (1 - Math.exp(-1))) < 1e-9,
      String(s.sandboxCpuPercent),
    );
    assert.equal(s.memoryTotalMb, 24683520 / 1024);
    assert.equal(s.memoryAvailableMb, 20000);
    assert.equal(s.sandboxMemoryMb, 3);
    assert.equal(s.cpuPressurePercent, 42.5);
    assert.equal(s.cpuPressureSource, 'psi');
    assert.equal(s.threads, 1234);
    assert.equal(s.threadsLimit, 32768);
    assert.ok(s.diskTotalMb > 0 && s.diskFreeMb <= s.diskTotalMb);

    // No PSI: the load average beyond the cores stands in.
    await rm(join(proc, 'pressure'), { recursive: true });
    const cores = s.cores;
    await writeFile(join(proc, 'loadavg'), `${cores * 1.5} 0 0 1/10 1\n`);
    const noPsi = await host.read();
    assert.equal(noPsi.cpuPressureSource, 'loadavg');
    assert.equal(noPsi.cpuPressurePercent, 50);

    await writeFile(join(proc, 'meminfo'), 'MemTotal: 1 kB\n');
    await assert.rejects(host.read(), /MemAvailable|memoryAvailableMb/);
  } finally {
    await rm(proc, { recursive: true, force: true });
  }
});
