import type { AdmissionRefusal, SandboxSpec } from '@dsec/core';

/**
 * Admission by real use (paper 4.3, docs/adr/0007-admission-by-real-use.md).
 *
 * A sandbox's requested memory and CPU are ceilings (its cgroup limits), not
 * reservations: agent sandboxes mostly wait on the model, and about 90 % of
 * them use under 5 % of what they ask for. So the edge admits while what the
 * node *measures* allows it, under two loose overcommit ratios on the sums of
 * ceilings and a hard cap on the number of sandboxes.
 *
 * This file is the pure policy: `decide` takes the limits, the edge's ledger
 * and the latest measurement, and names the first check a new sandbox fails.
 * It reads nothing itself, so it is tested with made-up measurements.
 */

/** One reading of the node (a `PressureSource` takes it). */
export interface PressureSample {
  /** `Date.now()` when it was taken. */
  takenAtMs: number;
  memoryTotalMb: number;
  /** `MemAvailable`: free memory plus what the kernel can reclaim without swapping. */
  memoryAvailableMb: number;
  /**
   * Memory charged to the sandboxes' parent cgroup, less its inactive file
   * cache (reclaimed first; a parent also keeps what removed sandboxes
   * charged). 0 before it exists.
   */
  sandboxMemoryMb: number;
  /**
   * CPU pressure in percent: PSI `some avg60` (the share of the last minute in
   * which a runnable task waited for a CPU), or an estimate from the load
   * average where the kernel has no PSI.
   */
  cpuPressurePercent: number;
  cpuPressureSource: 'psi' | 'loadavg';
  /**
   * CPU time the sandboxes used, in percent of all cores, averaged over the
   * last ~10 s (an exponentially weighted mean of the intervals between samples).
   */
  sandboxCpuPercent: number;
  cores: number;
  /** Threads (tasks) alive on the host, and the kernel's limit: min(pid_max, threads-max). */
  threads: number;
  threadsLimit: number;
  /** Space left to unprivileged writers on the filesystem of the edge's state dir. */
  diskFreeMb: number;
  diskTotalMb: number;
}

/** Resolved limits (absolute values; `resolveAdmissionLimits` derives them from the config). */
export interface AdmissionLimits {
  /** Hard cap on live sandboxes. */
  maxSandboxes: number;
  /** Ceiling on the sum of requested memory: memory overcommit × physical memory. */
  maxRequestedMemoryMb: number;
  /** Ceiling on the sum of requested CPU: CPU overcommit × cores. */
  maxRequestedCpuCores: number;
  /** `MemAvailable` that must be left after the new sandbox. */
  minFreeMemoryMb: number;
  /** Ceiling on memory charged to the sandboxes' cgroups. */
  maxSandboxMemoryMb: number;
  /**
   * Ceiling on CPU pressure; it refuses only while the sandboxes themselves
   * use much of the CPU (`SANDBOX_CPU_GATE_PERCENT`): the platform's own work
   * during a burst of creates raises pressure too, and so does a sandbox
   * stalled on its own CPU quota, with the CPUs idle.
   */
  maxCpuPressurePercent: number;
  /** Ceiling on threads in use, in percent of the kernel's limit. */
  maxThreadsPercent: number;
  /** Disk space that must be left on the state dir's filesystem (undefined: min(1 GiB, 5 %)). */
  minFreeDiskMb: number | undefined;
  /**
   * What a sandbox admitted since the last sample is assumed to take until a
   * sample shows it (so a burst between two samples cannot overshoot).
   */
  newSandbox: { memoryMb: number; threads: number; diskMb: number };
}

/** The knobs (`dsec up` flags, `ContainerEdgeOptions.admission`); every one is optional. */
export interface AdmissionConfig {
  /** Hard cap on live sandboxes. Default 4096. */
  maxSandboxes?: number | undefined;
  /** Sum of requested memory ≤ this × physical memory. Default 32. */
  memoryOvercommit?: number | undefined;
  /** Sum of requested CPU ≤ this × cores. Default 1024 (CPU is compressible). */
  cpuOvercommit?: number | undefined;
  /** Refuse when `MemAvailable` would drop below this (0: off). Default 10 % of memory, within 512–4096. */
  minFreeMemoryMb?: number | undefined;
  /** Refuse when the sandboxes' cgroups are charged more than this. Default 95 % of memory. */
  maxSandboxMemoryMb?: number | undefined;
  /** Refuse while CPU pressure (PSI some avg60) is above this and sandboxes use the CPUs. Default 90. */
  maxCpuPressurePercent?: number | undefined;
  /** Refuse when threads in use would pass this share of the kernel's limit. Default 80. */
  maxThreadsPercent?: number | undefined;
  /** Refuse when the state dir's filesystem would have less free (0: off). Default min(1024, 5 % of it). */
  minFreeDiskMb?: number | undefined;
  /** Assumed memory of a sandbox not yet seen by a sample. Default 8. */
  newSandboxMemoryMb?: number | undefined;
  /** Pressure is read at most this often (creates in between use the last reading). Default 250. */
  sampleIntervalMs?: number | undefined;
}

/** CPU pressure only refuses while the sandboxes use at least this share of all cores. */
export const SANDBOX_CPU_GATE_PERCENT = 50;

export const ADMISSION_DEFAULTS = {
  maxSandboxes: 4096,
  memoryOvercommit: 32,
  cpuOvercommit: 1024,
  maxCpuPressurePercent: 90,
  maxThreadsPercent: 80,
  newSandboxMemoryMb: 8,
  newSandboxThreads: 4,
  newSandboxDiskMb: 1,
  sampleIntervalMs: 250,
} as const;

/** The limits for a node of `memoryMb` and `cores`, from the config and the defaults. */
export function resolveAdmissionLimits(
  config: AdmissionConfig,
  machine: { memoryMb: number; cores: number },
): AdmissionLimits {
  const d = ADMISSION_DEFAULTS;
  return {
    maxSandboxes: config.maxSandboxes ?? d.maxSandboxes,
    maxRequestedMemoryMb: Math.floor(
      (config.memoryOvercommit ?? d.memoryOvercommit) * machine.memoryMb,
    ),
    maxRequestedCpuCores: (config.cpuOvercommit ?? d.cpuOvercommit) * machine.cores,
    minFreeMemoryMb:
      config.minFreeMemoryMb ?? Math.min(4096, Math.max(512, Math.floor(machine.memoryMb * 0.1))),
    maxSandboxMemoryMb: config.maxSandboxMemoryMb ?? Math.floor(machine.memoryMb * 0.95),
    maxCpuPressurePercent: config.maxCpuPressurePercent ?? d.maxCpuPressurePercent,
    maxThreadsPercent: config.maxThreadsPercent ?? d.maxThreadsPercent,
    minFreeDiskMb: config.minFreeDiskMb,
    newSandbox: {
      memoryMb: config.newSandboxMemoryMb ?? d.newSandboxMemoryMb,
      threads: d.newSandboxThreads,
      diskMb: d.newSandboxDiskMb,
    },
  };
}

/** What the edge holds now: live sandboxes and the sums of their requested ceilings. */
export interface AdmissionLedger {
  sandboxes: number;
  requestedMemoryMb: number;
  requestedCpuCores: number;
  /** Admitted sandboxes the latest sample may not show yet (creating, or started after it began). */
  unsettled: number;
}

/** The requested part of a spec; a zero request asks whether the node takes anything at all. */
export type AdmissionRequest = Pick<SandboxSpec, 'memoryLimitMb' | 'cpuCoresLimit'>;

/**
 * The first check that admitting one more sandbox would fail, or undefined
 * when it may be admitted. Without a sample (no measurement yet, or the
 * source failed) only the count and the ratios are checked.
 */
export function decide(
  limits: AdmissionLimits,
  ledger: AdmissionLedger,
  sample: PressureSample | undefined,
  request: AdmissionRequest,
): AdmissionRefusal | undefined {
  const over = (
    resource: AdmissionRefusal['resource'],
    measure: string,
    current: number,
    limit: number,
  ): AdmissionRefusal | undefined =>
    current > limit
      ? { resource, measure, current: round(current), limit: round(limit) }
      : undefined;
  const under = (
    resource: AdmissionRefusal['resource'],
    measure: string,
    left: number,
    min: number,
  ): AdmissionRefusal | undefined =>
    // A floor of 0 turns the check off (the projection could otherwise go below it).
    min > 0 && left < min
      ? { resource, measure, current: round(left), limit: round(min) }
      : undefined;

  const refusal =
    over('sandboxes', 'live', ledger.sandboxes + 1, limits.maxSandboxes) ??
    over(
      'memory',
      'requested_mb',
      ledger.requestedMemoryMb + request.memoryLimitMb,
      limits.maxRequestedMemoryMb,
    ) ??
    // A hair of slack: sums of fractional cores are not exact in binary.
    over(
      'cpu',
      'requested_cores',
      ledger.requestedCpuCores + request.cpuCoresLimit,
      limits.maxRequestedCpuCores + 1e-9,
    );
  if (refusal || !sample) return refusal;

  // The new sandbox and every one the sample may not show yet are assumed to take `newSandbox`.
  const pending = ledger.unsettled + 1;
  const est = limits.newSandbox;
  return (
    under(
      'memory',
      'available_mb',
      sample.memoryAvailableMb - pending * est.memoryMb,
      limits.minFreeMemoryMb,
    ) ??
    over(
      'memory',
      'charged_mb',
      sample.sandboxMemoryMb + pending * est.memoryMb,
      limits.maxSandboxMemoryMb,
    ) ??
    (sample.sandboxCpuPercent >= SANDBOX_CPU_GATE_PERCENT
      ? over('cpu', 'pressure_percent', sample.cpuPressurePercent, limits.maxCpuPressurePercent)
      : undefined) ??
    over(
      'pids',
      'threads',
      sample.threads + pending * est.threads,
      Math.floor((sample.threadsLimit * limits.maxThreadsPercent) / 100),
    ) ??
    under('disk', 'free_mb', sample.diskFreeMb - pending * est.diskMb, minFreeDisk(limits, sample))
  );
}

/**
 * How many more sandboxes the measured headroom allows (for placement):
 * each resource's headroom over what one new sandbox is assumed to take,
 * less the sandboxes the sample does not show yet. 0 while any check refuses.
 */
export function measuredRoom(
  limits: AdmissionLimits,
  ledger: AdmissionLedger,
  sample: PressureSample,
): number {
  if (decide(limits, ledger, sample, { memoryLimitMb: 0, cpuCoresLimit: 0 })) return 0;
  const est = limits.newSandbox;
  const per = (headroom: number, each: number) =>
    each > 0 ? Math.floor(headroom / each) : Number.POSITIVE_INFINITY;
  const room = Math.min(
    per(sample.memoryAvailableMb - limits.minFreeMemoryMb, est.memoryMb),
    per(limits.maxSandboxMemoryMb - sample.sandboxMemoryMb, est.memoryMb),
    per(
      Math.floor((sample.threadsLimit * limits.maxThreadsPercent) / 100) - sample.threads,
      est.threads,
    ),
    per(sample.diskFreeMb - minFreeDisk(limits, sample), est.diskMb),
  );
  return Math.max(0, room - ledger.unsettled);
}

function minFreeDisk(limits: AdmissionLimits, sample: PressureSample): number {
  return limits.minFreeDiskMb ?? Math.min(1024, sample.diskTotalMb * 0.05);
}

function round(x: number): number {
  return Math.round(x * 100) / 100;
}
