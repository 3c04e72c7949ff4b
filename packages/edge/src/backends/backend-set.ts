import { DsecError } from '@dsec/core';
import type { BackendKind, DisplayInput } from '@dsec/core';
import type { Backend, BackendSandbox, PauseResult, StartedSandbox } from './backend.js';
import type { PidsLimitEvent, SandboxChannel } from './channel.js';

/**
 * Several backends behind one: each call goes to the backend of the
 * sandbox's `spec.backend`. The first backend is the edge's default (its
 * `kind`); `kinds` is what the edge reports and admits. Optional abilities
 * (pause, OOM reports) answer `unavailable` for a backend without them.
 */
export class BackendSet implements Backend {
  readonly kind: BackendKind;
  readonly kinds: readonly BackendKind[];
  readonly #byKind: Map<BackendKind, Backend>;

  constructor(readonly backends: readonly Backend[]) {
    if (backends.length === 0) throw new DsecError('internal', 'a backend set needs a backend');
    this.kind = backends[0]!.kind;
    this.kinds = backends.map((b) => b.kind);
    this.#byKind = new Map(backends.map((b) => [b.kind, b]));
  }

  /** The backend that runs `rec` (the sandbox's `spec.backend`). */
  for(rec: Pick<BackendSandbox, 'spec'>): Backend {
    const b = this.#byKind.get(rec.spec.backend);
    if (!b) {
      throw new DsecError('invalid_argument', `this edge runs no ${rec.spec.backend} sandboxes`, {
        field: 'backend',
      });
    }
    return b;
  }

  start(rec: BackendSandbox, signal?: AbortSignal): Promise<StartedSandbox> {
    return this.for(rec).start(rec, signal);
  }

  stop(rec: BackendSandbox): Promise<void> {
    return this.for(rec).stop(rec);
  }

  isRunning(rec: BackendSandbox): Promise<boolean> {
    return this.for(rec).isRunning(rec);
  }

  ensureChronus(rec: BackendSandbox): Promise<number | undefined> {
    return this.for(rec).ensureChronus(rec);
  }

  channel(rec: BackendSandbox, options?: { dedicated?: boolean }): Promise<SandboxChannel> {
    return this.for(rec).channel(rec, options);
  }

  async oomKilled(rec: BackendSandbox): Promise<boolean> {
    const b = this.for(rec);
    return b.oomKilled ? b.oomKilled(rec) : false;
  }

  relieve(rec: BackendSandbox): Promise<PidsLimitEvent> | undefined {
    return this.for(rec).relieve?.(rec);
  }

  pause(rec: BackendSandbox): Promise<PauseResult> {
    const b = this.for(rec);
    if (!b.pause) throw new DsecError('unavailable', `the ${b.kind} backend cannot pause`);
    return b.pause(rec);
  }

  /** Undoing a pause that a backend cannot make is nothing to do. */
  async resume(rec: BackendSandbox): Promise<{ chronusPid?: number | undefined }> {
    const b = this.for(rec);
    return b.resume ? b.resume(rec) : {};
  }

  async isFrozen(rec: BackendSandbox): Promise<boolean> {
    const b = this.for(rec);
    return b.isFrozen ? b.isFrozen(rec) : false;
  }

  async memoryBytes(rec: BackendSandbox): Promise<number | undefined> {
    return this.for(rec).memoryBytes?.(rec);
  }

  screenshot(rec: BackendSandbox): Promise<Buffer> {
    const b = this.for(rec);
    if (!b.screenshot) throw new DsecError('unavailable', `${b.kind} sandboxes have no display`);
    return b.screenshot(rec);
  }

  input(rec: BackendSandbox, input: DisplayInput): Promise<void> {
    const b = this.for(rec);
    if (!b.input) throw new DsecError('unavailable', `${b.kind} sandboxes have no display`);
    return b.input(rec, input);
  }

  async close(): Promise<void> {
    for (const b of this.backends) await b.close?.();
  }
}
