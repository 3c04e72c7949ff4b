/**
 * @dsec/native — the host operations Node cannot do itself, done by two small
 * C programs built at install time (`make` in this package):
 *
 * - `dsec-helper`: file-backed EROFS mounts, FUSE mounts (the blob daemon),
 *   the overlay root filesystem over idmapped layers, and `chronus`, the
 *   per-sandbox command daemon that runs commands inside a sandbox's
 *   namespaces while staying out of its reach.
 * - `dsec-init`: PID 1 of every container sandbox (bind-mount {@link initPath}).
 *
 * @example
 * ```ts
 * import { mountErofs, mountRootfs, startChronus, unmount } from '@dsec/native';
 * import { ChronusConnection } from '@dsec/native';
 * await mountErofs('/layers/base.erofs', '/mnt/base');
 * await mountRootfs({ target: '/sb/1/root', upper: '/sb/1/up', work: '/sb/1/wk',
 *   lowers: ['/mnt/base'], idmap: { hostId: 100000, size: 65536 } });
 * // … start the container (runc) with dsec-init as PID 1, then:
 * await startChronus({ socketPath: '/run/dsec/1.sock', initPid, shellPath: '/bin/busybox',
 *   cgroupDirs: [], seccompProfile, capabilities: ['CAP_CHOWN'], noNewPrivs: true });
 * const conn = await ChronusConnection.connect('/run/dsec/1.sock');
 * const cmd = conn.spawn({ argv: ['sh', '-c', 'echo hi'], shell: true });
 * cmd.onStdout((b) => process.stdout.write(b));
 * const { exitCode } = await cmd.exited;
 * conn.close();
 * await unmount(['/sb/1/root', '/mnt/base']);
 * ```
 */
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { rm, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';

import { DsecError, throwIfAborted } from '@dsec/core';

export { ChronusConnection, CommandHandle } from './chronus-client.js';
export type { CommandExit, SpawnRequest } from './chronus-client.js';

/**
 * Where `make` put the binaries: beside this module's source (`../build`), or,
 * when this module is bundled into the CLI (`packages/cli/dist`), in the
 * native package next door. `DSEC_NATIVE_DIR` overrides both.
 */
function builtFile(name: string): string {
  const candidates = [
    ...(process.env.DSEC_NATIVE_DIR ? [`${process.env.DSEC_NATIVE_DIR}/${name}`] : []),
    fileURLToPath(new URL(`../build/${name}`, import.meta.url)),
    fileURLToPath(new URL(`../../native/build/${name}`, import.meta.url)),
  ];
  const path = candidates.find((p) => existsSync(p));
  if (!path)
    throw new Error(
      'native helpers not built: run `npm install` (it runs `make -C packages/native`)',
    );
  return path;
}

/** Absolute path of the `dsec-helper` binary; throws if it was not built. */
export function helperPath(): string {
  return builtFile('dsec-helper');
}

/** Absolute path of the static `dsec-init` binary (PID 1 of sandboxes); throws if it was not built. */
export function initPath(): string {
  return builtFile('dsec-init');
}

/**
 * Runs `dsec-helper ARGS` to completion; rejects with its one-line error.
 * `extraFds` are handed down as the helper's fds 3, 4, ….
 */
function runHelper(args: string[], extraFds: number[] = []): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn(helperPath(), args, { stdio: ['ignore', 'ignore', 'pipe', ...extraFds] });
    let stderr = '';
    child.stderr?.setEncoding('utf8').on('data', (s: string) => (stderr += s));
    child.on('error', (err) =>
      reject(new DsecError('internal', `dsec-helper ${args[0]}: ${err.message}`, { cause: err })),
    );
    child.on('close', (code, signal) => {
      if (code === 0) resolve();
      else {
        const why = stderr.trim() || `dsec-helper ${args[0]} exited with ${signal ?? code}`;
        reject(new DsecError('internal', why, { details: { exitCode: code } }));
      }
    });
  });
}

/**
 * Helper runs take milliseconds and undo their own partial work on failure,
 * so they are never killed halfway; a cancelled mount is undone afterwards.
 */
async function mountCancellable(
  args: string[],
  target: string,
  signal: AbortSignal | undefined,
): Promise<void> {
  throwIfAborted(signal);
  await runHelper(args);
  if (signal?.aborted) {
    await runHelper(['umount', '--detach', target]).catch(() => undefined);
    throwIfAborted(signal);
  }
}

/** Mounts an EROFS image file read-only (no loop device); `blobDevice` is the data blob of a split layer. */
export async function mountErofs(
  image: string,
  target: string,
  options: { blobDevice?: string; signal?: AbortSignal } = {},
): Promise<void> {
  const args = ['mount-erofs', image, target];
  if (options.blobDevice !== undefined) args.push('--device', options.blobDevice);
  await mountCancellable(args, target, options.signal);
}

/**
 * Mounts a read-only FUSE filesystem (`fuse.NAME`, default `dsec-blobd`) at
 * `target`, served by the caller on `fuseFd`, an open `/dev/fuse` descriptor
 * of this process. The helper inherits the descriptor, mounts and exits; the
 * caller starts answering requests (INIT first) once this resolves.
 * Options: allow_other, default_permissions, nosuid, nodev, noexec,
 * max_read=1 MiB, owner root.
 */
export async function mountFuse(
  target: string,
  fuseFd: number,
  options: { name?: string; signal?: AbortSignal } = {},
): Promise<void> {
  throwIfAborted(options.signal);
  const args = ['mount-fuse', target, '--fd', '3'];
  if (options.name !== undefined) args.push('--name', options.name);
  await runHelper(args, [fuseFd]);
  if (options.signal?.aborted) {
    await runHelper(['umount', '--detach', target]).catch(() => undefined);
    throwIfAborted(options.signal);
  }
}

/** Unmounts each target; targets that are not mounted or do not exist are fine. */
export async function unmount(
  targets: string[],
  options: { detach?: boolean; signal?: AbortSignal } = {},
): Promise<void> {
  throwIfAborted(options.signal);
  if (targets.length === 0) return;
  await runHelper(['umount', ...(options.detach ? ['--detach'] : []), ...targets]);
}

export interface MountRootfsOptions {
  target: string;
  upper: string;
  work: string;
  /** Lower layers, top (highest priority) first. */
  lowers: string[];
  /** Map layer uid/gid 0..size-1 to hostId.. through idmapped lower mounts. */
  idmap?: { hostId: number; size: number };
  /**
   * The writable layer's own filesystem (an ext4 image: the disk quota),
   * mounted at `mount` through a self-detaching loop device; `upper` and
   * `work` must be inside `mount`. Only with `rootfsCommandPrefix`.
   */
  upperImage?: { image: string; mount: string };
  signal?: AbortSignal;
}

/**
 * Mounts the sandbox root overlay. With `idmap` the lowers are idmapped clones;
 * those staging mounts are detached right after the overlay is mounted (the
 * overlay keeps its own clones), so unmounting `target` is the only cleanup.
 */
export async function mountRootfs(options: MountRootfsOptions): Promise<void> {
  await mountCancellable(rootfsArgs(options), options.target, options.signal);
}

/**
 * A command prefix that mounts the sandbox root overlay in a private mount
 * namespace and then execs the command that follows it (the OCI runtime).
 * The mount is visible only to that command and what it starts, and goes
 * away with them: nothing to unmount on the host, even after a crash.
 */
export function rootfsCommandPrefix(options: Omit<MountRootfsOptions, 'signal'>): string[] {
  return [helperPath(), ...rootfsArgs(options), '--exec'];
}

function rootfsArgs(options: Omit<MountRootfsOptions, 'signal'>): string[] {
  const args = [
    'mount-rootfs',
    '--target',
    options.target,
    '--upper',
    options.upper,
    '--work',
    options.work,
  ];
  if (options.idmap) args.push('--idmap', `${options.idmap.hostId}:${options.idmap.size}`);
  if (options.upperImage) {
    args.push('--upper-image', options.upperImage.image, '--upper-mount', options.upperImage.mount);
  }
  for (const lower of options.lowers) args.push('--lower', lower);
  return args;
}

export interface ChronusOptions {
  /** Host path of the daemon's unix socket, in a root-only directory. */
  socketPath: string;
  /** Host pid of the sandbox's PID 1: the daemon joins its namespaces and exits when it dies. */
  initPid: number;
  /** Host path of a static shell (busybox) that SHELL commands run from a sealed copy. */
  shellPath: string;
  /** cgroup directories (one per v1 hierarchy, or the v2 leaf) the daemon and its commands join. */
  cgroupDirs: string[];
  /** Seccomp profile in the line format (`default errno 1`, `allow read`, …); '' loads none. */
  seccompProfile: string;
  /** Capabilities commands may hold, e.g. `CAP_CHOWN`. */
  capabilities: string[];
  noNewPrivs: boolean;
  signal?: AbortSignal;
}

/**
 * Starts the sandbox's command daemon, detached: it outlives this Node process
 * (an edge restart must not kill it) and exits by itself when the sandbox's
 * init dies. Resolves once it listens on `socketPath`.
 */
export async function startChronus(options: ChronusOptions): Promise<{ pid: number }> {
  const pending = await prepareChronus(options);
  await pending.attach(options.initPid);
  return { pid: pending.pid };
}

/** A chronus daemon that has done its host-side setup and waits for the sandbox's init. */
export interface PendingChronus {
  pid: number;
  /** Hands over the init's host PID; resolves once the daemon serves. */
  attach(initPid: number): Promise<void>;
  /** Kills the waiting daemon (the sandbox failed to start). */
  abort(): void;
}

/**
 * Starts chronus before the sandbox runs, so its slow host-side setup (joining
 * the cgroups — they must already exist — sealing the shell, compiling the
 * seccomp filter) overlaps the OCI runtime's start-up. Resolves once the
 * daemon is spawned; `attach` completes the start.
 */
export async function prepareChronus(
  options: Omit<ChronusOptions, 'initPid'>,
): Promise<PendingChronus> {
  throwIfAborted(options.signal);
  const args = [
    'chronus',
    '--sock',
    options.socketPath,
    '--pid',
    '-',
    '--shell',
    options.shellPath,
  ];
  for (const dir of options.cgroupDirs) args.push('--cgroup', dir);
  args.push('--caps', options.capabilities.join(','));
  if (options.noNewPrivs) args.push('--no-new-privs');
  const profilePath = `${options.socketPath}.seccomp`;
  if (options.seccompProfile !== '') {
    await writeFile(profilePath, options.seccompProfile, { mode: 0o600 });
    args.push('--seccomp', profilePath);
  }
  const child = spawn(helperPath(), args, { detached: true, stdio: ['pipe', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.setEncoding('utf8').on('data', (s: string) => (stdout += s));
  child.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
  child.stdin.on('error', () => undefined); // a daemon that died is reported by `attach`
  const ready = new Promise<void>((resolve, reject) => {
    child.stdout.on('data', () => stdout.includes('ready\n') && resolve());
    child.on('error', (err) =>
      reject(new DsecError('internal', `chronus: ${err.message}`, { cause: err })),
    );
    child.on('close', (code, sig) => {
      const why = stderr.trim() || `chronus exited with ${sig ?? code} before it was ready`;
      reject(new DsecError('internal', why, { details: { exitCode: code } }));
    });
  });
  ready.catch(() => undefined);
  const release = () => {
    child.stdin.destroy();
    child.stdout.destroy();
    child.stderr.destroy();
    child.unref();
    void rm(profilePath, { force: true }); // read before `ready`; the daemon cannot see it afterwards
  };
  return {
    pid: child.pid ?? 0,
    async attach(initPid: number) {
      child.stdin.end(`${initPid}\n`);
      const onAbort = () => child.kill('SIGKILL');
      options.signal?.addEventListener('abort', onAbort, { once: true });
      try {
        await ready;
      } catch (err) {
        child.kill('SIGKILL');
        throw err;
      } finally {
        options.signal?.removeEventListener('abort', onAbort);
        release();
      }
    },
    abort() {
      child.kill('SIGKILL');
      release();
    },
  };
}
