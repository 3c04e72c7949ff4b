import { spawn, spawnSync } from 'node:child_process';
import { DsecError, throwIfAborted } from '@dsec/core';
import { helperPath } from './binaries.js';

/**
 * Running a program over a directory tree a sandbox made, confined to it
 * (`dsec-helper confine`, src/confine.c; SECURITY.md A9 and H35).
 *
 * The program gets a mount namespace of its own whose root is an empty,
 * read-only tmpfs holding only the trees named here, each attached under a
 * fixed name with nosymfollow, nosuid, nodev and noexec: the kernel follows
 * no symlink on them in any component, and any absolute path or `..` the
 * program is steered to ends inside that root. `--tools` adds the host's
 * `/usr` read-only for dynamically linked tools (cp, mkfs.erofs). The
 * helper's own tree operations (`tree scan|shadow|scrub|rm`, src/tree.c)
 * also open every path with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
 * RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`.
 *
 * Every platform operation that reads, copies, packs or deletes inside a
 * tree a sandbox controlled goes through here (docs/security.md, "Host-side
 * work on sandbox-made trees"); a new one must too.
 */
export interface ConfineOptions {
  /**
   * An empty directory of the platform's own on which the private root is
   * mounted (in the private namespace only: the host keeps seeing it empty).
   * Any number of runs may share one.
   */
  rootDir: string;
  /** Trees to attach at `/NAME` (a plain name: letters, digits, `.`, `_`, `-`); read-only unless `writable`. */
  trees?: readonly ConfinedTree[] | undefined;
  /**
   * A sandbox's disk-quota filesystem: the ext4 loop device `device` (its
   * superblock already mounted in the sandbox's namespace; this mount shares
   * it), attached read-only at `/NAME`.
   */
  ext4?: { device: string; name: string } | undefined;
  /** The host's `/usr` (read-only) and merged-usr links, for dynamically linked host tools. */
  tools?: boolean | undefined;
  /** Working directory inside the private root. */
  cwd?: string | undefined;
  /** Cgroup directories the program joins first (its CPU and memory limits). */
  cgroupDirs?: readonly string[] | undefined;
  /** RLIMIT_FSIZE: no file the program writes grows past this (SIGXFSZ). */
  maxFileBytes?: number | undefined;
  /** RLIMIT_CPU in seconds (SIGXCPU, then SIGKILL). */
  maxCpuSeconds?: number | undefined;
  /** RLIMIT_STACK (soft): recursive tools walking deep trees need more than 8 MiB. */
  stackBytes?: number | undefined;
}

export interface ConfinedTree {
  path: string;
  name: string;
  writable?: boolean | undefined;
}

/** The sandbox's own view instead of a private root: the mount namespace and root of its init. */
export interface SandboxViewOptions {
  initPid: number;
  cgroupDirs?: readonly string[] | undefined;
}

export interface ConfinedResult {
  exitCode: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
  /** Killed at `timeoutMs`. */
  timedOut: boolean;
}

export interface RunConfinedOptions {
  /** Kills the program (and what it started) past this; `timedOut` says so. */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
}

function limitArgs(options: {
  cgroupDirs?: readonly string[] | undefined;
  maxFileBytes?: number | undefined;
  maxCpuSeconds?: number | undefined;
  stackBytes?: number | undefined;
}): string[] {
  const args: string[] = [];
  for (const dir of options.cgroupDirs ?? []) args.push('--cgroup', dir);
  const num = (flag: string, v: number | undefined): void => {
    if (v === undefined) return;
    if (!Number.isSafeInteger(v) || v <= 0)
      throw new DsecError('invalid_argument', `${flag} must be a positive integer`);
    args.push(flag, String(v));
  };
  num('--max-file-bytes', options.maxFileBytes);
  num('--max-cpu-seconds', options.maxCpuSeconds);
  num('--stack-bytes', options.stackBytes);
  return args;
}

function confineArgs(options: ConfineOptions): string[] {
  const args = ['confine', '--root', options.rootDir];
  for (const t of options.trees ?? []) args.push(t.writable ? '--rw' : '--ro', t.path, t.name);
  if (options.ext4) args.push('--ext4', options.ext4.device, options.ext4.name);
  if (options.tools) args.push('--tools');
  if (options.cwd !== undefined) args.push('--cwd', options.cwd);
  return [...args, ...limitArgs(options)];
}

/** The argv that runs `program` confined (a host tool: needs `tools`, or an absolute path in a tree). */
export function confinedCommand(options: ConfineOptions, program: readonly string[]): string[] {
  return [helperPath(), ...confineArgs(options), '--', ...program];
}

/** The argv that runs the helper's own `tree OP ARGS` confined (it needs nothing in the root). */
export function confinedTreeCommand(
  options: ConfineOptions,
  treeArgs: readonly string[],
): string[] {
  return [helperPath(), ...confineArgs(options), '--self', '--', 'tree', ...treeArgs];
}

/** The argv that runs `tree OP ARGS` in a sandbox's own mount namespace and root. */
export function sandboxViewTreeCommand(
  options: SandboxViewOptions,
  treeArgs: readonly string[],
): string[] {
  if (!Number.isSafeInteger(options.initPid) || options.initPid <= 0)
    throw new DsecError('invalid_argument', 'initPid must be a pid');
  return [
    helperPath(),
    'confine',
    '--ns',
    String(options.initPid),
    ...limitArgs(options),
    '--self',
    '--',
    'tree',
    ...treeArgs,
  ];
}

const KEEP_BYTES = 64 * 1024;

/**
 * Runs a command made by `confinedCommand` & co. to its end. Resolves with
 * its exit status whatever it is (callers tell a refusal from a fault); a
 * helper that cannot start is `internal`, an abort kills it and is `aborted`.
 * The program and its children form a process group, killed as one.
 */
export function runConfined(
  argv: readonly string[],
  options: RunConfinedOptions = {},
): Promise<ConfinedResult> {
  throwIfAborted(options.signal);
  const [cmd, ...args] = argv;
  if (cmd === undefined) throw new DsecError('invalid_argument', 'empty command');
  return new Promise<ConfinedResult>((resolve, reject) => {
    const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    let stdout = '';
    let stderr = '';
    let timedOut = false;
    const keep = (acc: string, chunk: string): string => {
      const s = acc + chunk;
      return s.length > KEEP_BYTES ? s.slice(s.length - KEEP_BYTES) : s;
    };
    child.stdout.setEncoding('utf8').on('data', (c: string) => (stdout = keep(stdout, c)));
    child.stderr.setEncoding('utf8').on('data', (c: string) => (stderr = keep(stderr, c)));
    const killGroup = (): void => {
      try {
        if (child.pid !== undefined) process.kill(-child.pid, 'SIGKILL');
      } catch {
        // already gone
      }
    };
    const timer =
      options.timeoutMs !== undefined
        ? setTimeout(() => {
            timedOut = true;
            killGroup();
          }, options.timeoutMs)
        : undefined;
    options.signal?.addEventListener('abort', killGroup, { once: true });
    const done = (): void => {
      if (timer) clearTimeout(timer);
      options.signal?.removeEventListener('abort', killGroup);
    };
    child.once('error', (err) => {
      done();
      reject(new DsecError('internal', `cannot run ${cmd}: ${err.message}`, { cause: err }));
    });
    child.once('close', (exitCode, signal) => {
      done();
      // What the program left in its group (none of ours should outlive it).
      killGroup();
      if (options.signal?.aborted) {
        reject(new DsecError('aborted', 'operation aborted', { cause: options.signal.reason }));
        return;
      }
      resolve({ exitCode, signal, stdout, stderr, timedOut });
    });
  });
}

/** A confined run that must succeed: a failure is `internal` with the program's last words. */
export async function runConfinedOk(
  argv: readonly string[],
  what: string,
  options: RunConfinedOptions = {},
): Promise<ConfinedResult> {
  const r = await runConfined(argv, options);
  if (r.exitCode === 0) return r;
  throw confinedFailure(r, what, options.timeoutMs);
}

/** The error for a confined run that did not succeed: a time limit is `deadline_exceeded`. */
export function confinedFailure(r: ConfinedResult, what: string, timeoutMs?: number): DsecError {
  if (r.timedOut) {
    return new DsecError('deadline_exceeded', `${what} ran past its ${timeoutMs} ms limit`, {
      details: { timeoutMs },
    });
  }
  const tail = (r.stderr.trim() || r.stdout.trim()).split('\n').slice(-10).join('\n');
  const how = r.signal ? `was killed by ${r.signal}` : `exited with ${r.exitCode}`;
  return new DsecError('internal', `${what} ${how}${tail ? `: ${tail}` : ''}`, {
    details: { exitCode: r.exitCode, signal: r.signal },
  });
}

/**
 * Removes `path` and everything under it without following any symlink in
 * it, at any depth (`tree rm`: fd-relative unlinks; a too-deep directory is
 * renamed up and removed from there, so fds stay bounded). `path` itself is
 * the platform's; what is below it may be a sandbox's. Missing is fine.
 */
export async function removeTree(
  path: string,
  options: { signal?: AbortSignal } = {},
): Promise<void> {
  await runConfinedOk([helperPath(), 'tree', 'rm', path], `removing ${path}`, options);
}

/** `removeTree`, synchronously (start-up clean-up, before anything else runs). */
export function removeTreeSync(path: string): void {
  const r = spawnSync(helperPath(), ['tree', 'rm', path], { stdio: ['ignore', 'ignore', 'pipe'] });
  if (r.status !== 0) {
    const why = String(r.stderr ?? '').trim() || `exited with ${r.signal ?? r.status}`;
    throw new DsecError('internal', `removing ${path}: ${why}`);
  }
}
