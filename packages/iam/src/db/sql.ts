/**
 * The tiny SQL seam under the control-plane store: IAM and the edge
 * registry speak only this, so their logic exists once for both databases.
 *
 * Vocabulary:
 * - SQL text uses `?` placeholders, in order; a driver rewrites them for its
 *   database (PostgreSQL's `$1, $2, ...`). No `?` may appear inside a string
 *   literal of the text.
 * - Values are strings, numbers or `null` (booleans are stored as 0/1, JSON
 *   as text); integer columns come back as JavaScript numbers in both
 *   drivers, `COUNT` and `SUM` included.
 * - `transaction(fn)` runs `fn` as one serializable unit of work against the
 *   rows it locks: on SQLite a `BEGIN IMMEDIATE` transaction (the database's
 *   single writer lock, taken up front); on PostgreSQL a `READ COMMITTED`
 *   transaction in which code that checks-then-writes takes row locks first
 *   (`lockSuffix`). It commits when `fn` resolves and rolls back when it
 *   throws; a driver may run `fn` again after a transient conflict
 *   (PostgreSQL serialization failure or deadlock), so `fn` must not have
 *   effects outside the database.
 * - Inside `fn`, use only the `SqlQuery` it is given: calling the outer
 *   `SqlDb` there may wait on the transaction itself.
 * - A driver turns "the database is unreachable or busy past its wait" into
 *   `DsecError('unavailable')`, and leaves constraint violations as they are
 *   for `isUniqueViolation`.
 */
export type Dialect = 'sqlite' | 'postgres';

export type SqlValue = string | number | null;

export interface SqlQuery {
  readonly dialect: Dialect;
  all<T>(sql: string, params?: readonly SqlValue[]): Promise<T[]>;
  get<T>(sql: string, params?: readonly SqlValue[]): Promise<T | undefined>;
  run(sql: string, params?: readonly SqlValue[]): Promise<{ changes: number }>;
  /** Runs a script of several statements without parameters (migrations). */
  exec(script: string): Promise<void>;
}

export interface SqlDb extends SqlQuery {
  transaction<T>(fn: (q: SqlQuery) => Promise<T>): Promise<T>;
  close(): Promise<void>;
}

/**
 * The row-lock clause for a `SELECT` whose rows a transaction is about to
 * check and then write against: `FOR UPDATE OF <alias>` on PostgreSQL;
 * nothing on SQLite, whose write transactions already exclude each other.
 */
export function lockSuffix(q: SqlQuery, alias: string): string {
  return q.dialect === 'postgres' ? ` FOR UPDATE OF ${alias}` : '';
}

/** A `UNIQUE` or `PRIMARY KEY` violation, from either driver. */
export function isUniqueViolation(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return (
    code === '23505' ||
    code === 'SQLITE_CONSTRAINT_UNIQUE' ||
    code === 'SQLITE_CONSTRAINT_PRIMARYKEY'
  );
}
