import { existsSync, mkdirSync, readFileSync, rmdirSync, statfsSync, writeFileSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError } from '@dsec/core';
import { runTool } from '../network/sys.js';

/**
 * How a node's cgroups are laid out. The edge creates a sandbox's cgroups
 * before the OCI runtime starts (which joins them and sets their limits from
 * the `cgroupsPath` we give it) and removes them when the sandbox ends (the
 * runtime runs detached and is gone by then); the driver also lets the edge
 * join commands to them, read usage and check that none leaked.
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
  /**
   * Removes the cgroup's directories that hold nothing (no process, no child
   * cgroup) and leaves the rest: for a node's parent, which outlives the node
   * while sandboxes it leaves running are still in it.
   */
  removeIfEmpty(path: string): void;
  /** Memory usage in bytes, or undefined when the cgroup is gone. */
  memoryUsageBytes(path: string): Promise<number | undefined>;
  /**
   * Usage less inactive file cache (the kernel reclaims that first), as
   * kubelet counts a working set; undefined when the cgroup is gone. A parent
   * keeps the cache its removed children charged, so raw usage only grows.
   */
  memoryWorkingSetBytes(path: string): Promise<number | undefined>;
  /** CPU time used by the cgroup and its descendants, in ns; undefined when it is gone. */
  cpuUsageNs(path: string): Promise<number | undefined>;
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
  // Not a controller: the named hierarchy of a systemd host. The runtime puts
  // the sandbox there too, and the edge removes what the runtime made.
  'systemd',
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

  removeIfEmpty(path: string): void {
    for (const dir of this.dirs(path)) removeEmptyDir(dir);
  }

  async memoryUsageBytes(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, 'memory', path, 'memory.usage_in_bytes'));
  }

  async memoryWorkingSetBytes(path: string): Promise<number | undefined> {
    const dir = join(this.root, 'memory', path);
    return workingSet(await this.memoryUsageBytes(path), dir, 'total_inactive_file');
  }

  async cpuUsageNs(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, 'cpuacct', path, 'cpuacct.usage'));
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

  removeIfEmpty(path: string): void {
    for (const dir of this.dirs(path)) removeEmptyDir(dir);
  }

  async memoryUsageBytes(path: string): Promise<number | undefined> {
    return readNumber(join(this.root, path, 'memory.current'));
  }

  async memoryWorkingSetBytes(path: string): Promise<number | undefined> {
    return workingSet(await this.memoryUsageBytes(path), join(this.root, path), 'inactive_file');
  }

  async cpuUsageNs(path: string): Promise<number | undefined> {
    const stat = await readFile(join(this.root, path, 'cpu.stat'), 'utf8').catch(() => undefined);
    const usec = stat && /^usage_usec (\d+)$/m.exec(stat)?.[1];
    return usec ? Number(usec) * 1000 : undefined;
  }

  async oomKills(path: string): Promise<number> {
    const text = await readFile(join(this.root, path, 'memory.events'), 'utf8').catch(() => '');
    return Number(/oom_kill (\d+)/.exec(text)?.[1] ?? 0);
  }
}

/**
 * SIGKILLs the processes in the directories and removes them, retrying while
 * they drain (a dying pid namespace under load can take seconds); fails if
 * they have not drained after `DRAIN_TIMEOUT_MS`, rather than leak silently.
 * A sandbox usually drains within a few milliseconds of its init's death, so
 * it polls every millisecond at first, with synchronous cgroupfs calls
 * (microseconds each, where thread-pool round trips cost far more).
 */
async function removeDirs(dirs: string[]): Promise<void> {
  const deadline = Date.now() + DRAIN_TIMEOUT_MS;
  let left = dirs;
  for (let attempt = 0; ; attempt++) {
    left = left.filter((dir) => !killAndRemove(dir));
    if (left.length === 0) return;
    if (Date.now() > deadline) {
      throw new DsecError(
        'internal',
        `cgroups did not drain in ${DRAIN_TIMEOUT_MS} ms: ${left[0]}`,
      );
    }
    await sleep(attempt < 50 ? 1 : 20);
  }
}

/** rmdir(2) refuses a cgroup that still has processes or children, which is the check we want. */
function removeEmptyDir(dir: string): void {
  try {
    rmdirSync(dir);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code !== 'ENOENT' && code !== 'EBUSY' && code !== 'ENOTEMPTY') throw err;
  }
}

/** True once `dir` is gone; otherwise kills what is in it and tries to remove it. */
function killAndRemove(dir: string): boolean {
  let procs: string;
  try {
    procs = readFileSync(join(dir, 'cgroup.procs'), 'utf8');
  } catch {
    return true; // gone
  }
  for (const pid of procs.split('\n').filter(Boolean)) {
    try {
      process.kill(Number(pid), 'SIGKILL');
    } catch {
      // already exiting
    }
  }
  try {
    rmdirSync(dir);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'ENOENT';
  }
}

async function workingSet(
  usage: number | undefined,
  dir: string,
  key: string,
): Promise<number | undefined> {
  if (usage === undefined) return undefined;
  const stat = await readFile(join(dir, 'memory.stat'), 'utf8').catch(() => '');
  const inactive = Number(new RegExp(`^${key} (\\d+)$`, 'm').exec(stat)?.[1] ?? 0);
  return Math.max(0, usage - inactive);
}

async function readNumber(file: string): Promise<number | undefined> {
  try {
    return Number((await readFile(file, 'utf8')).trim());
  } catch {
    return undefined;
  }
}

const DRAIN_TIMEOUT_MS = 15_000;
const CGROUP2_SUPER_MAGIC = 0x63677270;

/**
 * Remounts the host's cgroup2 hierarchy (`/sys/fs/cgroup`, or `unified` beside
 * v1) with `favordynmods`. The kernel then keeps the lock that guards task
 * migration in its slow-reader mode, so moving a task into a cgroup (every
 * create does it twice: the runtime and the command daemon) no longer waits
 * for an RCU grace period, measured at 12-25 ms here; fork and exit pay a
 * little more. The setting is global to the kernel, v1 hierarchies included.
 * Best effort: a host without cgroup2 or a kernel older than 6.0 keeps the
 * slower path.
 */
export async function favorDynamicModifications(
  log?: (msg: string, fields?: Record<string, unknown>) => void,
  root = '/sys/fs/cgroup',
): Promise<void> {
  const mount = [root, join(root, 'unified')].find((dir) => {
    try {
      return statfsSync(dir).type === CGROUP2_SUPER_MAGIC;
    } catch {
      return false;
    }
  });
  if (!mount) return;
  const options = (await readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .find((line) => line.split(' ')[4] === mount)
    ?.split(' ')[5];
  if (options?.split(',').includes('favordynmods')) return;
  await runTool('mount', ['-o', 'remount,favordynmods', mount]).then(
    () => log?.('cgroup2 remounted with favordynmods', { mount }),
    (err: unknown) => log?.('cannot set favordynmods', { mount, err: String(err) }),
  );
}

/** Picks the driver matching the host: v2 only when /sys/fs/cgroup is the unified hierarchy. */
export function detectCgroupDriver(root = '/sys/fs/cgroup'): CgroupDriver {
  const unified = existsSync(join(root, 'cgroup.controllers'));
  return unified ? new CgroupV2(root) : new CgroupV1(root);
}
