/**
 * The node's chronus supervisor (`dsec-helper chronusd`) and the per-sandbox
 * command daemons it forks. One supervisor per node seals the platform shell
 * once and compiles the seccomp profile once; each sandbox's daemon is a
 * forked child that shares its pages copy-on-write (ADR 0008). The control
 * protocol is in packages/native/PROTOCOL.md.
 *
 * Lifetimes: the supervisor is detached (its own session) so that an edge
 * crash does not take it down; the next edge adopts it through its pid file.
 * A daemon does not need its supervisor once it serves: it outlives a
 * supervisor crash (reparented), and a fresh supervisor is started for the
 * next sandbox.
 *
 * @example
 * ```ts
 * const supervisor = new ChronusSupervisor({ dir: '/var/lib/dsec/chronus', shellPath: '/bin/busybox' });
 * const pending = await prepareChronus({ supervisor, socketPath: '/run/dsec/1/chronus.sock',
 *   cgroupDirs, seccompProfile, capabilities: ['CAP_CHOWN'], noNewPrivs: true });
 * // … start the runtime, learn the init's host PID, then:
 * await pending.attach(initPid);
 * isChronus(pending.pid, '/dsec/sb1'); // true while it serves
 * await supervisor.stop(); // the daemon keeps serving
 * ```
 */
import { spawn } from 'node:child_process';
import { createConnection, isIP } from 'node:net';
import type { Socket } from 'node:net';
import { chmod, mkdir, open, readFile, readlink, rm, stat } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

import { DsecError, throwIfAborted } from '@dsec/core';

import { helperPath } from './binaries.js';

/** `/proc/PID/cmdline` of the supervisor and of each daemon (chronus.h). */
const SUPERVISOR_TITLE = 'dsec-chronusd';
const DAEMON_TITLE = 'dsec-chronus';
/** 2: `prepare` takes `net` (the daemon configures the sandbox's interface). */
const PROTOCOL_VERSION = 2;
/** The supervisor answers a ping, or the first line of a prepare, at once; this is for a hung one. */
const ANSWER_TIMEOUT_MS = 10_000;

export interface ChronusSupervisorOptions {
  /**
   * The supervisor's directory: control socket `ctl.sock`, pid file
   * `chronusd.pid`, log `chronusd.log`. Created (or chmodded) 0700: only root
   * may talk to the supervisor.
   */
  dir: string;
  /** Host path of the static shell (busybox) that SHELL commands run from one sealed copy. */
  shellPath: string;
  /** How long a new supervisor may take to listen. Default 10 s. */
  startTimeoutMs?: number;
}

/**
 * Handle of the node's chronus supervisor. Nothing runs until the first
 * `start()` (or `prepareChronus`), which adopts a live supervisor of the same
 * directory, binary and shell, or starts one. A supervisor that died is
 * replaced by the next request.
 */
export class ChronusSupervisor {
  readonly dir: string;
  readonly #options: ChronusSupervisorOptions;
  #running: Promise<number> | undefined;
  #pid: number | undefined;
  #adopted = false;
  #protocol: number | undefined;

  constructor(options: ChronusSupervisorOptions) {
    this.#options = options;
    this.dir = resolve(options.dir);
  }

  /** Pid of the supervisor this handle last started or adopted. */
  get pid(): number | undefined {
    return this.#pid;
  }

  /** True when the running supervisor was found alive rather than started by this handle. */
  get adopted(): boolean {
    return this.#adopted;
  }

  /**
   * The control protocol of the supervisor this handle last started or
   * adopted (1 for a helper built before `net`); undefined before the first start.
   */
  get protocolVersion(): number | undefined {
    return this.#protocol;
  }

  /** The control socket's path. */
  get socketPath(): string {
    return join(this.dir, 'ctl.sock');
  }

  /**
   * Makes sure a supervisor serves: adopts the live one (pid file, its
   * command line, its binary, and a ping on the control socket that must
   * name the same pid and shell) or starts one. Idempotent; concurrent calls
   * share one start. Throws `unavailable` when a new supervisor fails to
   * start (its log is `dir/chronusd.log`).
   */
  async start(signal?: AbortSignal): Promise<number> {
    throwIfAborted(signal);
    return this.#current();
  }

  /**
   * Stops the supervisor of this directory (SIGTERM, then SIGKILL after
   * `timeoutMs`, default 2 s): the one this handle started or adopted, or
   * else the one the pid file names (left by an edge that crashed and never
   * adopted since). The daemons it forked keep serving their sandboxes.
   */
  async stop(options: { timeoutMs?: number } = {}): Promise<void> {
    const running = this.#running;
    this.#running = undefined;
    const pid =
      (await running?.catch(() => undefined)) ??
      this.#pid ??
      Number((await readFile(join(this.dir, 'chronusd.pid'), 'utf8').catch(() => '')).trim());
    if (Number.isSafeInteger(pid) && pid > 1 && (await isSupervisor(pid, this.dir))) {
      signalQuietly(pid, 'SIGTERM');
      if (!(await waitExit(pid, options.timeoutMs ?? 2000))) {
        signalQuietly(pid, 'SIGKILL');
        await waitExit(pid, 2000);
      }
    }
    this.#pid = undefined;
    await rm(this.socketPath, { force: true });
    await rm(join(this.dir, 'chronusd.pid'), { force: true });
  }

  /**
   * A connection to the control socket, starting (or replacing) the
   * supervisor when nothing listens there. `generation` identifies the
   * supervisor for {@link ChronusSupervisor.replace}. @internal
   */
  async connect(signal?: AbortSignal): Promise<{ socket: Socket; generation: Promise<number> }> {
    throwIfAborted(signal);
    const generation = this.#current();
    await generation;
    try {
      return { socket: await connectUnix(this.socketPath), generation };
    } catch {
      // It died (or was killed): the first caller to notice starts a new one.
      this.#forget(generation);
      const fresh = this.#current();
      await fresh;
      return { socket: await connectUnix(this.socketPath), generation: fresh };
    }
  }

  /**
   * Drops a supervisor that stopped answering (SIGKILL when it is ours), so
   * the next request starts a fresh one. @internal
   */
  async replace(generation: Promise<number>): Promise<void> {
    const pid = await generation.catch(() => undefined);
    if (pid !== undefined && (await isSupervisor(pid, this.dir))) signalQuietly(pid, 'SIGKILL');
    this.#forget(generation);
  }

  #current(): Promise<number> {
    if (!this.#running) {
      const running = this.#adoptOrSpawn();
      this.#running = running;
      running.catch(() => this.#forget(running));
    }
    return this.#running;
  }

  #forget(generation: Promise<number>): void {
    if (this.#running === generation) this.#running = undefined;
  }

  async #adoptOrSpawn(): Promise<number> {
    await mkdir(this.dir, { recursive: true, mode: 0o700 });
    await chmod(this.dir, 0o700);
    // A supervisor of this directory is adopted when it runs the current
    // helper binary and answers for our shell; replaced otherwise (an
    // upgrade, a changed shell, or a hung one).
    const old = Number(
      (await readFile(join(this.dir, 'chronusd.pid'), 'utf8').catch(() => '')).trim(),
    );
    if (Number.isSafeInteger(old) && old > 1 && (await isSupervisor(old, this.dir))) {
      const answer = (await runsHelper(old)) ? await this.#ping() : undefined;
      if (answer?.pid === old) {
        this.#pid = old;
        this.#adopted = true;
        this.#protocol = answer.protocol;
        return old;
      }
      signalQuietly(old, 'SIGKILL');
      await waitExit(old, 2000);
    }
    const { pid, protocol } = await this.#spawn();
    this.#pid = pid;
    this.#adopted = false;
    this.#protocol = protocol;
    return pid;
  }

  /**
   * The pid and protocol version that answer on the control socket, if it
   * speaks our protocol (or an older one: it runs the current helper binary,
   * which a partial upgrade may have left older) and seals our shell.
   */
  async #ping(): Promise<{ pid: number; protocol: number } | undefined> {
    const socket = await connectUnix(this.socketPath).catch(() => undefined);
    if (!socket) return undefined;
    try {
      socket.end(encodeRequest(['ping']));
      const text = await readUntilClose(socket, ANSWER_TIMEOUT_MS);
      const m = /^chronusd (\d+) (\d+) (.*)\n/.exec(text);
      const protocol = Number(m?.[1]);
      if (!m || protocol < 1 || protocol > PROTOCOL_VERSION || m[3] !== this.#options.shellPath)
        return undefined;
      return { pid: Number(m[2]), protocol };
    } catch {
      return undefined;
    } finally {
      socket.destroy();
    }
  }

  async #spawn(): Promise<{ pid: number; protocol: number }> {
    const logPath = join(this.dir, 'chronusd.log');
    const log = await open(logPath, 'a', 0o600);
    let child;
    try {
      child = spawn(
        helperPath(),
        ['chronusd', '--dir', this.dir, '--shell', this.#options.shellPath],
        { detached: true, stdio: ['ignore', 'pipe', log.fd], cwd: '/' },
      );
    } finally {
      await log.close();
    }
    const stdout = child.stdout;
    if (!stdout) throw new DsecError('internal', 'chronus supervisor: no stdout pipe');
    try {
      return await new Promise<{ pid: number; protocol: number }>((resolvePid, reject) => {
        let text = '';
        const timer = setTimeout(
          () => reject(new DsecError('unavailable', 'chronus supervisor did not start in time')),
          this.#options.startTimeoutMs ?? 10_000,
        );
        stdout.setEncoding('utf8').on('data', (s: string) => {
          text += s;
          const m = /^ready (\d+)$/m.exec(text);
          if (m) {
            clearTimeout(timer);
            // Written before `ready`; a helper older than protocol 2 has no such line.
            const protocol = Number(/^protocol (\d+)$/m.exec(text)?.[1] ?? 1);
            resolvePid({ pid: Number(m[1]), protocol });
          }
        });
        child.on('error', (err) => {
          clearTimeout(timer);
          reject(
            new DsecError('unavailable', `chronus supervisor: ${err.message}`, { cause: err }),
          );
        });
        child.on('exit', (code, sig) => {
          clearTimeout(timer);
          reject(new DsecError('unavailable', `chronus supervisor exited with ${sig ?? code}`));
        });
      });
    } catch (err) {
      child.kill('SIGKILL');
      const tail = (await readFile(logPath, 'utf8').catch(() => '')).trim().split('\n').slice(-3);
      throw new DsecError(
        'unavailable',
        `${(err as Error).message}; log ${logPath}: ${tail.join(' | ')}`,
        {
          cause: err,
        },
      );
    } finally {
      stdout.destroy();
      child.removeAllListeners();
      child.unref();
    }
  }
}

export interface ChronusOptions {
  /** The node's supervisor, which forks the daemon. */
  supervisor: ChronusSupervisor;
  /** Host path of the daemon's unix socket, in a root-only directory. */
  socketPath: string;
  /** Host pid of the sandbox's PID 1: the daemon joins its namespaces and exits when it dies. */
  initPid: number;
  /** cgroup directories (one per v1 hierarchy, or the v2 leaf) the daemon and its commands join. */
  cgroupDirs: string[];
  /** Seccomp profile in the line format (`default errno 1`, `allow read`, …); '' loads none. */
  seccompProfile: string;
  /** Capabilities commands may hold, e.g. `CAP_CHOWN`. */
  capabilities: string[];
  noNewPrivs: boolean;
  /**
   * The daemon configures the sandbox's end of its veth from inside its
   * namespaces ({@link PendingChronus.configureNetwork}) before it serves.
   * Ignored (no `configureNetwork`) when the supervisor's helper is older,
   * and by {@link startChronus}.
   */
  network?: boolean;
  signal?: AbortSignal;
}

/**
 * The sandbox's side of its network link: the interface (already in the
 * sandbox's network namespace) and, per family, its address and the gateway
 * of its default route.
 */
export interface ChronusNetworkConfig {
  interface: string;
  addresses: { address: string; prefixLength: number; gateway: string }[];
}

/**
 * Starts the sandbox's command daemon. It outlives this Node process and the
 * supervisor, and exits by itself when the sandbox's init dies. Resolves
 * once it listens on `socketPath`.
 */
export async function startChronus(options: ChronusOptions): Promise<{ pid: number }> {
  // No `network`: nothing here would configure it (a restarted daemon's sandbox has its own).
  const pending = await prepareChronus({ ...options, network: false });
  await pending.attach(options.initPid);
  return { pid: pending.pid };
}

/** A chronus daemon that has been forked and waits for the sandbox's init. */
export interface PendingChronus {
  pid: number;
  /**
   * Hands over the init's host PID; resolves once the daemon serves (with
   * `network`, only after {@link PendingChronus.configureNetwork}).
   */
  attach(initPid: number): Promise<void>;
  /**
   * Present when the daemon was prepared with `network` by a supervisor that
   * supports it: configures the interface (it must exist in the sandbox's
   * network namespace by now) over rtnetlink from inside the sandbox's
   * namespaces, with every address and default route of `config`. Call it
   * along with `attach`; it resolves once the daemon is done. Errors:
   * `invalid_argument` for a malformed config, `internal` with the daemon's
   * reason (the daemon then exits, so `attach` fails too).
   */
  configureNetwork?: (config: ChronusNetworkConfig) => Promise<void>;
  /** Kills the waiting daemon (the sandbox failed to start). */
  abort(): void;
}

/**
 * Has the supervisor fork the sandbox's daemon before the sandbox runs, so
 * its slow host-side setup (joining the cgroups, which must already exist,
 * and binding the socket) overlaps the OCI runtime's start-up. Resolves once
 * the daemon is forked; `attach` completes the start. Errors: `internal`
 * with the daemon's own one-line reason; `unavailable` when no supervisor
 * can be started or it does not answer.
 */
export async function prepareChronus(
  options: Omit<ChronusOptions, 'initPid'>,
): Promise<PendingChronus> {
  throwIfAborted(options.signal);
  const { supervisor } = options;
  const request = ['prepare', 'sock', options.socketPath];
  for (const dir of options.cgroupDirs) request.push('cgroup', dir);
  request.push('caps', options.capabilities.join(','));
  request.push('no-new-privs', options.noNewPrivs ? '1' : '0');
  if (options.seccompProfile !== '') request.push('seccomp', options.seccompProfile);

  const { socket, generation } = await supervisor.connect(options.signal);
  // The version of the supervisor just connected to (connect awaited its start).
  const network = options.network === true && (supervisor.protocolVersion ?? 1) >= 2;
  if (network) request.push('net', '1');
  let text = '';
  let closed = false;
  socket.setEncoding('utf8').on('data', (s: string) => (text += s));
  socket.on('error', () => undefined); // reported as the close below
  socket.once('close', () => (closed = true));
  const failure = (what: string) => {
    const reason = text.replace(/^pid \d+\n/, '').trim();
    return new DsecError('internal', reason || `chronus ${what}`);
  };
  /** Resolves with the match once `re` matches the text, or rejects when the connection ends first. */
  const expect = (re: RegExp, what: string, timeoutMs?: number) =>
    new Promise<RegExpExecArray>((resolveMatch, reject) => {
      const check = () => {
        const m = re.exec(text);
        if (m) done(() => resolveMatch(m));
        else if (closed) done(() => reject(failure(what)));
      };
      const timer =
        timeoutMs === undefined
          ? undefined
          : setTimeout(
              () =>
                done(() => reject(new DsecError('unavailable', `chronus supervisor: no ${what}`))),
              timeoutMs,
            );
      const done = (settle: () => void) => {
        clearTimeout(timer);
        socket.off('data', check);
        socket.off('close', check);
        settle();
      };
      socket.on('data', check);
      socket.on('close', check);
      check();
    });

  socket.write(encodeRequest(request));
  let pid: number;
  const onAbort = () => socket.destroy();
  options.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    pid = Number((await expect(/^pid (\d+)\n/, 'daemon fork', ANSWER_TIMEOUT_MS))[1]);
  } catch (err) {
    socket.destroy();
    if (err instanceof DsecError && err.code === 'unavailable')
      await supervisor.replace(generation);
    throwIfAborted(options.signal);
    throw err;
  } finally {
    options.signal?.removeEventListener('abort', onAbort);
  }
  // The pid goes out only once the daemon is prepared: writing to a daemon that
  // already failed would end the connection (EPIPE) before its reason is read.
  const prepared = expect(/\nprepared\n/, 'exited before it was prepared');
  const ready = expect(/\nready\n/, 'exited before it was ready');
  prepared.catch(() => undefined);
  ready.catch(() => undefined);
  // The `net` line goes after the pid line; settled by attach.
  let pidSent!: { resolve: () => void; reject: (err: unknown) => void };
  const pidWritten = new Promise<void>((resolve, reject) => (pidSent = { resolve, reject }));
  pidWritten.catch(() => undefined);
  return {
    pid,
    ...(network
      ? {
          async configureNetwork(config: ChronusNetworkConfig) {
            const line = networkLine(config);
            const configured = expect(/\nconfigured\n/, 'exited before its network was configured');
            configured.catch(() => undefined);
            await pidWritten;
            socket.write(line);
            await configured;
          },
        }
      : {}),
    async attach(initPid: number) {
      const onAttachAbort = () => {
        signalQuietly(pid, 'SIGKILL');
        socket.destroy();
      };
      options.signal?.addEventListener('abort', onAttachAbort, { once: true });
      try {
        await prepared;
        socket.write(`${initPid}\n`);
        pidSent.resolve();
        await ready;
      } catch (err) {
        pidSent.reject(err);
        signalQuietly(pid, 'SIGKILL');
        throwIfAborted(options.signal);
        throw err;
      } finally {
        options.signal?.removeEventListener('abort', onAttachAbort);
        socket.destroy();
      }
    },
    abort() {
      // The daemon also exits by itself when it reads EOF instead of a pid.
      pidSent.reject(new DsecError('aborted', 'chronus daemon aborted'));
      signalQuietly(pid, 'SIGKILL');
      socket.destroy();
    },
  };
}

/** `net IFNAME ADDR/PLEN GATEWAY …\n` (PROTOCOL.md), with every field checked. */
function networkLine(config: ChronusNetworkConfig): string {
  const bad = (what: string) =>
    new DsecError('invalid_argument', `chronus network configuration: bad ${what}`);
  if (!/^[A-Za-z0-9_.-]{1,15}$/.test(config.interface)) throw bad('interface name');
  const families = new Set<number>();
  const fields = [config.interface];
  for (const a of config.addresses) {
    const family = isIP(a.address);
    if (family === 0 || isIP(a.gateway) !== family || families.has(family)) throw bad('address');
    if (
      !Number.isInteger(a.prefixLength) ||
      a.prefixLength < 1 ||
      a.prefixLength > (family === 4 ? 32 : 128)
    )
      throw bad('prefix length');
    families.add(family);
    fields.push(`${a.address}/${a.prefixLength}`, a.gateway);
  }
  if (families.size === 0) throw bad('address list');
  return `net ${fields.join(' ')}\n`;
}

/**
 * Whether `pid` is a chronus daemon serving the sandbox whose cgroup is
 * `cgroupsPath` (as in `/proc/PID/cgroup`, e.g. `/dsec/dsec-0123…`): its
 * title, its membership of that cgroup, and a pid namespace that is ours
 * (a process inside the sandbox cannot have that, whatever it calls itself).
 * Guards against PID reuse after an edge restart.
 */
export async function isChronus(pid: number, cgroupsPath: string): Promise<boolean> {
  const [cmdline, cgroup, pidns, ourPidns] = await Promise.all([
    readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => ''),
    readFile(`/proc/${pid}/cgroup`, 'utf8').catch(() => ''),
    readlink(`/proc/${pid}/ns/pid`).catch(() => undefined),
    readlink('/proc/self/ns/pid'),
  ]);
  return (
    cmdline.split('\0')[0] === DAEMON_TITLE &&
    pidns === ourPidns &&
    cgroup.split('\n').some((line) => line.endsWith(`:${cgroupsPath}`))
  );
}

/**
 * The chronus daemons in the sandbox's cgroup (`cgroupDir`, one of the
 * directories the daemon joined): for a stop whose record never learnt the
 * daemon's pid. Reads one `cgroup.procs`; [] when the cgroup is gone.
 */
export async function findChronus(cgroupDir: string, cgroupsPath: string): Promise<number[]> {
  const procs = await readFile(join(cgroupDir, 'cgroup.procs'), 'utf8').catch(() => '');
  const pids = procs.split('\n').filter(Boolean).map(Number);
  const found: number[] = [];
  for (const pid of pids) if (await isChronus(pid, cgroupsPath)) found.push(pid);
  return found;
}

/**
 * A live chronus supervisor of `dir`: its title, and its stderr, which is
 * `dir/chronusd.log` (the title shows no path; a recycled pid of another
 * node's supervisor has another log).
 */
async function isSupervisor(pid: number, dir: string): Promise<boolean> {
  const [cmdline, statText, stderr] = await Promise.all([
    readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => ''),
    readFile(`/proc/${pid}/stat`, 'utf8').catch(() => ''),
    readlink(`/proc/${pid}/fd/2`).catch(() => ''),
  ]);
  return (
    cmdline.split('\0')[0] === SUPERVISOR_TITLE &&
    !/\) [ZX] /.test(statText) &&
    stderr === join(dir, 'chronusd.log')
  );
}

/** Whether `pid` runs the current helper binary (a rebuilt or upgraded helper is another inode). */
async function runsHelper(pid: number): Promise<boolean> {
  const [exe, helper] = await Promise.all([
    stat(`/proc/${pid}/exe`).catch(() => undefined),
    stat(helperPath()).catch(() => undefined),
  ]);
  return (
    exe !== undefined && helper !== undefined && exe.ino === helper.ino && exe.dev === helper.dev
  );
}

/** `u32le length | NUL-terminated strings`: one control request. */
function encodeRequest(strings: string[]): Buffer {
  for (const s of strings) {
    if (s.includes('\0'))
      throw new DsecError('invalid_argument', 'chronus request strings cannot hold NUL bytes');
  }
  const body = Buffer.from(strings.map((s) => `${s}\0`).join(''), 'utf8');
  const header = Buffer.alloc(4);
  header.writeUInt32LE(body.length, 0);
  return Buffer.concat([header, body]);
}

function connectUnix(path: string): Promise<Socket> {
  return new Promise((resolveSocket, reject) => {
    const socket = createConnection(path);
    socket.once('connect', () => {
      socket.removeAllListeners('error');
      resolveSocket(socket);
    });
    socket.once('error', reject);
  });
}

function readUntilClose(socket: Socket, timeoutMs: number): Promise<string> {
  return new Promise((resolveText, reject) => {
    let text = '';
    const timer = setTimeout(() => reject(new Error('timed out')), timeoutMs);
    socket.setEncoding('utf8').on('data', (s: string) => (text += s));
    socket.once('error', (err) => {
      clearTimeout(timer);
      reject(err);
    });
    socket.once('close', () => {
      clearTimeout(timer);
      resolveText(text);
    });
  });
}

function signalQuietly(pid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(pid, signal);
  } catch {
    // already gone
  }
}

/** Waits until `pid` is gone or a zombie; false on timeout. */
async function waitExit(pid: number, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  for (let delayMs = 1; ; delayMs = Math.min(delayMs * 2, 50)) {
    const statText = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
    if (statText === '' || /\) [ZX] /.test(statText)) return true;
    if (Date.now() > deadline) return false;
    await sleep(delayMs);
  }
}
