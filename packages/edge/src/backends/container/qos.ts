import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { QosClass } from '@dsec/core';
import { runTool } from '../../network/sys.js';

/**
 * CPU QoS of a started sandbox (paper 5.2, docs/adr/0007-admission-by-real-use.md).
 *
 * A `best-effort` sandbox gets, on top of the minimal CPU weight its OCI
 * config already set (`cpu.shares` 2, which runtimes turn into `cpu.weight` 1
 * on cgroup v2):
 * - its cgroup marked idle (`cpu.idle` 1, kernel ≥ 5.15, v1 and v2): the
 *   scheduler then treats the whole group as SCHED_IDLE against its siblings,
 *   so a waking latency-sensitive task preempts it at once. Task policies
 *   alone do not reach across cgroups: between two sandboxes the scheduler
 *   compares their group entities, not their tasks.
 * - `SCHED_IDLE` on every thread of the sandbox's init and of its command
 *   daemon, so everything they fork (every command the platform runs in the
 *   sandbox) inherits it. Inside the sandbox it cannot be undone: leaving
 *   SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE above 0, and the sandbox
 *   has neither.
 *
 * The command daemon's policy is only changed when it sits in the sandbox's
 * own CPU cgroup (a per-sandbox daemon); a daemon shared by the node's
 * sandboxes keeps its policy, and its children then rely on the cgroup.
 * `latency-sensitive` (and an absent class) changes nothing.
 */
export async function applyQos(
  initPid: number,
  chronusPid: number | undefined,
  qosClass: QosClass | undefined,
  options: { cgroupRoot?: string; procRoot?: string } = {},
): Promise<void> {
  if (qosClass !== 'best-effort') return;
  const proc = options.procRoot ?? '/proc';
  const cgroup = cpuCgroupOf(proc, initPid);
  if (cgroup === undefined)
    throw new DsecError('internal', `sandbox init ${initPid} has no CPU cgroup`);
  const dir = join(options.cgroupRoot ?? '/sys/fs/cgroup', cgroup.mount, cgroup.path);
  try {
    writeFileSync(join(dir, 'cpu.idle'), '1');
  } catch (err) {
    // Kernels before 5.15 have no cpu.idle: the minimal weight and SCHED_IDLE remain.
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
  const pids = [initPid];
  if (chronusPid !== undefined && cpuCgroupOf(proc, chronusPid)?.path === cgroup.path)
    pids.push(chronusPid);
  // chrt (util-linux) -a sets every thread of the process; children inherit the policy.
  await Promise.all(
    pids.map((pid) =>
      runTool('chrt', ['--idle', '-a', '-p', '0', String(pid)], { timeoutMs: 5000 }),
    ),
  );
}

/**
 * The CPU cgroup of a process: on v1 the `cpu` controller's line of
 * /proc/PID/cgroup (`4:cpu,cpuacct:/dsec/x`, mounted at `cpu`), on v2 the
 * unified line (`0::/dsec/x`). Undefined when the process is gone.
 */
export function cpuCgroupOf(
  procRoot: string,
  pid: number,
): { mount: string; path: string } | undefined {
  let text: string;
  try {
    text = readFileSync(join(procRoot, String(pid), 'cgroup'), 'utf8');
  } catch {
    return undefined;
  }
  let unified: string | undefined;
  for (const line of text.split('\n')) {
    const [, controllers, path] = /^\d+:([^:]*):(.*)$/.exec(line) ?? [];
    if (controllers === undefined || path === undefined) continue;
    if (controllers.split(',').includes('cpu')) return { mount: 'cpu', path };
    if (controllers === '') unified = path;
  }
  return unified === undefined ? undefined : { mount: '', path: unified };
}
