import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { readFile, rmdir } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

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
  /**
   * Creates the cgroup ahead of the runtime (which adopts it and sets its
   * limits), so the command daemon can join it while the runtime starts.
   */
  create(path: string): Promise<void>;
  /**
   * Kills whatever is still in the cgroup (everything there is the sandbox's)
   * and removes its directories; missing ones are fine.
   */
  remove(path: string): Promise<void>;
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

  // Synchronous on purpose: a dozen tiny cgroupfs syscalls take microseconds
  // each, while a chain of thread-pool round trips costs milliseconds of
  // create latency.
  async create(path: string): Promise<void> {
    for (const c of this.#controllers) {
      if (c !== 'cpuset') {
        mkdirSync(join(this.root, c, path), { recursive: true });
        continue;
      }
      // A v1 cpuset cgroup starts with no CPUs or memory nodes, and nothing can
      // join it until they are copied down from its parent.
      let dir = join(this.root, c);
      for (const part of path.split('/').filter(Boolean)) {
        const parent = dir;
        dir = join(dir, part);
        mkdirSync(dir, { recursive: true });
        for (const file of ['cpuset.cpus', 'cpuset.mems']) {
          if (readFileSync(join(dir, file), 'utf8').trim() === '') {
            writeFileSync(join(dir, file), readFileSync(join(parent, file), 'utf8'));
          }
        }
      }
    }
  }

  async remove(path: string): Promise<void> {
    await removeDirs(this.dirs(path));
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

  async create(path: string): Promise<void> {
    mkdirSync(join(this.root, path), { recursive: true });
  }

  async remove(path: string): Promise<void> {
    await removeDirs(this.dirs(path));
  }

  async memoryUsageBytes(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, path, 'memory.current'));
  }

  async oomKills(path: string): Promise<number> {
    const text = await readFile(join(this.root, path, 'memory.events'), 'utf8').catch(() => '');
    return Number(/oom_kill (\d+)/.exec(text)?.[1] ?? 0);
  }
}

/** SIGKILLs the processes in the directories and removes them, retrying while they drain. */
async function removeDirs(dirs: string[]): Promise<void> {
  for (let attempt = 0; attempt < 50; attempt++) {
    let left = 0;
    for (const dir of dirs) {
      const procs = await readFile(join(dir, 'cgroup.procs'), 'utf8').catch(() => undefined);
      if (procs === undefined) continue; // gone
      for (const pid of procs.split('\n').filter(Boolean)) {
        try {
          process.kill(Number(pid), 'SIGKILL');
        } catch {
          // already exiting
        }
      }
      await rmdir(dir).catch(() => left++);
    }
    if (left === 0) return;
    await sleep(Math.min(2 ** attempt, 20));
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
