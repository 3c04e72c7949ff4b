import { PostgresDb } from './db/drivers/postgres.js';
import type { PostgresDbOptions } from './db/drivers/postgres.js';
import { SqliteDb } from './db/drivers/sqlite.js';
import type { SqliteDbOptions } from './db/drivers/sqlite.js';
import { migrate } from './db/migrations.js';
import type { SqlDb } from './db/sql.js';
import { EdgeRegistry } from './edge-registry.js';
import { Iam } from './iam.js';
import type { IamOptions } from './iam.js';

export interface ControlDbOptions extends IamOptions, SqliteDbOptions, PostgresDbOptions {}

/**
 * The control plane's durable state: IAM and the edge registry, in one
 * database. Stateless apiservers and watchers each open one on the same
 * database; `close()` ends this process's connections only.
 */
export interface ControlDb {
  readonly kind: 'sqlite' | 'postgres';
  readonly iam: Iam;
  readonly edges: EdgeRegistry;
  /**
   * Writes IAM's pending audit rows, waits for queries in flight, then closes
   * the connections; later calls fail `unavailable`.
   */
  close(): Promise<void>;
}

const POSTGRES_URL = /^postgres(ql)?:\/\//i;

/** True when `location` names a PostgreSQL database rather than a SQLite file. */
export function isPostgresLocation(location: string): boolean {
  return POSTGRES_URL.test(location);
}

/**
 * Opens the control database at `location` and brings its schema up to
 * date (`migrate`): a `postgres://` or `postgresql://` URL (a cluster), or
 * else a SQLite file path, created private (0600) when missing, `:memory:`
 * for a throwaway one. A SQLite file written by an earlier release opens
 * and is upgraded in place.
 *
 * Throws `unavailable` when a PostgreSQL server cannot be reached (the
 * message names it without its password), `internal` for a database whose
 * schema is newer than this release.
 */
export async function openControlDb(
  location: string,
  options: ControlDbOptions = {},
): Promise<ControlDb> {
  const postgres = isPostgresLocation(location);
  const db: SqlDb = postgres ? new PostgresDb(location, options) : new SqliteDb(location, options);
  try {
    await migrate(db, options.now);
  } catch (err) {
    await db.close();
    throw err;
  }
  const iam = new Iam(db, options);
  return {
    kind: postgres ? 'postgres' : 'sqlite',
    iam,
    edges: new EdgeRegistry(db, options),
    // Pending aggregated denials are written before the connections go.
    close: async () => {
      await iam.close();
      await db.close();
    },
  };
}
