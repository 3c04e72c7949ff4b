import { execFile } from 'node:child_process';
import { chmod, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { promisify } from 'node:util';
import type { SandboxSpec } from '@dsec/core';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { mountPoints } from '@dsec/edge';

const execFileAsync = promisify(execFile);

/** A temp state dir (traversable by sandboxes' mapped roots) with a busybox base layer in its image store. */
export async function makeStateDir(): Promise<{
  dir: string;
  store: DirImageStore;
  /** A cgroup parent private to this state dir, so counts are not disturbed by other tests. */
  cgroupParent: string;
  cleanup(): Promise<void>;
}> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-edge-it-'));
  const cgroupParent = `dsec-test-${basename(dir)}`;
  await chmod(dir, 0o711);
  const store = new DirImageStore(join(dir, 'images'));
  const rootfs = join(dir, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: rootfs } });
  await rm(rootfs, { recursive: true, force: true });
  return {
    dir,
    store,
    cgroupParent,
    async cleanup() {
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    },
  };
}

export function spec(overrides: Partial<SandboxSpec> = {}): SandboxSpec {
  return {
    backend: 'container',
    image: 'busybox',
    toolkits: [],
    memoryLimitMb: 256,
    cpuCoresLimit: 1,
    pidsLimit: 256,
    ttlSeconds: 600,
    networkRules: {},
    initUser: 'root',
    env: {},
    labels: {},
    ...overrides,
  };
}

export interface HostResources {
  mounts: string[];
  cgroups: string[];
  containers: string[];
  processes: string[];
  sandboxDirs: string[];
}

/**
 * Everything a sandbox can leave behind on the host, scoped to one state dir
 * so concurrent test files do not disturb the count.
 */
export async function hostResources(stateDir: string): Promise<HostResources> {
  const mounts = [...(await mountPoints())]
    .filter((m) => m.startsWith(stateDir) && !m.includes('/layers/'))
    .sort();
  const cgroups: string[] = [];
  const cgroupParent = `dsec-test-${basename(stateDir)}`;
  for (const ctrl of ['memory', 'pids', 'cpu', 'freezer', 'systemd']) {
    const names = await readdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(
      () => [] as string[],
    );
    cgroups.push(...names.filter((n) => n.startsWith('dsec-')).map((n) => `${ctrl}/${n}`));
  }
  // crun and runc both keep one state directory per container under their root.
  const containers = await readdir(join(stateDir, 'edge', 'runtime')).catch(() => [] as string[]);
  const processes = await execFileAsync('pgrep', ['-af', stateDir]).then(
    (r) => r.stdout.split('\n').filter((l) => l && !l.includes('pgrep')),
    () => [] as string[],
  );
  // Command daemons show no path (`dsec-chronus`): they are this state dir's
  // when they sit in a cgroup under its cgroup parent.
  for (const pid of await execFileAsync('pgrep', ['-x', 'dsec-chronus']).then(
    (r) => r.stdout.split('\n').filter(Boolean),
    () => [],
  )) {
    const cgroup = await readFile(`/proc/${pid}/cgroup`, 'utf8').catch(() => '');
    if (cgroup.includes(`/${cgroupParent}/`)) processes.push(`${pid} dsec-chronus`);
  }
  const sandboxDirs = await readdir(join(stateDir, 'edge', 'sandboxes')).catch(
    () => [] as string[],
  );
  return { mounts, cgroups: cgroups.sort(), containers, processes, sandboxDirs };
}

/** QEMU processes whose command line names a file under `dir` (a test's state dir). */
export async function qemusUnder(dir: string): Promise<number[]> {
  const found: number[] = [];
  for (const e of await readdir('/proc')) {
    if (!/^\d+$/.test(e)) continue;
    const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes('qemu-system') && cmd.includes(dir)) found.push(Number(e));
  }
  return found;
}

/** Kills what `qemusUnder` finds: a failed test must not leave a VM running. */
export async function killQemusUnder(dir: string): Promise<void> {
  for (const pid of await qemusUnder(dir)) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // gone
    }
  }
}
