import { readFileSync, statfsSync } from 'node:fs';
import { cpus } from 'node:os';
import { join } from 'node:path';
import type { PressureSample } from './admission-policy.js';

/**
 * Where admission's measurements come from. `read` takes one sample; the
 * admission controller decides how often (never per request).
 */
export interface PressureSource {
  read(): Promise<PressureSample>;
}

export interface HostPressureOptions {
  /** The edge's state dir: disk space is measured on its filesystem. */
  stateDir: string;
  /**
   * Working set of the sandboxes' parent cgroup (charge less inactive file
   * cache), undefined while it does not exist.
   */
  sandboxMemoryBytes: () => Promise<number | undefined>;
  /** CPU time used by the sandboxes' parent cgroup in ns, undefined while it does not exist. */
  sandboxCpuNs: () => Promise<number | undefined>;
  /** Root of procfs (tests point it at a fake tree). Default `/proc`. */
  procRoot?: string | undefined;
  now?: (() => number) | undefined;
}

const MIB = 2 ** 20;
/** Time constant of the sandboxes' smoothed CPU use. */
const CPU_SMOOTHING_MS = 10_000;

/**
 * Reads a Linux host: `/proc/meminfo` (MemTotal, MemAvailable), PSI
 * (`/proc/pressure/cpu`, when the kernel has it) or `/proc/loadavg`, threads
 * alive (`/proc/loadavg`) against `kernel.pid_max` and `kernel.threads-max`,
 * `statfs` of the state dir, and the sandboxes' parent cgroup (working set,
 * CPU time). A dozen small synchronous reads: tens of microseconds, cheaper
 * than thread-pool round trips.
 */
export class HostPressure implements PressureSource {
  readonly #proc: string;
  readonly #now: () => number;
  #lastCpu: { atMs: number; ns: number } | undefined;
  #sandboxCpuPercent = 0;

  constructor(readonly options: HostPressureOptions) {
    this.#proc = options.procRoot ?? '/proc';
    this.#now = options.now ?? Date.now;
  }

  async read(): Promise<PressureSample> {
    const takenAtMs = this.#now();
    const meminfo = this.#text('meminfo');
    const memKb = (key: string) => Number(new RegExp(`^${key}:\\s+(\\d+)`, 'm').exec(meminfo)?.[1]);
    const memoryTotalMb = memKb('MemTotal') / 1024;
    const memoryAvailableMb = memKb('MemAvailable') / 1024;

    const loadavg = this.#text('loadavg').split(/\s+/);
    const cores = cpus().length || 1;
    const psi = this.#optionalText(join('pressure', 'cpu'));
    const psiSome = psi && /^some .*avg60=([\d.]+)/m.exec(psi)?.[1];
    // Without PSI: the share of runnable tasks beyond the cores, as a stand-in
    // for "some task waited" (100 % once the run queue holds twice the cores).
    const load1 = Number(loadavg[0]);
    const cpuPressurePercent = psiSome
      ? Number(psiSome)
      : Math.min(100, Math.max(0, ((load1 - cores) / cores) * 100));

    // The sandboxes' CPU use between samples, smoothed over about 10 s.
    const cpuNs = await this.options.sandboxCpuNs();
    const prev = this.#lastCpu;
    if (cpuNs !== undefined) {
      if (prev && takenAtMs > prev.atMs) {
        const dtMs = takenAtMs - prev.atMs;
        const used = Math.max(0, cpuNs - prev.ns) / 1e6 / (dtMs * cores);
        const alpha = 1 - Math.exp(-dtMs / CPU_SMOOTHING_MS);
        this.#sandboxCpuPercent += alpha * (Math.min(1, used) * 100 - this.#sandboxCpuPercent);
      }
      this.#lastCpu = { atMs: takenAtMs, ns: cpuNs };
    }

    const threads = Number(loadavg[3]?.split('/')[1]);
    const threadsLimit = Math.min(
      Number(this.#text(join('sys', 'kernel', 'pid_max')).trim()),
      Number(this.#text(join('sys', 'kernel', 'threads-max')).trim()),
    );

    const fs = statfsSync(this.options.stateDir);
    const sandboxBytes = (await this.options.sandboxMemoryBytes()) ?? 0;
    const sample: PressureSample = {
      takenAtMs,
      memoryTotalMb,
      memoryAvailableMb,
      sandboxMemoryMb: sandboxBytes / MIB,
      cpuPressurePercent,
      cpuPressureSource: psiSome ? 'psi' : 'loadavg',
      sandboxCpuPercent: this.#sandboxCpuPercent,
      cores,
      threads,
      threadsLimit,
      diskFreeMb: (fs.bavail * fs.bsize) / MIB,
      diskTotalMb: (fs.blocks * fs.bsize) / MIB,
    };
    for (const [key, value] of Object.entries(sample)) {
      if (typeof value === 'number' && !Number.isFinite(value))
        throw new Error(`unreadable host measurement: ${key}`);
    }
    return sample;
  }

  #text(file: string): string {
    return readFileSync(join(this.#proc, file), 'utf8');
  }

  #optionalText(file: string): string | undefined {
    try {
      return this.#text(file);
    } catch {
      return undefined;
    }
  }
}
