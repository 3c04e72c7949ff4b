import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';

/**
 * How a node's cgroups are laid out. The OCI runtime creates and removes a
 * sandbox's cgroups (from the `cgroupsPath` we give it); the driver only
 * knows where they are, so the edge can join commands to them, read usage,
 * freeze them and check that none leaked.
 *
 * Implementations: `v1` (one hierarchy per controller, as on this machine's
 * hybrid layout) and `v2` (one unified hierarchy).
 */
export interface CgroupDriver {
  readonly version: 1 | 2;
  /** Every directory a process must be written into to be fully inside `path`. */
  dirs(path: string): string[];
  /** True if any of the sandbox's cgroup directories exist. */
  exists(path: string): boolean;
  /** Memory usage in bytes, or undefined when the cgroup is gone. */
  memoryUsageBytes(path: string): Promise<number | undefined>;
  /** Number of OOM kills the kernel performed in the cgroup so far. */
  oomKills(path: string): Promise<number>;
}

const V1_CONTROLLERS = [
  'memory',
  'cpu',
  'cpuacct',
  'pids',
  'cpuset',
  'freezer',
  'devices',
  'blkio',
];

class CgroupV1 implements CgroupDriver {
  readonly version = 1 as const;
  readonly #controllers: string[];

  constructor(readonly root: string) {
    this.#controllers = V1_CONTROLLERS.filter((c) => existsSync(join(root, c)));
  }

  dirs(path: string): string[] {
    return this.#controllers.map((c) => join(this.root, c, path));
  }

  exists(path: string): boolean {
    return this.dirs(path).some((d) => existsSync(d));
  }

  async memoryUsageBytes(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, 'memory', path, 'memory.usage_in_bytes'));
  }

  async oomKills(path: string): Promise<number> {
    const text = await readFile(
      join(this.root, 'memory', path, 'memory.oom_control'),
      'utf8',
    ).catch(() => '');
    return Number(/oom_kill (\d+)/.exec(text)?.[1] ?? 0);
  }
}

class CgroupV2 implements CgroupDriver {
  readonly version = 2 as const;

  constructor(readonly root: string) {}

  dirs(path: string): string[] {
    return [join(this.root, path)];
  }

  exists(path: string): boolean {
    return existsSync(join(this.root, path));
  }

  async memoryUsageBytes(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, path, 'memory.current'));
  }

  async oomKills(path: string): Promise<number> {
    const text = await readFile(join(this.root, path, 'memory.events'), 'utf8').catch(() => '');
    return Number(/oom_kill (\d+)/.exec(text)?.[1] ?? 0);
  }
}

async function readNumber(file: string): Promise<number | undefined> {
  try {
    return Number((await readFile(file, 'utf8')).trim());
  } catch {
    return undefined;
  }
}

/** Picks the driver matching the host: v2 only when /sys/fs/cgroup is the unified hierarchy. */
export function detectCgroupDriver(root = '/sys/fs/cgroup'): CgroupDriver {
  const unified = existsSync(join(root, 'cgroup.controllers'));
  return unified ? new CgroupV2(root) : new CgroupV1(root);
}
