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
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, {
      stdio: [options.stdin === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
      timeout: options.timeoutMs ?? 15_000,
      killSignal: 'SIGKILL',
    });
    let out = '';
    let err = '';
    child.stdout?.setEncoding('utf8').on('data', (s: string) => (out += s));
    child.stderr?.setEncoding('utf8').on('data', (s: string) => {
      if (err.length < (options.stderrLimitBytes ?? 16_384)) err += s;
    });
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
    if (options.stdin !== undefined) child.stdin?.end(options.stdin);
  });
}

/** Applies an nftables script atomically (`nft -f -`): all of it or none. */
export function nft(script: string): Promise<string> {
  return runTool('nft', ['-f', '-'], { stdin: script });
}

/**
 * One `nft -f` transaction for many callers' scripts (see {@link MicroBatcher}):
 * a burst of sandbox changes costs a few transactions instead of one process
 * and one table-wide commit each. Scripts must be idempotent (element
 * add/delete pairs): when a batch fails it is split and retried (bisect), so
 * only the script at fault fails.
 */
export function nftBatcher(
  run: (script: string) => Promise<unknown> = nft,
): MicroBatcher<string, void> {
  return new MicroBatcher<string, void>((scripts) =>
    bisect(scripts, async (part) => {
      await run(part.join(''));
    }),
  );
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
