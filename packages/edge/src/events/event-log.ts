import type Database from 'better-sqlite3';
import { openPrivateDatabase } from '../state/host-state.js';
import { statementCache } from '../state/statement-cache.js';
import type { CommandResult, SandboxEvent, SandboxEventKind } from '@dsec/core';

export interface EventLogOptions {
  /** Events kept per sandbox; older ones are dropped first. */
  maxPerSandbox?: number;
  /** Events kept on the edge in all. */
  maxTotal?: number;
  /** Repeats of one key within this window are counted, not stored. */
  dedupeWindowMs?: number;
  /** Called for every event recorded, folded repeats included (metrics count them). */
  onRecord?: ((kind: SandboxEventKind) => void) | undefined;
  /** Called for each event dropped because the queue of unwritten events was full. */
  onDrop?: ((kind: SandboxEventKind) => void) | undefined;
  /** How long a recorded event may wait for the write that stores it (with others). Default 50 ms. */
  flushIntervalMs?: number;
  /** Events queued that make the write happen at once, in one transaction. Default 256. */
  flushBatch?: number;
  /**
   * Events waiting to be written, at most: past it new ones are dropped and
   * counted (`dropped`), so no sandbox can make the edge's memory grow. Default 4096.
   */
  maxQueued?: number;
  /**
   * Bytes the waiting events may hold, at most (strings counted at two bytes
   * a code unit, plus a fixed overhead an event): the same, for large events. Default 4 MiB.
   */
  maxQueuedBytes?: number;
}

/** Repeat-folding keys remembered at most (a flood of distinct keys forgets the oldest). */
const MAX_DEDUPE_KEYS = 10_000;
/** What one queued event costs besides its strings (object, array slot), counted against `maxQueuedBytes`. */
const QUEUED_OVERHEAD_BYTES = 128;

/** An event waiting for its write. */
interface Queued {
  sandboxId: string;
  time: string;
  kind: SandboxEventKind;
  message: string;
  count: number;
  details: string;
  bytes: number;
}

interface Row {
  id: number;
  sandbox_id: string;
  time: string;
  kind: SandboxEventKind;
  message: string;
  count: number;
  details: string;
}

/**
 * Audit events of misbehaviour per sandbox (issue 5): denied connections,
 * refused DNS names, output caps and limits hit. Its own small SQLite file
 * in the edge's state directory, bounded per sandbox and in total, with
 * repeats of the same thing folded into a count so a sandbox hammering a
 * denied address cannot flood it.
 *
 * Writes are batched off the caller's path: `record` queues the event (a
 * few microseconds), and the queue is written in one transaction
 * `flushIntervalMs` later, or at once when `flushBatch` are waiting; `list`
 * and `purge` write what is queued first, so a reader sees every event
 * recorded before it asked. An insert with its fsync per event held the
 * edge's event loop for every denied packet a sandbox sent (SECURITY.md
 * J38; measured in docs/security.md, "Egress follow-up"). Events are not
 * acknowledged writes: the database runs with `synchronous = NORMAL` (WAL:
 * a power loss may take the last commits, never the file's integrity), and
 * what is queued when the edge dies (at most one interval's worth) is lost,
 * as a full disk loses them (docs/security.md, B13). At most `maxQueued`
 * events and `maxQueuedBytes` wait at once; past that new ones are dropped
 * and counted (`dropped`, `onDrop`). A write that fails drops its batch
 * the same way: it runs from a timer, where a throw would end the edge.
 */
export class EventLog {
  readonly #db: Database.Database;
  readonly #sql: (source: string) => Database.Statement;
  readonly #o: Required<Omit<EventLogOptions, 'onRecord' | 'onDrop'>>;
  readonly #onRecord: ((kind: SandboxEventKind) => void) | undefined;
  readonly #onDrop: ((kind: SandboxEventKind) => void) | undefined;
  readonly #recent = new Map<string, { until: number; suppressed: number }>();
  #queue: Queued[] = [];
  #queuedBytes = 0;
  /** The interval's write, when events wait for it. */
  #timer: NodeJS.Timeout | undefined;
  /** The write of a full batch, on the next turn of the loop (not the recording caller's stack). */
  #soon: NodeJS.Immediate | undefined;
  #inserts = 0;
  #closed = false;
  /** Events dropped since the log opened: the queue was full, the disk, or the write failed. */
  dropped = 0;
  /** Why the last write failed, when one did (the events it held are counted in `dropped`). */
  lastWriteError: unknown;

  constructor(file: string, options: EventLogOptions = {}) {
    const { onRecord, onDrop, ...limits } = options;
    this.#onRecord = onRecord;
    this.#onDrop = onDrop;
    this.#o = {
      maxPerSandbox: 1000,
      maxTotal: 200_000,
      dedupeWindowMs: 10_000,
      flushIntervalMs: 50,
      flushBatch: 256,
      maxQueued: 4096,
      maxQueuedBytes: 4 * 2 ** 20,
      ...limits,
    };
    this.#db = openPrivateDatabase(file);
    this.#sql = statementCache(this.#db);
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('busy_timeout = 5000');
    // Not acknowledged writes (see the class comment): no fsync per commit.
    this.#db.pragma('synchronous = NORMAL');
    this.#db.exec(`
      CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL,
        time TEXT NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        count INTEGER NOT NULL,
        details TEXT NOT NULL
      );
      CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id, id);
    `);
  }

  record(
    sandboxId: string,
    kind: SandboxEventKind,
    message: string,
    details: Record<string, unknown> = {},
    dedupeKey?: string,
  ): void {
    this.#onRecord?.(kind);
    const now = Date.now();
    let count = 1;
    if (dedupeKey !== undefined) {
      const key = `${sandboxId}\n${kind}\n${dedupeKey}`;
      const seen = this.#recent.get(key);
      if (seen && seen.until > now) {
        seen.suppressed++;
        return;
      }
      count += seen?.suppressed ?? 0;
      // Deleted first so the map's order is the order of expiry (the window is one length).
      this.#recent.delete(key);
      this.#recent.set(key, { until: now + this.#o.dedupeWindowMs, suppressed: 0 });
      if (this.#recent.size > MAX_DEDUPE_KEYS) {
        // The expired ones, then (distinct keys within one window) the oldest: each key
        // is visited once, so a flood of new keys costs O(1) a record, not a scan.
        for (const [k, v] of this.#recent) {
          if (v.until > now && this.#recent.size <= MAX_DEDUPE_KEYS) break;
          this.#recent.delete(k);
        }
      }
    }
    const event = {
      sandboxId,
      time: new Date(now).toISOString(),
      kind,
      message: truncate(message, 1024),
      count,
      details: detailsJson(details),
      bytes: 0,
    };
    event.bytes =
      QUEUED_OVERHEAD_BYTES +
      2 *
        (sandboxId.length +
          event.time.length +
          kind.length +
          event.message.length +
          event.details.length);
    if (
      this.#closed ||
      this.#queue.length >= this.#o.maxQueued ||
      this.#queuedBytes + event.bytes > this.#o.maxQueuedBytes
    ) {
      this.dropped++;
      this.#onDrop?.(kind);
      return;
    }
    this.#queue.push(event);
    this.#queuedBytes += event.bytes;
    if (this.#queue.length >= this.#o.flushBatch) {
      if (!this.#soon) {
        clearTimeout(this.#timer);
        this.#timer = undefined;
        this.#soon = setImmediate(() => this.flush());
        this.#soon.unref();
      }
    } else if (!this.#timer && !this.#soon) {
      this.#timer = setTimeout(() => this.flush(), this.#o.flushIntervalMs);
      this.#timer.unref();
    }
  }

  /** Events recorded and not yet written, and the bytes they hold (both bounded). */
  get queued(): { events: number; bytes: number } {
    return { events: this.#queue.length, bytes: this.#queuedBytes };
  }

  /**
   * Writes every queued event, in one transaction (also called by `list`,
   * `purge`, `close`). Never throws: a failed write drops its events, counted.
   */
  flush(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
    if (this.#soon) clearImmediate(this.#soon);
    this.#soon = undefined;
    const batch = this.#queue;
    if (batch.length === 0) return;
    this.#queue = [];
    this.#queuedBytes = 0;
    try {
      this.#write(batch);
    } catch (err) {
      // A full disk (a sandbox without a quota filled the node's), or a database
      // the edge cannot write: the events are lost, never the edge.
      this.lastWriteError = err;
      this.dropped += batch.length;
      for (const e of batch) this.#onDrop?.(e.kind);
    }
  }

  #write(batch: Queued[]): void {
    const insert = this.#sql(
      'INSERT INTO events (sandbox_id, time, kind, message, count, details) VALUES (?, ?, ?, ?, ?, ?)',
    );
    const trim = this.#sql(
      `DELETE FROM events WHERE sandbox_id = ? AND id <= (
         SELECT id FROM events WHERE sandbox_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)`,
    );
    this.#db.transaction(() => {
      for (const e of batch) insert.run(e.sandboxId, e.time, e.kind, e.message, e.count, e.details);
      // Each sandbox of the batch keeps its newest maxPerSandbox.
      for (const id of new Set(batch.map((e) => e.sandboxId)))
        trim.run(id, id, this.#o.maxPerSandbox);
      const before = this.#inserts;
      this.#inserts += batch.length;
      if (Math.floor(before / 1000) !== Math.floor(this.#inserts / 1000)) {
        this.#sql(
          'DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)',
        ).run(this.#o.maxTotal);
      }
    })();
  }

  /** Events a finished command tells about: output over the cap, OOM kill, timeout. */
  recordCommand(sandboxId: string, result: CommandResult): void {
    const base = { commandId: result.commandId };
    if (result.truncated) {
      this.record(
        sandboxId,
        'output_truncated',
        `command output went past the cap (stdout ${result.stdoutBytes} B, stderr ${result.stderrBytes} B)`,
        { ...base, stdoutBytes: result.stdoutBytes, stderrBytes: result.stderrBytes },
      );
    }
    if (result.outcome === 'oom') {
      this.record(
        sandboxId,
        'oom_killed',
        'command killed by the OOM killer at the memory limit',
        base,
      );
    } else if (result.outcome === 'timeout') {
      this.record(sandboxId, 'command_timeout', 'command killed at its timeout', {
        ...base,
        durationMs: result.durationMs,
      });
    }
  }

  /**
   * A command's spawn met the sandbox's pids limit: chronus ended processes
   * to make room (leftovers of finished commands first, biggest first), or
   * could free none and the call failed with `resource_exhausted`.
   */
  recordPidsLimit(
    sandboxId: string,
    pidsLimit: number,
    event: { refused: boolean; reclaimedProcesses: number; reclaimedGroups: number },
  ): void {
    const details = {
      limit: 'pids',
      max: pidsLimit,
      refused: event.refused,
      reclaimedProcesses: event.reclaimedProcesses,
      reclaimedGroups: event.reclaimedGroups,
    };
    const message = event.refused
      ? `a command could not start: the sandbox is at its pids limit (${pidsLimit}) and no process could be reclaimed`
      : `the sandbox reached its pids limit (${pidsLimit}); ${event.reclaimedProcesses} processes in ` +
        `${event.reclaimedGroups} groups were killed to start a platform command`;
    this.record(sandboxId, 'pids_limit', message, details, event.refused ? 'refused' : 'reclaimed');
  }

  list(sandboxId: string, afterId = 0, limit = 500): SandboxEvent[] {
    this.flush();
    const rows = this.#sql(
      'SELECT * FROM events WHERE sandbox_id = ? AND id > ? ORDER BY id LIMIT ?',
    ).all(sandboxId, afterId, Math.max(1, Math.min(limit, 1000))) as Row[];
    return rows.map((r) => ({
      id: r.id,
      sandboxId: r.sandbox_id,
      time: r.time,
      kind: r.kind,
      message: r.message,
      count: r.count,
      details: JSON.parse(r.details) as Record<string, unknown>,
    }));
  }

  /** Forgets events of sandboxes the edge no longer keeps. */
  purge(keepSandboxIds: Set<string>): void {
    this.flush();
    const ids = this.#sql('SELECT DISTINCT sandbox_id AS id FROM events').all() as {
      id: string;
    }[];
    const del = this.#sql('DELETE FROM events WHERE sandbox_id = ?');
    for (const { id } of ids) if (!keepSandboxIds.has(id)) del.run(id);
  }

  /** Writes what is queued and closes the database; later events are dropped. */
  close(): void {
    if (this.#closed) return;
    this.flush();
    this.#closed = true;
    this.#db.close();
  }
}

/**
 * `s` cut to `max` UTF-16 units, as a string of its own: a plain slice of a
 * long string keeps the whole of it alive (V8's sliced strings), and queued
 * events must hold only what they store.
 */
function truncate(s: string, max: number): string {
  if (s.length <= max) return s;
  return Buffer.from(s.slice(0, max), 'utf8').toString('utf8');
}

/** Stored details, at most: a longer object keeps its head, still JSON (a cut string is not). */
const MAX_DETAILS_CHARS = 8192;

function detailsJson(details: Record<string, unknown>): string {
  const json = JSON.stringify(details);
  if (json.length <= MAX_DETAILS_CHARS) return json;
  // Before, the JSON itself was cut at 8192: the sandbox's event listing then failed to parse it.
  return JSON.stringify({ truncated: true, chars: json.length, head: truncate(json, 7936) });
}
