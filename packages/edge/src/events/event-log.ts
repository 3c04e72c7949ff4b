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
 */
export class EventLog {
  readonly #db: Database.Database;
  readonly #sql: (source: string) => Database.Statement;
  readonly #o: Required<Omit<EventLogOptions, 'onRecord'>>;
  readonly #onRecord: ((kind: SandboxEventKind) => void) | undefined;
  readonly #recent = new Map<string, { until: number; suppressed: number }>();
  #inserts = 0;

  constructor(file: string, options: EventLogOptions = {}) {
    const { onRecord, ...limits } = options;
    this.#onRecord = onRecord;
    this.#o = { maxPerSandbox: 1000, maxTotal: 200_000, dedupeWindowMs: 10_000, ...limits };
    this.#db = openPrivateDatabase(file);
    this.#sql = statementCache(this.#db);
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('busy_timeout = 5000');
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
      this.#recent.set(key, { until: now + this.#o.dedupeWindowMs, suppressed: 0 });
      if (this.#recent.size > 10_000) {
        for (const [k, v] of this.#recent) if (v.until <= now) this.#recent.delete(k);
      }
    }
    try {
      this.#insert(sandboxId, kind, message, count, details, now);
    } catch (err) {
      // A full disk (a sandbox without a quota filled the node's) loses the event, never the call.
      const code = (err as { code?: unknown }).code;
      if (code !== 'SQLITE_FULL' && code !== 'ENOSPC' && code !== 'EDQUOT') throw err;
    }
  }

  #insert(
    sandboxId: string,
    kind: SandboxEventKind,
    message: string,
    count: number,
    details: Record<string, unknown>,
    now: number,
  ): void {
    const db = this.#db;
    db.prepare(
      'INSERT INTO events (sandbox_id, time, kind, message, count, details) VALUES (?, ?, ?, ?, ?, ?)',
    ).run(
      sandboxId,
      new Date(now).toISOString(),
      kind,
      message.slice(0, 1024),
      count,
      JSON.stringify(details).slice(0, 8192),
    );
    db.prepare(
      `DELETE FROM events WHERE sandbox_id = ? AND id <= (
         SELECT id FROM events WHERE sandbox_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)`,
    ).run(sandboxId, sandboxId, this.#o.maxPerSandbox);
    if (++this.#inserts % 1000 === 0) {
      db.prepare(
        'DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)',
      ).run(this.#o.maxTotal);
    }
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
    const ids = this.#sql('SELECT DISTINCT sandbox_id AS id FROM events').all() as {
      id: string;
    }[];
    const del = this.#sql('DELETE FROM events WHERE sandbox_id = ?');
    for (const { id } of ids) if (!keepSandboxIds.has(id)) del.run(id);
  }

  close(): void {
    this.#db.close();
  }
}
