import { DsecError, gpuModelMatches, gpuUnitMatches, isMigProfile } from '@dsec/core';
import type { FnCallGpuRequest } from '@dsec/core';
import type { GpuInventory } from './inventory.js';

/**
 * One thing a worker can be given: a whole GPU (not in MIG mode) or one MIG
 * instance. CUDA sees either as one device.
 */
export type GpuUnit =
  | { kind: 'gpu'; uuid: string; index: number; name: string; memoryMib: number }
  | {
      kind: 'mig';
      uuid: string;
      parentIndex: number;
      parentUuid: string;
      deviceIndex: number;
      profile: string;
      memoryMib?: number | undefined;
    };

/** What a worker holds: its units, in the order CUDA will number them. */
export interface GpuAssignment {
  workerId: string;
  mode: 'shared' | 'exclusive';
  units: GpuUnit[];
}

export interface GpuUnitStatus {
  unit: GpuUnit;
  /** `free` when no worker holds it. */
  mode: 'free' | 'shared' | 'exclusive';
  /** Holders, in the order they were assigned. */
  workers: string[];
}

export interface GpuAllocatorOptions {
  /** Workers one unit holds at most in shared mode. Default 4. */
  maxSharedWorkersPerUnit?: number | undefined;
  /**
   * Where a shared request lands: `spread` (default) the least-loaded unit,
   * free ones included, so workers get the most GPU each; `pack` the
   * most-loaded shared unit with room, a free one only when none has room,
   * so whole GPUs stay free for exclusive requests. Ties go to the lowest
   * index either way.
   */
  sharedPlacement?: 'spread' | 'pack' | undefined;
}

/** The most units one request may ask for. */
export const MAX_GPU_COUNT = 64;

// The model matching is shared with the apiserver's routing (it reads `EdgeStatus.gpus`).
export { gpuModelMatches, isMigProfile };

/**
 * Hands GPUs to pool workers (issue 14.5). State is in memory and owned by
 * one edge; every method is synchronous, so two assignments never race.
 *
 * - `exclusive`: each unit goes to one worker alone.
 * - `shared`: up to `maxSharedWorkersPerUnit` workers on one unit (CUDA
 *   time-slices them; memory is not partitioned: MIG is for that).
 * - A unit is in one mode at a time: shared workers never land on a unit an
 *   exclusive worker holds, nor an exclusive worker on a unit with shared
 *   workers. A free unit takes either.
 * - `model` filters: a MIG profile (`1g.10gb`) selects MIG instances of that
 *   profile; anything else selects whole GPUs by `gpuModelMatches`; absent,
 *   any whole GPU. MIG instances are only ever given when a profile is
 *   named (a caller asking for "a GPU" expects a whole one).
 * - `count` units, all or none, never the same unit twice. A MIG request is
 *   for one instance: CUDA lets a process use only one MIG device.
 *
 * Order is deterministic: GPUs by index, MIG instances by parent index then
 * device index; exclusive takes the first free units.
 *
 * Errors: `invalid_argument` for a malformed request (naming `gpu.<field>`);
 * `conflict` for a worker that already holds GPUs; `capacity_exhausted` when
 * the request cannot be met now, with `details` saying how many units match
 * it at all (`matching`, 0 when this host has no such device) and how many
 * are usable now for its mode (`available`).
 */
export class GpuAllocator {
  readonly #units: GpuUnit[];
  readonly #holders: string[][];
  readonly #modes: ('free' | 'shared' | 'exclusive')[];
  readonly #byWorker = new Map<string, GpuAssignment>();
  readonly #maxShared: number;
  readonly #placement: 'spread' | 'pack';

  constructor(inventory: GpuInventory, options: GpuAllocatorOptions = {}) {
    const maxShared = options.maxSharedWorkersPerUnit ?? 4;
    if (!(Number.isSafeInteger(maxShared) && maxShared >= 1)) {
      throw new DsecError('invalid_argument', 'maxSharedWorkersPerUnit must be an integer ≥ 1', {
        field: 'maxSharedWorkersPerUnit',
      });
    }
    this.#maxShared = maxShared;
    this.#placement = options.sharedPlacement ?? 'spread';
    this.#units = [...inventory.gpus]
      .sort((a, b) => a.index - b.index)
      .flatMap((g): GpuUnit[] =>
        g.migEnabled
          ? [...g.migInstances]
              .sort((a, b) => a.deviceIndex - b.deviceIndex)
              .map((m) => ({
                kind: 'mig',
                uuid: m.uuid,
                parentIndex: g.index,
                parentUuid: g.uuid,
                deviceIndex: m.deviceIndex,
                profile: m.profile,
                ...(m.memoryMib !== undefined ? { memoryMib: m.memoryMib } : {}),
              }))
          : [{ kind: 'gpu', uuid: g.uuid, index: g.index, name: g.name, memoryMib: g.memoryMib }],
      );
    this.#holders = this.#units.map(() => []);
    this.#modes = this.#units.map(() => 'free');
  }

  /** Assigns units to `workerId` per `request`, or throws without changing anything. */
  assign(workerId: string, request: FnCallGpuRequest): GpuAssignment {
    const { mode, count, model } = checkRequest(request);
    if (this.#byWorker.has(workerId)) {
      throw new DsecError('conflict', `worker ${workerId} already holds GPUs`);
    }
    const matching = this.#units
      .map((u, i) => [u, i] as const)
      .filter(([u]) => unitMatches(u, model))
      .map(([, i]) => i);
    const usable = matching.filter((i) =>
      mode === 'exclusive'
        ? this.#modes[i] === 'free'
        : this.#modes[i] !== 'exclusive' && this.#holders[i]!.length < this.#maxShared,
    );
    if (usable.length < count) {
      throw new DsecError(
        'capacity_exhausted',
        matching.length < count
          ? `this node has ${matching.length} GPU${matching.length === 1 ? '' : 's'} matching ${describe(request)}`
          : `${usable.length} of ${matching.length} GPUs matching ${describe(request)} are free for it now`,
        {
          details: {
            resource: 'gpu',
            mode,
            count,
            ...(model !== undefined ? { model } : {}),
            matching: matching.length,
            available: usable.length,
            ...(mode === 'shared' ? { maxSharedWorkersPerUnit: this.#maxShared } : {}),
          },
        },
      );
    }
    const chosen = mode === 'exclusive' ? usable.slice(0, count) : this.#pickShared(usable, count);
    for (const i of chosen) {
      this.#modes[i] = mode;
      this.#holders[i]!.push(workerId);
    }
    const assignment: GpuAssignment = {
      workerId,
      mode,
      units: chosen.map((i) => ({ ...this.#units[i]! })),
    };
    this.#byWorker.set(workerId, assignment);
    return cloneAssignment(assignment);
  }

  /** Frees what `workerId` holds (its worker exited). False when it held nothing. */
  release(workerId: string): boolean {
    const held = this.#byWorker.get(workerId);
    if (!held) return false;
    this.#byWorker.delete(workerId);
    for (const unit of held.units) {
      const i = this.#units.findIndex((u) => u.uuid === unit.uuid);
      const holders = this.#holders[i]!;
      holders.splice(holders.indexOf(workerId), 1);
      if (holders.length === 0) this.#modes[i] = 'free';
    }
    return true;
  }

  assignmentOf(workerId: string): GpuAssignment | undefined {
    const a = this.#byWorker.get(workerId);
    return a && cloneAssignment(a);
  }

  /** Every unit with its mode and holders, in allocation order (for status and tests). */
  status(): GpuUnitStatus[] {
    return this.#units.map((unit, i) => ({
      unit: { ...unit },
      mode: this.#modes[i]!,
      workers: [...this.#holders[i]!],
    }));
  }

  /** Shared: `count` distinct units by load (`spread`: least first; `pack`: fullest first). */
  #pickShared(usable: number[], count: number): number[] {
    const load = (i: number) => this.#holders[i]!.length;
    const sorted = [...usable].sort((a, b) => {
      if (this.#placement === 'pack') {
        // Units already shared first (fullest first), then free ones; index order within.
        const d = load(b) - load(a);
        return d !== 0 ? d : a - b;
      }
      const d = load(a) - load(b);
      return d !== 0 ? d : a - b;
    });
    return sorted.slice(0, count).sort((a, b) => a - b);
  }
}

/** A request checked and with its defaults (`count` 1, `model` trimmed): what pools are keyed by. */
export function normalizeGpuRequest(r: FnCallGpuRequest): {
  mode: 'shared' | 'exclusive';
  count: number;
  model: string | undefined;
} {
  return checkRequest(r);
}

function checkRequest(r: FnCallGpuRequest): {
  mode: 'shared' | 'exclusive';
  count: number;
  model: string | undefined;
} {
  if (r.mode !== 'shared' && r.mode !== 'exclusive') {
    throw new DsecError('invalid_argument', 'gpu.mode must be shared or exclusive', {
      field: 'gpu.mode',
    });
  }
  const count = r.count ?? 1;
  if (!(Number.isSafeInteger(count) && count >= 1 && count <= MAX_GPU_COUNT)) {
    throw new DsecError('invalid_argument', `gpu.count must be an integer 1–${MAX_GPU_COUNT}`, {
      field: 'gpu.count',
    });
  }
  const model = r.model?.trim() || undefined;
  if (model !== undefined && isMigProfile(model) && count > 1) {
    throw new DsecError(
      'invalid_argument',
      'gpu.count must be 1 with a MIG profile: a CUDA process can use only one MIG instance',
      { field: 'gpu.count' },
    );
  }
  return { mode: r.mode, count, model };
}

function unitMatches(u: GpuUnit, model: string | undefined): boolean {
  return gpuUnitMatches({ kind: u.kind, model: u.kind === 'gpu' ? u.name : u.profile }, model);
}

function describe(r: FnCallGpuRequest): string {
  const count = r.count ?? 1;
  return `${r.mode} ×${count}${r.model ? ` ${r.model}` : ''}`;
}

function cloneAssignment(a: GpuAssignment): GpuAssignment {
  return { workerId: a.workerId, mode: a.mode, units: a.units.map((u) => ({ ...u })) };
}
