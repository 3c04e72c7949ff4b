import Database from 'better-sqlite3';
import type { CommandInfo, CommandResult } from '@dsec/core';

interface Row {
  command_id: string;
  sandbox_id: string;
  request_id: string | null;
  info: string;
  result: string | null;
  state: 'running' | 'finished';
}

/**
 * The command log on disk (paper 6.2): one row per command, written when it
 * starts and when it ends, in the edge's SQLite file (its own table, its own
 * connection). `synchronous = NORMAL` in WAL mode: a commit survives a crash
 * of the edge process (it is in the WAL) without an fsync on the exec hot
 * path; a host power loss may lose the last few results.
 */
export class CommandStore {
  readonly #db: Database.Database;
  readonly #insert: Database.Statement;
  readonly #finish: Database.Statement;
  readonly #get: Database.Statement;
  readonly #byRequest: Database.Statement;

  constructor(file: string) {
    this.#db = new Database(file);
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('synchronous = NORMAL');
    this.#db.pragma('busy_timeout = 5000');
    this.#db.exec(`
      CREATE TABLE IF NOT EXISTS commands (
        command_id TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL,
        request_id TEXT,
        state TEXT NOT NULL,
        info TEXT NOT NULL,
        result TEXT,
        started_at TEXT NOT NULL,
        finished_at TEXT
      );
      CREATE UNIQUE INDEX IF NOT EXISTS commands_request ON commands(sandbox_id, request_id)
        WHERE request_id IS NOT NULL;
      CREATE INDEX IF NOT EXISTS commands_sandbox ON commands(sandbox_id, started_at);
      CREATE INDEX IF NOT EXISTS commands_finished ON commands(state, finished_at);
    `);
    this.#insert = this.#db.prepare(
      `INSERT INTO commands (command_id, sandbox_id, request_id, state, info, started_at)
       VALUES (?, ?, ?, 'running', ?, ?)`,
    );
    this.#finish = this.#db.prepare(
      `UPDATE commands SET state = 'finished', result = ?, finished_at = ?, info = ? WHERE command_id = ?`,
    );
    this.#get = this.#db.prepare('SELECT * FROM commands WHERE command_id = ? AND sandbox_id = ?');
    this.#byRequest = this.#db.prepare(
      'SELECT * FROM commands WHERE sandbox_id = ? AND request_id = ?',
    );
  }

  insert(info: CommandInfo): void {
    this.#insert.run(
      info.commandId,
      info.sandboxId,
      info.requestId ?? null,
      JSON.stringify({ ...info, result: undefined }),
      info.startedAt,
    );
  }

  finish(info: CommandInfo & { result: CommandResult; finishedAt: string }): void {
    this.#finish.run(
      JSON.stringify(info.result),
      info.finishedAt,
      JSON.stringify({ ...info, result: undefined }),
      info.commandId,
    );
  }

  /** Forgets a command that never started (spawn failed), so a retry may run it. */
  delete(commandId: string): void {
    this.#db.prepare('DELETE FROM commands WHERE command_id = ?').run(commandId);
  }

  get(sandboxId: string, commandId: string): CommandInfo | undefined {
    const row = this.#get.get(commandId, sandboxId) as Row | undefined;
    return row && fromRow(row);
  }

  findByRequest(sandboxId: string, requestId: string): CommandInfo | undefined {
    const row = this.#byRequest.get(sandboxId, requestId) as Row | undefined;
    return row && fromRow(row);
  }

  /** Newest first. */
  list(sandboxId: string, limit: number): CommandInfo[] {
    const rows = this.#db
      .prepare('SELECT * FROM commands WHERE sandbox_id = ? ORDER BY started_at DESC LIMIT ?')
      .all(sandboxId, limit) as Row[];
    return rows.map(fromRow);
  }

  /** Commands the log says are running (after an edge restart: they died with its connections). */
  running(): CommandInfo[] {
    return (this.#db.prepare("SELECT * FROM commands WHERE state = 'running'").all() as Row[]).map(
      fromRow,
    );
  }

  /**
   * Drops finished commands that ended before `beforeIso`, and beyond the
   * newest `keep` finished ones of each sandbox.
   */
  purge(beforeIso: string, keep: number): number {
    let n = this.#db
      .prepare("DELETE FROM commands WHERE state = 'finished' AND finished_at < ?")
      .run(beforeIso).changes;
    n += this.#db
      .prepare(
        `DELETE FROM commands WHERE command_id IN (
           SELECT command_id FROM (
             SELECT command_id, ROW_NUMBER() OVER (PARTITION BY sandbox_id ORDER BY finished_at DESC) AS n
             FROM commands WHERE state = 'finished'
           ) WHERE n > ?
         )`,
      )
      .run(keep).changes;
    return n;
  }

  /** Keeps at most `keep` finished commands of one sandbox (called as they finish). */
  trim(sandboxId: string, keep: number): void {
    this.#db
      .prepare(
        `DELETE FROM commands WHERE sandbox_id = ? AND state = 'finished' AND command_id NOT IN (
           SELECT command_id FROM commands WHERE sandbox_id = ? AND state = 'finished'
           ORDER BY finished_at DESC LIMIT ?
         )`,
      )
      .run(sandboxId, sandboxId, keep);
  }

  close(): void {
    this.#db.close();
  }
}

function fromRow(row: Row): CommandInfo {
  const info = JSON.parse(row.info) as CommandInfo;
  info.state = row.state;
  if (row.result !== null) info.result = JSON.parse(row.result) as CommandResult;
  return info;
}
