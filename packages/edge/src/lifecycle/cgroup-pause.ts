import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError } from '@dsec/core';

/**
 * The kernel side of pausing a sandbox's cgroup (docs/adr/0012-pause-and-resume.md):
 * freeze every task in it, push its memory out to swap, undo both.
 *
 * - `freeze` stops every task of the cgroup (and of its children) where it
 *   stands; nothing runs, nothing is lost. Resolves once the kernel reports
 *   the cgroup frozen; throws `unavailable` (after thawing again) when a task
 *   will not freeze within `timeoutMs` (one stuck in an uninterruptible sleep).
 * - `reclaim` is called on a frozen cgroup: the kernel reclaims nearly all of
 *   its memory, anonymous and tmpfs pages to swap, clean page cache dropped.
 *   Pages stay in swap until a task touches them again, which frozen tasks
 *   do not. Best effort: what cannot be reclaimed (kernel memory, or
 *   everything when there is no free swap) stays. The limits are as before
 *   once it returns.
 * - `restoreLimits` puts back what `reclaim` may have opened (v2's swap
 *   limit), after a crash in the middle of it; resume calls it every time.
 * - `thaw` lets the tasks run again; idempotent.
 * - `frozen` is true while the cgroup is frozen or freezing, undefined when
 *   it is gone.
 * - `swapNeededBytes` is how much swap space a reclaim would take now: its
 *   anonymous and tmpfs memory, less pages that already have a swap slot
 *   (swapped in since the last pause and not written to since).
 */
export interface CgroupPause {
  freeze(path: string, options?: { timeoutMs?: number }): Promise<void>;
  reclaim(path: string, limits: MemoryLimits): Promise<ReclaimResult>;
  restoreLimits(path: string, limits: MemoryLimits): Promise<void>;
  thaw(path: string): Promise<void>;
  frozen(path: string): boolean | undefined;
  swapNeededBytes(path: string): Promise<number>;
}

/** A sandbox's memory limits as its runtime set them: RAM, and RAM plus swap. */
export interface MemoryLimits {
  memoryBytes: number;
  /** RAM + swap; equal to `memoryBytes` means no swap while it runs. */
  memoryAndSwapBytes: number;
}

export interface ReclaimResult {
  /** Memory charged to the cgroup before and after. */
  beforeBytes: number;
  afterBytes: number;
  reclaimMs: number;
}

const DEFAULT_FREEZE_TIMEOUT_MS = 10_000;
/** `force_empty` calls per reclaim, repeated while each frees at least `RECLAIM_PROGRESS_BYTES`. */
const RECLAIM_CALLS = 8;
const RECLAIM_PROGRESS_BYTES = 1 << 20;

/** The v1 (separate `freezer` and `memory` hierarchies) or v2 implementation. */
export function openCgroupPause(version: 1 | 2, root = '/sys/fs/cgroup'): CgroupPause {
  return version === 1 ? new CgroupPauseV1(root) : new CgroupPauseV2(root);
}

class CgroupPauseV1 implements CgroupPause {
  constructor(readonly root: string) {}

  #freezer(path: string) {
    return join(this.root, 'freezer', path, 'freezer.state');
  }

  #memory(path: string, file: string) {
    return join(this.root, 'memory', path, file);
  }

  async freeze(path: string, options: { timeoutMs?: number } = {}): Promise<void> {
    const file = this.#freezer(path);
    writeFileSync(file, 'FROZEN');
    // FREEZING until every task has stopped; usually within a millisecond.
    const deadline = Date.now() + (options.timeoutMs ?? DEFAULT_FREEZE_TIMEOUT_MS);
    for (let i = 0; readFileSync(file, 'utf8').trim() !== 'FROZEN'; i++) {
      if (Date.now() > deadline) {
        await this.thaw(path);
        throw new DsecError('unavailable', `the sandbox's processes did not freeze: ${path}`);
      }
      // Writing FROZEN again retries the tasks that were not stopped yet.
      if (i % 10 === 9) writeFileSync(file, 'FROZEN');
      await sleep(i < 20 ? 1 : 10);
    }
  }

  async reclaim(path: string): Promise<ReclaimResult> {
    const usage = this.#memory(path, 'memory.usage_in_bytes');
    const beforeBytes = readBytes(usage);
    const start = performance.now();
    // `force_empty` drains the per-CPU LRU batches, then reclaims (swapping
    // anonymous and tmpfs pages) until the cgroup is empty or 16 passes in a
    // row free nothing; it touches no limit, so there is nothing to put back
    // and nothing a crash could leave half done. Pages still on the active
    // list when a call gives up are aged by it: the next call finds them
    // (measured: recently written tmpfs pages take a second call), so it is
    // repeated while it makes progress. The RAM + swap limit does not stand in
    // the way: swapping a page out moves its charge, it adds none. About a
    // second per few hundred MiB written to swap, so it runs on the thread
    // pool, not on the edge's event loop.
    for (let call = 0, last = beforeBytes; call < RECLAIM_CALLS; call++) {
      // Reading memory.stat flushes the cgroup's per-CPU statistics, which
      // reclaim reads to decide whether to deactivate active pages.
      readFileSync(this.#memory(path, 'memory.stat'));
      await writeFile(this.#memory(path, 'memory.force_empty'), '0');
      const now = readBytes(usage);
      if (now < RECLAIM_PROGRESS_BYTES || (call > 0 && last - now < RECLAIM_PROGRESS_BYTES)) break;
      last = now;
    }
    return { beforeBytes, afterBytes: readBytes(usage), reclaimMs: performance.now() - start };
  }

  async swapNeededBytes(path: string): Promise<number> {
    const stat = await readFile(this.#memory(path, 'memory.stat'), 'utf8').catch(() => '');
    return (
      statValue(stat, 'total_rss') +
      statValue(stat, 'total_shmem') -
      statValue(stat, 'total_swapcached')
    );
  }

  /** v1 reclaims without touching limits: nothing to restore. */
  async restoreLimits(): Promise<void> {}

  async thaw(path: string): Promise<void> {
    const file = this.#freezer(path);
    if (!existsSync(file)) return;
    writeFileSync(file, 'THAWED');
    for (let i = 0; readFileSync(file, 'utf8').trim() !== 'THAWED'; i++) {
      if (i > 1000)
        throw new DsecError('internal', `the sandbox's processes did not thaw: ${path}`);
      writeFileSync(file, 'THAWED');
      await sleep(1);
    }
  }

  frozen(path: string): boolean | undefined {
    try {
      return readFileSync(this.#freezer(path), 'utf8').trim() !== 'THAWED';
    } catch {
      return undefined;
    }
  }
}

/**
 * cgroup v2: `cgroup.freeze` and `memory.reclaim`. A running sandbox may not
 * swap there (`memory.swap.max` is 0: the runtime's swap limit equals its
 * memory limit), so the reclaim opens `memory.swap.max` and puts it back.
 * Not exercised on the hybrid v1 host this was built on (ADR 0012).
 */
class CgroupPauseV2 implements CgroupPause {
  constructor(readonly root: string) {}

  async freeze(path: string, options: { timeoutMs?: number } = {}): Promise<void> {
    const dir = join(this.root, path);
    writeFileSync(join(dir, 'cgroup.freeze'), '1');
    const deadline = Date.now() + (options.timeoutMs ?? DEFAULT_FREEZE_TIMEOUT_MS);
    for (let i = 0; !/^frozen 1$/m.test(readFileSync(join(dir, 'cgroup.events'), 'utf8')); i++) {
      if (Date.now() > deadline) {
        await this.thaw(path);
        throw new DsecError('unavailable', `the sandbox's processes did not freeze: ${path}`);
      }
      await sleep(i < 20 ? 1 : 10);
    }
  }

  async reclaim(path: string, limits: MemoryLimits): Promise<ReclaimResult> {
    const dir = join(this.root, path);
    const current = join(dir, 'memory.current');
    const beforeBytes = readBytes(current);
    const start = performance.now();
    writeFileSync(join(dir, 'memory.swap.max'), 'max');
    try {
      await writeFile(join(dir, 'memory.reclaim'), String(beforeBytes));
    } catch (err) {
      // EAGAIN: less than asked could be reclaimed.
      if ((err as NodeJS.ErrnoException).code !== 'EAGAIN') throw err;
    }
    const reclaimMs = performance.now() - start;
    const afterBytes = readBytes(current);
    await this.restoreLimits(path, limits);
    return { beforeBytes, afterBytes, reclaimMs };
  }

  async restoreLimits(path: string, limits: MemoryLimits): Promise<void> {
    // v2's swap.max counts swap alone; it may be set below what is in swap.
    writeFileSync(
      join(this.root, path, 'memory.swap.max'),
      String(Math.max(0, limits.memoryAndSwapBytes - limits.memoryBytes)),
    );
  }

  async swapNeededBytes(path: string): Promise<number> {
    const stat = await readFile(join(this.root, path, 'memory.stat'), 'utf8').catch(() => '');
    return statValue(stat, 'anon') + statValue(stat, 'shmem') - statValue(stat, 'swapcached');
  }

  async thaw(path: string): Promise<void> {
    const file = join(this.root, path, 'cgroup.freeze');
    if (existsSync(file)) writeFileSync(file, '0');
  }

  frozen(path: string): boolean | undefined {
    try {
      return readFileSync(join(this.root, path, 'cgroup.freeze'), 'utf8').trim() === '1';
    } catch {
      return undefined;
    }
  }
}

function statValue(stat: string, key: string): number {
  return Number(new RegExp(`^${key} (\\d+)$`, 'm').exec(stat)?.[1] ?? 0);
}

function readBytes(file: string): number {
  return Number(readFileSync(file, 'utf8').trim());
}
