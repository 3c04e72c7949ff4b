import { closeSync, existsSync, openSync, readSync } from 'node:fs';
import { join } from 'node:path';
import { reclaimLeftovers } from '@dsec/native';
import type { PidsLimitEvent, ReclaimedProcesses } from '@dsec/native';

/**
 * How close to its limit a sandbox that refused forks must be for the edge
 * to take back its leftovers before a call: within an eighth of its limit,
 * and never closer than what one platform call may need (a reaper, the
 * command, a pipe's other end). A fork bomb's population swings by a few
 * percent as its members die of refused forks; a sandbox that met its
 * limit once and is well below it now keeps its processes.
 */
export const PIDS_RESERVE = 8;

export function nearLimit(current: number, max: number): boolean {
  return current >= max - Math.max(PIDS_RESERVE, Math.ceil(max / 8));
}

/** The host side of one sandbox that `PidsRelief` reads. */
export interface ReliefTarget {
  id: string;
  /** Every cgroup directory of the sandbox (asked once); the one with `pids.events` is read. */
  cgroupDirs: () => string[];
  /** The sandbox's pids limit (`spec.pidsLimit`). */
  pidsLimit: number;
  initPid: number;
  chronusPid: number;
}

interface Watched {
  dir: string;
  eventsFd: number;
  currentFd: number;
  refusalsSeen: number;
  running: Promise<PidsLimitEvent> | undefined;
}

/**
 * The platform's control after a fork bomb (issue 24; docs/security.md B11).
 * A bomb's thousand runnable processes take nearly all of the sandbox's CPU
 * share, so a command started among them waits behind every one, and
 * chronus's own reclaim (on a fork refused at pids.max) scans /proc at a
 * hundred times the usual cost from inside that share: the next exec took
 * 1.6–2.5 s. Before each spawn the edge reads the sandbox's `pids.events`
 * (one pread on a kept fd: the hot path); when forks were refused there
 * since its last reclaim and the sandbox is `nearLimit` now, it has
 * `dsec-helper pids-reclaim` take back the leftovers of finished commands
 * from the host, where the bomb does not slow it down, before the spawn
 * goes out. Concurrent calls share one reclaim. A sandbox well below its
 * limit keeps every background process, whatever it met before.
 */
export class PidsRelief {
  /** null: the sandbox has no pids cgroup to read. */
  readonly #watched = new Map<string, Watched | null>();
  readonly #buf = Buffer.alloc(64);
  readonly #reclaim: typeof reclaimLeftovers;

  constructor(options: { reclaim?: typeof reclaimLeftovers } = {}) {
    this.#reclaim = options.reclaim ?? reclaimLeftovers;
  }

  /** Undefined (at once) when the sandbox is not exhausted; else what the reclaim did. */
  check(target: ReliefTarget): Promise<PidsLimitEvent> | undefined {
    const w = this.#watch(target);
    if (!w) return undefined;
    if (w.running) return w.running;
    const refusals = this.#count(w.eventsFd, 'max ');
    if (refusals === undefined || refusals <= w.refusalsSeen) return undefined;
    const current = this.#count(w.currentFd, '');
    if (current === undefined || !nearLimit(current, target.pidsLimit)) return undefined;
    w.refusalsSeen = refusals;
    const running = this.#reclaim(w.dir, target.initPid, target.chronusPid, target.pidsLimit)
      .then(
        (r: ReclaimedProcesses) => ({
          refused: false,
          reclaimedProcesses: r.processes,
          reclaimedGroups: r.groups,
        }),
        // The spawn goes ahead regardless; chronus reclaims itself if its fork is refused.
        () => ({ refused: false, reclaimedProcesses: 0, reclaimedGroups: 0 }),
      )
      .finally(() => (w.running = undefined));
    w.running = running;
    return running;
  }

  /** Closes what was kept for a sandbox (it stopped). */
  forget(id: string): void {
    const w = this.#watched.get(id);
    this.#watched.delete(id);
    if (!w) return;
    closeSync(w.eventsFd);
    closeSync(w.currentFd);
  }

  close(): void {
    for (const id of [...this.#watched.keys()]) this.forget(id);
  }

  #watch(target: ReliefTarget): Watched | undefined {
    const known = this.#watched.get(target.id);
    if (known !== undefined) return known ?? undefined;
    const dir = target.cgroupDirs().find((d) => existsSync(join(d, 'pids.events')));
    if (!dir) {
      this.#watched.set(target.id, null);
      return undefined;
    }
    let eventsFd: number | undefined;
    try {
      eventsFd = openSync(join(dir, 'pids.events'), 'r');
      const currentFd = openSync(join(dir, 'pids.current'), 'r');
      // Refusals are counted from the first look: after an edge restart a bomb may be running.
      const w: Watched = { dir, eventsFd, currentFd, refusalsSeen: 0, running: undefined };
      this.#watched.set(target.id, w);
      return w;
    } catch {
      if (eventsFd !== undefined) closeSync(eventsFd);
      return undefined;
    }
  }

  /** The number after `prefix` at the start of a small cgroup file (pread at 0). */
  #count(fd: number, prefix: string): number | undefined {
    let n: number;
    try {
      n = readSync(fd, this.#buf, 0, this.#buf.length, 0);
    } catch {
      return undefined;
    }
    const text = this.#buf.toString('latin1', 0, n);
    if (!text.startsWith(prefix)) return undefined;
    const v = Number.parseInt(text.slice(prefix.length), 10);
    return Number.isFinite(v) ? v : undefined;
  }
}
