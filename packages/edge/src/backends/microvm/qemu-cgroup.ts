/**
 * How a VM sandbox's QEMU lives on the host, for the microVM and full-VM
 * backends alike: its cgroup, its launch inside it, and finding or killing it.
 */
import { spawn } from 'node:child_process';
import { closeSync, openSync } from 'node:fs';
import { readdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
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

/**
 * QEMU's jail, for every machine the edge runs: after opening its files it
 * becomes the sandbox's own uid (real, effective and saved: there is no way
 * back to root), then runs under its seccomp filter: no exec or fork, no
 * obsolete or scheduler/affinity syscalls. (`elevateprivileges=deny` would
 * also forbid the setuid that -runas makes.)
 */
export function qemuJailArgs(hostId: number): string[] {
  return [
    '-runas',
    `${hostId}:${hostId}`,
    '-sandbox',
    'on,obsolete=deny,spawn=deny,resourcecontrol=deny',
  ];
}

export interface QemuLaunch {
  binary: string;
  args: string[];
  /** The sandbox's cgroup directories (`CgroupDriver.dirs`), joined before QEMU starts. */
  cgroupDirs: string[];
  /** QEMU's stdout and stderr, appended (0600). */
  logFile: string;
  /** The guest's console file: its tail goes into the error when QEMU ends while booting. */
  consoleFile: string;
  /** A restore's saved machine: becomes QEMU's fd 3 (`-incoming fd:3`). */
  stateFd?: number | undefined;
  /** `microVM` or `VM`, for the error. */
  what: string;
}

/**
 * Starts QEMU detached, already inside the sandbox's cgroups: a shell joins
 * them, then becomes QEMU (same pid), so the guest's memory is charged to the
 * sandbox from its first page. `exited` rejects with `unavailable` and the
 * tails of the log and console once QEMU ends (callers race it against their
 * boot wait; it is never left unhandled).
 */
export function spawnQemu(launch: QemuLaunch): { pid: number; exited: Promise<never> } {
  const log = openSync(launch.logFile, 'a', 0o600);
  try {
    const child = spawn(
      '/bin/sh',
      [
        '-c',
        'for f in $DSEC_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"',
        'dsec-vm',
        launch.binary,
        ...launch.args,
      ],
      {
        detached: true,
        stdio:
          launch.stateFd === undefined
            ? ['ignore', log, log]
            : ['ignore', log, log, launch.stateFd],
        env: {
          PATH: process.env.PATH ?? '/usr/bin:/bin',
          DSEC_PROCS: launch.cgroupDirs.map((d) => join(d, 'cgroup.procs')).join(' '),
        },
      },
    );
    child.unref();
    const pid = child.pid;
    if (pid === undefined) throw new DsecError('unavailable', 'cannot start qemu');
    const exited = new Promise<never>((_, reject) =>
      child.once(
        'exit',
        (code, sig) =>
          void readTail(launch.logFile, launch.consoleFile).then((tail) =>
            reject(
              new DsecError(
                'unavailable',
                `the ${launch.what} exited while booting (${code ?? sig}): ${tail}`,
              ),
            ),
          ),
      ),
    );
    exited.catch(() => undefined);
    return { pid, exited };
  } finally {
    // The child holds its own copies of the descriptor.
    closeSync(log);
  }
}

/** The last lines of each file, for an error message. */
export async function readTail(...files: string[]): Promise<string> {
  const parts: string[] = [];
  for (const f of files) {
    const text = await readFile(f, 'utf8').catch(() => '');
    const tail = text.trim().split('\n').slice(-3).join(' | ');
    if (tail) parts.push(tail);
  }
  return parts.join(' || ').slice(-600) || 'no output';
}

/** Whether `pid` is the QEMU of the sandbox named `name` (guards against PID reuse). */
export async function isQemuOf(pid: number, name: string): Promise<boolean> {
  const cmdline = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
  return cmdline.includes('qemu-system') && cmdline.split('\0').includes(name);
}

export function killQuietly(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // already gone
  }
}
