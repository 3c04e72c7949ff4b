import { readdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';

/**
 * The cgroup a VM sandbox's QEMU runs in (microVM and full VM): memory is
 * the guest's RAM plus QEMU's own overhead, with no swap; the CPU quota is
 * the sandbox's cores.
 */
export async function makeQemuCgroup(
  cgroups: CgroupDriver,
  path: string,
  limits: { memoryMb: number; cpuCores: number },
): Promise<void> {
  await cgroups.create(path);
  const memory = limits.memoryMb * 2 ** 20;
  const periodUs = 100_000;
  const quotaUs = Math.round(limits.cpuCores * periodUs);
  // Whichever of v1's or v2's files the hierarchy has.
  const settings: [string, string][] = [
    ['memory.limit_in_bytes', String(memory)],
    ['memory.memsw.limit_in_bytes', String(memory)],
    ['memory.max', String(memory)],
    ['memory.swap.max', '0'],
    ['cpu.cfs_period_us', String(periodUs)],
    ['cpu.cfs_quota_us', String(quotaUs)],
    ['cpu.max', `${quotaUs} ${periodUs}`],
    // QEMU's threads (vCPUs, I/O workers), not the guest's processes (those are the guest kernel's).
    ['pids.max', '256'],
  ];
  for (const dir of cgroups.dirs(path)) {
    const present = new Set(await readdir(dir).catch(() => [] as string[]));
    for (const [file, value] of settings)
      if (present.has(file)) await writeFile(join(dir, file), value).catch(() => undefined);
  }
}
