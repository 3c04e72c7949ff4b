import { cpus } from 'node:os';
import { DsecError } from '@dsec/core';

export interface CreateGateOptions {
  /**
   * Creates whose sandbox is being started at once. Beyond a few per core
   * more only adds contention (runtime processes, mounts, page faults) and
   * every create gets slower; the rest wait their turn. Default 4 × cores,
   * at least 8.
   */
  maxInProgress?: number;
  /**
   * How long a create may wait for its turn before the node refuses it with
   * `capacity_exhausted` (a node that cannot start it within this long
   * cannot take it now; the apiserver tries another). Default 90 000, below
   * the SDK's create deadline (120 s).
   */
  maxQueueWaitMs?: number;
}

interface Waiter {
  resolve: () => void;
  reject: (err: unknown) => void;
  cleanup: () => void;
}

/**
 * Bounds how many sandbox starts run at once on a node; the others queue,
 * first come first served. A burst of a thousand create requests then runs
 * a steady number of runtimes instead of a thousand at once, each finishing
 * in bounded time, and none fails for having arrived in a crowd. A waiting
 * create leaves the queue when its caller gives up (`signal`): `aborted`,
 * with nothing started.
 */
export class CreateGate {
  readonly maxInProgress: number;
  readonly maxQueueWaitMs: number;
  #active = 0;
  readonly #queue: Waiter[] = [];

  constructor(options: CreateGateOptions = {}) {
    this.maxInProgress = options.maxInProgress ?? Math.max(8, 4 * cpus().length);
    this.maxQueueWaitMs = options.maxQueueWaitMs ?? 90_000;
  }

  /** Starts in progress and waiting, for status and tests. */
  get stats(): { inProgress: number; queued: number } {
    return { inProgress: this.#active, queued: this.#queue.length };
  }

  /** Runs `start` when a slot is free; its outcome is the caller's. */
  async run<T>(start: () => Promise<T>, signal?: AbortSignal): Promise<T> {
    await this.#acquire(signal);
    try {
      return await start();
    } finally {
      this.#release();
    }
  }

  #acquire(signal: AbortSignal | undefined): Promise<void> {
    if (signal?.aborted) return Promise.reject(abortedError());
    if (this.#active < this.maxInProgress && this.#queue.length === 0) {
      this.#active++;
      return Promise.resolve();
    }
    return new Promise<void>((resolve, reject) => {
      const leave = (err: DsecError) => {
        const i = this.#queue.indexOf(waiter);
        if (i < 0) return;
        this.#queue.splice(i, 1);
        waiter.cleanup();
        reject(err);
      };
      const timer = setTimeout(
        () =>
          leave(
            new DsecError(
              'capacity_exhausted',
              `the node is starting ${this.#active} sandboxes with ${this.#queue.length} waiting; none could start this one within ${this.maxQueueWaitMs} ms`,
              { details: { inProgress: this.#active, queued: this.#queue.length } },
            ),
          ),
        this.maxQueueWaitMs,
      );
      timer.unref();
      const onAbort = () => leave(abortedError());
      signal?.addEventListener('abort', onAbort, { once: true });
      const waiter: Waiter = {
        resolve,
        reject,
        cleanup: () => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
        },
      };
      this.#queue.push(waiter);
    });
  }

  #release(): void {
    const next = this.#queue.shift();
    if (!next) {
      this.#active--;
      return;
    }
    // The slot passes straight to the next waiter.
    next.cleanup();
    next.resolve();
  }
}

function abortedError(): DsecError {
  return new DsecError('aborted', 'the create was cancelled while waiting for its turn');
}
