import { DsecError } from '@dsec/core';
import type { Dialect, SqlDb, SqlQuery } from './sql.js';

/**
 * One step of the control database's layout, in each dialect. Steps only
 * ever append: a released step is never edited, since databases in the
 * field have run it. CPU is stored in millicores so quota sums are exact
 * integers (0.1 + 0.2 must not exceed a 0.3-core quota); times that are
 * compared are milliseconds since the epoch; timestamps that are only shown
 * are ISO-8601 text.
 */
export interface Migration {
  version: number;
  name: string;
  sql: Record<Dialect, string>;
}

export const MIGRATIONS: readonly Migration[] = [
  {
    version: 1,
    name: 'iam',
    sql: {
      // Exactly the layout releases before migrations were tracked created (user_version 1).
      sqlite: `
  CREATE TABLE projects (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    parent_id TEXT REFERENCES projects(id),
    quota_sandboxes INTEGER,
    quota_memory_mb INTEGER,
    quota_cpu_millis INTEGER,
    created_at TEXT NOT NULL,
    UNIQUE (parent_id, name)
  );
  CREATE INDEX projects_parent ON projects(parent_id);
  CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    hash TEXT NOT NULL UNIQUE,
    project_id TEXT NOT NULL REFERENCES projects(id),
    role TEXT NOT NULL CHECK (role IN ('admin', 'member')),
    name TEXT NOT NULL,
    created_by TEXT,
    created_at TEXT NOT NULL,
    revoked_at TEXT
  );
  CREATE TABLE reservations (
    id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    memory_mb INTEGER NOT NULL,
    cpu_millis INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
  );
  CREATE INDEX reservations_project ON reservations(project_id);
  CREATE INDEX reservations_expiry ON reservations(expires_at);
  CREATE TABLE idempotency (
    project_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    holder TEXT NOT NULL,
    sandbox_id TEXT,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (project_id, request_id)
  );
  CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    actor_key_id TEXT,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    outcome TEXT NOT NULL,
    details TEXT
  );`,
      // SQLite orders projects by rowid; PostgreSQL has none, so `seq` keeps creation order.
      postgres: `
  CREATE TABLE projects (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    parent_id TEXT REFERENCES projects(id),
    quota_sandboxes BIGINT,
    quota_memory_mb BIGINT,
    quota_cpu_millis BIGINT,
    created_at TEXT NOT NULL,
    seq BIGSERIAL NOT NULL,
    UNIQUE (parent_id, name)
  );
  CREATE INDEX projects_parent ON projects(parent_id);
  CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    hash TEXT NOT NULL UNIQUE,
    project_id TEXT NOT NULL REFERENCES projects(id),
    role TEXT NOT NULL CHECK (role IN ('admin', 'member')),
    name TEXT NOT NULL,
    created_by TEXT,
    created_at TEXT NOT NULL,
    revoked_at TEXT
  );
  CREATE TABLE reservations (
    id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    memory_mb BIGINT NOT NULL,
    cpu_millis BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
  );
  CREATE INDEX reservations_project ON reservations(project_id);
  CREATE INDEX reservations_expiry ON reservations(expires_at);
  CREATE TABLE idempotency (
    project_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    holder TEXT NOT NULL,
    sandbox_id TEXT,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (project_id, request_id)
  );
  CREATE TABLE audit (
    id BIGSERIAL PRIMARY KEY,
    at TEXT NOT NULL,
    actor_key_id TEXT,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    outcome TEXT NOT NULL,
    details TEXT
  );`,
    },
  },
  {
    version: 2,
    name: 'request fingerprints, one root, key index',
    // A NULL fingerprint is a claim made before requests were fingerprinted: it binds nothing.
    // The root index makes a second root impossible even when two apiservers bootstrap at once.
    sql: {
      sqlite: `
  ALTER TABLE idempotency ADD COLUMN fingerprint TEXT;
  CREATE UNIQUE INDEX projects_one_root ON projects ((parent_id IS NULL)) WHERE parent_id IS NULL;
  CREATE INDEX api_keys_project ON api_keys(project_id);`,
      postgres: `
  ALTER TABLE idempotency ADD COLUMN fingerprint TEXT;
  CREATE UNIQUE INDEX projects_one_root ON projects ((parent_id IS NULL)) WHERE parent_id IS NULL;
  CREATE INDEX api_keys_project ON api_keys(project_id);`,
    },
  },
  {
    version: 3,
    name: 'edge registry',
    // labels, backends and status are JSON text; healthy is 0/1.
    sql: {
      sqlite: `
  CREATE TABLE edges (
    edge_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    secret TEXT NOT NULL,
    labels TEXT NOT NULL,
    backends TEXT NOT NULL,
    healthy INTEGER NOT NULL DEFAULT 0,
    last_probe_at INTEGER,
    last_error TEXT,
    status TEXT,
    registered_at TEXT NOT NULL
  );`,
      postgres: `
  CREATE TABLE edges (
    edge_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    secret TEXT NOT NULL,
    labels TEXT NOT NULL,
    backends TEXT NOT NULL,
    healthy INTEGER NOT NULL DEFAULT 0,
    last_probe_at BIGINT,
    last_error TEXT,
    status TEXT,
    registered_at TEXT NOT NULL
  );`,
    },
  },
  {
    version: 4,
    name: 'key scopes',
    // JSON array of scopes; NULL is an unscoped key (every key made before scopes existed).
    sql: {
      sqlite: `
  ALTER TABLE api_keys ADD COLUMN scopes TEXT;`,
      postgres: `
  ALTER TABLE api_keys ADD COLUMN scopes TEXT;`,
    },
  },
  {
    version: 5,
    name: 'fncall rate quota',
    // Calls per second the project's subtree may start (issue 14); NULL: no limit of its own.
    sql: {
      sqlite: `
  ALTER TABLE projects ADD COLUMN quota_fncalls_per_second INTEGER;`,
      postgres: `
  ALTER TABLE projects ADD COLUMN quota_fncalls_per_second BIGINT;`,
    },
  },
  {
    version: 6,
    name: 'cordoned edges',
    // 1: placement sends the edge no new sandboxes or function calls (`dsec edge cordon`).
    sql: {
      sqlite: `
  ALTER TABLE edges ADD COLUMN cordoned INTEGER NOT NULL DEFAULT 0;`,
      postgres: `
  ALTER TABLE edges ADD COLUMN cordoned INTEGER NOT NULL DEFAULT 0;`,
    },
  },
  {
    version: 7,
    name: 'image bytes quota',
    // Bytes of layers a project's subtree may own (docs/adr/0019-layer-ownership.md); NULL: no
    // limit of its own. One row per snapshot being taken (`id` a holder, lapsing at `expires_at`)
    // or per layer a project owns (`id` its layer key, `expires_at` NULL: held until deleted).
    sql: {
      sqlite: `
  ALTER TABLE projects ADD COLUMN quota_image_bytes INTEGER;
  CREATE TABLE image_reservations (
    id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
  );
  CREATE INDEX image_reservations_project ON image_reservations(project_id);`,
      postgres: `
  ALTER TABLE projects ADD COLUMN quota_image_bytes BIGINT;
  CREATE TABLE image_reservations (
    id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT
  );
  CREATE INDEX image_reservations_project ON image_reservations(project_id);`,
    },
  },
  {
    version: 8,
    name: 'edge TLS pins',
    // JSON array of the SHA-256 fingerprints of the edge's accepted TLS certificates;
    // NULL: the edge serves no TLS (issue 24 point 7).
    sql: {
      sqlite: `
  ALTER TABLE edges ADD COLUMN tls_pins TEXT;`,
      postgres: `
  ALTER TABLE edges ADD COLUMN tls_pins TEXT;`,
    },
  },
  {
    version: 9,
    name: 'audit retention index',
    // The retention sweep deletes by age (`at` is ISO-8601 UTC text, which sorts as time).
    sql: {
      sqlite: `
  CREATE INDEX audit_at ON audit(at);`,
      postgres: `
  CREATE INDEX audit_at ON audit(at);`,
    },
  },
  {
    version: 10,
    name: 'idempotency retention index',
    // The idempotency sweep deletes records past `idempotencyRetentionMs` by age.
    sql: {
      sqlite: `
  CREATE INDEX idempotency_created ON idempotency(created_at);`,
      postgres: `
  CREATE INDEX idempotency_created ON idempotency(created_at);`,
    },
  },
  {
    version: 11,
    name: 'volumes',
    // A project's named volumes (docs/volumes.md): one row per (project, name), on one edge,
    // `size_bytes` counted against `quota_volume_bytes` of the project and every ancestor
    // (NULL: no limit of its own) from the moment the row exists. `state` 'creating' until
    // the edge has made it.
    sql: {
      sqlite: `
  ALTER TABLE projects ADD COLUMN quota_volume_bytes INTEGER;
  CREATE TABLE volumes (
    project_id TEXT NOT NULL REFERENCES projects(id),
    name TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    edge_id TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (project_id, name)
  );`,
      postgres: `
  ALTER TABLE projects ADD COLUMN quota_volume_bytes BIGINT;
  CREATE TABLE volumes (
    project_id TEXT NOT NULL REFERENCES projects(id),
    name TEXT NOT NULL,
    size_bytes BIGINT NOT NULL,
    edge_id TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (project_id, name)
  );`,
    },
  },
];

/** The newest layout this release knows. */
export const SCHEMA_VERSION = MIGRATIONS.length;

/** Any constant of our own: serialises migrations of apiservers starting at once. */
const MIGRATION_LOCK_KEY = 0x64736563; // "dsec"

const MIGRATIONS_TABLE = `CREATE TABLE IF NOT EXISTS schema_migrations (
  version INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  applied_at TEXT NOT NULL
)`;

/**
 * Brings the database to `SCHEMA_VERSION` in one transaction: each missing
 * step runs in order and is recorded in `schema_migrations`. Processes that
 * start together migrate one after the other (SQLite's write lock; a
 * PostgreSQL advisory lock), and the later ones find nothing to do.
 *
 * A SQLite file from a release before `schema_migrations` existed recorded
 * its steps in `PRAGMA user_version` only; those count as applied. SQLite's
 * `user_version` is kept equal to the newest step, so such a release opening
 * a newer file runs nothing on it.
 *
 * A database newer than this release is refused (`internal`): running old
 * code on a layout it does not know could corrupt it.
 */
export async function migrate(
  db: SqlDb,
  now: () => number = Date.now,
): Promise<{ from: number; to: number }> {
  return db.transaction(async (q) => {
    if (q.dialect === 'postgres') {
      await q.get(`SELECT pg_advisory_xact_lock(${MIGRATION_LOCK_KEY})`);
    }
    await q.exec(MIGRATIONS_TABLE);
    const applied = new Set(
      (await q.all<{ version: number }>('SELECT version FROM schema_migrations')).map(
        (r) => r.version,
      ),
    );
    if (applied.size === 0 && q.dialect === 'sqlite') {
      const legacy =
        (await q.get<{ user_version: number }>('PRAGMA user_version'))?.user_version ?? 0;
      for (const m of MIGRATIONS.filter((m) => m.version <= legacy)) {
        await record(q, m, now);
        applied.add(m.version);
      }
    }
    const from = Math.max(0, ...applied);
    if (from > SCHEMA_VERSION) {
      throw new DsecError(
        'internal',
        `the control database has schema version ${from}, newer than this release's ${SCHEMA_VERSION}: upgrade DSec`,
      );
    }
    for (const m of MIGRATIONS) {
      if (applied.has(m.version)) continue;
      await q.exec(m.sql[q.dialect]);
      await record(q, m, now);
    }
    if (q.dialect === 'sqlite') await q.exec(`PRAGMA user_version = ${SCHEMA_VERSION}`);
    return { from, to: SCHEMA_VERSION };
  });
}

async function record(q: SqlQuery, m: Migration, now: () => number): Promise<void> {
  await q.run('INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)', [
    m.version,
    m.name,
    new Date(now()).toISOString(),
  ]);
}
