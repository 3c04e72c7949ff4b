import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, readdirSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import { isDsecError } from '@dsec/core';
import { hashApiKey, newApiKey } from './keys.js';
import { openControlDb, requestFingerprint, SCHEMA_VERSION } from './index.js';
import { controlDbConformance } from './testing/index.js';

const root = mkdtempSync(join(tmpdir(), 'dsec-iam-'));
after(() => rmSync(root, { recursive: true, force: true }));
let n = 0;
const freshPath = () => join(root, `iam-${++n}.db`);

// Instances on one file are separate connections, as several processes sharing it would be.
controlDbConformance('SQLite', { fresh: async () => freshPath() });

/** The layout the release before versioned migrations created (schema.ts at 52f993e, user_version 1). */
const LEGACY_SCHEMA = `
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
  );`;

test('a database written by the release before versioned migrations opens and upgrades', async (t) => {
  const path = freshPath();
  const key = newApiKey();
  const legacy = new Database(path);
  legacy.pragma('journal_mode = WAL');
  legacy.exec(LEGACY_SCHEMA);
  legacy.pragma('user_version = 1');
  const at = new Date().toISOString();
  legacy
    .prepare('INSERT INTO projects (id, name, parent_id, created_at) VALUES (?, ?, NULL, ?)')
    .run('prj-root', 'root', at);
  legacy
    .prepare(
      'INSERT INTO projects (id, name, parent_id, quota_sandboxes, created_at) VALUES (?, ?, ?, ?, ?)',
    )
    .run('prj-team', 'team', 'prj-root', 2, at);
  legacy
    .prepare(
      'INSERT INTO api_keys (id, hash, project_id, role, name, created_at) VALUES (?, ?, ?, ?, ?, ?)',
    )
    .run('key-admin', hashApiKey(key), 'prj-root', 'admin', 'bootstrap', at);
  legacy
    .prepare(
      'INSERT INTO reservations (id, project_id, memory_mb, cpu_millis, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)',
    )
    .run('sb-old', 'prj-team', 256, 500, Date.now(), Date.now() + 3_600_000);
  legacy
    .prepare(
      'INSERT INTO idempotency (project_id, request_id, holder, sandbox_id, created_at) VALUES (?, ?, ?, ?, ?)',
    )
    .run('prj-team', 'job-1', 'rsv-x', 'sb-old', Date.now());
  legacy
    .prepare('INSERT INTO audit (at, action, target, outcome) VALUES (?, ?, ?, ?)')
    .run(at, 'project.create', 'prj-root', 'ok');
  legacy.close();

  const db = await openControlDb(path);
  t.after(() => db.close());
  const admin = await db.iam.authenticate(key);
  assert.deepEqual(admin, { keyId: 'key-admin', projectId: 'prj-root', role: 'admin' });
  assert.equal((await db.iam.bootstrap()).created, false);
  assert.deepEqual(await db.iam.usage('prj-team'), {
    sandboxes: 1,
    memoryMb: 256,
    cpuCores: 0.5,
    imageBytes: 0,
    volumeBytes: 0,
  });
  await db.iam.reserve('prj-team', { memoryMb: 1, cpuCores: 0 }, 'sb-new');
  await assert.rejects(db.iam.reserve('prj-team', { memoryMb: 1, cpuCores: 0 }, 'sb-3'), (e) =>
    isDsecError(e, 'quota_exceeded'),
  );
  // A claim from before fingerprints binds nothing: any request may read its result.
  assert.deepEqual(
    await db.iam.claimRequest('prj-team', 'job-1', 'rsv-y', requestFingerprint({ any: 1 })),
    { state: 'done', sandboxId: 'sb-old' },
  );
  assert.equal((await db.iam.listAudit()).at(-1)?.target, 'prj-root');
  await db.edges.register({
    edgeId: 'edge-1',
    url: 'http://127.0.0.1:1',
    secret: 'x'.repeat(43),
    labels: {},
    backends: ['container'],
  });
  await db.close();

  const check = new Database(path, { readonly: true });
  t.after(() => check.close());
  assert.equal(check.pragma('user_version', { simple: true }), SCHEMA_VERSION);
  assert.deepEqual(
    check.prepare('SELECT version FROM schema_migrations ORDER BY version').pluck().all(),
    Array.from({ length: SCHEMA_VERSION }, (_, i) => i + 1),
  );
});

test('the SQLite file and its WAL are private (0600), and hold no raw key', async (t) => {
  const dir = mkdtempSync(join(root, 'private-'));
  const path = join(dir, 'iam.db');
  const db = await openControlDb(path);
  t.after(() => db.close());
  const boot = await db.iam.bootstrap();
  const admin = await db.iam.authenticate(boot.key);
  const k = await db.iam.createKey(admin, { projectId: admin.projectId, name: 'ci' });
  for (const f of ['iam.db', 'iam.db-wal', 'iam.db-shm'])
    assert.equal(statSync(join(dir, f)).mode & 0o777, 0o600, f);
  await db.close();
  for (const f of readdirSync(dir)) {
    const bytes = readFileSync(join(dir, f)).toString('latin1');
    assert.ok(!bytes.includes(boot.key!), `raw key found in ${f}`);
    assert.ok(!bytes.includes(k.key), `raw key found in ${f}`);
  }
});

test(':memory: opens a throwaway database', async (t) => {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  assert.equal(db.kind, 'sqlite');
  assert.equal((await db.iam.bootstrap()).created, true);
});

test('canonical request fingerprints ignore key order and undefined members', () => {
  const a = requestFingerprint({ projectId: 'p', spec: { image: 'x', env: { B: '2', A: '1' } } });
  const b = requestFingerprint({
    spec: { env: { A: '1', B: '2' }, image: 'x', labels: undefined },
    projectId: 'p',
  });
  const c = requestFingerprint({ projectId: 'p', spec: { image: 'x', env: { A: '1', B: '3' } } });
  assert.equal(a, b);
  assert.notEqual(a, c);
  assert.match(a, /^[0-9a-f]{64}$/);
});

test('an edge registration cannot empty its pins or keep them on a plaintext URL', async (t) => {
  const db = await openControlDb(':memory:');
  t.after(() => db.close());
  const pin = `${'AB:'.repeat(31)}AB`;
  const edge = {
    edgeId: 'edge-tls',
    url: 'https://127.0.0.1:1',
    secret: 'x'.repeat(43),
    labels: {},
    backends: ['container'],
  };
  await db.edges.register({ ...edge, tlsPins: [pin] });
  // A join's input that would leave the edge pinned to nothing (any certificate, or none),
  // or dialled in plaintext with its pins kept: refused, the registration as it was.
  const attempts: [string, { url?: string; tlsPins: string[] }, string][] = [
    ['no pins', { tlsPins: [] }, 'tlsPins'],
    ['an empty pin', { tlsPins: [''] }, 'tlsPins'],
    ['a short pin', { tlsPins: ['AB:CD'] }, 'tlsPins'],
    ['pins on http:', { url: 'http://127.0.0.1:1', tlsPins: [pin] }, 'url'],
  ];
  for (const [what, bad, field] of attempts) {
    await assert.rejects(
      db.edges.register({ ...edge, ...bad }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === field,
      what,
    );
    assert.deepEqual((await db.edges.get('edge-tls'))?.tlsPins, [pin], `${what}: unchanged`);
  }
});
