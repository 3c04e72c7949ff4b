import { closeSync, constants, ftruncateSync, openSync, readFileSync, writeSync } from 'node:fs';
import type Database from 'better-sqlite3';
import { ensurePrivateFile, openPrivateDatabase, PRIVATE_FILE_MODE } from './host-state.js';
import { statementCache } from './statement-cache.js';
import type { CommandInfo, CommandResult } from '@dsec/core';

/**
 * Housekeeping writes (trims) and the starts of foreground commands wait at
 * most this long for a commit to share (under load one comes every turn of
 * the event loop: the group commit of results).
 */
const FLUSH_DELAY_MS = 250;
/** On a full disk, queued writes are retried this often, and at most this many are held. */
const DISK_FULL_RETRY_MS = 1000;
const MAX_HELD_WRITES = 10_000;
/**
 * Results journalled but not yet in the table are committed to it at once past
 * this many: a batch holds the event loop for ~10 ms, not the ~16 ms of
 * FLUSH_DELAY_MS's worth at 1,600 results a second.
 */
const MAX_JOURNALLED = 256;

/** SQLite's and the kernel's ways of saying the disk is full. */
function isDiskFull(err: unknown): boolean {
  const code = (err as { code?: unknown } | undefined)?.code;
  return code === 'SQLITE_FULL' || code === 'ENOSPC' || code === 'EDQUOT';
}

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
 * path; a host power loss may lose the last few results. A command's result
 * is committed before it is returned, and its start before its ID is handed
 * out (background commands, request IDs), so a killed edge loses nothing it
 * answered for (SECURITY E28) and a retried request ID is never run twice
 * (E29). A foreground command's start shares the commit of its result (the
 * result's row replaces a start not yet written); trims of old results are
 * batched.
 *
 * Foreground results (`finishGrouped`) are the exec hot path: each one costs
 * a row in three B-trees, ~60 µs of CPU committed alone. They are made
 * durable by one `write` to an append-only journal beside the database
 * (`<file>-results`, one JSON line per result, all results of a turn of the
 * event loop in one write; as durable as a WAL commit with `synchronous =
 * NORMAL`: in the kernel's page cache, so an edge crash keeps them), and
 * reach the table in batches: at the next read, write or within
 * FLUSH_DELAY_MS. The journal is emptied after each batch commits and
 * replayed into the table when the store opens (an upsert by command ID, so
 * a line whose batch committed just before a crash is applied twice, to the
 * same row).
 */
export class CommandStore {
  readonly #db: Database.Database;
  readonly #sql: (source: string) => Database.Statement;
  readonly #insert: Database.Statement;
  readonly #get: Database.Statement;
  readonly #byRequest: Database.Statement;
  readonly #upsert: Database.Statement;
  readonly #trim: Database.Statement;
  readonly #delete: Database.Statement;
  readonly #applyAll: (ops: (() => void)[]) => void;
  /** The results journal (append-only); `#journalled`: lines in it since the last batch. */
  readonly #journal: number;
  #journalled = 0;
  /** Lines of this turn's results, written to the journal together at its end. */
  #journalLines: string[] = [];
  #pending: (() => void)[] = [];
  #flushTimer: NodeJS.Timeout | undefined;
  /** Starts queued to share their result's commit (`insert` without `durable`), by command ID. */
  readonly #deferredStarts = new Set<string>();
  /** Results waiting for the group commit at the end of this turn of the event loop. */
  #group:
    { promise: Promise<void>; resolve: () => void; reject: (err: unknown) => void } | undefined;

  constructor(file: string) {
    this.#db = openPrivateDatabase(file);
    this.#sql = statementCache(this.#db);
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('synchronous = NORMAL');
    this.#db.pragma('busy_timeout = 5000');
    // Every result is a row on the exec hot path: pages of a 16 MiB cache are not read back,
    // and a checkpoint every 4,000 WAL pages (not SQLite's 1,000) copies each hot page once
    // for more results (together ≈ 20 % of a result's write cost).
    this.#db.pragma('cache_size = -16000');
    this.#db.pragma('wal_autocheckpoint = 4000');
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
      -- A sandbox's list is served by commands_trim and sorted (a sandbox keeps a bounded
      -- number of results): one index fewer to update per result.
      DROP INDEX IF EXISTS commands_sandbox;
      -- Trims walk one sandbox's finished results newest first. (The index on (state,
      -- finished_at) this replaces made every trim scan every sandbox's results.)
      DROP INDEX IF EXISTS commands_finished;
      CREATE INDEX IF NOT EXISTS commands_trim ON commands(sandbox_id, state, finished_at);
    `);
    this.#insert = this.#sql(
      `INSERT INTO commands (command_id, sandbox_id, request_id, state, info, started_at)
       VALUES (?, ?, ?, 'running', ?, ?)`,
    );
    this.#upsert = this.#sql(
      `INSERT INTO commands (command_id, sandbox_id, request_id, state, info, result, started_at, finished_at)
       VALUES (?, ?, ?, 'finished', ?, ?, ?, ?)
       ON CONFLICT(command_id) DO UPDATE SET state = 'finished', result = excluded.result,
         finished_at = excluded.finished_at, info = excluded.info`,
    );
    // Everything older than the sandbox's keep-th newest result: two range scans of commands_trim.
    this.#trim = this.#sql(
      `DELETE FROM commands WHERE sandbox_id = ? AND state = 'finished' AND (finished_at, rowid) < (
         SELECT finished_at, rowid FROM commands WHERE sandbox_id = ? AND state = 'finished'
         ORDER BY finished_at DESC, rowid DESC LIMIT 1 OFFSET ?
       )`,
    );
    this.#delete = this.#sql('DELETE FROM commands WHERE command_id = ?');
    this.#applyAll = this.#db.transaction((ops: (() => void)[]) => {
      for (const op of ops) op();
    });
    this.#get = this.#sql('SELECT * FROM commands WHERE command_id = ? AND sandbox_id = ?');
    this.#byRequest = this.#sql('SELECT * FROM commands WHERE sandbox_id = ? AND request_id = ?');
    const journal = `${file}-results`;
    ensurePrivateFile(journal);
    this.#journal = openSync(journal, constants.O_RDWR | constants.O_APPEND, PRIVATE_FILE_MODE);
    this.#replayJournal(journal);
  }

  /** Results journalled before a crash (or a close that could not commit them) into the table. */
  #replayJournal(journal: string): void {
    const text = readFileSync(journal, 'utf8');
    if (text === '') return;
    const ops: (() => void)[] = [];
    // A line cut short by the crash was never acknowledged: everything after the last newline.
    for (const line of text.slice(0, text.lastIndexOf('\n') + 1).split('\n')) {
      let row: unknown;
      try {
        row = JSON.parse(line);
      } catch {
        continue;
      }
      if (Array.isArray(row) && row.length === 7) ops.push(() => this.#upsert.run(...row));
    }
    this.#applyAll(ops);
    ftruncateSync(this.#journal, 0);
  }

  /**
   * Records a started command. `durable`: commit now (its ID is acknowledged
   * before it ends: background commands, request IDs); otherwise the row
   * shares the commit of the command's result.
   */
  insert(info: CommandInfo, options: { durable?: boolean } = {}): void {
    const infoJson = JSON.stringify({ ...info, result: undefined });
    const op = () =>
      this.#insert.run(
        info.commandId,
        info.sandboxId,
        info.requestId ?? null,
        infoJson,
        info.startedAt,
      );
    if (options.durable !== false) {
      this.#write(op);
      return;
    }
    // The result's upsert writes the whole row: a start still queued then is skipped.
    const id = info.commandId;
    this.#deferredStarts.add(id);
    this.#defer(() => {
      if (this.#deferredStarts.delete(id)) op();
    });
  }

  /**
   * Records a result. On a full disk (a sandbox without a disk quota filled
   * the node's) the row stays queued and is committed once space returns:
   * the caller still gets its result (the platform keeps working), though
   * until then a crash of the edge would lose it and reads do not see it.
   */
  finish(info: CommandInfo & { result: CommandResult; finishedAt: string }): void {
    this.#write(this.#finishOp(info), { holdIfFull: true });
  }

  /**
   * As `finish`, but durable by the journal: with every other result
   * finished in the same turn of the event loop, one write to it (the table
   * gets the row in a later batch). Resolves once written (or, on a full
   * disk, held as `finish` holds it); rejects if the write failed.
   */
  finishGrouped(info: CommandInfo & { result: CommandResult; finishedAt: string }): Promise<void> {
    const row = this.#finishRow(info);
    this.#pending.push(() => this.#upsert.run(...row));
    this.#journalLines.push(JSON.stringify(row));
    if (!this.#group) {
      let resolve!: () => void;
      let reject!: (err: unknown) => void;
      const promise = new Promise<void>((res, rej) => {
        resolve = res;
        reject = rej;
      });
      this.#group = { promise, resolve, reject };
      setImmediate(() => this.#commitGroup());
    }
    return this.#group.promise;
  }

  /** Writes this turn's results to the journal (or, if it cannot, commits them to the table). */
  #commitGroup(): void {
    const group = this.#group;
    this.#group = undefined;
    if (!group) return;
    const lines = this.#journalLines;
    this.#journalLines = [];
    try {
      if (lines.length > 0 && this.#db.open) {
        try {
          writeSync(this.#journal, lines.join('\n') + '\n');
          this.#journalled += lines.length;
        } catch (err) {
          if (!isDiskFull(err)) throw err;
          this.flush(); // the table may still take them (SQLite keeps free pages)
        }
      }
      if (this.#journalled >= MAX_JOURNALLED) this.flush();
      else this.#scheduleFlush();
      group.resolve();
    } catch (err) {
      // On a full disk the results stay queued (as `finish` holds them); the callers get them.
      if (isDiskFull(err)) group.resolve();
      else group.reject(err);
    }
  }

  /** A result's row: the upsert's parameters (and a journal line). */
  #finishRow(info: CommandInfo & { result: CommandResult; finishedAt: string }): unknown[] {
    this.#deferredStarts.delete(info.commandId);
    return [
      info.commandId,
      info.sandboxId,
      info.requestId ?? null,
      JSON.stringify({ ...info, result: undefined }),
      JSON.stringify(info.result),
      info.startedAt,
      info.finishedAt,
    ];
  }

  #finishOp(info: CommandInfo & { result: CommandResult; finishedAt: string }): () => void {
    const row = this.#finishRow(info);
    return () => this.#upsert.run(...row);
  }

  /** Forgets a command that never started (spawn failed), so a retry may run it. */
  delete(commandId: string): void {
    // A start still queued is simply never written.
    if (this.#deferredStarts.delete(commandId)) return;
    this.#write(() => this.#delete.run(commandId), { holdIfFull: true });
  }

  /**
   * Writes what is queued, in one transaction. On a full disk the writes
   * stay queued (retried every second) and the error is thrown.
   */
  flush(): void {
    if (!this.#db.open) return;
    if (this.#pending.length === 0) {
      this.#emptyJournal(); // what it holds was committed by an earlier flush
      return;
    }
    const ops = this.#pending;
    this.#pending = [];
    clearTimeout(this.#flushTimer);
    this.#flushTimer = undefined;
    try {
      this.#applyAll(ops);
    } catch (err) {
      if (!isDiskFull(err)) throw err;
      this.#pending = ops.concat(this.#pending).slice(-MAX_HELD_WRITES);
      this.#flushTimer = setTimeout(() => this.#flushQuietly(), DISK_FULL_RETRY_MS);
      this.#flushTimer.unref();
      throw err;
    }
    this.#emptyJournal();
  }

  /** After a commit: every journalled result is in the table (this turn's lines, not yet written, too). */
  #emptyJournal(): void {
    if (this.#journalled === 0) return;
    ftruncateSync(this.#journal, 0);
    this.#journalled = 0;
  }

  /** For timers and reads: a full disk must neither crash the edge nor fail a read. */
  #flushQuietly(): void {
    try {
      this.flush();
    } catch (err) {
      if (!isDiskFull(err)) throw err;
    }
  }

  /**
   * Commits now (after anything queued), before the caller acknowledges it.
   * `holdIfFull`: on a full disk keep it queued and return; otherwise the
   * write is dropped and the error thrown (the caller must not acknowledge).
   */
  #write(op: () => void, options: { holdIfFull?: boolean } = {}): void {
    this.#pending.push(op);
    try {
      this.flush();
    } catch (err) {
      if (!isDiskFull(err)) throw err;
      if (options.holdIfFull) return;
      this.#pending = this.#pending.filter((o) => o !== op);
      throw err;
    }
  }

  #defer(op: () => void): void {
    this.#pending.push(op);
    this.#scheduleFlush();
  }

  #scheduleFlush(): void {
    if (this.#flushTimer) return;
    this.#flushTimer = setTimeout(() => this.#flushQuietly(), FLUSH_DELAY_MS);
    this.#flushTimer.unref();
  }

  get(sandboxId: string, commandId: string): CommandInfo | undefined {
    this.#flushQuietly();
    const row = this.#get.get(commandId, sandboxId) as Row | undefined;
    return row && fromRow(row);
  }

  findByRequest(sandboxId: string, requestId: string): CommandInfo | undefined {
    this.#flushQuietly();
    const row = this.#byRequest.get(sandboxId, requestId) as Row | undefined;
    return row && fromRow(row);
  }

  /** Newest first. */
  list(sandboxId: string, limit: number): CommandInfo[] {
    this.#flushQuietly();
    const rows = this.#sql(
      'SELECT * FROM commands WHERE sandbox_id = ? ORDER BY started_at DESC, rowid DESC LIMIT ?',
    ).all(sandboxId, limit) as Row[];
    return rows.map(fromRow);
  }

  /** Commands the log says are running (after an edge restart: they died with its connections). */
  running(): CommandInfo[] {
    this.flush();
    return (this.#sql("SELECT * FROM commands WHERE state = 'running'").all() as Row[]).map(
      fromRow,
    );
  }

  /**
   * Drops finished commands that ended before `beforeIso`: one scan of the
   * table (the per-sandbox bound is `trim`'s, which an index serves; a
   * window over every sandbox's results here took ~0.4 s at 1,500 sandboxes).
   */
  purge(beforeIso: string): number {
    this.flush();
    return this.#sql("DELETE FROM commands WHERE state = 'finished' AND finished_at < ?").run(
      beforeIso,
    ).changes;
  }

  /** Keeps at most `keep` finished commands of one sandbox (called as they finish). */
  trim(sandboxId: string, keep: number): void {
    // The cutoff is the keep-th newest result; with none to keep, there is no cutoff.
    if (keep <= 0) {
      const all = this.#sql("DELETE FROM commands WHERE sandbox_id = ? AND state = 'finished'");
      this.#defer(() => all.run(sandboxId));
    } else this.#defer(() => this.#trim.run(sandboxId, sandboxId, keep - 1));
  }

  close(): void {
    this.#commitGroup();
    this.flush();
    this.#db.close();
    closeSync(this.#journal);
  }
}

function fromRow(row: Row): CommandInfo {
  const info = JSON.parse(row.info) as CommandInfo;
  info.state = row.state;
  if (row.result !== null) info.result = JSON.parse(row.result) as CommandResult;
  return info;
}
