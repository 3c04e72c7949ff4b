import { spawn, type ChildProcess } from 'node:child_process';
import { DsecError } from '@dsec/core';
import { bisect, MicroBatcher } from './batcher.js';

/**
 * Runs a host tool (`ip`, `nft`, `sh`) to completion with optional stdin;
 * rejects with its stderr. Bounded in time so a wedged tool cannot hang a
 * sandbox's create or stop.
 */
export function runTool(
  cmd: string,
  args: string[],
  options: { stdin?: string; timeoutMs?: number; stderrLimitBytes?: number } = {},
): Promise<string> {
  const tool = startTool(cmd, args, { ...options, stdin: options.stdin !== undefined });
  return tool.finish(options.stdin);
}

/** A started host tool (see {@link startTool}). */
export interface StartedTool {
  /** Writes `stdin` (if the tool reads it) and closes it; resolves to stdout once it exits 0. */
  finish(stdin?: string): Promise<string>;
  /** Ends the tool (SIGKILL) when its work is no longer wanted; `finish` then rejects. */
  kill(): void;
}

/**
 * Starts a host tool now and gives it its input later: the process start
 * (a fork of the edge's large process, then the tool's exec and start-up)
 * overlaps with whatever the caller still has to do before it knows the
 * input. `stdin`: the tool reads standard input (given by `finish`).
 */
export function startTool(
  cmd: string,
  args: string[],
  options: { stdin?: boolean; timeoutMs?: number; stderrLimitBytes?: number } = {},
): StartedTool {
  const child = spawn(cmd, args, {
    stdio: [options.stdin ? 'pipe' : 'ignore', 'pipe', 'pipe'],
    timeout: options.timeoutMs ?? 15_000,
    killSignal: 'SIGKILL',
  });
  let out = '';
  let err = '';
  child.stdout?.setEncoding('utf8').on('data', (s: string) => (out += s));
  child.stderr?.setEncoding('utf8').on('data', (s: string) => {
    if (err.length < (options.stderrLimitBytes ?? 16_384)) err += s;
  });
  child.stdin?.on('error', () => undefined); // reported through 'close'
  const done = new Promise<string>((resolve, reject) => {
    child.on('error', (e) =>
      reject(new DsecError('internal', `${cmd}: ${e.message}`, { cause: e })),
    );
    child.on('close', (code, signal) => {
      if (code === 0) resolve(out);
      else
        reject(
          new DsecError(
            'internal',
            `${cmd} ${args.slice(0, 3).join(' ')}: ${err.trim() || `exit ${signal ?? code}`}`,
            {
              details: { exitCode: code },
            },
          ),
        );
    });
  });
  // Reported by `finish`; a killed tool nobody waits for is not an error.
  done.catch(() => undefined);
  return {
    finish(stdin?: string) {
      child.stdin?.end(stdin ?? '');
      return done;
    },
    kill() {
      child.kill('SIGKILL');
    },
  };
}

/** Applies an nftables script atomically (`nft -f -`): all of it or none. */
export function nft(script: string): Promise<string> {
  return runTool('nft', ['-f', '-'], { stdin: script });
}

/**
 * One nft transaction for many callers' scripts (see {@link MicroBatcher}):
 * a burst of sandbox changes costs a few transactions instead of one each.
 * A script is nft commands, one per line. Scripts must be idempotent
 * (element add/delete pairs): when a batch fails it is split and retried
 * (bisect), so only the script at fault fails. `run` gets one batch's
 * commands (by default an `nft -f` process; the edge passes its
 * {@link NftSession}).
 */
export function nftBatcher(
  run: (commands: string[]) => Promise<unknown> = (commands) =>
    nft(commands.map((c) => c + '\n').join('')),
): MicroBatcher<string, void> {
  return new MicroBatcher<string, void>((scripts) =>
    bisect(scripts, async (part) => {
      const commands = part.flatMap((s) => s.split('\n')).filter((c) => c.trim() !== '');
      if (commands.length > 0) await run(commands);
    }),
  );
}

/**
 * nftables commands through one long-lived `nft -j -i` process: each
 * request is one line, which nft runs as one transaction (all of it or
 * none), so a sandbox's create, removal or DNS answer pays neither a process
 * start nor nft's start-up cache fill (about 4 ms idle, 15 ms and more on a
 * busy 2-core host; a request here takes about 0.3 ms).
 *
 * nft reads lines through libedit, which keeps each one in its history: the
 * process is replaced after `maxRequests` requests or `maxBytes` of input so
 * that stays bounded, and `HOME` points nowhere so no history file is
 * written. stdout is made line-buffered (`stdbuf -oL`) and stderr joins it,
 * so what nft says comes back in the order it was said. Each request is
 * followed by a marker line that nft cannot parse (`dsmark_<n>`); its error
 * echoes the marker, which says the request is done. Lines between two
 * markers are the request's output: JSON documents (from `list` commands) or,
 * when a line starts with `Error:`, the request failed and made no change.
 *
 * nft rereads its cache when the ruleset's generation changed and always for
 * `list` commands, so a long-lived process sees what other processes and the
 * packet path (dynamic sets) changed.
 */
export class NftSession {
  readonly #maxRequests: number;
  readonly #maxBytes: number;
  readonly #timeoutMs: number;
  #current: NftProcess | undefined;

  constructor(options: { maxRequests?: number; maxBytes?: number; timeoutMs?: number } = {}) {
    this.#maxRequests = options.maxRequests ?? 2000;
    this.#maxBytes = options.maxBytes ?? 32 * 2 ** 20;
    this.#timeoutMs = options.timeoutMs ?? 15_000;
  }

  /**
   * Runs `commands` (nft syntax, one per entry, no newlines) as one
   * transaction; resolves to the JSON documents nft printed (one per `list`
   * command), rejects with nft's error (`internal`) when any command failed.
   */
  run(commands: string[]): Promise<unknown[]> {
    const line = commands.join('; ');
    if (line.includes('\n'))
      return Promise.reject(new DsecError('internal', 'nft: a command contains a newline'));
    const proc = this.#process();
    const done = proc.run(line);
    if (proc.requests >= this.#maxRequests || proc.bytes >= this.#maxBytes) {
      proc.retire();
      // The next request finds its process started.
      this.#current = new NftProcess(this.#timeoutMs);
    }
    return done;
  }

  /** Starts the process ahead of the first request (its start-up is then off the create path). */
  warm(): void {
    this.#process();
  }

  /** Lets the process finish what it was given, then exit. */
  close(): void {
    this.#current?.retire();
    this.#current = undefined;
  }

  #process(): NftProcess {
    if (!this.#current || this.#current.retired) this.#current = new NftProcess(this.#timeoutMs);
    return this.#current;
  }
}

interface NftRequest {
  marker: string;
  output: unknown[];
  errors: string[];
  resolve: (output: unknown[]) => void;
  reject: (err: unknown) => void;
  timer: NodeJS.Timeout;
}

/** The most error text kept per request (nft echoes the whole failed line). */
const NFT_ERROR_TEXT_LIMIT = 4096;

class NftProcess {
  readonly #child: ChildProcess;
  readonly #pending: NftRequest[] = [];
  readonly #timeoutMs: number;
  #out = '';
  #markers = 0;
  /** The marker's own error ends with a caret line under it; it belongs to no request. */
  #skipCaret = false;
  #held: string | undefined;
  requests = 0;
  bytes = 0;
  retired = false;

  constructor(timeoutMs: number) {
    this.#timeoutMs = timeoutMs;
    this.#child = spawn('sh', ['-c', 'exec stdbuf -oL nft -j -i 2>&1'], {
      stdio: ['pipe', 'pipe', 'ignore'],
      env: { ...process.env, HOME: '/dev/null' },
    });
    this.#child.stdout?.setEncoding('utf8').on('data', (d: string) => this.#onOutput(d));
    this.#child.stdin?.on('error', () => undefined); // reported through 'close'
    this.#child.on('error', (e) => this.#fail(new DsecError('internal', `nft: ${e.message}`)));
    this.#child.on('close', (code, signal) =>
      this.#fail(new DsecError('internal', `nft -i exited (${signal ?? code})`)),
    );
    // The process never keeps the edge's process alive: a waiting request's timer does.
    this.#child.unref();
    for (const stream of [this.#child.stdin, this.#child.stdout])
      (stream as unknown as { unref?: () => void } | null)?.unref?.();
  }

  run(line: string): Promise<unknown[]> {
    this.requests++;
    this.bytes += line.length;
    return new Promise<unknown[]>((resolve, reject) => {
      if (this.retired || !this.#child.stdin?.writable) {
        reject(new DsecError('internal', 'nft -i is not running'));
        return;
      }
      const marker = `dsmark_${++this.#markers}`;
      const timer = setTimeout(() => {
        this.#fail(new DsecError('internal', `nft -i: no answer within ${this.#timeoutMs} ms`));
        this.#child.kill('SIGKILL');
      }, this.#timeoutMs);
      this.#pending.push({ marker, output: [], errors: [], resolve, reject, timer });
      this.#child.stdin.write(`${line}\n${marker}\n`);
    });
  }

  /** No new requests; the process exits once it has run what it was given. */
  retire(): void {
    if (this.retired) return;
    this.retired = true;
    this.#child.stdin?.end();
  }

  #onOutput(data: string): void {
    this.#out += data;
    let nl: number;
    while ((nl = this.#out.indexOf('\n')) >= 0) {
      const line = this.#out.slice(0, nl);
      this.#out = this.#out.slice(nl + 1);
      const head = this.#pending[0];
      if (this.#skipCaret && /^\s*\^+\s*$/.test(line)) {
        this.#skipCaret = false;
        continue;
      }
      this.#skipCaret = false;
      if (!head) continue;
      // An error's first line is held back until the next one says whether it
      // was the marker's own (`Error: syntax error…` then the marker).
      const held = this.#held;
      this.#held = undefined;
      if (line === head.marker) {
        this.#pending.shift();
        clearTimeout(head.timer);
        this.#skipCaret = true;
        if (head.errors.length === 0) head.resolve(head.output);
        else head.reject(new DsecError('internal', `nft: ${head.errors.join('\n').trim()}`));
        continue;
      }
      if (held !== undefined) this.#message(head, held);
      if (line.startsWith('Error:')) {
        this.#held = line;
        continue;
      }
      if (line.startsWith('{') && head.errors.length === 0) {
        try {
          head.output.push(JSON.parse(line));
          continue;
        } catch {
          // not JSON after all: part of a message
        }
      }
      // Other text (a failed command's echo and carets, a warning) only matters after an error.
      if (head.errors.length > 0) this.#message(head, line);
    }
  }

  #message(head: NftRequest, line: string): void {
    if (head.errors.join('\n').length < NFT_ERROR_TEXT_LIMIT)
      head.errors.push(line.slice(0, NFT_ERROR_TEXT_LIMIT));
  }

  #fail(err: DsecError): void {
    this.retired = true;
    for (const r of this.#pending.splice(0)) {
      clearTimeout(r.timer);
      r.reject(err);
    }
  }
}

/**
 * Host-side `ip` commands through one long-lived `ip -force -batch -`
 * process: each request's lines are written to its stdin and run as they
 * arrive, so a create pays neither a process start nor a wait for a batch
 * to fill. `rtnetlink` serializes these changes in the kernel anyway.
 *
 * Each request's lines are followed by a marker line that always fails
 * (`link show dev dsmark/<n>`: no interface name contains a slash); with
 * `-force`, ip reports every failed line as `Command failed -:N` on stderr,
 * in order, so the marker's report says the request is done and the
 * reports before it name its failures.
 *
 * ip caches interface indexes by name for its whole life; a name that is
 * deleted and made again would resolve to the old index. So the process is
 * replaced after any failure and after `maxRequests`, and callers must not
 * reuse a name within one process except after a failure (veth names are
 * unique per sandbox).
 */
export class IpSession {
  readonly #maxRequests: number;
  readonly #timeoutMs: number;
  #current: IpProcess | undefined;

  constructor(options: { maxRequests?: number; timeoutMs?: number } = {}) {
    this.#maxRequests = options.maxRequests ?? 1000;
    this.#timeoutMs = options.timeoutMs ?? 15_000;
  }

  /** Runs `lines` (ip batch syntax); rejects with the messages of the lines that failed. */
  run(lines: string[]): Promise<void> {
    if (!this.#current || this.#current.retired) this.#current = new IpProcess(this.#timeoutMs);
    const proc = this.#current;
    const done = proc.run(lines);
    if (proc.requests >= this.#maxRequests) proc.retire();
    done.catch(() => proc.retire());
    return done;
  }

  /** Lets the process finish what it was given, then exit. */
  close(): void {
    this.#current?.retire();
    this.#current = undefined;
  }
}

const IP_IDLE_MS = 5000;

interface IpRequest {
  marker: number;
  errors: string[];
  resolve: () => void;
  reject: (err: unknown) => void;
  timer: NodeJS.Timeout;
}

class IpProcess {
  readonly #child: ChildProcess;
  readonly #pending: IpRequest[] = [];
  readonly #timeoutMs: number;
  #lines = 0;
  #idle: NodeJS.Timeout | undefined;
  #stderr = '';
  #messages: string[] = [];
  requests = 0;
  retired = false;

  constructor(timeoutMs: number) {
    this.#timeoutMs = timeoutMs;
    this.#child = spawn('ip', ['-force', '-batch', '-'], { stdio: ['pipe', 'ignore', 'pipe'] });
    this.#child.stderr?.setEncoding('utf8').on('data', (d: string) => this.#onStderr(d));
    this.#child.stdin?.on('error', () => undefined); // reported through 'close'
    this.#child.on('error', (e) => this.#fail(new DsecError('internal', `ip: ${e.message}`)));
    this.#child.on('close', (code, signal) =>
      this.#fail(new DsecError('internal', `ip -batch exited (${signal ?? code})`)),
    );
    // The process never keeps the edge's process alive: a waiting request's timer does.
    this.#child.unref();
    for (const stream of [this.#child.stdin, this.#child.stderr])
      (stream as unknown as { unref?: () => void } | null)?.unref?.();
  }

  run(lines: string[]): Promise<void> {
    this.requests++;
    return new Promise<void>((resolve, reject) => {
      if (this.retired || !this.#child.stdin?.writable) {
        reject(new DsecError('internal', 'ip -batch is not running'));
        return;
      }
      this.#lines += lines.length + 1;
      const marker = this.#lines;
      const timer = setTimeout(() => {
        this.#fail(new DsecError('internal', `ip -batch: no answer within ${this.#timeoutMs} ms`));
        this.#child.kill('SIGKILL');
      }, this.#timeoutMs);
      this.#pending.push({ marker, errors: [], resolve, reject, timer });
      clearTimeout(this.#idle);
      this.#child.stdin.write([...lines, `link show dev dsmark/${marker}`, ''].join('\n'));
    });
  }

  /** No new requests; the process exits once it has run what it was given. */
  retire(): void {
    clearTimeout(this.#idle);
    if (this.retired) return;
    this.retired = true;
    this.#child.stdin?.end();
  }

  #onStderr(data: string): void {
    this.#stderr += data;
    let nl: number;
    while ((nl = this.#stderr.indexOf('\n')) >= 0) {
      const line = this.#stderr.slice(0, nl);
      this.#stderr = this.#stderr.slice(nl + 1);
      const failed = /^Command failed -:(\d+)$/.exec(line);
      if (!failed) {
        if (line.trim()) this.#messages.push(line.trim());
        continue;
      }
      const head = this.#pending[0];
      if (!head) continue;
      if (Number(failed[1]) !== head.marker) {
        head.errors.push(this.#messages.join('; ') || `line ${failed[1]} failed`);
      } else {
        this.#pending.shift();
        clearTimeout(head.timer);
        // An idle process goes after a while; the next request starts another.
        if (this.#pending.length === 0) {
          this.#idle = setTimeout(() => this.retire(), IP_IDLE_MS);
          this.#idle.unref();
        }
        if (head.errors.length === 0) head.resolve();
        else head.reject(new DsecError('internal', `ip: ${head.errors.join('; ')}`));
      }
      this.#messages = [];
    }
  }

  #fail(err: DsecError): void {
    this.retired = true;
    for (const r of this.#pending.splice(0)) {
      clearTimeout(r.timer);
      r.reject(err);
    }
  }
}
