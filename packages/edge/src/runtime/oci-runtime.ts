import { spawn } from 'node:child_process';
import { execFile } from 'node:child_process';
import { existsSync, rmSync, statfsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';

const execFileAsync = promisify(execFile);

/**
 * The OCI runtime that starts and removes containers from a bundle
 * (`config.json` + rootfs): crun where installed (a C program: about half of
 * runc's start-up), runc otherwise; both speak the same CLI.
 *
 * Lifecycle: `run` starts the container detached (`run -d`) and returns once
 * its init has said `ready`; the runtime process has exited by then, so no
 * process is kept per sandbox (paper 4.3: density). The container lives as
 * long as its init: stopping it is killing the init and removing its cgroups
 * (the edge owns them), then `forget`ting the runtime's state. `forceDelete`
 * is for a container whose init pid was never recorded (an interrupted create).
 */
export interface OciRuntime {
  readonly name: string;
  /**
   * Host paths the runtime must not see as they are: its private mount
   * namespace gets an empty tmpfs over each (crun refuses a hybrid cgroup
   * layout, so it is shown the v1 hierarchies only).
   */
  readonly maskPaths: string[];
  run(options: RunOptions): Promise<RunningContainer>;
  /** Drops the runtime's state of a container whose init is gone (no process is started). */
  forget(id: string): void;
  /** Removes a container and its cgroups whatever its state; unknown IDs are fine. */
  forceDelete(id: string): Promise<void>;
  /** Container IDs the runtime knows of. */
  list(): Promise<string[]>;
  /** Whether the runtime still holds state for the container (cheap: no process is started). */
  exists(id: string): boolean;
}

export interface RunOptions {
  id: string;
  bundle: string;
  pidFile: string;
  /** How long the container's init may take to say `ready`. */
  timeoutMs: number;
  /** A command the runtime is run under (it execs the runtime), e.g. one that mounts the rootfs first. */
  prefix?: string[] | undefined;
  signal?: AbortSignal | undefined;
}

export interface RunningContainer {
  /** Host PID of the container's init. */
  initPid: number;
}

const CGROUP2_SUPER_MAGIC = 0x63677270;
const TMPFS_MAGIC = 0x01021994;

/** crun or runc (`binary`), whichever is given; `defaultRuntimeBinary` picks one. */
export class RuncRuntime implements OciRuntime {
  readonly name: string;
  readonly maskPaths: string[];

  constructor(
    readonly binary: string,
    /** The runtime's state directory (`--root`), private to this edge. */
    readonly root: string,
    cgroupRoot = '/sys/fs/cgroup',
  ) {
    this.name = binary.split('/').at(-1) ?? binary;
    this.maskPaths =
      this.name === 'crun' && isHybrid(cgroupRoot) ? [join(cgroupRoot, 'unified')] : [];
  }

  async run(options: RunOptions): Promise<RunningContainer> {
    const argv = [
      ...(options.prefix ?? []),
      this.binary,
      ...['--root', this.root, 'run', '-d', '--bundle', options.bundle],
      ...['--pid-file', options.pidFile, options.id],
    ];
    // Own session: nothing the edge's terminal or process group does reaches it.
    // The container's init inherits stdout, says `ready` on it and then closes
    // it, so the pipe ends when both the runtime and the init are done with it.
    const child = spawn(argv[0]!, argv.slice(1), {
      detached: true,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let stdout = '';
    let stderr = '';
    child.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d.slice(0, 64)));
    child.stderr.setEncoding('utf8').on('data', (d: string) => {
      if (stderr.length < 8192) stderr += d;
    });
    const closed = new Promise<number | null>((resolve) => child.once('close', resolve));
    try {
      await new Promise<void>((resolve, reject) => {
        const timer = setTimeout(
          () =>
            reject(
              new DsecError(
                'deadline_exceeded',
                `${this.name} did not start ${options.id} in ${options.timeoutMs} ms`,
              ),
            ),
          options.timeoutMs,
        );
        const onAbort = () => reject(new DsecError('aborted', 'sandbox creation aborted'));
        options.signal?.addEventListener('abort', onAbort, { once: true });
        const done = () => {
          clearTimeout(timer);
          options.signal?.removeEventListener('abort', onAbort);
        };
        void closed.then((code) => {
          done();
          if (code === 0 && stdout.includes('ready\n')) resolve();
          else
            reject(
              new DsecError(
                'internal',
                `${this.name} run ${options.id} exited (${code}): ${stderr.trim() || 'no output'}`,
              ),
            );
        });
        child.once('error', (err) => {
          done();
          reject(
            new DsecError('internal', `cannot start ${this.binary}: ${err.message}`, {
              cause: err,
            }),
          );
        });
      });
    } catch (err) {
      child.kill('SIGKILL');
      child.stdout.destroy();
      child.stderr.destroy();
      // What it may have started is found by name and removed.
      await this.forceDelete(options.id).catch(() => undefined);
      throw err;
    }
    const initPid = Number((await readFile(options.pidFile, 'utf8').catch(() => '')).trim());
    if (!Number.isInteger(initPid) || initPid <= 0) {
      await this.forceDelete(options.id);
      throw new DsecError('internal', `${this.name} wrote no usable pid for ${options.id}`);
    }
    return { initPid };
  }

  forget(id: string): void {
    rmSync(join(this.root, id), { recursive: true, force: true });
  }

  async forceDelete(id: string): Promise<void> {
    try {
      await execFileAsync(this.binary, ['--root', this.root, 'delete', '--force', id]);
    } catch (err) {
      const stderr = String((err as { stderr?: unknown }).stderr ?? '');
      if (!/does not exist|not found|no such file/i.test(stderr)) {
        throw new DsecError('internal', `${this.name} delete ${id}: ${stderr.trim()}`, {
          cause: err,
        });
      }
    }
  }

  exists(id: string): boolean {
    return existsSync(join(this.root, id));
  }

  async list(): Promise<string[]> {
    const { stdout } = await execFileAsync(this.binary, [
      '--root',
      this.root,
      'list',
      '--format',
      'json',
    ]);
    const items = JSON.parse(stdout.trim() || 'null') as { id: string }[] | null;
    return (items ?? []).map((c) => c.id);
  }
}

/** A v1 layout with the v2 hierarchy mounted beside it (at `unified`), as on this machine. */
function isHybrid(cgroupRoot: string): boolean {
  try {
    return (
      statfsSync(cgroupRoot).type === TMPFS_MAGIC &&
      statfsSync(join(cgroupRoot, 'unified')).type === CGROUP2_SUPER_MAGIC
    );
  } catch {
    return false;
  }
}

/** crun when it is installed (faster start-up, smaller), else runc. */
export function defaultRuntimeBinary(): string {
  const path = (process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin').split(':');
  return path.some((dir) => dir && existsSync(join(dir, 'crun'))) ? 'crun' : 'runc';
}
