import { DsecError } from '@dsec/core';
import type { Backend } from '../backends/backend.js';
import type { EdgeStore, SandboxRecord } from '../state/edge-store.js';
import type { SwapArea } from './swap-area.js';

export interface LifecycleOptions {
  store: EdgeStore;
  backend: Backend;
  /** How long a paused sandbox is kept before it is stopped (default 24 h). */
  pausedTtlMs?: number | undefined;
  /** Pause a running sandbox after this long without a command, session, file or port call (default: never). */
  idleTimeoutMs?: number | undefined;
  /** The swap files pauses use; switched off at `close` when nothing is paused. */
  swap?: SwapArea | undefined;
  /** The io layer keeps running sandboxes' records briefly: forget one before it is paused. */
  forgetRecord: (id: string) => void;
  /** Whether a client is waiting on a command or session line of the sandbox (not idle then). */
  busy: (id: string) => boolean;
  /** Stops a sandbox the way the edge does (paused TTL). */
  stop: (rec: SandboxRecord, reason: string) => Promise<void>;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

export const DEFAULT_PAUSED_TTL_MS = 24 * 3_600_000;
/** `setSandboxTimeout` bounds: a second to a week. */
export const MIN_TTL_SECONDS = 1;
export const MAX_TTL_SECONDS = 7 * 24 * 3600;

/**
 * Pause, resume and TTL control of an edge's sandboxes (issue 11,
 * docs/adr/0012-pause-and-resume.md).
 *
 * States: `running` ⇄ `paused`; both end in `stopping` → `stopped`. Pausing
 * a paused sandbox and resuming a running one are no-ops; anything else that
 * is not live is `sandbox_not_running`. Transitions of one sandbox run one at
 * a time (a resume asked for during a pause waits for it, then undoes it);
 * concurrent resumes share one.
 *
 * Crash safety: each transition writes its intent to the edge's database
 * before touching the sandbox and clears it in the same write that records
 * the new state. `recover` (at edge start) finishes a transition it finds
 * begun, so after a kill -9 every sandbox is in its old or its new state.
 *
 * TTLs: the running TTL does not run down while paused: `expiresAt` moves
 * later by the time spent paused when the sandbox resumes (and reads, while
 * paused, as the deadline it would have if resumed now). A paused sandbox
 * has its own deadline, `pausedExpiresAt` (`pausedTtlMs` after the pause),
 * after which it is stopped.
 */
export class Lifecycle {
  readonly #o: LifecycleOptions;
  /** The transition in progress per sandbox; the next one chains after it. */
  readonly #chains = new Map<string, Promise<unknown>>();
  /** A resume queued or in progress, shared by every caller that needs one. */
  readonly #resuming = new Map<string, Promise<SandboxRecord>>();
  /** Last command, session, file or port call per running sandbox (idle reclamation). */
  readonly #lastActiveMs = new Map<string, number>();

  constructor(options: LifecycleOptions) {
    this.#o = options;
  }

  get pausedTtlMs(): number {
    return this.#o.pausedTtlMs ?? DEFAULT_PAUSED_TTL_MS;
  }

  /** Pauses a running sandbox; a paused one is returned as it is. */
  pause(id: string, reason = 'requested'): Promise<SandboxRecord> {
    this.#backend('pause');
    return this.#serial(id, async () => {
      const rec = this.#get(id);
      if (rec.state === 'paused') return rec;
      this.#requireLive(rec);
      this.#o.store.setLifecycle(id, { intent: 'pause' });
      // Calls from now on find no cached record: they wait for this pause, then resume.
      this.#o.forgetRecord(id);
      const pauseOnce = () =>
        this.#o.backend.pause!(rec).catch((err: unknown) => {
          // The backend thawed what it froze: still running.
          this.#o.store.setLifecycle(id, { intent: null });
          throw err;
        });
      let result = await pauseOnce();
      // A snapshot that froze the sandbox before this pause thaws it when it
      // ends unless it finds the sandbox paused, which it is not until the
      // write below: freeze once more if that happened in between.
      if (this.#o.backend.isFrozen && !(await this.#o.backend.isFrozen(rec)))
        result = await pauseOnce();
      const done = this.#finishPause(id);
      this.#o.log?.('sandbox paused', {
        id,
        reason,
        freezeMs: Math.round(result.freezeMs),
        reclaimMs: Math.round(result.reclaimMs),
        memoryBeforeBytes: result.memoryBeforeBytes,
        memoryAfterBytes: result.memoryAfterBytes,
      });
      return done;
    });
  }

  /** Resumes a paused sandbox (waiting for a pause in progress first); a running one is returned as it is. */
  resume(id: string): Promise<SandboxRecord> {
    this.#backend('resume');
    let resuming = this.#resuming.get(id);
    if (!resuming) {
      resuming = this.#serial(id, async () => {
        const rec = this.#get(id);
        if (rec.state === 'running' && rec.intent === undefined) return rec;
        this.#requireLive(rec);
        this.#o.store.setLifecycle(id, { intent: 'resume' });
        const start = performance.now();
        const { chronusPid } = await this.#o.backend.resume!(rec);
        const done = this.#finishResume(id, chronusPid);
        this.#o.log?.('sandbox resumed', { id, resumeMs: Math.round(performance.now() - start) });
        return done;
      }).finally(() => this.#resuming.delete(id));
      this.#resuming.set(id, resuming);
    }
    return resuming;
  }

  /**
   * The transparent resume: every command, session, file and port call of
   * the io layer passes here with the sandbox's record. Running with nothing
   * in progress: returned as is, synchronously (the hot path). Paused, or
   * with a pause in progress: resumed first, and the caller awaits that.
   * Anything else is `sandbox_not_running`.
   */
  ensureRunning(rec: SandboxRecord): SandboxRecord | Promise<SandboxRecord> {
    this.#lastActiveMs.set(rec.id, Date.now());
    if (rec.state === 'running' && !this.#chains.has(rec.id) && rec.intent === undefined)
      return rec;
    if ((rec.state === 'paused' || rec.state === 'running') && this.#o.backend.resume)
      return this.resume(rec.id);
    throw notRunning(rec);
  }

  /**
   * Sets the running TTL to `ttlSeconds` from now (1 s to 7 days, else
   * `invalid_argument`). For a paused sandbox: `ttlSeconds` from when it
   * resumes. The deadline is in the edge's database, so the sweep enforces
   * it after any restart.
   */
  setTimeout(id: string, ttlSeconds: number): SandboxRecord {
    if (
      typeof ttlSeconds !== 'number' ||
      !Number.isFinite(ttlSeconds) ||
      ttlSeconds < MIN_TTL_SECONDS ||
      ttlSeconds > MAX_TTL_SECONDS
    ) {
      throw new DsecError(
        'invalid_argument',
        `ttlSeconds must be between ${MIN_TTL_SECONDS} and ${MAX_TTL_SECONDS}`,
        { field: 'ttlSeconds' },
      );
    }
    const rec = this.#get(id);
    this.#requireLive(rec);
    // A paused sandbox's deadline is shifted by its paused time when it resumes.
    const from = rec.state === 'paused' && rec.pausedAt ? Date.parse(rec.pausedAt) : Date.now();
    const expiresAt = new Date(from + ttlSeconds * 1000).toISOString();
    this.#o.store.setLifecycle(id, { expiresAt });
    return { ...rec, expiresAt };
  }

  /**
   * Called by the edge's sweep: stops paused sandboxes past their paused
   * TTL, and with `idleTimeoutMs` pauses running ones nobody has used for
   * that long (a command or session line still in progress counts as use).
   */
  async sweep(): Promise<void> {
    const now = Date.now();
    for (const rec of this.#o.store.list(['paused'])) {
      if (rec.pausedExpiresAt !== undefined && Date.parse(rec.pausedExpiresAt) <= now) {
        await this.#o
          .stop(rec, 'paused ttl expired')
          .catch((err: unknown) =>
            this.#o.log?.('paused ttl stop failed', { id: rec.id, err: String(err) }),
          );
      }
    }
    const running = this.#o.store.list(['running']);
    const live = new Set(running.map((r) => r.id));
    for (const id of this.#lastActiveMs.keys()) if (!live.has(id)) this.#lastActiveMs.delete(id);
    const idleMs = this.#o.idleTimeoutMs;
    if (idleMs === undefined || !this.#o.backend.pause) return;
    for (const rec of running) {
      const last = this.#lastActiveMs.get(rec.id);
      // First seen (created, adopted after a restart): the idle clock starts now.
      if (last === undefined) this.#lastActiveMs.set(rec.id, now);
      if (last === undefined || now - last < idleMs || this.#chains.has(rec.id)) continue;
      if (this.#o.busy(rec.id)) {
        this.#lastActiveMs.set(rec.id, now);
        continue;
      }
      await this.pause(rec.id, 'idle').catch((err: unknown) =>
        this.#o.log?.('idle pause failed', { id: rec.id, err: String(err) }),
      );
    }
  }

  /**
   * At edge start, before adoption: finishes a pause or resume a crash
   * interrupted (both are idempotent), freezes a paused sandbox found
   * running, and thaws a running one found frozen. Dead sandboxes are left
   * to the edge's reconcile, which stops them. Returns the record as it is now.
   */
  async recover(rec: SandboxRecord): Promise<SandboxRecord> {
    const backend = this.#o.backend;
    if (!backend.pause || !backend.resume || !backend.isFrozen) return rec;
    if (rec.state !== 'running' && rec.state !== 'paused') return rec;
    if (!(await backend.isRunning(rec))) return rec;
    try {
      if (rec.intent === 'resume') {
        const { chronusPid } = await backend.resume(rec);
        this.#o.log?.('interrupted resume finished', { id: rec.id });
        return this.#finishResume(rec.id, chronusPid);
      }
      if (rec.intent === 'pause' || (rec.state === 'paused' && !(await backend.isFrozen(rec)))) {
        await backend.pause(rec);
        this.#o.log?.('interrupted pause finished', { id: rec.id });
        return rec.state === 'paused' ? { ...rec, intent: undefined } : this.#finishPause(rec.id);
      }
      if (rec.state === 'running' && (await backend.isFrozen(rec))) {
        // Frozen by an edge that crashed before it could thaw (no intent of ours).
        await backend.resume(rec);
        this.#o.log?.('frozen running sandbox thawed', { id: rec.id });
      }
    } catch (err) {
      this.#o.log?.('lifecycle recovery failed', { id: rec.id, err: String(err) });
    }
    return this.#o.store.get(rec.id) ?? rec;
  }

  /**
   * Waits for transitions in progress; with nothing paused, switches the
   * pause swap files off (paused sandboxes keep theirs across an edge
   * restart: their memory is in it).
   */
  async close(): Promise<void> {
    await Promise.allSettled([...this.#chains.values()]);
    const swap = this.#o.swap;
    if (!swap || swap.files().length === 0) return;
    const holding = this.#o.store
      .list(['paused', 'running', 'stopping'])
      .some((r) => r.state === 'paused' || r.intent !== undefined);
    if (!holding) await swap.release();
  }

  #finishPause(id: string): SandboxRecord {
    const cur = this.#get(id);
    // Stopped while it was being paused: that stands.
    if (cur.state !== 'running' && cur.state !== 'paused') return cur;
    const now = Date.now();
    const fields = {
      state: 'paused' as const,
      pausedAt: new Date(now).toISOString(),
      pausedExpiresAt: new Date(now + this.pausedTtlMs).toISOString(),
      intent: null,
    };
    this.#o.store.setLifecycle(id, fields);
    this.#lastActiveMs.delete(id);
    return { ...cur, ...fields, intent: undefined };
  }

  #finishResume(id: string, chronusPid: number | undefined): SandboxRecord {
    const cur = this.#get(id);
    if (cur.state !== 'running' && cur.state !== 'paused') return cur;
    const now = Date.now();
    const pausedMs = cur.pausedAt ? Math.max(0, now - Date.parse(cur.pausedAt)) : 0;
    const fields = {
      state: 'running' as const,
      expiresAt: new Date(Date.parse(cur.expiresAt) + pausedMs).toISOString(),
      pausedAt: null,
      pausedExpiresAt: null,
      intent: null,
      ...(chronusPid !== undefined ? { chronusPid } : {}),
    };
    this.#o.store.setLifecycle(id, fields);
    this.#lastActiveMs.set(id, now);
    return {
      ...cur,
      ...fields,
      pausedAt: undefined,
      pausedExpiresAt: undefined,
      intent: undefined,
      chronusPid: chronusPid ?? cur.chronusPid,
    };
  }

  #serial<T>(id: string, fn: () => Promise<T>): Promise<T> {
    const prev = this.#chains.get(id);
    const next = prev ? prev.then(fn, fn) : fn();
    const tail = next.catch(() => undefined);
    this.#chains.set(id, tail);
    void tail.then(() => {
      if (this.#chains.get(id) === tail) this.#chains.delete(id);
    });
    return next;
  }

  #get(id: string): SandboxRecord {
    const rec = this.#o.store.get(id);
    if (!rec) throw new DsecError('sandbox_not_found', `no sandbox ${id}`);
    return rec;
  }

  #requireLive(rec: SandboxRecord): void {
    if (rec.state !== 'running' && rec.state !== 'paused') throw notRunning(rec);
  }

  #backend(op: 'pause' | 'resume'): void {
    if (!this.#o.backend[op]) {
      throw new DsecError('unavailable', `the ${this.#o.backend.kind} backend cannot ${op}`);
    }
  }
}

/**
 * The deadline `SandboxInfo.expiresAt` shows: for a paused sandbox, the one
 * it would have if it resumed at `nowMs` (its clock does not run while paused).
 */
export function effectiveExpiresAt(rec: SandboxRecord, nowMs = Date.now()): string {
  if (rec.state !== 'paused' || rec.pausedAt === undefined) return rec.expiresAt;
  const pausedMs = Math.max(0, nowMs - Date.parse(rec.pausedAt));
  return new Date(Date.parse(rec.expiresAt) + pausedMs).toISOString();
}

function notRunning(rec: SandboxRecord): DsecError {
  return new DsecError('sandbox_not_running', `sandbox ${rec.id} is ${rec.state}`, {
    details: { state: rec.state },
  });
}
