import { DsecError, pooledRandomBytes, DEFAULT_COMMAND_TIMEOUT_MS } from '@dsec/core';
import type { CommandOutcome, SessionInfo, SessionResult, SessionRunSpec } from '@dsec/core';
import type { CommandExit, SandboxChannel, SandboxCommand } from '../backends/channel.js';
import type { LiveCommand } from './command-registry.js';
import { DEFAULT_PATH, resultOf } from './command-runner.js';
import { isPidsRefusal, pidsExhausted } from './exhaustion.js';
import { isUserRefusal, userRefused } from './spawn-user.js';
import type { UserField } from './spawn-user.js';
import { MarkerScanner } from './marker-scanner.js';

/** After a timeout or kill, how long the shell has to report the end of the call before it is killed itself. */
const INTERRUPT_GRACE_MS = 1500;

/**
 * Signals the processes a session call started: every process in the
 * sandbox whose environment carries the call's tag (`DSEC_CALL=$1`, set on
 * the call's `eval`, inherited by everything it execs). The shell itself,
 * background jobs of earlier calls and other sessions carry other tags or
 * none. Runs as the platform's busybox sh, as the session's user.
 */
const SIGNAL_CALL_SCRIPT = `
tag=$1 sig=$2
for d in /proc/[0-9]*; do
  p=\${d#/proc/}
  [ "$p" = "$$" ] && continue
  # NUL-separated: busybox grep would stop at the first NUL of a line.
  tr '\\0' '\\n' <"$d/environ" 2>/dev/null | grep -qxF "DSEC_CALL=$tag" && kill -"$sig" "$p" 2>/dev/null
done
exit 0
`;

export interface ShellSessionOptions {
  name: string;
  /** The sandbox's shared chronus connection (re-asked on each start: it may have been reopened). */
  channel: () => Promise<SandboxChannel>;
  /** A shell path inside the sandbox; undefined: the platform's busybox `sh`. */
  shell?: string | undefined;
  user: string;
  /** Where `user` came from, named if the sandbox cannot run as it. */
  userField: UserField;
  env: Record<string, string>;
  cwd?: string | undefined;
  /** The sandbox's pids limit, named when the shell cannot start there. */
  pidsLimit?: number | undefined;
}

type CallEnd = { kind: 'marker'; status: number } | { kind: 'exit'; exit: CommandExit };

interface ActiveCall {
  live: LiveCommand;
  /** Not secret (it is in the call's environment), unlike the nonce. */
  tag: string;
  out: MarkerScanner;
  err: MarkerScanner;
  outcome: CommandOutcome | undefined;
  startedMs: number;
  end: (e: CallEnd) => void;
}

/**
 * A named, persistent shell in a sandbox: cwd, environment, variables,
 * functions and background jobs carry over between calls. Each call writes
 * its line to the shell's stdin wrapped as
 *
 *     command eval '<line>' </dev/null 7>&- 8>&-
 *     __dsec_s=$?; printf '\036DSEC:%s:%d\036' <nonce> "$__dsec_s" >&7; … >&8
 *
 * where fds 7 and 8 are the shell's own copies of its stdout and stderr. The
 * call ends when both streams carried the marker with this call's nonce
 * (docs/adr/0004-shell-sessions.md). Calls are serialized.
 */
export class ShellSession {
  readonly name: string;
  readonly createdAt = new Date().toISOString();
  calls = 0;
  readonly #o: ShellSessionOptions;
  #handle: SandboxCommand | undefined;
  #pid: number | undefined;
  #alive = false;
  #starts = 0;
  #closed = false;
  #queue: Promise<unknown> = Promise.resolve();
  #current: ActiveCall | undefined;
  #busy = false;

  constructor(options: ShellSessionOptions) {
    this.name = options.name;
    this.#o = options;
  }

  info(): SessionInfo {
    return {
      name: this.name,
      shell: this.#o.shell ?? 'sh',
      user: this.#o.user,
      pid: this.#alive ? this.#pid : undefined,
      alive: this.#alive,
      busy: this.#busy,
      calls: this.calls,
      createdAt: this.createdAt,
    };
  }

  /** Runs one line; calls queue behind each other. */
  run(spec: SessionRunSpec, live: LiveCommand): Promise<SessionResult> {
    const p = this.#queue.then(() => this.#run(spec, live));
    this.#queue = p.catch(() => undefined);
    return p;
  }

  /** Kills the shell and everything it started; later calls fail. */
  close(): void {
    this.#closed = true;
    this.#handle?.killTree();
  }

  async #run(spec: SessionRunSpec, live: LiveCommand): Promise<SessionResult> {
    if (this.#closed) throw new DsecError('conflict', `session ${this.name} was closed`);
    this.#busy = true;
    try {
      const restarted = await this.#ensure();
      this.calls++;
      const nonce = pooledRandomBytes(16).toString('hex');
      const tag = pooledRandomBytes(16).toString('hex');
      const call: ActiveCall = {
        live,
        tag,
        out: new MarkerScanner(nonce),
        err: new MarkerScanner(nonce),
        outcome: undefined,
        startedMs: Date.now(),
        end: () => undefined,
      };
      const ended = new Promise<CallEnd>((resolve) => (call.end = resolve));
      this.#current = call;
      this.#handle!.write(wrap(spec, nonce, tag));
      live.setStarted({
        kill: () => void this.#interrupt(call, 'killed', 'KILL'),
        signal: (sig) => void this.#signalCall(call, sig),
      });
      const timer = setTimeout(
        () => void this.#interrupt(call, 'timeout', 'KILL'),
        spec.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS,
      );
      let end: CallEnd;
      try {
        end = await ended;
      } finally {
        clearTimeout(timer);
        this.#current = undefined;
      }
      const base = { session: this.name, shellRestarted: restarted };
      if (end.kind === 'marker') {
        return {
          ...resultOf(
            live,
            { exitCode: end.status, signal: null },
            call.outcome ?? 'exited',
            call.startedMs,
          ),
          ...base,
          sessionEnded: false,
        };
      }
      const outcome = call.outcome ?? (end.exit.signal ? 'signaled' : 'exited');
      return {
        ...resultOf(live, end.exit, outcome, call.startedMs),
        ...base,
        sessionEnded: true,
        reason:
          call.outcome !== undefined
            ? 'the session shell did not stop the call and was killed; the next call starts a new one'
            : 'the session shell exited; the next call starts a new one',
      };
    } finally {
      this.#busy = false;
    }
  }

  /** Starts the shell if it is not running; returns whether it replaced one that died. */
  async #ensure(): Promise<boolean> {
    if (this.#alive) return false;
    const conn = await this.#o.channel();
    const handle = conn.spawn({
      argv: this.#o.shell !== undefined ? [this.#o.shell] : ['sh'],
      shell: this.#o.shell === undefined,
      env: { PATH: DEFAULT_PATH, ...this.#o.env },
      cwd: this.#o.cwd ?? '',
      user: this.#o.user,
      stdin: true,
    });
    handle.onStdout((chunk) => this.#output(handle, 'out', chunk));
    handle.onStderr((chunk) => this.#output(handle, 'err', chunk));
    try {
      this.#pid = (await handle.started).pid;
    } catch (e) {
      if (isPidsRefusal(e)) throw pidsExhausted(this.#o.pidsLimit, e);
      if (isUserRefusal(e)) throw userRefused(this.#o.user, this.#o.userField, e);
      const errno = (e as { code?: string }).code;
      throw new DsecError(
        errno === 'ECONNRESET' ? 'unavailable' : 'invalid_argument',
        `cannot start the session shell ${JSON.stringify(this.#o.shell ?? 'sh')}: ${(e as Error).message}`,
        { field: 'shell', details: errno ? { errno } : undefined, cause: e },
      );
    }
    this.#handle = handle;
    this.#alive = true;
    handle.exited.then(
      (exit) => this.#shellGone(handle, exit),
      () => this.#shellGone(handle, { exitCode: null, signal: 'SIGKILL' } as CommandExit),
    );
    // Private copies of the shell's stdout and stderr for the end markers, so a
    // line that redirects its shell's output (`exec >log`) does not hide them.
    handle.write('exec 7>&1 8>&2\n');
    this.#starts++;
    return this.#starts > 1;
  }

  #output(handle: SandboxCommand, stream: 'out' | 'err', chunk: Buffer): void {
    const call = this.#current;
    if (!call || handle !== this.#handle) return; // between calls: background jobs' chatter
    const scanner = stream === 'out' ? call.out : call.err;
    const data = scanner.push(chunk);
    if (data.length > 0) {
      if (stream === 'out') call.live.stdout(data);
      else call.live.stderr(data);
    }
    if (call.out.done && call.err.done)
      call.end({ kind: 'marker', status: call.out.status ?? 255 });
  }

  #shellGone(handle: SandboxCommand, exit: CommandExit): void {
    if (handle !== this.#handle) return;
    this.#alive = false;
    const call = this.#current;
    if (!call) return;
    const out = call.out.flush();
    const err = call.err.flush();
    if (out.length > 0) call.live.stdout(out);
    if (err.length > 0) call.live.stderr(err);
    call.end({ kind: 'exit', exit });
  }

  /** Stops the call's foreground job; if the shell itself does not come back, kills it. */
  async #interrupt(call: ActiveCall, outcome: CommandOutcome, sig: string): Promise<void> {
    if (call.outcome !== undefined || this.#current !== call) return;
    call.outcome = outcome;
    const handle = this.#handle;
    const deadline = Date.now() + INTERRUPT_GRACE_MS;
    // Again a few times: a job may start new processes (`(sleep 9; sleep 9)`) as the first die.
    while (this.#current === call && Date.now() < deadline) {
      await this.#signalCall(call, sig).catch(() => undefined);
      await Promise.race([
        new Promise((r) => setTimeout(r, INTERRUPT_GRACE_MS / 4)),
        call.live.result.catch(() => undefined),
      ]);
    }
    // Still no end of call: the shell itself is stuck (a builtin loop). It goes; the next call starts anew.
    if (this.#current === call) handle?.killTree();
  }

  /** Signals what the call started (not the shell, not older background jobs). */
  async #signalCall(call: ActiveCall, sig: string | number): Promise<void> {
    if (this.#current !== call || this.#pid === undefined) return;
    const name = typeof sig === 'number' ? String(sig) : sig.replace(/^SIG/, '');
    if (!/^[A-Z0-9]{1,10}$/.test(name)) {
      throw new DsecError('invalid_argument', `unknown signal ${String(sig)}`, { field: 'signal' });
    }
    const conn = await this.#o.channel();
    const h = conn.spawn({
      argv: ['sh', '-c', SIGNAL_CALL_SCRIPT, 'sh', call.tag, name],
      shell: true,
      user: this.#o.user,
      env: { PATH: DEFAULT_PATH },
    });
    await h.exited;
  }
}

/** The text written to the shell for one call. */
export function wrap(spec: SessionRunSpec, nonce: string, tag: string): string {
  const quoted = `'${spec.line.replace(/'/g, `'\\''`)}'`;
  let input = ' </dev/null';
  let heredoc = '';
  if (spec.stdin !== undefined && spec.stdin.length > 0) {
    const delim = `DSEC_EOF_${nonce}`;
    input = ` <<'${delim}'`;
    heredoc = `${spec.stdin}${spec.stdin.endsWith('\n') ? '' : '\n'}${delim}\n`;
  }
  const mark = `'\\036DSEC:%s:%d\\036' ${nonce} "$__dsec_s"`;
  return (
    `DSEC_CALL=${tag} command eval ${quoted}${input} 7>&- 8>&-\n${heredoc}` +
    `__dsec_s=$?; printf ${mark} >&7; printf ${mark} >&8\n`
  );
}
