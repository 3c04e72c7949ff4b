import pg from 'pg';
import { DsecError } from '@dsec/core';
import type { SqlDb, SqlQuery, SqlValue } from '../sql.js';

export interface PostgresDbOptions {
  /** Connections this process keeps at most. Default 10. */
  poolSize?: number;
  /** Time to wait for a connection (new, or free from the pool) before `unavailable`. Default 10 000. */
  connectTimeoutMs?: number;
}

const INT8_OID = 20;
const NUMERIC_OID = 1700;

/**
 * `COUNT` is `bigint` and `SUM` of a `bigint` column is `numeric` in
 * PostgreSQL, which `pg` returns as strings by default (they may exceed
 * 2^53). Every such value here (millisecond times, megabytes, millicores,
 * counts) is far below 2^53, so they are read as numbers, as SQLite returns
 * them. Set per pool, not on `pg`'s global table, so other users of `pg` in
 * the process are unaffected.
 */
const types = {
  getTypeParser: ((oid: number, format?: 'text' | 'binary') =>
    oid === INT8_OID || oid === NUMERIC_OID
      ? (value: string) => Number(value)
      : pg.types.getTypeParser(oid, format)) as pg.CustomTypesConfig['getTypeParser'],
};

/** Transient conflicts after which a transaction is simply run again. */
const RETRY_SQLSTATES = new Set(['40001', '40P01']);
const MAX_TRANSACTION_ATTEMPTS = 5;

/**
 * `SqlDb` over a `pg` pool. Plain queries take any pooled connection; a
 * transaction holds one connection from `BEGIN` to `COMMIT`. Several
 * processes (apiservers, watchers) share the database, each with its own
 * pool; correctness between them comes from the transactions' row locks
 * (see `SqlDb`), not from anything in this process.
 */
export class PostgresDb implements SqlDb {
  readonly dialect = 'postgres' as const;
  readonly #pool: pg.Pool;
  readonly #where: string;
  #closed = false;

  constructor(url: string, options: PostgresDbOptions = {}) {
    this.#where = redactUrl(url);
    this.#pool = new pg.Pool({
      connectionString: url,
      max: options.poolSize ?? 10,
      connectionTimeoutMillis: options.connectTimeoutMs ?? 10_000,
      types,
    });
    // An idle pooled connection that the server drops (restart, failover) emits this;
    // unhandled it would crash the process. The pool discards it and reconnects on demand.
    this.#pool.on('error', () => undefined);
  }

  all<T>(sql: string, params: readonly SqlValue[] = []): Promise<T[]> {
    return this.#query<T>(this.#pool, sql, params).then((r) => r.rows);
  }

  get<T>(sql: string, params: readonly SqlValue[] = []): Promise<T | undefined> {
    return this.#query<T>(this.#pool, sql, params).then((r) => r.rows[0]);
  }

  run(sql: string, params: readonly SqlValue[] = []): Promise<{ changes: number }> {
    return this.#query(this.#pool, sql, params).then((r) => ({ changes: r.rowCount ?? 0 }));
  }

  async exec(script: string): Promise<void> {
    await this.#query(this.#pool, script, undefined);
  }

  async transaction<T>(fn: (q: SqlQuery) => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      let client: pg.PoolClient;
      if (this.#closed) throw new DsecError('unavailable', 'the control database is closed');
      try {
        client = await this.#pool.connect();
      } catch (err) {
        throw this.#unavailable(err);
      }
      let broken: Error | undefined;
      let open = true;
      const use = (): pg.PoolClient => {
        if (!open) throw new Error('a transaction handle was used after its transaction ended');
        return client;
      };
      const q: SqlQuery = {
        dialect: 'postgres',
        all: <R>(sql: string, params: readonly SqlValue[] = []) =>
          this.#query<R>(use(), sql, params).then((r) => r.rows),
        get: <R>(sql: string, params: readonly SqlValue[] = []) =>
          this.#query<R>(use(), sql, params).then((r) => r.rows[0]),
        run: (sql, params = []) =>
          this.#query(use(), sql, params).then((r) => ({ changes: r.rowCount ?? 0 })),
        exec: async (script) => void (await this.#query(use(), script, undefined)),
      };
      try {
        await this.#query(client, 'BEGIN', undefined);
        const result = await fn(q);
        await this.#query(client, 'COMMIT', undefined);
        return result;
      } catch (err) {
        await client.query('ROLLBACK').catch((rollbackErr: unknown) => {
          // A connection that cannot roll back is not given back to the pool.
          broken = rollbackErr instanceof Error ? rollbackErr : new Error(String(rollbackErr));
        });
        const sqlstate = (err as { code?: unknown }).code;
        if (
          typeof sqlstate === 'string' &&
          RETRY_SQLSTATES.has(sqlstate) &&
          attempt < MAX_TRANSACTION_ATTEMPTS
        )
          continue;
        throw err;
      } finally {
        open = false;
        client.release(broken);
      }
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#pool.end().catch(() => undefined);
  }

  async #query<R>(
    on: pg.Pool | pg.PoolClient,
    sql: string,
    params: readonly SqlValue[] | undefined,
  ): Promise<pg.QueryResult<R & pg.QueryResultRow>> {
    if (this.#closed) throw new DsecError('unavailable', 'the control database is closed');
    try {
      return params === undefined
        ? await on.query<R & pg.QueryResultRow>(sql)
        : await on.query<R & pg.QueryResultRow>(numberPlaceholders(sql), params as SqlValue[]);
    } catch (err) {
      throw isConnectionError(err) ? this.#unavailable(err) : err;
    }
  }

  #unavailable(err: unknown): DsecError {
    return new DsecError('unavailable', `the control database at ${this.#where} is unreachable`, {
      cause: err,
    });
  }
}

const placeholderCache = new Map<string, string>();

/** `?, ?` → `$1, $2`, skipping quoted text; cached per SQL text. */
export function numberPlaceholders(sql: string): string {
  let out = placeholderCache.get(sql);
  if (out !== undefined) return out;
  out = '';
  let n = 0;
  let quote: string | undefined;
  for (const ch of sql) {
    if (quote) {
      if (ch === quote) quote = undefined;
      out += ch;
    } else if (ch === "'" || ch === '"') {
      quote = ch;
      out += ch;
    } else out += ch === '?' ? `$${++n}` : ch;
  }
  if (placeholderCache.size < 1000) placeholderCache.set(sql, out);
  return out;
}

/**
 * Failures of the connection rather than of the statement: the server is
 * down, restarting, refusing connections, or the socket broke.
 */
function isConnectionError(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  if (typeof code === 'string') {
    if (/^(08|57P0[1-3]|53300)/.test(code)) return true;
    if (
      /^E(CONNREFUSED|CONNRESET|TIMEDOUT|HOSTUNREACH|NETUNREACH|NOTFOUND|PIPE|AI_AGAIN)$/.test(code)
    )
      return true;
  }
  const message = err instanceof Error ? err.message : '';
  return /Connection terminated|timeout exceeded when trying to connect|Client has encountered a connection error/i.test(
    message,
  );
}

/** The URL without its password, for messages and logs. */
export function redactUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    return u.toString();
  } catch {
    return 'postgres://(unparsable URL)';
  }
}
