import type Database from 'better-sqlite3';
import { DsecError, randomId } from '@dsec/core';
import { openPrivateDatabase } from './private-db.js';
import { migrate } from './schema.js';
import { API_KEY_PATTERN, hashApiKey, newApiKey } from './keys.js';
import { ROLE_RANK } from './types.js';
import type {
  ApiKeyInfo,
  AuditEntry,
  AuditOutcome,
  CreatedKey,
  Principal,
  Project,
  Quota,
  RequestClaim,
  Resources,
  Role,
  Usage,
} from './types.js';

export interface IamOptions {
  /** SQLite file; `:memory:` for tests that do not need durability. */
  path: string;
  /** Clock, for tests. */
  now?: () => number;
  /**
   * How long a reservation or idempotency claim that was never bound to a
   * created sandbox keeps holding quota (an apiserver that died mid-create).
   */
  pendingTtlMs?: number;
  /** Extra time a bound reservation outlives its sandbox's expiry. */
  expiryGraceMs?: number;
}

export const PROJECT_NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/;

interface ProjectRow {
  id: string;
  name: string;
  parent_id: string | null;
  quota_sandboxes: number | null;
  quota_memory_mb: number | null;
  quota_cpu_millis: number | null;
  created_at: string;
}

interface KeyRow {
  id: string;
  project_id: string;
  role: Role;
  name: string;
  created_at: string;
  revoked_at: string | null;
}

type AuditArgs = [string | null, string, string, AuditOutcome, Record<string, unknown> | undefined];

const SUBTREE_CTE = `WITH RECURSIVE sub(id) AS (
  SELECT ? UNION ALL SELECT p.id FROM projects p JOIN sub ON p.parent_id = sub.id)`;
const ANCESTORS_CTE = `WITH RECURSIVE anc(id, parent_id, depth) AS (
  SELECT id, parent_id, 0 FROM projects WHERE id = ?
  UNION ALL SELECT p.id, p.parent_id, anc.depth + 1 FROM projects p JOIN anc ON p.id = anc.parent_id)`;

/**
 * Durable identity and quota state: nested projects, API keys, quota
 * reservations, idempotency records and the audit log, in one SQLite file
 * (WAL, `synchronous=FULL`). Several processes may share the file; every
 * check-then-write runs inside one `BEGIN IMMEDIATE` transaction, so parallel
 * reservations can never overrun a quota.
 *
 * Lifecycle:
 *   `Iam.open({ path })` → `bootstrap()` once (root project + first admin key)
 *   → `authenticate` / `canAccess` per request → `reserve` → `bindReservation`
 *   (sandbox created) or `release` (create failed) → `release` (sandbox deleted)
 *   → `close()`.
 *
 * Authorisation rules (paper 3.2): a key acts on its project and every
 * descendant; it may grant only roles at or below its own; only admins create
 * projects, and a child's quota never exceeds its parent's effective quota.
 * Every mutation and every denial is written to the audit log. Raw keys are
 * never stored or logged; only their SHA-256.
 */
export class Iam {
  readonly #db: Database.Database;
  readonly #sql: (source: string) => Database.Statement;
  readonly #now: () => number;
  readonly #pendingTtlMs: number;
  readonly #expiryGraceMs: number;
  readonly #deferred: AuditArgs[] = [];

  private constructor(db: Database.Database, options: IamOptions) {
    this.#db = db;
    const statements = new Map<string, Database.Statement>();
    // Each distinct SQL text is prepared once: requests stay off SQLite's compiler.
    this.#sql = (source) => {
      let statement = statements.get(source);
      if (!statement) {
        statement = db.prepare(source);
        statements.set(source, statement);
      }
      return statement;
    };
    this.#now = options.now ?? Date.now;
    this.#pendingTtlMs = options.pendingTtlMs ?? 10 * 60_000;
    this.#expiryGraceMs = options.expiryGraceMs ?? 60_000;
  }

  /** Opens (creating if needed) and migrates the database. */
  static open(options: IamOptions): Iam {
    const db = openPrivateDatabase(options.path);
    db.pragma('journal_mode = WAL');
    db.pragma('synchronous = FULL');
    db.pragma('foreign_keys = ON');
    db.pragma('busy_timeout = 5000');
    migrate(db);
    return new Iam(db, options);
  }

  close(): void {
    this.#db.close();
  }

  // ---- bootstrap & authentication -------------------------------------------------

  /**
   * Creates the root project and an admin key when the database has no
   * project yet. The raw key is returned only then, once; later calls return
   * `{ created: false }` with the root project's ID.
   */
  bootstrap(): { created: boolean; projectId: string; keyId?: string; key?: string } {
    return this.#tx(() => {
      const root = this.#sql('SELECT id FROM projects WHERE parent_id IS NULL LIMIT 1').get() as
        { id: string } | undefined;
      if (root) return { created: false, projectId: root.id };
      const projectId = randomId('prj');
      const at = this.#iso();
      this.#sql(
        'INSERT INTO projects (id, name, parent_id, created_at) VALUES (?, ?, NULL, ?)',
      ).run(projectId, 'root', at);
      const { id, key } = this.#insertKey(projectId, 'admin', 'bootstrap', null);
      this.#audit(null, 'project.create', projectId, 'ok', { name: 'root' });
      this.#audit(null, 'key.create', id, 'ok', { projectId, role: 'admin' });
      return { created: true, projectId, keyId: id, key };
    });
  }

  /** Throws `unauthenticated` for a missing, malformed, unknown or revoked key. */
  authenticate(rawKey: string | undefined): Principal {
    if (typeof rawKey !== 'string' || !API_KEY_PATTERN.test(rawKey)) {
      this.#audit(null, 'auth', '', 'denied', { reason: rawKey ? 'malformed' : 'missing' });
      throw new DsecError('unauthenticated', 'missing or malformed API key');
    }
    const row = this.#sql(
      'SELECT id, project_id, role, revoked_at FROM api_keys WHERE hash = ?',
    ).get(hashApiKey(rawKey)) as
      Pick<KeyRow, 'id' | 'project_id' | 'role' | 'revoked_at'> | undefined;
    if (!row) {
      this.#audit(null, 'auth', '', 'denied', { reason: 'unknown' });
      throw new DsecError('unauthenticated', 'unknown API key');
    }
    if (row.revoked_at !== null) {
      this.#audit(row.id, 'auth', row.id, 'denied', { reason: 'revoked' });
      throw new DsecError('unauthenticated', 'API key revoked');
    }
    return { keyId: row.id, projectId: row.project_id, role: row.role };
  }

  /** True when the principal's project is `projectId` or one of its ancestors. */
  canAccess(principal: Principal, projectId: string): boolean {
    return this.isAncestorOrSelf(principal.projectId, projectId);
  }

  isAncestorOrSelf(ancestorId: string, projectId: string): boolean {
    const row = this.#sql(`${ANCESTORS_CTE} SELECT 1 AS x FROM anc WHERE id = ?`).get(
      projectId,
      ancestorId,
    );
    return row !== undefined;
  }

  // ---- projects -------------------------------------------------------------------

  /**
   * Creates a child of `parentId` (default: the caller's project). Only an
   * admin key of the parent or an ancestor may; a missing or foreign parent is
   * `not_found`. Each quota field must be ≤ the parent's effective limit (the
   * tightest over its ancestors) — else `permission_denied` naming the field.
   * A duplicate name under the same parent is `conflict`.
   */
  createProject(
    caller: Principal,
    input: { name: string; parentId?: string | undefined; quota?: Quota | undefined },
  ): Project {
    const parentId = input.parentId ?? caller.projectId;
    const quota = input.quota ?? {};
    return this.#tx(() => {
      if (!this.#projectRow(parentId) || !this.canAccess(caller, parentId)) {
        this.#audit(caller.keyId, 'project.create', parentId, 'denied', {
          reason: 'parent not found',
        });
        throw new DsecError('not_found', `no project ${JSON.stringify(parentId)}`, {
          field: 'parentId',
        });
      }
      if (caller.role !== 'admin') {
        this.#audit(caller.keyId, 'project.create', parentId, 'denied', { reason: 'not admin' });
        throw new DsecError('permission_denied', 'only admin keys create projects');
      }
      if (!PROJECT_NAME_PATTERN.test(input.name)) {
        throw new DsecError('invalid_argument', 'name must match [A-Za-z0-9][A-Za-z0-9._-]{0,62}', {
          field: 'name',
        });
      }
      checkQuotaShape(quota);
      const limits = this.#effectiveQuota(parentId);
      for (const field of ['sandboxes', 'memoryMb', 'cpuCores'] as const) {
        const want = quota[field];
        const limit = limits[field];
        if (want !== undefined && limit !== undefined && want > limit) {
          this.#audit(caller.keyId, 'project.create', parentId, 'denied', {
            reason: 'quota above parent',
            field,
          });
          throw new DsecError(
            'permission_denied',
            `quota.${field} ${want} exceeds the parent's limit ${limit}`,
            {
              field: `quota.${field}`,
              details: { limit, requested: want },
            },
          );
        }
      }
      const exists = this.#sql('SELECT 1 FROM projects WHERE parent_id = ? AND name = ?').get(
        parentId,
        input.name,
      );
      if (exists)
        throw new DsecError('conflict', `project ${input.name} already exists here`, {
          field: 'name',
        });
      const id = randomId('prj');
      const at = this.#iso();
      this.#sql(
        `INSERT INTO projects (id, name, parent_id, quota_sandboxes, quota_memory_mb, quota_cpu_millis, created_at)
           VALUES (?, ?, ?, ?, ?, ?, ?)`,
      ).run(
        id,
        input.name,
        parentId,
        quota.sandboxes ?? null,
        quota.memoryMb ?? null,
        toMillis(quota.cpuCores),
        at,
      );
      this.#audit(caller.keyId, 'project.create', id, 'ok', { parentId, name: input.name, quota });
      return { id, name: input.name, parentId, quota: cleanQuota(quota), createdAt: at };
    });
  }

  /** A project the caller may see; `not_found` otherwise. */
  getProject(caller: Principal, projectId: string): Project {
    const row = this.#projectRow(projectId);
    if (!row || !this.canAccess(caller, projectId)) {
      throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
    }
    return toProject(row);
  }

  /** The caller's project and all its descendants. */
  listProjects(caller: Principal): Project[] {
    const rows = this.#sql(
      `${SUBTREE_CTE} SELECT p.* FROM projects p JOIN sub ON p.id = sub.id ORDER BY p.rowid`,
    ).all(caller.projectId) as ProjectRow[];
    return rows.map(toProject);
  }

  /** IDs of `projectId` and every descendant. */
  subtreeIds(projectId: string): string[] {
    const rows = this.#sql(`${SUBTREE_CTE} SELECT id FROM sub`).all(projectId) as {
      id: string;
    }[];
    return rows.map((r) => r.id);
  }

  // ---- keys -----------------------------------------------------------------------

  /**
   * Creates a key for `projectId` (the caller's project or a descendant) with
   * a role at or below the caller's. Foreign or unknown projects are
   * `not_found`; a higher role is `permission_denied`.
   */
  createKey(
    caller: Principal,
    input: { projectId: string; role?: Role | undefined; name?: string | undefined },
  ): CreatedKey {
    const role = input.role ?? 'member';
    return this.#tx(() => {
      if (!this.#projectRow(input.projectId) || !this.canAccess(caller, input.projectId)) {
        this.#audit(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'project not found',
        });
        throw new DsecError('not_found', `no project ${JSON.stringify(input.projectId)}`, {
          field: 'projectId',
        });
      }
      if (ROLE_RANK[role] > ROLE_RANK[caller.role]) {
        this.#audit(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'role above own',
          role,
        });
        throw new DsecError('permission_denied', `a ${caller.role} key cannot grant ${role}`, {
          field: 'role',
        });
      }
      const { id, key } = this.#insertKey(input.projectId, role, input.name ?? '', caller.keyId);
      this.#audit(caller.keyId, 'key.create', id, 'ok', { projectId: input.projectId, role });
      return { id, key, projectId: input.projectId, role };
    });
  }

  /**
   * Revokes a key in the caller's subtree whose role is at or below the
   * caller's. Unknown or foreign keys are `not_found`. Revoking twice is a no-op.
   */
  revokeKey(caller: Principal, keyId: string): void {
    this.#tx(() => {
      const row = this.#sql('SELECT * FROM api_keys WHERE id = ?').get(keyId) as KeyRow | undefined;
      if (!row || !this.canAccess(caller, row.project_id)) {
        this.#audit(caller.keyId, 'key.revoke', keyId, 'denied', { reason: 'not found' });
        throw new DsecError('not_found', `no key ${JSON.stringify(keyId)}`);
      }
      if (ROLE_RANK[row.role] > ROLE_RANK[caller.role]) {
        this.#audit(caller.keyId, 'key.revoke', keyId, 'denied', { reason: 'role above own' });
        throw new DsecError(
          'permission_denied',
          `a ${caller.role} key cannot revoke an ${row.role} key`,
        );
      }
      if (row.revoked_at === null) {
        this.#sql('UPDATE api_keys SET revoked_at = ? WHERE id = ?').run(this.#iso(), keyId);
      }
      this.#audit(caller.keyId, 'key.revoke', keyId, 'ok');
    });
  }

  /** Keys of the caller's subtree (never their secrets). */
  listKeys(caller: Principal): ApiKeyInfo[] {
    const rows = this.#sql(
      `${SUBTREE_CTE} SELECT k.id, k.project_id, k.role, k.name, k.created_at, k.revoked_at
         FROM api_keys k JOIN sub ON k.project_id = sub.id ORDER BY k.created_at, k.id`,
    ).all(caller.projectId) as KeyRow[];
    return rows.map((r) => ({
      id: r.id,
      projectId: r.project_id,
      role: r.role,
      name: r.name,
      createdAt: r.created_at,
      revokedAt: r.revoked_at,
    }));
  }

  // ---- quota reservations ---------------------------------------------------------

  /**
   * Reserves one sandbox's resources against `projectId` and every ancestor
   * (usage summed over each one's subtree), in one `BEGIN IMMEDIATE`
   * transaction. `holderId` names the reservation (a sandbox ID, or a
   * temporary ID later bound with `bindReservation`). Until bound, the
   * reservation lapses after `pendingTtlMs`. Throws `quota_exceeded` naming
   * the limiting project and resource; `conflict` if `holderId` is taken.
   */
  reserve(
    projectId: string,
    resources: Resources,
    holderId: string,
    options: { actorKeyId?: string } = {},
  ): void {
    const memoryMb = Math.ceil(resources.memoryMb);
    const cpuMillis = Math.ceil(resources.cpuCores * 1000);
    if (!(memoryMb >= 0 && cpuMillis >= 0))
      throw new DsecError('invalid_argument', 'resources must be ≥ 0');
    this.#tx(() => {
      const now = this.#now();
      this.#sql('DELETE FROM reservations WHERE expires_at <= ?').run(now);
      const chain = this.#sql(
        `${ANCESTORS_CTE} SELECT p.* FROM anc JOIN projects p ON p.id = anc.id ORDER BY anc.depth`,
      ).all(projectId) as ProjectRow[];
      if (chain.length === 0)
        throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
      for (const p of chain) {
        if (p.quota_sandboxes === null && p.quota_memory_mb === null && p.quota_cpu_millis === null)
          continue;
        const used = this.#usageRaw(p.id);
        const checks = [
          ['sandboxes', p.quota_sandboxes, used.n + 1, 1],
          ['memoryMb', p.quota_memory_mb, used.mem + memoryMb, memoryMb],
          ['cpuCores', p.quota_cpu_millis, used.cpu + cpuMillis, cpuMillis],
        ] as const;
        for (const [resource, limit, after, requested] of checks) {
          if (limit !== null && after > limit) {
            const scale = resource === 'cpuCores' ? 1000 : 1;
            const details = {
              projectId: p.id,
              resource,
              limit: limit / scale,
              used: (after - requested) / scale,
              requested: requested / scale,
            };
            this.#audit(options.actorKeyId ?? null, 'quota.reserve', projectId, 'denied', details);
            throw new DsecError(
              'quota_exceeded',
              `project ${p.name} would exceed its ${resource} quota`,
              { details },
            );
          }
        }
      }
      const taken = this.#sql('SELECT 1 FROM reservations WHERE id = ?').get(holderId);
      if (taken) throw new DsecError('conflict', `reservation ${holderId} exists`);
      this.#sql(
        'INSERT INTO reservations (id, project_id, memory_mb, cpu_millis, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)',
      ).run(holderId, projectId, memoryMb, cpuMillis, now, now + this.#pendingTtlMs);
    });
  }

  /**
   * Turns a pending reservation into the sandbox's own: renames it to
   * `sandboxId`, keeps it until the sandbox expires (plus a grace period), and
   * records the idempotency result when a `requestId` was given.
   */
  bindReservation(
    holderId: string,
    sandboxId: string,
    options: { expiresAt: string | number; requestId?: string | undefined; actorKeyId?: string },
  ): void {
    const expires =
      (typeof options.expiresAt === 'number' ? options.expiresAt : Date.parse(options.expiresAt)) +
      this.#expiryGraceMs;
    this.#tx(() => {
      const row = this.#sql('SELECT project_id FROM reservations WHERE id = ?').get(holderId) as
        { project_id: string } | undefined;
      if (!row) throw new DsecError('conflict', `reservation ${holderId} lapsed`);
      this.#sql('UPDATE reservations SET id = ?, expires_at = ? WHERE id = ?').run(
        sandboxId,
        Number.isFinite(expires) ? expires : this.#now() + this.#pendingTtlMs,
        holderId,
      );
      if (options.requestId !== undefined) {
        this.#sql(
          'UPDATE idempotency SET sandbox_id = ? WHERE project_id = ? AND request_id = ? AND holder = ?',
        ).run(sandboxId, row.project_id, options.requestId, holderId);
      }
      this.#audit(options.actorKeyId ?? null, 'sandbox.create', sandboxId, 'ok', {
        projectId: row.project_id,
      });
    });
  }

  /** Frees a reservation (by sandbox or holder ID). Returns whether one existed. */
  release(id: string, options: { actorKeyId?: string; action?: string } = {}): boolean {
    return this.#tx(() => {
      const r = this.#sql('DELETE FROM reservations WHERE id = ?').run(id);
      if (options.action) this.#audit(options.actorKeyId ?? null, options.action, id, 'ok');
      return r.changes > 0;
    });
  }

  /** The project a live reservation is charged to, if any. */
  reservationProject(id: string): string | undefined {
    const row = this.#sql(
      'SELECT project_id FROM reservations WHERE id = ? AND expires_at > ?',
    ).get(id, this.#now()) as { project_id: string } | undefined;
    return row?.project_id;
  }

  /** Live usage summed over the project's subtree. */
  usage(projectId: string): Usage {
    const u = this.#usageRaw(projectId);
    return { sandboxes: u.n, memoryMb: u.mem, cpuCores: u.cpu / 1000 };
  }

  // ---- idempotency ----------------------------------------------------------------

  /**
   * Claims `(projectId, requestId)` for a create. `claimed`: go ahead and
   * create; `done`: the create already happened, answer with `sandboxId`;
   * `pending`: another request is creating it now. A pending claim older than
   * `pendingTtlMs` (its creator died) is taken over.
   */
  claimRequest(projectId: string, requestId: string, holderId: string): RequestClaim {
    return this.#tx(() => {
      const now = this.#now();
      const row = this.#sql(
        'SELECT holder, sandbox_id, created_at FROM idempotency WHERE project_id = ? AND request_id = ?',
      ).get(projectId, requestId) as
        { holder: string; sandbox_id: string | null; created_at: number } | undefined;
      if (row?.sandbox_id) return { state: 'done', sandboxId: row.sandbox_id };
      if (row && row.created_at + this.#pendingTtlMs > now) return { state: 'pending' };
      this.#sql(
        `INSERT INTO idempotency (project_id, request_id, holder, sandbox_id, created_at) VALUES (?, ?, ?, NULL, ?)
           ON CONFLICT (project_id, request_id) DO UPDATE SET holder = excluded.holder, created_at = excluded.created_at`,
      ).run(projectId, requestId, holderId, now);
      return { state: 'claimed' };
    });
  }

  /** Drops a claim that did not lead to a sandbox, so a retry may create. */
  abandonRequest(projectId: string, requestId: string, holderId: string): void {
    this.#sql(
      'DELETE FROM idempotency WHERE project_id = ? AND request_id = ? AND holder = ? AND sandbox_id IS NULL',
    ).run(projectId, requestId, holderId);
  }

  // ---- audit ----------------------------------------------------------------------

  /** Appends an audit record (for denials decided outside IAM, e.g. sandbox access). */
  audit(
    actorKeyId: string | null,
    action: string,
    target: string,
    outcome: AuditOutcome,
    details?: Record<string, unknown>,
  ): void {
    this.#audit(actorKeyId, action, target, outcome, details);
  }

  /** Newest first. */
  listAudit(options: { limit?: number } = {}): AuditEntry[] {
    const rows = this.#sql('SELECT * FROM audit ORDER BY id DESC LIMIT ?').all(
      options.limit ?? 100,
    ) as {
      id: number;
      at: string;
      actor_key_id: string | null;
      action: string;
      target: string;
      outcome: AuditOutcome;
      details: string | null;
    }[];
    return rows.map((r) => ({
      id: r.id,
      at: r.at,
      actorKeyId: r.actor_key_id,
      action: r.action,
      target: r.target,
      outcome: r.outcome,
      details: r.details === null ? undefined : (JSON.parse(r.details) as Record<string, unknown>),
    }));
  }

  // ---- internals ------------------------------------------------------------------

  #tx<T>(fn: () => T): T {
    if (this.#db.inTransaction) return fn();
    try {
      return this.#db.transaction(fn).immediate();
    } finally {
      // Denials are recorded after the (rolled-back) transaction, or they would vanish with it.
      if (this.#deferred.length > 0) {
        const entries = this.#deferred.splice(0);
        this.#db.transaction(() => entries.forEach((e) => this.#writeAudit(...e))).immediate();
      }
    }
  }

  #iso(): string {
    return new Date(this.#now()).toISOString();
  }

  #audit(
    actor: string | null,
    action: string,
    target: string,
    outcome: AuditOutcome,
    details?: Record<string, unknown>,
  ): void {
    if (outcome === 'denied' && this.#db.inTransaction)
      this.#deferred.push([actor, action, target, outcome, details]);
    else this.#writeAudit(actor, action, target, outcome, details);
  }

  #writeAudit(
    actor: string | null,
    action: string,
    target: string,
    outcome: AuditOutcome,
    details?: Record<string, unknown>,
  ): void {
    this.#sql(
      'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, ?, ?, ?, ?, ?)',
    ).run(
      this.#iso(),
      actor,
      action,
      target.slice(0, 200),
      outcome,
      details ? JSON.stringify(details) : null,
    );
  }

  #insertKey(
    projectId: string,
    role: Role,
    name: string,
    createdBy: string | null,
  ): { id: string; key: string } {
    const id = randomId('key');
    const key = newApiKey();
    this.#sql(
      'INSERT INTO api_keys (id, hash, project_id, role, name, created_by, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)',
    ).run(id, hashApiKey(key), projectId, role, name, createdBy, this.#iso());
    return { id, key };
  }

  #projectRow(id: string): ProjectRow | undefined {
    return this.#sql('SELECT * FROM projects WHERE id = ?').get(id) as ProjectRow | undefined;
  }

  /** The tightest limit per field over the project and its ancestors. */
  #effectiveQuota(projectId: string): Quota {
    const chain = this.#sql(
      `${ANCESTORS_CTE} SELECT p.* FROM anc JOIN projects p ON p.id = anc.id`,
    ).all(projectId) as ProjectRow[];
    const out: Quota = {};
    for (const p of chain) {
      const q = toProject(p).quota;
      for (const f of ['sandboxes', 'memoryMb', 'cpuCores'] as const) {
        const v = q[f];
        const cur = out[f];
        if (v !== undefined && (cur === undefined || v < cur)) out[f] = v;
      }
    }
    return out;
  }

  #usageRaw(projectId: string): { n: number; mem: number; cpu: number } {
    return this.#sql(
      `${SUBTREE_CTE} SELECT COUNT(*) AS n, COALESCE(SUM(memory_mb), 0) AS mem, COALESCE(SUM(cpu_millis), 0) AS cpu
         FROM reservations WHERE project_id IN (SELECT id FROM sub) AND expires_at > ?`,
    ).get(projectId, this.#now()) as { n: number; mem: number; cpu: number };
  }
}

function toMillis(cores: number | undefined): number | null {
  return cores === undefined ? null : Math.round(cores * 1000);
}

function cleanQuota(q: Quota): Quota {
  const out: Quota = {};
  if (q.sandboxes !== undefined) out.sandboxes = q.sandboxes;
  if (q.memoryMb !== undefined) out.memoryMb = q.memoryMb;
  if (q.cpuCores !== undefined) out.cpuCores = Math.round(q.cpuCores * 1000) / 1000;
  return out;
}

function checkQuotaShape(q: Quota): void {
  for (const f of ['sandboxes', 'memoryMb'] as const) {
    const v = q[f];
    if (v !== undefined && !(Number.isSafeInteger(v) && v >= 0)) {
      throw new DsecError('invalid_argument', `quota.${f} must be an integer ≥ 0`, {
        field: `quota.${f}`,
      });
    }
  }
  const c = q.cpuCores;
  if (c !== undefined && !(Number.isFinite(c) && c >= 0 && c <= 1e9)) {
    throw new DsecError('invalid_argument', 'quota.cpuCores must be ≥ 0', {
      field: 'quota.cpuCores',
    });
  }
}

function toProject(r: ProjectRow): Project {
  const quota: Quota = {};
  if (r.quota_sandboxes !== null) quota.sandboxes = r.quota_sandboxes;
  if (r.quota_memory_mb !== null) quota.memoryMb = r.quota_memory_mb;
  if (r.quota_cpu_millis !== null) quota.cpuCores = r.quota_cpu_millis / 1000;
  return { id: r.id, name: r.name, parentId: r.parent_id, quota, createdAt: r.created_at };
}
