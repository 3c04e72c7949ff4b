/**
 * @dsec/native — the host operations Node cannot do itself, done by two small
 * C programs built at install time (`make` in this package):
 *
 * - `dsec-helper`: file-backed EROFS mounts, FUSE mounts (the blob daemon),
 *   the overlay root filesystem over idmapped layers, and `chronusd`, the
 *   node's supervisor of chronus, the per-sandbox command daemon that runs
 *   commands inside a sandbox's namespaces while staying out of its reach,
 *   and `pids-reclaim` ({@link reclaimLeftovers}).
 * - `dsec-init`: PID 1 of every container sandbox (bind-mount {@link initPath}).
 * - `dsec-helper confine` / `tree`: the one way the platform works on a
 *   directory tree a sandbox made ({@link confinedCommand}, {@link removeTree}).
 *
 * @example
 * ```ts
 * import { ChronusSupervisor, mountErofs, mountRootfs, startChronus, unmount } from '@dsec/native';
 * import { ChronusConnection } from '@dsec/native';
 * await mountErofs('/layers/base.erofs', '/mnt/base');
 * await mountRootfs({ target: '/sb/1/root', upper: '/sb/1/up', work: '/sb/1/wk',
 *   lowers: ['/mnt/base'], idmap: { hostId: 100000, size: 65536 } });
 * // … start the container (runc) with dsec-init as PID 1, then:
 * const supervisor = new ChronusSupervisor({ dir: '/run/dsec/chronusd', shellPath: '/bin/busybox' });
 * await startChronus({ supervisor, socketPath: '/run/dsec/1.sock', initPid,
 *   cgroupDirs: [], seccompProfile, capabilities: ['CAP_CHOWN'], noNewPrivs: true });
 * const conn = await ChronusConnection.connect('/run/dsec/1.sock');
 * const cmd = conn.spawn({ argv: ['sh', '-c', 'echo hi'], shell: true });
 * cmd.onStdout((b) => process.stdout.write(b));
 * const { exitCode } = await cmd.exited;
 * conn.close();
 * await unmount(['/sb/1/root', '/mnt/base']);
 * await supervisor.stop(); // the daemon keeps serving until the sandbox's init dies
 * ```
 */
import { spawn, spawnSync } from 'node:child_process';

import { DsecError, throwIfAborted } from '@dsec/core';

import { helperPath } from './binaries.js';

export { helperPath, initPath, xattrToolPath } from './binaries.js';

export {
  confinedCommand,
  confinedFailure,
  confinedTreeCommand,
  removeTree,
  removeTreeSync,
  runConfined,
  runConfinedOk,
  sandboxViewTreeCommand,
} from './confine.js';
export type {
  ConfinedResult,
  ConfinedTree,
  ConfineOptions,
  RunConfinedOptions,
  SandboxViewOptions,
} from './confine.js';

export { ChronusConnection, CommandHandle } from './chronus-client.js';
export { reclaimLeftovers } from './pids-reclaim.js';
export type { ReclaimedProcesses } from './pids-reclaim.js';
export {
  ChronusSupervisor,
  findChronus,
  isChronus,
  prepareChronus,
  startChronus,
} from './chronus-supervisor.js';
export type {
  ChronusNetworkConfig,
  ChronusOptions,
  ChronusSupervisorOptions,
  PendingChronus,
} from './chronus-supervisor.js';
export type {
  CommandExit,
  CommandStarted,
  PidsLimitEvent,
  SpawnRequest,
} from './chronus-client.js';

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

/**
 * Mounts an EROFS image file read-only; `blobDevice` is the data blob of a
 * split layer. File-backed (no loop device, Linux 6.12+) unless `loop`: then
 * the image and the blob go through read-only loop devices that clear
 * themselves when the mount goes (older kernels).
 */
export async function mountErofs(
  image: string,
  target: string,
  options: { blobDevice?: string; loop?: boolean; signal?: AbortSignal } = {},
): Promise<void> {
  const args = ['mount-erofs', image, target];
  if (options.blobDevice !== undefined) args.push('--device', options.blobDevice);
  if (options.loop) args.push('--loop');
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
  /** Directories hidden under an empty tmpfs in the private namespace. Only with `rootfsCommandPrefix`. */
  masks?: string[] | undefined;
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
 * Compiles a seccomp profile (the line format chronus loads) into the BPF
 * program the kernel runs: `struct sock_filter[]` bytes. A runtime that
 * takes a precompiled filter (crun's `run.oci.seccomp_bpf_data`) then skips
 * compiling the OCI profile on every start (≈ 7 ms here). Throws
 * `invalid_argument` with the compiler's reason.
 */
export function compileSeccompBpf(profile: string): Buffer {
  const r = spawnSync(helperPath(), ['seccomp-bpf'], { input: profile, maxBuffer: 2 ** 20 });
  if (r.status !== 0) {
    throw new DsecError('invalid_argument', `seccomp profile: ${String(r.stderr).trim()}`);
  }
  return r.stdout;
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
  for (const mask of options.masks ?? []) args.push('--mask', mask);
  for (const lower of options.lowers) args.push('--lower', lower);
  return args;
}
