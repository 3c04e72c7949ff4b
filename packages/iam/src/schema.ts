import type Database from 'better-sqlite3';

/**
 * The IAM database layout. `user_version` records the applied migration;
 * migrations only ever append. CPU is stored in millicores so quota sums are
 * exact integers (0.1 + 0.2 must not exceed a 0.3-core quota).
 */
const MIGRATIONS: string[] = [
  `
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
  );
  `,
];

export function migrate(db: Database.Database): void {
  const current = db.pragma('user_version', { simple: true }) as number;
  for (let v = current; v < MIGRATIONS.length; v++) {
    db.transaction(() => {
      db.exec(MIGRATIONS[v] ?? '');
      db.pragma(`user_version = ${v + 1}`);
    }).immediate();
  }
}
