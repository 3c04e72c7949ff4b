import { DsecError } from '@dsec/core';
import type { AdmissionRefusal, NodePressure } from '@dsec/core';
import {
  ADMISSION_DEFAULTS,
  decide,
  measuredRoom,
  type AdmissionLedger,
  type AdmissionLimits,
  type AdmissionRequest,
  type PressureSample,
} from './admission-policy.js';
import type { PressureSource } from './host-pressure.js';

export interface AdmissionControllerOptions {
  edgeId: string;
  limits: AdmissionLimits;
  source: PressureSource;
  /** A sample younger than this is reused (default 250 ms). */
  sampleIntervalMs?: number | undefined;
  now?: (() => number) | undefined;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/**
 * The edge's admission state: the ledger of live sandboxes and their
 * requested ceilings, and the latest pressure sample.
 *
 * Protocol, per create: `await refresh()` (reads the host at most once per
 * `sampleIntervalMs`, all concurrent callers sharing one read), then
 * synchronously `admit(id, request)` and the record insert, with no `await`
 * between them (so two creates cannot both take the last room), `settle(id)`
 * when the start finished either way, `release(id)` when the sandbox ended.
 * A sandbox counts as *unsettled* from `admit` until a sample that began
 * after its `settle` completes; `decide` assumes each unsettled one takes
 * what a new sandbox is assumed to take.
 */
export class AdmissionController {
  readonly limits: AdmissionLimits;
  readonly #source: PressureSource;
  readonly #intervalMs: number;
  readonly #now: () => number;
  readonly #held = new Map<string, AdmissionRequest>();
  /** Admitted, not yet visible: undefined while starting, else the first sample generation that shows it. */
  readonly #unsettled = new Map<string, number | undefined>();
  #requestedMemoryMb = 0;
  #requestedCpuCores = 0;
  #sample: PressureSample | undefined;
  /** Generation of the most recently begun read. */
  #generation = 0;
  #reading: Promise<void> | undefined;
  #lastAttemptMs = Number.NEGATIVE_INFINITY;
  /** Reads of the source so far (for tests and the density benchmark's sanity). */
  reads = 0;

  constructor(readonly options: AdmissionControllerOptions) {
    this.limits = options.limits;
    this.#source = options.source;
    this.#intervalMs = options.sampleIntervalMs ?? ADMISSION_DEFAULTS.sampleIntervalMs;
    this.#now = options.now ?? Date.now;
  }

  /** Makes sure the sample is at most `sampleIntervalMs` old. Never rejects. */
  refresh(): Promise<void> {
    if (this.#reading) return this.#reading;
    if (this.#now() - this.#lastAttemptMs < this.#intervalMs) return Promise.resolve();
    this.#lastAttemptMs = this.#now();
    const generation = ++this.#generation;
    this.reads++;
    this.#reading = this.#source
      .read()
      .then(
        (sample) => {
          this.#sample = sample;
          for (const [id, visibleAt] of this.#unsettled)
            if (visibleAt !== undefined && visibleAt <= generation) this.#unsettled.delete(id);
        },
        (err: unknown) => {
          // Admission then checks the count and the ratios only, until a read works again.
          this.#sample = undefined;
          this.options.log?.('reading host pressure failed', { err: String(err) });
        },
      )
      .finally(() => (this.#reading = undefined));
    return this.#reading;
  }

  /**
   * Admits one sandbox or throws `capacity_exhausted` whose details name the
   * resource, its measure, the value with this sandbox and the limit.
   * Synchronous: the caller inserts its record before anything else runs.
   */
  admit(id: string, request: AdmissionRequest): void {
    const refusal = this.check(request);
    if (refusal) {
      throw new DsecError(
        'capacity_exhausted',
        `edge ${this.options.edgeId} refuses the sandbox: ${refusal.resource} ${refusal.measure} would be ${refusal.current}, limit ${refusal.limit}`,
        { details: { edgeId: this.options.edgeId, ...refusal } },
      );
    }
    this.#hold(id, request);
    this.#unsettled.set(id, undefined);
  }

  /** The check a sandbox of `request` would fail now (nothing is admitted). */
  check(request: AdmissionRequest): AdmissionRefusal | undefined {
    return decide(this.limits, this.ledger(), this.#sample, request);
  }

  /** The sandbox's start finished (or failed): the next sample to begin will show it. */
  settle(id: string): void {
    if (this.#unsettled.has(id)) this.#unsettled.set(id, this.#generation + 1);
  }

  /** The sandbox ended (stopped, failed, or its record was never written). Idempotent. */
  release(id: string): void {
    const held = this.#held.get(id);
    if (!held) return;
    this.#held.delete(id);
    this.#unsettled.delete(id);
    this.#requestedMemoryMb -= held.memoryLimitMb;
    this.#requestedCpuCores -= held.cpuCoresLimit;
  }

  /** Replaces the ledger with the sandboxes found live (after the edge's reconcile). */
  adopt(sandboxes: { id: string; request: AdmissionRequest }[]): void {
    for (const id of [...this.#held.keys()]) this.release(id);
    for (const s of sandboxes) this.#hold(s.id, s.request);
  }

  ledger(): AdmissionLedger {
    return {
      sandboxes: this.#held.size,
      requestedMemoryMb: this.#requestedMemoryMb,
      requestedCpuCores: this.#requestedCpuCores,
      unsettled: this.#unsettled.size,
    };
  }

  /** Capacity for placement and the latest measurement (see `EdgeStatus`). */
  view(): {
    capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
    used: { memoryMb: number; cpuCores: number; sandboxes: number };
    pressure: NodePressure | undefined;
  } {
    const ledger = this.ledger();
    const sample = this.#sample;
    const room = sample
      ? measuredRoom(this.limits, ledger, sample)
      : this.limits.maxSandboxes - ledger.sandboxes;
    return {
      capacity: {
        memoryMb: this.limits.maxRequestedMemoryMb,
        cpuCores: this.limits.maxRequestedCpuCores,
        sandboxes: Math.max(
          ledger.sandboxes,
          Math.min(this.limits.maxSandboxes, ledger.sandboxes + room),
        ),
      },
      used: {
        memoryMb: ledger.requestedMemoryMb,
        cpuCores: round(ledger.requestedCpuCores),
        sandboxes: ledger.sandboxes,
      },
      pressure: sample && {
        measuredAt: new Date(sample.takenAtMs).toISOString(),
        memoryTotalMb: Math.round(sample.memoryTotalMb),
        memoryAvailableMb: Math.round(sample.memoryAvailableMb),
        sandboxMemoryMb: Math.round(sample.sandboxMemoryMb),
        cpuPressurePercent: sample.cpuPressurePercent,
        sandboxCpuPercent: Math.round(sample.sandboxCpuPercent * 10) / 10,
        threads: sample.threads,
        threadsLimit: sample.threadsLimit,
        diskFreeMb: Math.round(sample.diskFreeMb),
        refusing: decide(this.limits, ledger, sample, { memoryLimitMb: 0, cpuCoresLimit: 0 }),
      },
    };
  }

  #hold(id: string, request: AdmissionRequest): void {
    if (this.#held.has(id)) return;
    this.#held.set(id, {
      memoryLimitMb: request.memoryLimitMb,
      cpuCoresLimit: request.cpuCoresLimit,
    });
    this.#requestedMemoryMb += request.memoryLimitMb;
    this.#requestedCpuCores += request.cpuCoresLimit;
  }
}

function round(x: number): number {
  return Math.round(x * 1000) / 1000;
}
