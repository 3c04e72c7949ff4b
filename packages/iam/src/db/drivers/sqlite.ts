import type Database from 'better-sqlite3';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError } from '@dsec/core';
import { openPrivateDatabase } from '../../private-db.js';
import type { SqlDb, SqlQuery, SqlValue } from '../sql.js';

export interface SqliteDbOptions {
  /**
   * How long a statement or `BEGIN IMMEDIATE` keeps retrying while another
   * connection holds the write lock, before failing with `unavailable`.
   * Default 5000.
   */
  busyTimeoutMs?: number;
}

/** First and longest pause between retries of a busy statement. */
const BUSY_BACKOFF_MIN_MS = 1;
const BUSY_BACKOFF_MAX_MS = 25;

/**
 * `SqlDb` over one better-sqlite3 connection (WAL, `synchronous=FULL`,
 * foreign keys on). The file is created 0600 (private-db.ts).
 *
 * better-sqlite3 is synchronous, and so is SQLite's own busy wait: a
 * connection that waited for another connection's write lock inside
 * `busy_timeout` would block the event loop, and when that other connection
 * belongs to this same process (several `Iam` instances on one file, as in
 * the tests) it could never release the lock, a deadlock until the timeout.
 * So SQLite's busy timeout is 0 here and a busy statement is retried
 * asynchronously, with backoff, for up to `busyTimeoutMs`.
 *
 * One connection serves one transaction at a time: every use of it, reads
 * included, goes through a queue, so a read never sees another caller's
 * uncommitted writes and two transactions never interleave on it. Each
 * statement is synchronous, so the queue costs a promise turn, not a wait.
 */
export class SqliteDb implements SqlDb {
  readonly dialect = 'sqlite' as const;
  readonly #db: Database.Database;
  readonly #statements = new Map<string, Database.Statement>();
  readonly #busyTimeoutMs: number;
  #queue: Promise<unknown> = Promise.resolve();
  #closed = false;

  constructor(path: string, options: SqliteDbOptions = {}) {
    this.#busyTimeoutMs = options.busyTimeoutMs ?? 5000;
    const db = openPrivateDatabase(path);
    try {
      // Opening may meet another process mid-write: SQLite's own (blocking) wait is
      // acceptable here, once, before this connection serves anything.
      db.pragma(`busy_timeout = ${this.#busyTimeoutMs}`);
      db.pragma('journal_mode = WAL');
      db.pragma('synchronous = FULL');
      db.pragma('foreign_keys = ON');
      db.pragma('busy_timeout = 0');
    } catch (err) {
      db.close();
      throw err;
    }
    this.#db = db;
  }

  all<T>(sql: string, params: readonly SqlValue[] = []): Promise<T[]> {
    return this.#serial(() => this.#retrying(() => this.#stmt(sql).all(...params) as T[]));
  }

  get<T>(sql: string, params: readonly SqlValue[] = []): Promise<T | undefined> {
    return this.#serial(() =>
      this.#retrying(() => this.#stmt(sql).get(...params) as T | undefined),
    );
  }

  run(sql: string, params: readonly SqlValue[] = []): Promise<{ changes: number }> {
    return this.#serial(() => this.#retrying(() => this.#runNow(sql, params)));
  }

  exec(script: string): Promise<void> {
    return this.#serial(() => this.#retrying(() => void this.#db.exec(script)));
  }

  transaction<T>(fn: (q: SqlQuery) => Promise<T>): Promise<T> {
    return this.#serial(async () => {
      await this.#retrying(() => this.#db.exec('BEGIN IMMEDIATE'));
      let open = true;
      const use = <R>(f: () => R): Promise<R> => {
        if (!open) throw new Error('a transaction handle was used after its transaction ended');
        return this.#retrying(f);
      };
      const q: SqlQuery = {
        dialect: 'sqlite',
        all: <R>(sql: string, params: readonly SqlValue[] = []) =>
          use(() => this.#stmt(sql).all(...params) as R[]),
        get: <R>(sql: string, params: readonly SqlValue[] = []) =>
          use(() => this.#stmt(sql).get(...params) as R | undefined),
        run: (sql, params = []) => use(() => this.#runNow(sql, params)),
        exec: (script) => use(() => void this.#db.exec(script)),
      };
      try {
        const result = await fn(q);
        await this.#retrying(() => this.#db.exec('COMMIT'));
        return result;
      } catch (err) {
        // SQLite may have rolled back by itself (some errors end the transaction).
        if (this.#db.inTransaction) this.#db.exec('ROLLBACK');
        throw err;
      } finally {
        open = false;
      }
    });
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#queue.catch(() => undefined);
    this.#db.close();
  }

  #runNow(sql: string, params: readonly SqlValue[]): { changes: number } {
    return { changes: this.#stmt(sql).run(...params).changes };
  }

  // Each distinct SQL text is prepared once: requests stay off SQLite's compiler.
  #stmt(sql: string): Database.Statement {
    let statement = this.#statements.get(sql);
    if (!statement) {
      statement = this.#db.prepare(sql);
      this.#statements.set(sql, statement);
    }
    return statement;
  }

  #serial<T>(fn: () => Promise<T>): Promise<T> {
    if (this.#closed)
      return Promise.reject(new DsecError('unavailable', 'the control database is closed'));
    const next = this.#queue.then(fn, fn);
    this.#queue = next.catch(() => undefined);
    return next;
  }

  async #retrying<T>(fn: () => T): Promise<T> {
    const deadline = Date.now() + this.#busyTimeoutMs;
    for (
      let pauseMs = BUSY_BACKOFF_MIN_MS;
      ;
      pauseMs = Math.min(pauseMs * 2, BUSY_BACKOFF_MAX_MS)
    ) {
      try {
        return fn();
      } catch (err) {
        const code = (err as { code?: unknown }).code;
        if (typeof code !== 'string' || !code.startsWith('SQLITE_BUSY')) throw err;
        if (Date.now() >= deadline) {
          throw new DsecError(
            'unavailable',
            'the control database stayed locked by another writer',
            {
              cause: err,
            },
          );
        }
        // Jitter, so that waiting connections do not retry in lockstep.
        await sleep(pauseMs * (0.5 + Math.random()));
      }
    }
  }
}
