/**
 * Test fixtures for the native integration tests: a real `runc` container
 * (busybox rootfs, user namespace 0→100000, dsec-init as PID 1) and helpers
 * to run a command over chronus and collect its output. Needs root.
 */
import { execFile } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, copyFile, mkdir, mkdtemp, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';

import type { ChronusConnection, CommandExit, SpawnRequest } from './chronus-client.js';
import { initPath } from './binaries.js';
import { ChronusSupervisor, startChronus } from './chronus-supervisor.js';

const run = promisify(execFile);

export const BUSYBOX = '/usr/bin/busybox';

/** Why the integration tests cannot run here, or null when they can. */
export function integrationSkipReason(): string | null {
  if (process.getuid?.() !== 0) return 'needs root';
  for (const bin of ['/usr/sbin/runc', BUSYBOX, '/usr/bin/mkfs.erofs'])
    if (!existsSync(bin)) return `needs ${bin}`;
  return null;
}

export interface RuncSandbox {
  id: string;
  dir: string;
  initPid: number;
  /** cgroup directories of the container (v1 hierarchies), for --cgroup. */
  cgroupDirs: string[];
  destroy(): Promise<void>;
}

const APPLETS = [
  'sh',
  'cat',
  'ls',
  'id',
  'ps',
  'sleep',
  'true',
  'mount',
  'yes',
  'head',
  'kill',
  'echo',
  'pwd',
  'env',
  'wc',
  'tty',
  'stty',
  'setsid',
  'grep',
  'touch',
];

/** Starts a busybox container under runc with dsec-init as PID 1. */
export async function startRuncSandbox(): Promise<RuncSandbox> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-native-runc-'));
  await chmod(dir, 0o755); // the container's root (host uid 100000) must reach its rootfs
  const id = `dsec-native-${process.pid}-${Math.random().toString(36).slice(2, 8)}`;
  const rootfs = join(dir, 'rootfs');
  for (const d of ['bin', 'etc', 'proc', 'dev', 'sys', 'tmp', 'home/alice'])
    await mkdir(join(rootfs, d), { recursive: true });
  await copyFile(BUSYBOX, join(rootfs, 'bin/busybox'));
  for (const a of APPLETS) await symlink('busybox', join(rootfs, 'bin', a));
  // GNU yes/head (busybox yes is too slow to measure the channel) and the libc they need.
  for (const f of [
    '/usr/bin/yes',
    '/usr/bin/head',
    '/lib/x86_64-linux-gnu/libc.so.6',
    '/lib64/ld-linux-x86-64.so.2',
  ]) {
    if (!existsSync(f)) continue;
    await mkdir(join(rootfs, dirname(f)), { recursive: true });
    await copyFile(f, join(rootfs, f));
  }
  await writeFile(
    join(rootfs, 'etc/passwd'),
    'root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\nnobody:x:65534:65534::/nonexistent:/bin/false\n',
  );
  await writeFile(join(rootfs, 'etc/group'), 'root:x:0:\nalice:x:1000:\nwheel:x:10:alice\n');
  await run('chown', ['-R', '101000:101000', join(rootfs, 'home/alice')]);
  await run('runc', ['spec', '--bundle', dir]);
  const config = JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')) as {
    process: { terminal: boolean; args: string[] };
    root: { path: string; readonly: boolean };
    mounts: { destination: string; type: string; source: string; options: string[] }[];
    linux: {
      namespaces: { type: string }[];
      uidMappings?: unknown[];
      gidMappings?: unknown[];
      cgroupsPath?: string;
    };
  };
  config.process.terminal = false;
  config.process.args = ['/dev/.dsec-init'];
  config.root = { path: 'rootfs', readonly: false };
  config.mounts.push({
    destination: '/dev/.dsec-init',
    type: 'bind',
    source: initPath(),
    options: ['bind', 'ro'],
  });
  config.linux.namespaces.push({ type: 'user' });
  const map = [{ containerID: 0, hostID: 100000, size: 65536 }];
  config.linux.uidMappings = map;
  config.linux.gidMappings = map;
  config.linux.cgroupsPath = `/${id}`; // a top-level leaf: `runc delete` removes it entirely
  await writeFile(join(dir, 'config.json'), JSON.stringify(config));
  try {
    await run('runc', ['run', '-d', '--bundle', dir, id], { timeout: 20_000 });
  } catch (err) {
    await run('runc', ['delete', '--force', id]).catch(() => undefined);
    await rm(dir, { recursive: true, force: true });
    throw err;
  }
  const state = JSON.parse((await run('runc', ['state', id])).stdout) as { pid: number };
  const cgroupDirs = readFileSync(`/proc/${state.pid}/cgroup`, 'utf8')
    .split('\n')
    .map((l) => l.split(':'))
    .filter((f) => f[1] === 'pids' || f[1] === 'memory')
    .map((f) => `/sys/fs/cgroup/${f[1]}${f[2]}`);
  return {
    id,
    dir,
    initPid: state.pid,
    cgroupDirs,
    async destroy() {
      await run('runc', ['delete', '--force', id]).catch(() => undefined);
      await rm(dir, { recursive: true, force: true });
    },
  };
}

export interface Collected {
  exit: CommandExit;
  stdout: Buffer;
  stderr: Buffer;
  pid: number;
}

/** Spawns a command and waits for its exit, collecting all output. */
export async function runCollect(
  conn: ChronusConnection,
  req: SpawnRequest,
  stdin?: string,
): Promise<Collected> {
  const out: Buffer[] = [];
  const err: Buffer[] = [];
  const h = conn.spawn({ ...req, stdin: req.stdin ?? stdin !== undefined });
  h.onStdout((b) => out.push(Buffer.from(b)));
  h.onStderr((b) => err.push(Buffer.from(b)));
  if (stdin !== undefined) {
    h.write(stdin);
    h.endStdin();
  }
  const { pid } = await h.started;
  const exit = await h.exited;
  return { exit, stdout: Buffer.concat(out), stderr: Buffer.concat(err), pid };
}

/** Docker's default capability set. */
export const DOCKER_CAPS = [
  'CAP_CHOWN',
  'CAP_DAC_OVERRIDE',
  'CAP_FSETID',
  'CAP_FOWNER',
  'CAP_MKNOD',
  'CAP_NET_RAW',
  'CAP_SETGID',
  'CAP_SETUID',
  'CAP_SETFCAP',
  'CAP_SETPCAP',
  'CAP_NET_BIND_SERVICE',
  'CAP_SYS_CHROOT',
  'CAP_KILL',
  'CAP_AUDIT_WRITE',
];

export async function waitFor(
  cond: () => boolean | Promise<boolean>,
  what: string,
  ms = 5000,
): Promise<void> {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

export interface Daemon {
  sandbox: RuncSandbox;
  socketPath: string;
  pid: number;
  stop(): Promise<void>;
}

/**
 * A runc sandbox plus its chronus daemon, forked by `opts.supervisor` or by
 * a supervisor of its own (stopped again by stop()); stop() kills the
 * sandbox and checks the daemon went with it.
 */
export async function startDaemon(
  opts: { seccompProfile?: string; capabilities?: string[]; supervisor?: ChronusSupervisor } = {},
): Promise<Daemon> {
  const sandbox = await startRuncSandbox();
  const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
  const socketPath = join(sockDir, 'chronus.sock');
  const supervisor =
    opts.supervisor ??
    new ChronusSupervisor({ dir: join(sockDir, 'chronusd'), shellPath: BUSYBOX });
  const own = opts.supervisor === undefined;
  try {
    const { pid } = await startChronus({
      supervisor,
      socketPath,
      initPid: sandbox.initPid,
      cgroupDirs: sandbox.cgroupDirs,
      seccompProfile: opts.seccompProfile ?? '',
      capabilities: opts.capabilities ?? DOCKER_CAPS,
      noNewPrivs: true,
    });
    return {
      sandbox,
      socketPath,
      pid,
      async stop() {
        if (own) await supervisor.stop();
        await sandbox.destroy();
        await waitFor(() => !existsSync(`/proc/${pid}`), 'chronus to exit').finally(() =>
          rm(sockDir, { recursive: true, force: true }),
        );
      },
    };
  } catch (err) {
    if (own) await supervisor.stop();
    await sandbox.destroy();
    await rm(sockDir, { recursive: true, force: true });
    throw err;
  }
}
