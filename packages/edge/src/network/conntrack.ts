import { spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomInt } from 'node:crypto';
import { DsecError } from '@dsec/core';
import { helperPath } from '@dsec/native';

/**
 * A sandbox's flows in the kernel's connection tracking, and what the edge
 * does with them (docs/adr/0005-sandbox-network.md, "Flows").
 *
 * The firewall accepts a flow's later packets by its conntrack entry, ahead
 * of any policy. Each sandbox therefore has a conntrack *mark* of its own,
 * which the firewall writes on every flow it admits from it and requires on
 * every later packet (both ways) together with the sandbox's interface. So:
 * - the slot's next sandbox, which has the same addresses and so the same
 *   5-tuples, cannot use what its predecessor left (another mark), and a flow
 *   of its own that meets an old entry is judged by its own policy and takes
 *   the entry over;
 * - a live update lists the sandbox's flows by its mark and deletes those its
 *   new policy no longer allows ({@link ConntrackSession.list}), so a removed
 *   rule cuts its connections;
 * - entries of sandboxes that are gone are deleted in sweeps a few seconds
 *   after a teardown (and when an edge starts), one kernel walk for many
 *   teardowns: a walk of the table costs ≈ 11 ms of kernel time here whatever
 *   it finds, too much for every stop.
 */

/** The high byte every mark of this edge shares, so a sweep's dump can ask the kernel for this edge's entries only. */
export const MARK_TAG_MASK = 0xff000000;

/** This edge's tag (from its table's name; never 0, the mark of flows nobody marked). */
export function markTag(table: string): number {
  const byte = createHash('sha256').update(table).digest()[0]! || 1;
  return (byte << 24) >>> 0;
}

/** A fresh mark under `tag`, none of `taken` (the live sandboxes' marks). */
export function newMark(tag: number, taken: ReadonlySet<number>): number {
  for (;;) {
    const mark = (tag | randomInt(1, 0x1000000)) >>> 0;
    if (!taken.has(mark)) return mark;
  }
}

/** One conntrack entry of a sandbox, as `list` reports it. */
export interface ConntrackEntry {
  family: 4 | 6;
  /** IP protocol number (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6…). */
  protocol: number;
  source: string;
  destination: string;
  /** The destination port (TCP, UDP and other protocols with ports). */
  port?: number | undefined;
  /** What `delete` takes to delete exactly this entry. */
  key: string;
}

/** Parses one `entry FAMILY PROTO SRC DST DPORT|- KEY` line of the helper. */
export function parseEntry(line: string): ConntrackEntry | undefined {
  const [tag, family, protocol, source, destination, port, key, ...rest] = line.split(' ');
  if (tag !== 'entry' || rest.length > 0 || !key || !/^[0-9a-f]+$/.test(key)) return undefined;
  if ((family !== '4' && family !== '6') || !source || !destination) return undefined;
  const proto = Number(protocol);
  const p = port === '-' ? undefined : Number(port);
  if (!Number.isInteger(proto) || (p !== undefined && !Number.isInteger(p))) return undefined;
  return { family: family === '4' ? 4 : 6, protocol: proto, source, destination, port: p, key };
}

/**
 * The `dsec-helper conntrack` session (packages/native/src/conntrack.c): one
 * long-lived process reading a request per line and answering each in turn,
 * started on first use and ended after a few idle seconds (requests come with
 * policy updates and sweeps, not with every create).
 */
export class ConntrackSession {
  readonly #timeoutMs: number;
  readonly #binary: () => string;
  #proc: ConntrackProcess | undefined;

  constructor(options: { timeoutMs?: number; binary?: () => string } = {}) {
    this.#timeoutMs = options.timeoutMs ?? 15_000;
    this.#binary = options.binary ?? helperPath;
  }

  /** The entries carrying `mark` (both families). */
  async list(mark: number): Promise<ConntrackEntry[]> {
    const lines = await this.#run(`list ${mark}`);
    return lines.map(parseEntry).filter((e): e is ConntrackEntry => e !== undefined);
  }

  /** Deletes entries `list` gave; resolves to how many were still there. */
  async delete(keys: string[]): Promise<number> {
    let deleted = 0;
    // Bounded lines; the helper takes any number of keys per request.
    for (let i = 0; i < keys.length; i += 256)
      deleted += countOf(await this.#run(`delete ${keys.slice(i, i + 256).join(' ')}`));
    return deleted;
  }

  /**
   * Deletes every entry whose mark is under `tag` ({@link MARK_TAG_MASK}),
   * whose source or destination lies in one of `cidrs`, and whose mark is
   * none of `keep`; resolves to how many it deleted.
   */
  async sweep(tag: number, cidrs: string[], keep: Iterable<number>): Promise<number> {
    const marks = [...keep].join(' ');
    return countOf(await this.#run(`sweep ${tag} ${MARK_TAG_MASK} ${cidrs.join(' ')} -- ${marks}`));
  }

  close(): void {
    this.#proc?.retire();
    this.#proc = undefined;
  }

  #run(request: string): Promise<string[]> {
    if (!this.#proc || this.#proc.retired)
      this.#proc = new ConntrackProcess(this.#binary(), this.#timeoutMs);
    return this.#proc.run(request);
  }
}

/** The `ok N` line's N, which `#run` hands back as its last line. */
function countOf(lines: string[]): number {
  return Number(lines.at(-1) ?? 0);
}

const IDLE_MS = 5000;

interface Request {
  lines: string[];
  resolve: (lines: string[]) => void;
  reject: (err: unknown) => void;
  timer: NodeJS.Timeout;
}

class ConntrackProcess {
  readonly #child: ChildProcess;
  readonly #pending: Request[] = [];
  readonly #timeoutMs: number;
  #out = '';
  #idle: NodeJS.Timeout | undefined;
  retired = false;

  constructor(binary: string, timeoutMs: number) {
    this.#timeoutMs = timeoutMs;
    this.#child = spawn(binary, ['conntrack'], { stdio: ['pipe', 'pipe', 'ignore'] });
    this.#child.stdout?.setEncoding('utf8').on('data', (d: string) => this.#onOutput(d));
    this.#child.stdin?.on('error', () => undefined); // reported through 'close'
    this.#child.on('error', (e) =>
      this.#fail(new DsecError('internal', `conntrack helper: ${e.message}`)),
    );
    this.#child.on('close', (code, signal) =>
      this.#fail(new DsecError('internal', `conntrack helper exited (${signal ?? code})`)),
    );
    // Never keeps the edge's process alive: a waiting request's timer does.
    this.#child.unref();
    for (const stream of [this.#child.stdin, this.#child.stdout])
      (stream as unknown as { unref?: () => void } | null)?.unref?.();
  }

  /** Resolves to the request's `entry` lines followed by its count. */
  run(request: string): Promise<string[]> {
    return new Promise<string[]>((resolve, reject) => {
      if (this.retired || !this.#child.stdin?.writable) {
        reject(new DsecError('internal', 'the conntrack helper is not running'));
        return;
      }
      const timer = setTimeout(() => {
        this.#fail(
          new DsecError('internal', `conntrack helper: no answer in ${this.#timeoutMs} ms`),
        );
        this.#child.kill('SIGKILL');
      }, this.#timeoutMs);
      this.#pending.push({ lines: [], resolve, reject, timer });
      clearTimeout(this.#idle);
      this.#child.stdin.write(`${request}\n`);
    });
  }

  retire(): void {
    clearTimeout(this.#idle);
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
      if (!head) continue;
      if (line.startsWith('entry ')) {
        head.lines.push(line);
        continue;
      }
      this.#pending.shift();
      clearTimeout(head.timer);
      if (this.#pending.length === 0) {
        this.#idle = setTimeout(() => this.retire(), IDLE_MS);
        this.#idle.unref();
      }
      const ok = /^ok (\d+)$/.exec(line);
      if (ok) head.resolve([...head.lines, ok[1]!]);
      else head.reject(new DsecError('internal', `conntrack: ${line.replace(/^error /, '')}`));
    }
  }

  #fail(err: DsecError): void {
    this.retired = true;
    clearTimeout(this.#idle);
    for (const r of this.#pending.splice(0)) {
      clearTimeout(r.timer);
      r.reject(err);
    }
  }
}
