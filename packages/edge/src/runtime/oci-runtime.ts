import { spawn } from 'node:child_process';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';

const execFileAsync = promisify(execFile);

/**
 * The OCI runtime that starts and removes containers from a bundle
 * (`config.json` + rootfs). runc here; crun speaks the same CLI and serves on
 * pure cgroup v2 hosts.
 *
 * Lifecycle: `run` starts the runtime in the foreground, detached from the
 * edge's session: the runtime process stays as the container's parent (its
 * shim) and, when the container's init exits, removes the container's
 * cgroups and state and exits itself. So stopping a container is killing its
 * init and waiting for the runtime process to go. `forceDelete` is for the
 * case where the runtime process died first (the container outlived it).
 */
export interface OciRuntime {
  readonly name: string;
  run(options: RunOptions): Promise<RunningContainer>;
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
  /** PID of the runtime process that waits on the container. */
  runtimePid: number;
  /** Host PID of the container's init. */
  initPid: number;
  /** Settles when the runtime process exits (only for processes this edge started). */
  exited: Promise<void>;
}

export class RuncRuntime implements OciRuntime {
  readonly name: string;

  constructor(
    readonly binary: string,
    /** The runtime's state directory (`--root`), private to this edge. */
    readonly root: string,
  ) {
    this.name = binary.split('/').at(-1) ?? binary;
  }

  async run(options: RunOptions): Promise<RunningContainer> {
    const argv = [
      ...(options.prefix ?? []),
      this.binary,
      ...[
        '--root',
        this.root,
        'run',
        '--bundle',
        options.bundle,
        '--pid-file',
        options.pidFile,
        options.id,
      ],
    ];
    const child = spawn(
      argv[0]!,
      argv.slice(1),
      // Own session: the runtime (and the sandbox under it) outlives an edge restart.
      { detached: true, stdio: ['ignore', 'pipe', 'pipe'] },
    );
    const exited = new Promise<void>((resolve) => child.once('close', () => resolve()));
    let stderr = '';
    child.stderr.setEncoding('utf8').on('data', (d: string) => {
      if (stderr.length < 8192) stderr += d;
    });
    try {
      await new Promise<void>((resolve, reject) => {
        let stdout = '';
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
        child.stdout.setEncoding('utf8').on('data', (d: string) => {
          stdout += d;
          if (stdout.includes('ready\n')) {
            done();
            resolve();
          }
        });
        child.once('close', (code) => {
          done();
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
      await exited;
      await this.forceDelete(options.id);
      throw err;
    }
    // The container is running: stop listening so nothing holds the edge's event loop.
    child.stdout.destroy();
    child.stderr.destroy();
    child.unref();
    // runc writes the pid file just after the init has started (and said `ready`).
    const initPid = await readPidFile(options.pidFile, 5_000);
    if (initPid === undefined || child.pid === undefined) {
      child.kill('SIGKILL');
      await this.forceDelete(options.id);
      throw new DsecError('internal', `${this.name} wrote no usable pid for ${options.id}`);
    }
    return { runtimePid: child.pid, initPid, exited };
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

async function readPidFile(file: string, timeoutMs: number): Promise<number | undefined> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const text = await readFile(file, 'utf8').catch(() => '');
    const pid = Number(text.trim());
    if (text.trim() && Number.isInteger(pid) && pid > 0) return pid;
    if (Date.now() > deadline) return undefined;
    await sleep(1);
  }
}
