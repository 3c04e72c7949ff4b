import { readdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { CgroupDriver } from './cgroup-driver.js';

export interface CgroupLimits {
  memoryBytes: number;
  /** CFS quota in cores (0.5 = half a core). */
  cpuCores: number;
  pidsMax: number;
}

/**
 * Creates a cgroup for a platform job with hard limits (memory without swap,
 * a CPU quota, a pids cap), in whichever of v1's or v2's files the node's
 * hierarchies have. The memory limit must take: a job the platform promised
 * to bound is not started unbounded. `remove` it after (it kills what is left).
 */
export async function makeLimitedCgroup(
  cgroups: CgroupDriver,
  path: string,
  limits: CgroupLimits,
): Promise<void> {
  await cgroups.create(path);
  const periodUs = 100_000;
  const quotaUs = Math.max(1000, Math.round(limits.cpuCores * periodUs));
  const memory = String(limits.memoryBytes);
  // In order: v1 refuses memsw below the memory limit.
  const settings: [string, string][] = [
    ['memory.limit_in_bytes', memory],
    ['memory.memsw.limit_in_bytes', memory],
    ['memory.max', memory],
    ['memory.swap.max', '0'],
    ['cpu.cfs_period_us', String(periodUs)],
    ['cpu.cfs_quota_us', String(quotaUs)],
    ['cpu.max', `${quotaUs} ${periodUs}`],
    ['pids.max', String(limits.pidsMax)],
  ];
  let memorySet = false;
  for (const dir of cgroups.dirs(path)) {
    let present: Set<string>;
    try {
      present = new Set(readdirSync(dir));
    } catch {
      continue;
    }
    for (const [file, value] of settings) {
      if (!present.has(file)) continue;
      try {
        writeFileSync(join(dir, file), value);
        if (file === 'memory.limit_in_bytes' || file === 'memory.max') memorySet = true;
      } catch {
        // memsw without swap accounting, swap.max without swap: optional
      }
    }
  }
  if (!memorySet) {
    await cgroups.remove(path).catch(() => undefined);
    throw new DsecError('unavailable', `cannot set a memory limit on cgroup ${path}`);
  }
}
