import type Database from 'better-sqlite3';
import { openPrivateDatabase } from './host-state.js';
import { statementCache } from './statement-cache.js';
import type { LayerInfo, SandboxSpec, SandboxState } from '@dsec/core';

/** What the edge remembers about a sandbox across its own restarts. */
export interface SandboxRecord {
  id: string;
  projectId: string;
  requestId?: string | undefined;
  state: SandboxState;
  spec: SandboxSpec;
  /** Resolved layers, bottom (base) first. */
  layers: LayerInfo[];
  /** Index of the sandbox's host uid/gid range. */
  slot: number;
  createdAt: string;
  expiresAt: string;
  runtimePid?: number | undefined;
  initPid?: number | undefined;
  chronusPid?: number | undefined;
  reason?: string | undefined;
  /** Since when it is paused (state `paused`). */
  pausedAt?: string | undefined;
  /** When a paused sandbox is stopped if nothing resumes it. */
  pausedExpiresAt?: string | undefined;
  /**
   * A pause or resume that was begun and not yet recorded as done: written
   * before the edge touches the sandbox, cleared with the new state, so a
   * restart after a crash in between finishes it (lifecycle/lifecycle.ts).
   */
  intent?: LifecycleIntent | undefined;
}

/** A lifecycle transition in progress (see `SandboxRecord.intent`). */
export type LifecycleIntent = 'pause' | 'resume';

interface Row {
  id: string;
  project_id: string;
  request_id: string | null;
  state: SandboxState;
  spec: string;
  layers: string;
  slot: number;
  created_at: string;
  expires_at: string;
  runtime_pid: number | null;
  init_pid: number | null;
  chronus_pid: number | null;
  reason: string | null;
  paused_at: string | null;
  paused_expires_at: string | null;
  intent: LifecycleIntent | null;
}

/** Columns added after the first release: added to an older database when it is opened. */
const ADDED_COLUMNS: Record<string, string> = {
  paused_at: 'TEXT',
  paused_expires_at: 'TEXT',
  intent: 'TEXT',
};

/**
 * The edge's durable local store (paper: the edge keeps what it needs on local
 * disk). One SQLite file in WAL mode with synchronous=NORMAL: a record written
 * before a step survives a crash of the edge process (kill -9, bugs), so a
 * restart can finish or undo it. Only a host power loss can drop the last
 * commits, and that also ends every sandbox the lost records described
 * (reconcile then finds their processes gone). FULL would cost an fsync per
 * state change on the create path.
 * Stopped sandboxes are kept for `retentionMs` so their final state can still
 * be read, then forgotten.
 */
export class EdgeStore {
  readonly #db: Database.Database;
  readonly #sql: (source: string) => Database.Statement;

  constructor(file: string) {
    this.#db = openPrivateDatabase(file);
    this.#sql = statementCache(this.#db);
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('synchronous = NORMAL');
    this.#db.pragma('busy_timeout = 5000');
    this.#db.exec(`
      CREATE TABLE IF NOT EXISTS sandboxes (
        id TEXT PRIMARY KEY,
        project_id TEXT NOT NULL,
        request_id TEXT,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        layers TEXT NOT NULL,
        slot INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL,
        runtime_pid INTEGER,
        init_pid INTEGER,
        chronus_pid INTEGER,
        reason TEXT
      );
      CREATE UNIQUE INDEX IF NOT EXISTS sandboxes_request ON sandboxes(project_id, request_id)
        WHERE request_id IS NOT NULL;
      CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
    `);
    const have = new Set(
      (this.#db.pragma('table_info(sandboxes)') as { name: string }[]).map((c) => c.name),
    );
    for (const [name, type] of Object.entries(ADDED_COLUMNS))
      if (!have.has(name)) this.#db.exec(`ALTER TABLE sandboxes ADD COLUMN ${name} ${type}`);
  }

  /** Inserts a new `creating` record with the lowest free id-range slot. */
  insert(rec: Omit<SandboxRecord, 'slot' | 'state'>): SandboxRecord {
    return this.#db.transaction(() => {
      const used = this.#sql(
        "SELECT slot FROM sandboxes WHERE state NOT IN ('stopped', 'failed') ORDER BY slot",
      ).all() as { slot: number }[];
      let slot = 0;
      for (const u of used) {
        if (u.slot !== slot) break;
        slot++;
      }
      this.#sql(
        `INSERT INTO sandboxes (id, project_id, request_id, state, spec, layers, slot, created_at, expires_at)
           VALUES (?, ?, ?, 'creating', ?, ?, ?, ?, ?)`,
      ).run(
        rec.id,
        rec.projectId,
        rec.requestId ?? null,
        JSON.stringify(rec.spec),
        JSON.stringify(rec.layers),
        slot,
        rec.createdAt,
        rec.expiresAt,
      );
      return { ...rec, slot, state: 'creating' as const };
    })();
  }

  findByRequest(projectId: string, requestId: string): SandboxRecord | undefined {
    const row = this.#sql('SELECT * FROM sandboxes WHERE project_id = ? AND request_id = ?').get(
      projectId,
      requestId,
    ) as Row | undefined;
    return row && fromRow(row);
  }

  update(
    id: string,
    fields: Partial<
      Pick<SandboxRecord, 'state' | 'runtimePid' | 'initPid' | 'chronusPid' | 'reason' | 'spec'>
    >,
  ): void {
    const cols: Record<string, unknown> = {
      spec: fields.spec && JSON.stringify(fields.spec),
      state: fields.state,
      runtime_pid: fields.runtimePid,
      init_pid: fields.initPid,
      chronus_pid: fields.chronusPid,
      reason: fields.reason,
    };
    const set = Object.entries(cols).filter(([, v]) => v !== undefined);
    if (set.length === 0) return;
    this.#sql(`UPDATE sandboxes SET ${set.map(([k]) => `${k} = ?`).join(', ')} WHERE id = ?`).run(
      ...set.map(([, v]) => v),
      id,
    );
  }

  /**
   * Writes a pause or resume step (lifecycle/lifecycle.ts): every field given
   * is set, `null` clears one. One statement, so a crash leaves either the
   * old row or the new one.
   */
  setLifecycle(
    id: string,
    fields: {
      state?: SandboxState;
      expiresAt?: string;
      pausedAt?: string | null;
      pausedExpiresAt?: string | null;
      intent?: LifecycleIntent | null;
      chronusPid?: number;
    },
  ): void {
    const cols: [string, unknown][] = [
      ['state', fields.state],
      ['expires_at', fields.expiresAt],
      ['paused_at', fields.pausedAt],
      ['paused_expires_at', fields.pausedExpiresAt],
      ['intent', fields.intent],
      ['chronus_pid', fields.chronusPid],
    ];
    const set = cols.filter(([, v]) => v !== undefined);
    if (set.length === 0) return;
    this.#sql(`UPDATE sandboxes SET ${set.map(([k]) => `${k} = ?`).join(', ')} WHERE id = ?`).run(
      ...set.map(([, v]) => v),
      id,
    );
  }

  get(id: string): SandboxRecord | undefined {
    const row = this.#sql('SELECT * FROM sandboxes WHERE id = ?').get(id) as Row | undefined;
    return row && fromRow(row);
  }

  list(states?: SandboxState[]): SandboxRecord[] {
    const rows = states
      ? (this.#sql(
          `SELECT * FROM sandboxes WHERE state IN (${states.map(() => '?').join(',')}) ORDER BY created_at`,
        ).all(...states) as Row[])
      : (this.#sql('SELECT * FROM sandboxes ORDER BY created_at').all() as Row[]);
    return rows.map(fromRow);
  }

  /** Forgets stopped or failed sandboxes that ended before `beforeIso`. */
  purgeEnded(beforeIso: string): number {
    return this.#sql(
      "DELETE FROM sandboxes WHERE state IN ('stopped', 'failed') AND expires_at < ?",
    ).run(beforeIso).changes;
  }

  close(): void {
    this.#db.close();
  }
}

function fromRow(row: Row): SandboxRecord {
  return {
    id: row.id,
    projectId: row.project_id,
    requestId: row.request_id ?? undefined,
    state: row.state,
    spec: JSON.parse(row.spec) as SandboxSpec,
    layers: JSON.parse(row.layers) as LayerInfo[],
    slot: row.slot,
    createdAt: row.created_at,
    expiresAt: row.expires_at,
    runtimePid: row.runtime_pid ?? undefined,
    initPid: row.init_pid ?? undefined,
    chronusPid: row.chronus_pid ?? undefined,
    reason: row.reason ?? undefined,
    pausedAt: row.paused_at ?? undefined,
    pausedExpiresAt: row.paused_expires_at ?? undefined,
    intent: row.intent ?? undefined,
  };
}
