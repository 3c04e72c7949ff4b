import { DsecError, randomId } from '@dsec/core';
import { AuthFailureLimiter } from './auth-failure-limiter.js';
import { isUniqueViolation, lockSuffix } from './db/sql.js';
import { DenialAggregator } from './denial-log.js';
import type { Denial, DenialGroup } from './denial-log.js';
import type { SqlDb, SqlQuery } from './db/sql.js';
import { API_KEY_PATTERN, hashApiKey, newApiKey } from './keys.js';
import { checkScopes, mayRevokeScopes, scopesCover, ungrantableScopes } from './scopes.js';
import { ROLE_RANK } from './types.js';
import type {
  ApiKeyInfo,
  AuditEntry,
  AuditOutcome,
  CreatedKey,
  FnCallRateLimit,
  Principal,
  Project,
  Quota,
  RequestClaim,
  Resources,
  Role,
  Usage,
  VolumeRecord,
} from './types.js';

export interface IamOptions {
  /** Clock, for tests. */
  now?: () => number;
  /**
   * How long a reservation or idempotency claim that was never bound to a
   * created sandbox keeps holding quota (an apiserver that died mid-create).
   * Default 600 000.
   */
  pendingTtlMs?: number;
  /** Extra time a bound reservation outlives its sandbox's expiry. Default 60 000. */
  expiryGraceMs?: number;
  /**
   * How long `authenticate` trusts a key it has already looked up, without
   * asking the database again. A key revoked through this instance is
   * refused at once; one revoked through another instance (another
   * apiserver) is refused here at most this long after. 0 looks every key
   * up on every call. Default 1000.
   */
  authCacheTtlMs?: number;
  /**
   * Keys the authentication cache, and the memory of keys that authenticated
   * (they pass a rate-limited address), hold at most; past it the least
   * recently authenticated goes, never all at once. Default 10 000.
   */
  authCacheMaxEntries?: number;
  /**
   * Failed authentications a source (client address) may have in a row
   * before it is refused with `rate_limited`; they come back at
   * `authFailuresPerSecond`. Default 30.
   */
  authFailureBurst?: number;
  /** Rate at which a source's failed authentications are allowed again. Default 1. */
  authFailuresPerSecond?: number;
  /** How long audit rows are kept; older ones are deleted in the background. Default 90 days. */
  auditRetentionMs?: number;
  /**
   * How long a create's idempotency record (`requestId` → sandbox) is kept:
   * a retry within it is answered with the same sandbox, one after it
   * creates anew. Older records are deleted in the background, so the table
   * holds at most the creates of this period. Default 7 days.
   */
  idempotencyRetentionMs?: number;
  /**
   * How often aggregated denials of the minutes that have ended are written
   * (one transaction each time). Default 5000.
   */
  auditFlushIntervalMs?: number;
  /** Denial groups (actor, action, target, reason) kept per minute before the overflow group. Default 100. */
  auditDenialGroupsPerMinute?: number;
}

/** What `Iam.authStats` reports: counters since this instance started. */
export interface AuthStats {
  /** Failed authentications by reason: `missing`, `malformed`, `unknown`, `revoked`, `rate_limited`. */
  failures: Record<string, number>;
  /** Denied requests of authenticated callers, by audited action (`sandbox.access`, `key.create`…). */
  denials: Record<string, number>;
  /** Aggregated denial rows written to the audit table. */
  auditRowsWritten: number;
  /** Denial groups waiting to be written. */
  auditGroupsPending: number;
  /** Denial groups dropped because the database refused them twice (it was down). */
  auditGroupsDropped: number;
}

export const PROJECT_NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/;

interface ProjectRow {
  id: string;
  name: string;
  parent_id: string | null;
  quota_sandboxes: number | null;
  quota_memory_mb: number | null;
  quota_cpu_millis: number | null;
  quota_fncalls_per_second: number | null;
  quota_image_bytes: number | null;
  quota_volume_bytes: number | null;
  created_at: string;
}

interface KeyRow {
  id: string;
  project_id: string;
  role: Role;
  name: string;
  created_at: string;
  revoked_at: string | null;
  /** JSON array; NULL for an unscoped key. */
  scopes: string | null;
}

type AuditArgs = [string | null, string, string, AuditOutcome, Record<string, unknown> | undefined];
type Deny = (...args: AuditArgs) => void;

// `CAST`: PostgreSQL must know the type of the recursive term's parameter.
const SUBTREE_CTE = `WITH RECURSIVE sub(id) AS (
  SELECT CAST(? AS TEXT) UNION ALL SELECT p.id FROM projects p JOIN sub ON p.parent_id = sub.id)`;
const ANCESTORS_CTE = `WITH RECURSIVE anc(id, parent_id, depth) AS (
  SELECT id, parent_id, 0 FROM projects WHERE id = ?
  UNION ALL SELECT p.id, p.parent_id, anc.depth + 1 FROM projects p JOIN anc ON p.id = anc.parent_id)`;
const PROJECT_COLUMNS =
  'p.id, p.name, p.parent_id, p.quota_sandboxes, p.quota_memory_mb, p.quota_cpu_millis, p.quota_fncalls_per_second, p.quota_image_bytes, p.quota_volume_bytes, p.created_at';
const HAS_QUOTA =
  '(p.quota_sandboxes IS NOT NULL OR p.quota_memory_mb IS NOT NULL OR p.quota_cpu_millis IS NOT NULL)';

/** Quota fields a child may not set above its parent's effective limit. */
const QUOTA_FIELDS = [
  'sandboxes',
  'memoryMb',
  'cpuCores',
  'fncallsPerSecond',
  'imageBytes',
  'volumeBytes',
] as const;

/**
 * Projects in a lineage at most, the root's included (a project has at most
 * 15 ancestors). A create's layer view is its lineage, resolving a name
 * costs a store read per project in it (a GET each on S3), and quota walks
 * and cached chains grow with it; an edge takes views of 64 at most.
 */
export const MAX_PROJECT_DEPTH = 16;
/**
 * Live (unrevoked) keys one project holds, and child projects one project has, at most: any
 * member can mint keys and any tenant admin projects, and each is a row on every authentication
 * path's table (SECURITY.md J38). Past it: `quota_exceeded`, naming the limit.
 */
export const MAX_KEYS_PER_PROJECT = 1000;
export const MAX_CHILD_PROJECTS = 1000;

/** Keys and ancestor chains held in memory at most; past it the cache starts over. */
const CACHE_MAX_ENTRIES = 10_000;
/** Expired reservations are deleted at most this often (reads ignore them anyway). */
const SWEEP_INTERVAL_MS = 10_000;
/** Keys that authenticated within this long pass a rate-limited source (they are not guesses). */
const KNOWN_KEY_TTL_MS = 3_600_000;
/** Audit rows deleted per statement, and statements per background sweep. */
const AUDIT_SWEEP_BATCH_ROWS = 1000;
const AUDIT_SWEEP_BATCHES = 5;
/** A background sweep that found nothing more to delete waits this long for the next one. */
const AUDIT_SWEEP_IDLE_MS = 600_000;
const DAY_MS = 86_400_000;

/**
 * Durable identity and quota state: nested projects, API keys, quota
 * reservations, idempotency records and the audit log, over a control
 * database (`openControlDb`: SQLite by default, PostgreSQL for a cluster).
 * Every method is async; the logic is written once over the `SqlDb` seam.
 *
 * Lifecycle:
 *   `openControlDb(location)` → `iam.bootstrap()` once (root project + first
 *   admin key) → `authenticate` / `canAccess` per request → `reserve` →
 *   `bindReservation` (sandbox created) or `release` (create failed) →
 *   `release` (sandbox deleted) → `ControlDb.close()`.
 *
 * Concurrency: several instances (several apiservers, each with its own
 * connections) may share one database. Every check-then-write runs in one
 * transaction that first takes the locks its check depends on: on SQLite the
 * database's write lock (`BEGIN IMMEDIATE`); on PostgreSQL the rows of every
 * ancestor project that has a quota, root first (a consistent order, so two
 * reservations never deadlock), before usage is summed. Parallel
 * reservations therefore never overrun a quota, on either database.
 *
 * Caches (per instance): `authenticate` keeps a key it found for
 * `authCacheTtlMs` (default 1 s), so a loaded apiserver does not query the
 * database per request; revocation is immediate on the revoking instance and
 * reaches the others within that TTL (docs/adr/0011-control-plane-store.md).
 * Ancestor chains are cached without expiry: a project's parent never
 * changes and projects are never deleted, so a chain, once read, stays true.
 *
 * Authorisation rules (paper 3.2): a key acts on its project and every
 * descendant; it may grant only roles at or below its own and only rights it
 * holds (`ungrantableScopes`: no key mints an additive scope it lacks); only
 * admins create projects, and a child's quota never exceeds its parent's
 * effective quota.
 * Every mutation and every denial is written to the audit log. Raw keys are
 * never stored or logged; only their SHA-256.
 */
export class Iam {
  readonly #db: SqlDb;
  readonly #now: () => number;
  readonly #pendingTtlMs: number;
  readonly #expiryGraceMs: number;
  readonly #authCacheTtlMs: number;
  readonly #authCacheMaxEntries: number;
  /** Key hash → principal and until when it may be served from memory. */
  readonly #keys = new Map<string, { principal: Principal; untilMs: number }>();
  /** Key hash → until when it counts as a key that authenticated (it passes a limited source). */
  readonly #knownKeys = new Map<string, number>();
  readonly #failures: AuthFailureLimiter;
  readonly #denials: DenialAggregator;
  readonly #auditRetentionMs: number;
  readonly #idempotencyRetentionMs: number;
  readonly #auditFlushIntervalMs: number;
  #auditTimer: NodeJS.Timeout | undefined;
  /** The flush (or sweep) in progress: flushes run one after another. */
  #auditWork: Promise<unknown> = Promise.resolve();
  /** Groups a failed write handed back, tried once more at the next flush. */
  #unwritten: DenialGroup[] = [];
  #nextAuditSweepMs = 0;
  #closed = false;
  readonly #stats = {
    failures: {} as Record<string, number>,
    denials: {} as Record<string, number>,
    auditRowsWritten: 0,
    auditGroupsDropped: 0,
  };
  /** Project → its ancestors and itself. */
  readonly #ancestors = new Map<string, ReadonlySet<string>>();
  /** Project → its ancestors and itself, root first. */
  readonly #lineages = new Map<string, readonly string[]>();
  #lastSweepMs = 0;

  /** @internal Use `openControlDb`, which migrates the database first. */
  constructor(db: SqlDb, options: IamOptions = {}) {
    this.#db = db;
    this.#now = options.now ?? Date.now;
    this.#pendingTtlMs = options.pendingTtlMs ?? 10 * 60_000;
    this.#expiryGraceMs = options.expiryGraceMs ?? 60_000;
    this.#authCacheTtlMs = options.authCacheTtlMs ?? 1000;
    this.#authCacheMaxEntries = Math.max(1, options.authCacheMaxEntries ?? CACHE_MAX_ENTRIES);
    this.#failures = new AuthFailureLimiter({
      burst: options.authFailureBurst ?? 30,
      perSecond: options.authFailuresPerSecond ?? 1,
    });
    this.#denials = new DenialAggregator({
      groupsPerMinute: options.auditDenialGroupsPerMinute ?? 100,
    });
    this.#auditRetentionMs = options.auditRetentionMs ?? 90 * DAY_MS;
    this.#idempotencyRetentionMs = options.idempotencyRetentionMs ?? 7 * DAY_MS;
    this.#auditFlushIntervalMs = options.auditFlushIntervalMs ?? 5000;
    this.#startAuditTimer();
  }

  // ---- bootstrap & authentication -------------------------------------------------

  /**
   * Creates the root project and an admin key when the database has no
   * project yet. The raw key is returned only then, once; later calls (and
   * every instance but one, when several bootstrap at once) return
   * `{ created: false }` with the root project's ID.
   */
  async bootstrap(): Promise<{
    created: boolean;
    projectId: string;
    keyId?: string;
    key?: string;
  }> {
    try {
      return await this.#tx(async (q) => {
        const root = await this.#root(q);
        if (root) return { created: false, projectId: root };
        const projectId = randomId('prj');
        const at = this.#iso();
        await q.run(
          'INSERT INTO projects (id, name, parent_id, created_at) VALUES (?, ?, NULL, ?)',
          [projectId, 'root', at],
        );
        const { id, key } = await this.#insertKey(q, projectId, 'admin', 'bootstrap', null);
        await this.#writeAudit(q, null, 'project.create', projectId, 'ok', { name: 'root' });
        await this.#writeAudit(q, null, 'key.create', id, 'ok', { projectId, role: 'admin' });
        return { created: true, projectId, keyId: id, key };
      });
    } catch (err) {
      // Another instance created the root between our check and our insert.
      if (!isUniqueViolation(err)) throw err;
      const root = await this.#root(this.#db);
      if (!root) throw err;
      return { created: false, projectId: root };
    }
  }

  /**
   * Throws `unauthenticated` for a missing, malformed, unknown or revoked key.
   * Served from memory for up to `authCacheTtlMs` after a lookup.
   *
   * `source` names the caller's address (`addressKey` of @dsec/core): its
   * failures are limited (`authFailureBurst`, `authFailuresPerSecond`) and,
   * past the limit, any key it sends that has not authenticated within the
   * last hour is refused with `rate_limited` (`details.retryAfterMs`) before
   * it is looked up. Every failure is counted (`authStats`) and audited
   * aggregated per source, reason and minute (never one write per request).
   * Without a `source` (an in-process caller) nothing is limited.
   */
  async authenticate(
    rawKey: string | undefined,
    options: { source?: string | undefined } = {},
  ): Promise<Principal> {
    const { source } = options;
    const wellFormed = typeof rawKey === 'string' && API_KEY_PATTERN.test(rawKey);
    const hash = wellFormed ? hashApiKey(rawKey) : undefined;
    const now = this.#now();
    const cached = hash === undefined ? undefined : this.#keys.get(hash);
    if (cached && cached.untilMs > now) return { ...cached.principal };
    if (source !== undefined && !(hash !== undefined && (this.#knownKeys.get(hash) ?? 0) > now)) {
      const waitMs = this.#failures.waitMs(source, now);
      if (waitMs > 0) {
        this.#authDenied(source, 'rate_limited', null, false);
        throw new DsecError(
          'rate_limited',
          'too many failed authentications from this address; wait before trying again',
          { details: { retryAfterMs: Number.isFinite(waitMs) ? waitMs : 60_000 } },
        );
      }
    }
    if (hash === undefined) {
      this.#authDenied(source, rawKey ? 'malformed' : 'missing');
      throw new DsecError('unauthenticated', 'missing or malformed API key');
    }
    const row = await this.#db.get<
      Pick<KeyRow, 'id' | 'project_id' | 'role' | 'revoked_at' | 'scopes'>
    >('SELECT id, project_id, role, revoked_at, scopes FROM api_keys WHERE hash = ?', [hash]);
    if (!row) {
      this.#keys.delete(hash);
      this.#knownKeys.delete(hash);
      this.#authDenied(source, 'unknown');
      throw new DsecError('unauthenticated', 'unknown API key');
    }
    if (row.revoked_at !== null) {
      this.#keys.delete(hash);
      this.#knownKeys.delete(hash);
      this.#authDenied(source, 'revoked', row.id);
      throw new DsecError('unauthenticated', 'API key revoked');
    }
    const principal: Principal = { keyId: row.id, projectId: row.project_id, role: row.role };
    const scopes = parseScopes(row.scopes);
    if (scopes) principal.scopes = Object.freeze(scopes);
    // Least recently authenticated first (Map order): one tenant's many keys push out the
    // oldest entries only, where clearing the lot made every other key a stranger again.
    const max = this.#authCacheMaxEntries;
    if (this.#authCacheTtlMs > 0) {
      setNewest(this.#keys, hash, { principal, untilMs: now + this.#authCacheTtlMs }, max);
    }
    setNewest(this.#knownKeys, hash, now + KNOWN_KEY_TTL_MS, max);
    return { ...principal };
  }

  /** Counters of failed authentications and denials since this instance started. */
  authStats(): AuthStats {
    return {
      failures: { ...this.#stats.failures },
      denials: { ...this.#stats.denials },
      auditRowsWritten: this.#stats.auditRowsWritten,
      auditGroupsPending: this.#denials.pending + this.#unwritten.length,
      auditGroupsDropped: this.#stats.auditGroupsDropped,
    };
  }

  /** True when the principal's project is `projectId` or one of its ancestors. */
  canAccess(principal: Principal, projectId: string): Promise<boolean> {
    return this.isAncestorOrSelf(principal.projectId, projectId);
  }

  async isAncestorOrSelf(ancestorId: string, projectId: string): Promise<boolean> {
    return (await this.#chain(this.#db, projectId))?.has(ancestorId) ?? false;
  }

  // ---- projects -------------------------------------------------------------------

  /**
   * Creates a child of `parentId` (default: the caller's project). Only an
   * admin key of the parent or an ancestor may; a missing or foreign parent is
   * `not_found`. Each quota field must be ≤ the parent's effective limit (the
   * tightest over its ancestors) — else `permission_denied` naming the field.
   * A duplicate name under the same parent is `conflict`.
   */
  async createProject(
    caller: Principal,
    input: { name: string; parentId?: string | undefined; quota?: Quota | undefined },
  ): Promise<Project> {
    const parentId = input.parentId ?? caller.projectId;
    const quota = input.quota ?? {};
    const conflict = () =>
      new DsecError('conflict', `project ${input.name} already exists here`, { field: 'name' });
    try {
      return await this.#tx(async (q, deny) => {
        const chain = await this.#chain(q, parentId);
        if (!chain?.has(caller.projectId)) {
          deny(caller.keyId, 'project.create', parentId, 'denied', { reason: 'parent not found' });
          throw new DsecError('not_found', `no project ${JSON.stringify(parentId)}`, {
            field: 'parentId',
          });
        }
        if (chain.size >= MAX_PROJECT_DEPTH) {
          throw new DsecError(
            'invalid_argument',
            `projects nest ${MAX_PROJECT_DEPTH} deep at most (the root included)`,
            { field: 'parentId', details: { maxDepth: MAX_PROJECT_DEPTH } },
          );
        }
        if (caller.role !== 'admin') {
          deny(caller.keyId, 'project.create', parentId, 'denied', { reason: 'not admin' });
          throw new DsecError('permission_denied', 'only admin keys create projects');
        }
        if (!PROJECT_NAME_PATTERN.test(input.name)) {
          throw new DsecError(
            'invalid_argument',
            'name must match [A-Za-z0-9][A-Za-z0-9._-]{0,62}',
            { field: 'name' },
          );
        }
        checkQuotaShape(quota);
        const limits = await this.#effectiveQuota(q, parentId);
        for (const field of QUOTA_FIELDS) {
          const want = quota[field];
          const limit = limits[field];
          if (want !== undefined && limit !== undefined && want > limit) {
            deny(caller.keyId, 'project.create', parentId, 'denied', {
              reason: 'quota above parent',
              field,
            });
            throw new DsecError(
              'permission_denied',
              `quota.${field} ${want} exceeds the parent's limit ${limit}`,
              { field: `quota.${field}`, details: { limit, requested: want } },
            );
          }
        }
        const exists = await q.get('SELECT 1 AS x FROM projects WHERE parent_id = ? AND name = ?', [
          parentId,
          input.name,
        ]);
        if (exists) throw conflict();
        const children = await q.get<{ n: number }>(
          'SELECT COUNT(*) AS n FROM projects WHERE parent_id = ?',
          [parentId],
        );
        if (Number(children?.n ?? 0) >= MAX_CHILD_PROJECTS) {
          deny(caller.keyId, 'project.create', parentId, 'denied', { reason: 'too many projects' });
          throw new DsecError(
            'quota_exceeded',
            `a project has ${MAX_CHILD_PROJECTS} child projects at most; remove one first`,
            { field: 'parentId', details: { limit: 'projects', max: MAX_CHILD_PROJECTS } },
          );
        }
        const id = randomId('prj');
        const at = this.#iso();
        await q.run(
          `INSERT INTO projects (id, name, parent_id, quota_sandboxes, quota_memory_mb, quota_cpu_millis,
             quota_fncalls_per_second, quota_image_bytes, quota_volume_bytes, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
          [
            id,
            input.name,
            parentId,
            quota.sandboxes ?? null,
            quota.memoryMb ?? null,
            toMillis(quota.cpuCores),
            quota.fncallsPerSecond ?? null,
            quota.imageBytes ?? null,
            quota.volumeBytes ?? null,
            at,
          ],
        );
        await this.#writeAudit(q, caller.keyId, 'project.create', id, 'ok', {
          parentId,
          name: input.name,
          quota,
        });
        return { id, name: input.name, parentId, quota: cleanQuota(quota), createdAt: at };
      });
    } catch (err) {
      // The same name created by another instance between our check and our insert.
      if (isUniqueViolation(err)) throw conflict();
      throw err;
    }
  }

  /** A project the caller may see; `not_found` otherwise. */
  async getProject(caller: Principal, projectId: string): Promise<Project> {
    const row = await this.#projectRow(this.#db, projectId);
    if (!row || !(await this.canAccess(caller, projectId))) {
      throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
    }
    return toProject(row);
  }

  /** The caller's project and all its descendants, in creation order. */
  async listProjects(caller: Principal): Promise<Project[]> {
    const order = this.#db.dialect === 'sqlite' ? 'p.rowid' : 'p.seq';
    const rows = await this.#db.all<ProjectRow>(
      `${SUBTREE_CTE} SELECT ${PROJECT_COLUMNS} FROM projects p JOIN sub ON p.id = sub.id ORDER BY ${order}`,
      [caller.projectId],
    );
    return rows.map(toProject);
  }

  /**
   * `projectId` and its ancestors, root first: the projects whose layers a
   * sandbox of `projectId` may stack besides the platform's (`LayerView`,
   * docs/adr/0019-layer-ownership.md). Empty for an unknown project.
   */
  async lineage(projectId: string): Promise<string[]> {
    const cached = this.#lineages.get(projectId);
    if (cached) return [...cached];
    const rows = await this.#db.all<{ id: string }>(
      `${ANCESTORS_CTE} SELECT id FROM anc ORDER BY depth DESC`,
      [projectId],
    );
    const ids = rows.map((r) => r.id);
    // Projects are never deleted and never move, so a lineage once read stays true.
    if (ids.length > 0) {
      if (this.#lineages.size >= CACHE_MAX_ENTRIES) this.#lineages.clear();
      this.#lineages.set(projectId, Object.freeze(ids));
    }
    return ids;
  }

  /** IDs of `projectId` and every descendant. */
  async subtreeIds(projectId: string): Promise<string[]> {
    const rows = await this.#db.all<{ id: string }>(`${SUBTREE_CTE} SELECT id FROM sub`, [
      projectId,
    ]);
    return rows.map((r) => r.id);
  }

  // ---- keys -----------------------------------------------------------------------

  /**
   * Creates a key for `projectId` (the caller's project or a descendant) with
   * a role at or below the caller's, and with `scopes` (`scopes.ts`; absent:
   * unscoped) whose rights the caller holds (`ungrantableScopes`): restrictive
   * scopes its own cover, additive ones (`metrics:read`) only if it carries
   * them or is an admin key of the root project; a scoped caller never mints
   * an unscoped key. Foreign or unknown projects are `not_found`; a higher
   * role or a right not held is `permission_denied` (field `role` or
   * `scopes`, details `scopes` listing what it may not grant), audited;
   * malformed scopes, or a run pattern with too many wildcards, are
   * `invalid_argument` naming the entry.
   */
  async createKey(
    caller: Principal,
    input: {
      projectId: string;
      role?: Role | undefined;
      name?: string | undefined;
      scopes?: readonly string[] | undefined;
    },
  ): Promise<CreatedKey> {
    const role = input.role ?? 'member';
    if (!Object.hasOwn(ROLE_RANK, role)) {
      throw new DsecError('invalid_argument', 'role must be admin or member', { field: 'role' });
    }
    const scopes = input.scopes === undefined ? undefined : checkScopes(input.scopes);
    return this.#tx(async (q, deny) => {
      await this.#requireLive(q, deny, caller, 'key.create');
      if (!(await this.#chain(q, input.projectId))?.has(caller.projectId)) {
        deny(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'project not found',
        });
        throw new DsecError('not_found', `no project ${JSON.stringify(input.projectId)}`, {
          field: 'projectId',
        });
      }
      if (ROLE_RANK[role] > ROLE_RANK[caller.role]) {
        deny(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'role above own',
          role,
        });
        throw new DsecError('permission_denied', `a ${caller.role} key cannot grant ${role}`, {
          field: 'role',
        });
      }
      if (scopes === undefined && !scopesCover(caller.scopes, undefined)) {
        deny(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'unscoped from scoped',
          scopes: null,
        });
        throw new DsecError('permission_denied', 'a scoped key can only create scoped keys', {
          field: 'scopes',
        });
      }
      const rootAdmin = caller.role === 'admin' && (await this.#isRoot(q, caller.projectId));
      const beyond = ungrantableScopes({ scopes: caller.scopes, rootAdmin }, scopes ?? []);
      if (beyond.length > 0) {
        deny(caller.keyId, 'key.create', input.projectId, 'denied', {
          reason: 'scopes beyond own',
          scopes: scopes ?? null,
          ungrantable: beyond,
        });
        throw new DsecError(
          'permission_denied',
          `a key can only grant rights it holds: not ${beyond.map((b) => JSON.stringify(b)).join(', ')}`,
          { field: 'scopes', details: { scopes: beyond } },
        );
      }
      const live = await q.get<{ n: number }>(
        'SELECT COUNT(*) AS n FROM api_keys WHERE project_id = ? AND revoked_at IS NULL',
        [input.projectId],
      );
      if (Number(live?.n ?? 0) >= MAX_KEYS_PER_PROJECT) {
        deny(caller.keyId, 'key.create', input.projectId, 'denied', { reason: 'too many keys' });
        throw new DsecError(
          'quota_exceeded',
          `a project holds ${MAX_KEYS_PER_PROJECT} live keys at most; revoke one first`,
          { field: 'projectId', details: { limit: 'keys', max: MAX_KEYS_PER_PROJECT } },
        );
      }
      const { id, key } = await this.#insertKey(
        q,
        input.projectId,
        role,
        input.name ?? '',
        caller.keyId,
        scopes,
      );
      await this.#writeAudit(q, caller.keyId, 'key.create', id, 'ok', {
        projectId: input.projectId,
        role,
        ...(scopes ? { scopes } : {}),
      });
      return { id, key, projectId: input.projectId, role, ...(scopes ? { scopes } : {}) };
    });
  }

  /**
   * Revokes a key in the caller's subtree whose role is at or below the
   * caller's and, for a scoped caller, whose scopes it could have granted
   * (`mayRevokeScopes`: restrictive ones its own cover, additive ones it
   * holds; a key may always revoke itself): else
   * `permission_denied`, audited. Unknown or foreign keys are `not_found`. Revoking twice is a
   * no-op. This instance refuses the key from now on; other instances within
   * their `authCacheTtlMs`.
   */
  async revokeKey(caller: Principal, keyId: string): Promise<void> {
    await this.#tx(async (q, deny) => {
      await this.#requireLive(q, deny, caller, 'key.revoke');
      const row = await q.get<KeyRow>(
        'SELECT id, project_id, role, name, created_at, revoked_at, scopes FROM api_keys WHERE id = ?',
        [keyId],
      );
      if (!row || !(await this.#chain(q, row.project_id))?.has(caller.projectId)) {
        deny(caller.keyId, 'key.revoke', keyId, 'denied', { reason: 'not found' });
        throw new DsecError('not_found', `no key ${JSON.stringify(keyId)}`);
      }
      if (ROLE_RANK[row.role] > ROLE_RANK[caller.role]) {
        deny(caller.keyId, 'key.revoke', keyId, 'denied', { reason: 'role above own' });
        throw new DsecError(
          'permission_denied',
          `a ${caller.role} key cannot revoke an ${row.role} key`,
        );
      }
      const rootAdmin =
        caller.scopes !== undefined &&
        caller.role === 'admin' &&
        (await this.#isRoot(q, caller.projectId));
      if (
        row.id !== caller.keyId &&
        !mayRevokeScopes({ scopes: caller.scopes, rootAdmin }, parseScopes(row.scopes))
      ) {
        deny(caller.keyId, 'key.revoke', keyId, 'denied', { reason: 'scopes beyond own' });
        throw new DsecError(
          'permission_denied',
          'a scoped key can only revoke keys whose scopes its own cover',
        );
      }
      if (row.revoked_at === null) {
        await q.run('UPDATE api_keys SET revoked_at = ? WHERE id = ?', [this.#iso(), keyId]);
      }
      await this.#writeAudit(q, caller.keyId, 'key.revoke', keyId, 'ok');
    });
    for (const [hash, entry] of this.#keys) {
      if (entry.principal.keyId === keyId) {
        this.#keys.delete(hash);
        this.#knownKeys.delete(hash);
      }
    }
  }

  /** Keys of the caller's subtree (never their secrets). */
  async listKeys(caller: Principal): Promise<ApiKeyInfo[]> {
    const rows = await this.#db.all<KeyRow>(
      `${SUBTREE_CTE} SELECT k.id, k.project_id, k.role, k.name, k.created_at, k.revoked_at, k.scopes
         FROM api_keys k JOIN sub ON k.project_id = sub.id ORDER BY k.created_at, k.id`,
      [caller.projectId],
    );
    return rows.map((r) => {
      const scopes = parseScopes(r.scopes);
      return {
        id: r.id,
        projectId: r.project_id,
        role: r.role,
        name: r.name,
        createdAt: r.created_at,
        revokedAt: r.revoked_at,
        ...(scopes ? { scopes } : {}),
      };
    });
  }

  // ---- call rate ------------------------------------------------------------------

  /**
   * The calls-per-second limits that apply to calls made in `projectId`: the
   * project's own and every ancestor's that has one, nearest first (a call
   * counts against each, as a sandbox counts against every ancestor's
   * quota). Empty for an unlimited chain; `not_found` for an unknown project.
   * `FnCallRateLimiter` reads this and keeps the buckets.
   */
  async fncallRateLimits(projectId: string): Promise<FnCallRateLimit[]> {
    const rows = await this.#db.all<ProjectRow & { depth: number }>(
      `${ANCESTORS_CTE} SELECT ${PROJECT_COLUMNS}, anc.depth AS depth FROM anc JOIN projects p ON p.id = anc.id
         ORDER BY anc.depth`,
      [projectId],
    );
    if (rows.length === 0)
      throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
    return rows
      .filter((r) => r.quota_fncalls_per_second !== null)
      .map((r) => ({
        projectId: r.id,
        name: r.name,
        perSecond: Number(r.quota_fncalls_per_second),
      }));
  }

  // ---- quota reservations ---------------------------------------------------------

  /**
   * Reserves one sandbox's resources against `projectId` and every ancestor
   * (usage summed over each one's subtree), in one transaction that holds
   * the locks of every limiting ancestor while it sums and inserts.
   * `holderId` names the reservation (a sandbox ID, or a temporary ID later
   * bound with `bindReservation`). Until bound, the reservation lapses after
   * `pendingTtlMs`. Throws `quota_exceeded` naming the limiting project and
   * resource (the nearest one when several are full); `not_found` for an
   * unknown project; `conflict` if `holderId` is taken.
   */
  async reserve(
    projectId: string,
    resources: Resources,
    holderId: string,
    options: { actorKeyId?: string } = {},
  ): Promise<void> {
    const memoryMb = Math.ceil(resources.memoryMb);
    const cpuMillis = Math.ceil(resources.cpuCores * 1000);
    if (!(memoryMb >= 0 && cpuMillis >= 0))
      throw new DsecError('invalid_argument', 'resources must be ≥ 0');
    await this.#sweep();
    const taken = () => new DsecError('conflict', `reservation ${holderId} exists`);
    try {
      await this.#tx(async (q, deny) => {
        const now = this.#now();
        if (!(await q.get('SELECT 1 AS x FROM projects WHERE id = ?', [projectId])))
          throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
        // Root first, so that every reservation locks shared ancestors in the same order.
        const limited = await q.all<ProjectRow>(
          `${ANCESTORS_CTE} SELECT ${PROJECT_COLUMNS} FROM anc JOIN projects p ON p.id = anc.id
             WHERE ${HAS_QUOTA} ORDER BY anc.depth DESC${lockSuffix(q, 'p')}`,
          [projectId],
        );
        for (const p of limited.reverse()) {
          const used = await this.#usageRaw(q, p.id, now);
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
              deny(options.actorKeyId ?? null, 'quota.reserve', projectId, 'denied', details);
              throw new DsecError(
                'quota_exceeded',
                `project ${p.name} would exceed its ${resource} quota`,
                { details },
              );
            }
          }
        }
        // A lapsed reservation of the same name no longer holds anything.
        await q.run('DELETE FROM reservations WHERE id = ? AND expires_at <= ?', [holderId, now]);
        if (await q.get('SELECT 1 AS x FROM reservations WHERE id = ?', [holderId])) throw taken();
        await q.run(
          'INSERT INTO reservations (id, project_id, memory_mb, cpu_millis, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)',
          [holderId, projectId, memoryMb, cpuMillis, now, now + this.#pendingTtlMs],
        );
      });
    } catch (err) {
      if (isUniqueViolation(err)) throw taken();
      throw err;
    }
  }

  /**
   * Turns a pending reservation into the sandbox's own: renames it to
   * `sandboxId`, keeps it until the sandbox expires (plus a grace period), and
   * records the idempotency result when a `requestId` was given. A pending
   * reservation that lapsed meanwhile is `conflict`.
   */
  async bindReservation(
    holderId: string,
    sandboxId: string,
    options: { expiresAt: string | number; requestId?: string | undefined; actorKeyId?: string },
  ): Promise<void> {
    const expires =
      (typeof options.expiresAt === 'number' ? options.expiresAt : Date.parse(options.expiresAt)) +
      this.#expiryGraceMs;
    await this.#tx(async (q) => {
      const now = this.#now();
      const row = await q.get<{ project_id: string }>(
        'SELECT project_id FROM reservations WHERE id = ? AND expires_at > ?',
        [holderId, now],
      );
      if (!row) throw new DsecError('conflict', `reservation ${holderId} lapsed`);
      await q.run('UPDATE reservations SET id = ?, expires_at = ? WHERE id = ?', [
        sandboxId,
        Number.isFinite(expires) ? expires : now + this.#pendingTtlMs,
        holderId,
      ]);
      if (options.requestId !== undefined) {
        await q.run(
          'UPDATE idempotency SET sandbox_id = ? WHERE project_id = ? AND request_id = ? AND holder = ?',
          [sandboxId, row.project_id, options.requestId, holderId],
        );
      }
      await this.#writeAudit(q, options.actorKeyId ?? null, 'sandbox.create', sandboxId, 'ok', {
        projectId: row.project_id,
      });
    });
  }

  /**
   * Moves a live reservation's expiry to `expiresAt` (plus the grace period),
   * later or earlier: a sandbox whose TTL was changed, or that was paused,
   * holds its quota exactly as long as it may live. A reservation that has
   * lapsed stays lapsed (reviving it could overrun a quota that was given to
   * someone else meanwhile). Returns whether one was moved.
   */
  async setReservationExpiry(id: string, expiresAt: string | number): Promise<boolean> {
    const at = typeof expiresAt === 'number' ? expiresAt : Date.parse(expiresAt);
    if (!Number.isFinite(at)) throw new DsecError('invalid_argument', 'expiresAt is not a time');
    const r = await this.#db.run(
      'UPDATE reservations SET expires_at = ? WHERE id = ? AND expires_at > ?',
      [at + this.#expiryGraceMs, id, this.#now()],
    );
    return r.changes > 0;
  }

  /** Frees a reservation (by sandbox or holder ID). Returns whether one existed. */
  async release(
    id: string,
    options: { actorKeyId?: string; action?: string } = {},
  ): Promise<boolean> {
    return this.#tx(async (q) => {
      const r = await q.run('DELETE FROM reservations WHERE id = ?', [id]);
      if (options.action)
        await this.#writeAudit(q, options.actorKeyId ?? null, options.action, id, 'ok');
      return r.changes > 0;
    });
  }

  /** The project a live reservation is charged to, if any. */
  async reservationProject(id: string): Promise<string | undefined> {
    const row = await this.#db.get<{ project_id: string }>(
      'SELECT project_id FROM reservations WHERE id = ? AND expires_at > ?',
      [id, this.#now()],
    );
    return row?.project_id;
  }

  /** Live usage summed over the project's subtree. */
  async usage(projectId: string): Promise<Usage> {
    const now = this.#now();
    const u = await this.#usageRaw(this.#db, projectId, now);
    const imageBytes = await this.#imageBytesUsed(this.#db, projectId, now);
    const volumeBytes = await this.#volumeBytesUsed(this.#db, projectId);
    return { sandboxes: u.n, memoryMb: u.mem, cpuCores: u.cpu / 1000, imageBytes, volumeBytes };
  }

  // ---- image bytes ----------------------------------------------------------------

  /**
   * Reserves image storage for a snapshot about to be taken in `projectId`:
   * `wantBytes` (the most the layer can weigh), or less when the tightest
   * `imageBytes` quota over the project and its ancestors has less room
   * left. Answers `maxBytes`, the bytes reserved, which the layer must not
   * exceed; undefined when no ancestor limits image bytes (nothing is
   * reserved then). With `wantBytes` undefined (a layer of unknown bound)
   * `maxBytes` is the room left but nothing is held: holding all of it for
   * the whole snapshot starved every other project under the same limit (a
   * sibling's, or all tenants' under a limit on the root), so such a layer
   * is checked only when `bindImageBytes` charges it. Pending until
   * `bindImageBytes`, it lapses after `pendingTtlMs`. `quota_exceeded`
   * (details `resource: 'imageBytes'`, the limiting project) when a limit has
   * no room left; `conflict` if `holderId` is taken.
   */
  async reserveImageBytes(
    projectId: string,
    holderId: string,
    wantBytes: number | undefined,
    options: { actorKeyId?: string } = {},
  ): Promise<{ maxBytes: number | undefined }> {
    if (wantBytes !== undefined && !(Number.isSafeInteger(wantBytes) && wantBytes >= 0))
      throw new DsecError('invalid_argument', 'wantBytes must be an integer ≥ 0');
    await this.#sweep();
    const taken = () => new DsecError('conflict', `reservation ${holderId} exists`);
    try {
      return await this.#tx(async (q, deny) => {
        const now = this.#now();
        const room = await this.#imageRoom(q, projectId, now, undefined);
        if (room === undefined) return { maxBytes: undefined };
        if (room.left <= 0) {
          const details = {
            projectId: room.project.id,
            resource: 'imageBytes',
            limit: room.project.quota_image_bytes,
            used: room.used,
            requested: wantBytes ?? 1,
          };
          deny(options.actorKeyId ?? null, 'quota.reserve', projectId, 'denied', details);
          throw new DsecError(
            'quota_exceeded',
            `project ${room.project.name} has no room left in its imageBytes quota`,
            { details },
          );
        }
        const bytes = Math.min(room.left, wantBytes ?? room.left);
        const held = wantBytes === undefined ? 0 : bytes;
        await q.run('DELETE FROM image_reservations WHERE id = ? AND expires_at <= ?', [
          holderId,
          now,
        ]);
        if (await q.get('SELECT 1 AS x FROM image_reservations WHERE id = ?', [holderId]))
          throw taken();
        await q.run(
          'INSERT INTO image_reservations (id, project_id, bytes, created_at, expires_at) VALUES (?, ?, ?, ?, ?)',
          [holderId, projectId, held, now, now + this.#pendingTtlMs],
        );
        return { maxBytes: bytes };
      });
    } catch (err) {
      if (isUniqueViolation(err)) throw taken();
      throw err;
    }
  }

  /**
   * Charges a finished layer: the pending reservation `holderId` becomes
   * `layerKey`'s (the layer's `formatLayerKey`), holding `bytes` until
   * `releaseImageBytes(layerKey)`. Bytes above what was reserved are checked
   * against every limiting ancestor first (`quota_exceeded` then, and the
   * caller deletes the layer). Without a live reservation (it lapsed, or the
   * chain has no limit) the bytes are charged as a new one, checked the same.
   */
  async bindImageBytes(
    holderId: string,
    projectId: string,
    layerKey: string,
    bytes: number,
    options: { actorKeyId?: string } = {},
  ): Promise<void> {
    if (!(Number.isSafeInteger(bytes) && bytes >= 0))
      throw new DsecError('invalid_argument', 'bytes must be an integer ≥ 0');
    await this.#tx(async (q, deny) => {
      const now = this.#now();
      const held = await q.get<{ bytes: number }>(
        'SELECT bytes FROM image_reservations WHERE id = ? AND (expires_at IS NULL OR expires_at > ?)',
        [holderId, now],
      );
      const reserved = held ? Number(held.bytes) : 0;
      if (bytes > reserved) {
        const room = await this.#imageRoom(q, projectId, now, holderId);
        if (room !== undefined && bytes > room.left) {
          const details = {
            projectId: room.project.id,
            resource: 'imageBytes',
            limit: room.project.quota_image_bytes,
            used: room.used,
            requested: bytes,
          };
          deny(options.actorKeyId ?? null, 'quota.reserve', projectId, 'denied', details);
          throw new DsecError(
            'quota_exceeded',
            `project ${room.project.name} would exceed its imageBytes quota`,
            { details },
          );
        }
      }
      // A record of the same key left by a layer removed outside the API holds nothing now.
      await q.run('DELETE FROM image_reservations WHERE id = ? OR id = ?', [layerKey, holderId]);
      await q.run(
        'INSERT INTO image_reservations (id, project_id, bytes, created_at, expires_at) VALUES (?, ?, ?, ?, NULL)',
        [layerKey, projectId, bytes, now],
      );
      await this.#writeAudit(q, options.actorKeyId ?? null, 'image.charge', layerKey, 'ok', {
        projectId,
        bytes,
      });
    });
  }

  /** Frees a pending image reservation or a layer's bytes (by holder or layer key). */
  async releaseImageBytes(
    id: string,
    options: { actorKeyId?: string; action?: string } = {},
  ): Promise<boolean> {
    return this.#tx(async (q) => {
      const r = await q.run('DELETE FROM image_reservations WHERE id = ?', [id]);
      if (options.action)
        await this.#writeAudit(q, options.actorKeyId ?? null, options.action, id, 'ok');
      return r.changes > 0;
    });
  }

  // ---- volumes (docs/volumes.md) ----------------------------------------------------

  /**
   * Records a volume of `projectId` on `edgeId` in state `creating`,
   * charging `sizeBytes` to the `volumeBytes` quota of the project and every
   * ancestor in the same transaction (rows of limiting ancestors locked):
   * `quota_exceeded` (details `resource: 'volumeBytes'`, the limiting
   * project) when one has no room; `conflict` when the project has a volume
   * of that name already; `not_found` for an unknown project.
   */
  async createVolume(
    input: { projectId: string; name: string; sizeBytes: number; edgeId: string },
    options: { actorKeyId?: string } = {},
  ): Promise<VolumeRecord> {
    const { projectId, name, sizeBytes, edgeId } = input;
    if (!(Number.isSafeInteger(sizeBytes) && sizeBytes > 0))
      throw new DsecError('invalid_argument', 'sizeBytes must be an integer > 0');
    const taken = () =>
      new DsecError('conflict', `volume ${name} exists in the project`, { field: 'name' });
    try {
      return await this.#tx(async (q, deny) => {
        if (!(await q.get('SELECT 1 AS x FROM projects WHERE id = ?', [projectId])))
          throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
        if (
          await q.get('SELECT 1 AS x FROM volumes WHERE project_id = ? AND name = ?', [
            projectId,
            name,
          ])
        )
          throw taken();
        const limited = await q.all<ProjectRow>(
          `${ANCESTORS_CTE} SELECT ${PROJECT_COLUMNS} FROM anc JOIN projects p ON p.id = anc.id
             WHERE p.quota_volume_bytes IS NOT NULL ORDER BY anc.depth DESC${lockSuffix(q, 'p')}`,
          [projectId],
        );
        for (const p of limited.reverse()) {
          const used = await this.#volumeBytesUsed(q, p.id);
          if (used + sizeBytes > Number(p.quota_volume_bytes)) {
            const details = {
              projectId: p.id,
              resource: 'volumeBytes',
              limit: Number(p.quota_volume_bytes),
              used,
              requested: sizeBytes,
            };
            deny(options.actorKeyId ?? null, 'quota.reserve', projectId, 'denied', details);
            throw new DsecError(
              'quota_exceeded',
              `project ${p.name} would exceed its volumeBytes quota`,
              { details },
            );
          }
        }
        const at = this.#iso();
        await q.run(
          'INSERT INTO volumes (project_id, name, size_bytes, edge_id, state, created_at) VALUES (?, ?, ?, ?, ?, ?)',
          [projectId, name, sizeBytes, edgeId, 'creating', at],
        );
        await this.#writeAudit(q, options.actorKeyId ?? null, 'volume.create', projectId, 'ok', {
          name,
          sizeBytes,
          edgeId,
        });
        return { projectId, name, sizeBytes, edgeId, state: 'creating' as const, createdAt: at };
      });
    } catch (err) {
      if (isUniqueViolation(err)) throw taken();
      throw err;
    }
  }

  /**
   * Marks a volume made by its edge. False when the record is gone (a delete
   * ran while the edge made it): the caller must then remove the edge's
   * volume, which no record and no quota would account for.
   */
  async markVolumeReady(
    projectId: string,
    name: string,
    made?: { edgeId: string; createdAt: string },
  ): Promise<boolean> {
    // With `made`: only the record that create made (a later create of the name, on
    // another edge, is another record, and this edge's volume is then unaccounted).
    const r = made
      ? await this.#db.run(
          "UPDATE volumes SET state = 'ready' WHERE project_id = ? AND name = ? AND edge_id = ? AND created_at = ? AND state = 'creating'",
          [projectId, name, made.edgeId, made.createdAt],
        )
      : await this.#db.run("UPDATE volumes SET state = 'ready' WHERE project_id = ? AND name = ?", [
          projectId,
          name,
        ]);
    return r.changes > 0;
  }

  /** The project's volume `name`; undefined when it has none. */
  async getVolume(projectId: string, name: string): Promise<VolumeRecord | undefined> {
    const r = await this.#db.get<VolumeRow>(
      'SELECT project_id, name, size_bytes, edge_id, state, created_at FROM volumes WHERE project_id = ? AND name = ?',
      [projectId, name],
    );
    return r && toVolume(r);
  }

  /** The project's own volumes (not its descendants': names are per project), by name. */
  async listVolumes(projectId: string): Promise<VolumeRecord[]> {
    const rows = await this.#db.all<VolumeRow>(
      'SELECT project_id, name, size_bytes, edge_id, state, created_at FROM volumes WHERE project_id = ? ORDER BY name',
      [projectId],
    );
    return rows.map(toVolume);
  }

  /** Forgets a volume (its bytes leave the quota); false when there was none. */
  async deleteVolume(
    projectId: string,
    name: string,
    options: { actorKeyId?: string } = {},
  ): Promise<boolean> {
    return this.#tx(async (q) => {
      const r = await q.run('DELETE FROM volumes WHERE project_id = ? AND name = ?', [
        projectId,
        name,
      ]);
      if (r.changes > 0)
        await this.#writeAudit(q, options.actorKeyId ?? null, 'volume.delete', projectId, 'ok', {
          name,
        });
      return r.changes > 0;
    });
  }

  async #volumeBytesUsed(q: SqlQuery, projectId: string): Promise<number> {
    const row = await q.get<{ bytes: number }>(
      `${SUBTREE_CTE} SELECT COALESCE(SUM(size_bytes), 0) AS bytes FROM volumes
         WHERE project_id IN (SELECT id FROM sub)`,
      [projectId],
    );
    return Number(row?.bytes ?? 0);
  }

  // ---- idempotency ----------------------------------------------------------------

  /**
   * Claims `(projectId, requestId)` for a create whose canonical request
   * hashes to `fingerprint` (see `requestFingerprint`). `claimed`: go ahead
   * and create; `done`: the create already happened, answer with
   * `sandboxId`; `pending`: another request is creating it now. A pending
   * claim older than `pendingTtlMs` (its creator died) is taken over.
   *
   * A request ID is bound to the first request that claimed it: the same ID
   * with a different fingerprint is `conflict` (details: `requestId`), in
   * every state, so a retry can never be answered with another request's
   * sandbox. Claims recorded before fingerprints existed bind nothing.
   */
  async claimRequest(
    projectId: string,
    requestId: string,
    holderId: string,
    fingerprint: string,
    options: { actorKeyId?: string } = {},
  ): Promise<RequestClaim> {
    return this.#tx(async (q, deny) => {
      const now = this.#now();
      // A claim deleted (abandoned) between our insert and our read: insert again.
      for (let attempt = 0; attempt < 3; attempt++) {
        // Insert first: of two instances claiming at once, exactly one inserts (the other
        // waits on the row, then finds it), where read-then-insert would let both claim.
        const inserted = await q.run(
          `INSERT INTO idempotency (project_id, request_id, holder, sandbox_id, created_at, fingerprint)
             VALUES (?, ?, ?, NULL, ?, ?) ON CONFLICT (project_id, request_id) DO NOTHING`,
          [projectId, requestId, holderId, now, fingerprint],
        );
        if (inserted.changes > 0) return { state: 'claimed' };
        const row = await q.get<{
          holder: string;
          sandbox_id: string | null;
          created_at: number;
          fingerprint: string | null;
        }>(
          `SELECT i.holder, i.sandbox_id, i.created_at, i.fingerprint FROM idempotency i
             WHERE i.project_id = ? AND i.request_id = ?${lockSuffix(q, 'i')}`,
          [projectId, requestId],
        );
        if (!row) continue;
        if (row.fingerprint !== null && row.fingerprint !== fingerprint) {
          deny(options.actorKeyId ?? null, 'request.claim', requestId, 'denied', {
            reason: 'requestId reused for a different request',
            projectId,
          });
          throw new DsecError(
            'conflict',
            'this requestId was already used for a different request; use a new requestId',
            { field: 'requestId', details: { requestId } },
          );
        }
        if (row.sandbox_id) return { state: 'done', sandboxId: row.sandbox_id };
        if (row.created_at + this.#pendingTtlMs > now) return { state: 'pending' };
        await q.run(
          'UPDATE idempotency SET holder = ?, created_at = ?, fingerprint = ? WHERE project_id = ? AND request_id = ?',
          [holderId, now, fingerprint, projectId, requestId],
        );
        return { state: 'claimed' };
      }
      return { state: 'pending' };
    });
  }

  /** Drops a claim that did not lead to a sandbox, so a retry may create. */
  async abandonRequest(projectId: string, requestId: string, holderId: string): Promise<void> {
    await this.#db.run(
      'DELETE FROM idempotency WHERE project_id = ? AND request_id = ? AND holder = ? AND sandbox_id IS NULL',
      [projectId, requestId, holderId],
    );
  }

  // ---- audit ----------------------------------------------------------------------

  /**
   * Appends an audit record (for decisions made outside IAM, e.g. sandbox
   * access). A denial is aggregated (see `authenticate`): it is counted and
   * written with the other denials of its minute, not now.
   */
  async audit(
    actorKeyId: string | null,
    action: string,
    target: string,
    outcome: AuditOutcome,
    details?: Record<string, unknown>,
  ): Promise<void> {
    if (outcome === 'denied') {
      this.#recordDenial({ actor: actorKeyId, action, target, details });
      return;
    }
    await this.#auditNow(actorKeyId, action, target, outcome, details);
  }

  /**
   * Newest first. Writes this instance's pending denials first, so what it
   * denied is there; an aggregated denial has `details.count` (how many it
   * stands for) and `details.lastAt`, and `at` is its first occurrence.
   */
  async listAudit(options: { limit?: number } = {}): Promise<AuditEntry[]> {
    await this.flushAudit();
    const rows = await this.#db.all<{
      id: number;
      at: string;
      actor_key_id: string | null;
      action: string;
      target: string;
      outcome: AuditOutcome;
      details: string | null;
    }>(
      'SELECT id, at, actor_key_id, action, target, outcome, details FROM audit ORDER BY id DESC LIMIT ?',
      [options.limit ?? 100],
    );
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

  /**
   * Writes every pending denial group now, the open minute's included (a
   * later denial of that minute starts a new group). One transaction.
   */
  flushAudit(): Promise<void> {
    return this.#auditSerial(() => this.#writeDenials(Number.POSITIVE_INFINITY));
  }

  /**
   * Deletes audit rows older than `auditRetentionMs`, in batches of 1000
   * rows (at most `maxBatches`); returns how many went. The background sweep
   * runs this a few batches at a time; an operator may call it for all.
   */
  sweepAudit(options: { maxBatches?: number } = {}): Promise<number> {
    return this.#auditSerial(() => this.#sweepAudit(options.maxBatches ?? Infinity));
  }

  /**
   * Deletes idempotency records older than `idempotencyRetentionMs`, in
   * batches of 1000 (at most `maxBatches`); returns how many went. The
   * background sweep runs this with the audit's.
   */
  sweepIdempotency(options: { maxBatches?: number } = {}): Promise<number> {
    return this.#auditSerial(() => this.#sweepIdempotency(options.maxBatches ?? Infinity));
  }

  /** Writes what is pending and stops the background writer; `ControlDb.close` calls this. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#auditTimer);
    this.#auditTimer = undefined;
    await this.flushAudit().catch(() => undefined);
  }

  // ---- internals ------------------------------------------------------------------

  /**
   * Runs `fn` in one transaction. Denials it reports through `deny` are
   * written after the transaction has rolled back, in one of their own, or
   * they would vanish with it.
   */
  async #tx<T>(fn: (q: SqlQuery, deny: Deny) => Promise<T>): Promise<T> {
    let denials: AuditArgs[] = [];
    try {
      return await this.#db.transaction((q) => {
        denials = []; // a driver may run fn again after a transient conflict
        return fn(q, (...args) => denials.push(args));
      });
    } finally {
      for (const [actor, action, target, , details] of denials) {
        this.#recordDenial({ actor, action, target, details });
      }
    }
  }

  /** A failed authentication: counted, charged to its source, audited aggregated. */
  #authDenied(
    source: string | undefined,
    reason: string,
    actor: string | null = null,
    charge = true,
  ): void {
    const failures = this.#stats.failures;
    failures[reason] = (failures[reason] ?? 0) + 1;
    if (charge && source !== undefined) this.#failures.charge(source, this.#now());
    this.#addDenial({ actor, action: 'auth', target: source ?? '', details: { reason } });
  }

  /** A denial of an authenticated caller: counted by action, audited aggregated. */
  #recordDenial(denial: Denial): void {
    const denials = this.#stats.denials;
    denials[denial.action] = (denials[denial.action] ?? 0) + 1;
    this.#addDenial(denial);
  }

  #addDenial(denial: Denial): void {
    this.#denials.add(denial, this.#now());
  }

  /**
   * The background writer: every `auditFlushIntervalMs`, the denial groups of
   * the minutes that have ended, then (when due) a few batches of the
   * retention sweep. Off the request path; never keeps the process alive.
   */
  #startAuditTimer(): void {
    this.#auditTimer = setInterval(() => {
      void this.#auditSerial(async () => {
        const now = this.#now();
        // Closed minutes only: the open one keeps aggregating.
        await this.#writeDenials(now - (now % 60_000));
        if (now >= this.#nextAuditSweepMs) {
          await this.#sweepIdempotency(AUDIT_SWEEP_BATCHES);
          await this.#sweepAudit(AUDIT_SWEEP_BATCHES);
        }
      }).catch(() => undefined);
    }, this.#auditFlushIntervalMs);
    this.#auditTimer.unref();
  }

  #auditSerial<T>(fn: () => Promise<T>): Promise<T> {
    const next = this.#auditWork.then(fn, fn);
    this.#auditWork = next.catch(() => undefined);
    return next;
  }

  /** Writes the groups of minutes before `beforeMs` in one transaction. */
  async #writeDenials(beforeMs: number): Promise<void> {
    const retry = this.#unwritten;
    const groups = [...retry, ...this.#denials.take(beforeMs)];
    this.#unwritten = [];
    if (groups.length === 0) return;
    try {
      await this.#db.transaction(async (q) => {
        for (const g of groups) {
          await q.run(
            'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, ?, ?, ?, ?, ?)',
            [
              new Date(g.firstAtMs).toISOString(),
              g.actor,
              g.action,
              g.target.slice(0, 200),
              'denied',
              JSON.stringify({
                ...g.details,
                count: g.count,
                lastAt: new Date(g.lastAtMs).toISOString(),
              }),
            ],
          );
        }
      });
      this.#stats.auditRowsWritten += groups.length;
    } catch (err) {
      // Once more at the next flush; groups that failed twice are dropped (and counted).
      this.#unwritten = groups.slice(retry.length);
      this.#stats.auditGroupsDropped += retry.length;
      throw err;
    }
  }

  async #sweepIdempotency(maxBatches: number): Promise<number> {
    const cutoff = this.#now() - this.#idempotencyRetentionMs;
    let removed = 0;
    for (let batch = 0; batch < maxBatches; batch++) {
      // Row values: the table's key is (project_id, request_id), it has no single id.
      const r = await this.#db.run(
        `DELETE FROM idempotency WHERE (project_id, request_id) IN
           (SELECT project_id, request_id FROM idempotency WHERE created_at < ? LIMIT ?)`,
        [cutoff, AUDIT_SWEEP_BATCH_ROWS],
      );
      removed += r.changes;
      if (r.changes < AUDIT_SWEEP_BATCH_ROWS) break;
    }
    return removed;
  }

  async #sweepAudit(maxBatches: number): Promise<number> {
    const cutoff = new Date(this.#now() - this.#auditRetentionMs).toISOString();
    let removed = 0;
    for (let batch = 0; batch < maxBatches; batch++) {
      const r = await this.#db.run(
        'DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE at < ? ORDER BY id LIMIT ?)',
        [cutoff, AUDIT_SWEEP_BATCH_ROWS],
      );
      removed += r.changes;
      if (r.changes < AUDIT_SWEEP_BATCH_ROWS) {
        // Caught up: the next background sweep can wait.
        this.#nextAuditSweepMs = this.#now() + AUDIT_SWEEP_IDLE_MS;
        return removed;
      }
    }
    return removed;
  }

  #iso(): string {
    return new Date(this.#now()).toISOString();
  }

  async #auditNow(...args: AuditArgs): Promise<void> {
    await this.#writeAudit(this.#db, ...args);
  }

  async #writeAudit(
    q: SqlQuery,
    actor: string | null,
    action: string,
    target: string,
    outcome: AuditOutcome,
    details?: Record<string, unknown>,
  ): Promise<void> {
    await q.run(
      'INSERT INTO audit (at, actor_key_id, action, target, outcome, details) VALUES (?, ?, ?, ?, ?, ?)',
      [
        this.#iso(),
        actor,
        action,
        target.slice(0, 200),
        outcome,
        details ? JSON.stringify(details) : null,
      ],
    );
  }

  async #insertKey(
    q: SqlQuery,
    projectId: string,
    role: Role,
    name: string,
    createdBy: string | null,
    scopes?: readonly string[],
  ): Promise<{ id: string; key: string }> {
    const id = randomId('key');
    const key = newApiKey();
    await q.run(
      'INSERT INTO api_keys (id, hash, project_id, role, name, created_by, created_at, scopes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)',
      [
        id,
        hashApiKey(key),
        projectId,
        role,
        name,
        createdBy,
        this.#iso(),
        scopes === undefined ? null : JSON.stringify(scopes),
      ],
    );
    return { id, key };
  }

  /**
   * Throws `unauthenticated` (audited) when the caller's own key has been
   * revoked. `authenticate` may answer from memory for `authCacheTtlMs`, and
   * a request may have authenticated just before a revocation committed;
   * for most calls that window is the documented one, but a key or a
   * revocation made in it would outlive it for good. Read in the
   * transaction, the key row locked on PostgreSQL (SQLite's write lock
   * already orders it), so a concurrent revocation either commits first and
   * is seen here, or waits for this transaction.
   */
  async #requireLive(q: SqlQuery, deny: Deny, caller: Principal, action: string): Promise<void> {
    const row = await q.get<Pick<KeyRow, 'revoked_at'>>(
      `SELECT k.revoked_at FROM api_keys k WHERE k.id = ?${lockSuffix(q, 'k')}`,
      [caller.keyId],
    );
    if (row && row.revoked_at === null) return;
    deny(caller.keyId, action, caller.keyId, 'denied', { reason: row ? 'revoked' : 'unknown' });
    throw new DsecError('unauthenticated', row ? 'API key revoked' : 'unknown API key');
  }

  /** Whether `projectId` is the root project (it has no parent). */
  async #isRoot(q: SqlQuery, projectId: string): Promise<boolean> {
    return (await this.#chain(q, projectId))?.size === 1;
  }

  async #root(q: SqlQuery): Promise<string | undefined> {
    const row = await q.get<{ id: string }>(
      'SELECT id FROM projects WHERE parent_id IS NULL LIMIT 1',
    );
    return row?.id;
  }

  #projectRow(q: SqlQuery, id: string): Promise<ProjectRow | undefined> {
    return q.get<ProjectRow>(`SELECT ${PROJECT_COLUMNS} FROM projects p WHERE p.id = ?`, [id]);
  }

  /** `projectId` and its ancestors; `undefined` for an unknown project. */
  async #chain(q: SqlQuery, projectId: string): Promise<ReadonlySet<string> | undefined> {
    const cached = this.#ancestors.get(projectId);
    if (cached) return cached;
    const rows = await q.all<{ id: string }>(`${ANCESTORS_CTE} SELECT id FROM anc`, [projectId]);
    if (rows.length === 0) return undefined;
    const chain = new Set(rows.map((r) => r.id));
    if (this.#ancestors.size >= CACHE_MAX_ENTRIES) this.#ancestors.clear();
    this.#ancestors.set(projectId, chain);
    return chain;
  }

  /** The tightest limit per field over the project and its ancestors. */
  async #effectiveQuota(q: SqlQuery, projectId: string): Promise<Quota> {
    const chain = await q.all<ProjectRow>(
      `${ANCESTORS_CTE} SELECT ${PROJECT_COLUMNS} FROM anc JOIN projects p ON p.id = anc.id`,
      [projectId],
    );
    const out: Quota = {};
    for (const p of chain) {
      const q2 = toProject(p).quota;
      for (const f of QUOTA_FIELDS) {
        const v = q2[f];
        const cur = out[f];
        if (v !== undefined && (cur === undefined || v < cur)) out[f] = v;
      }
    }
    return out;
  }

  /**
   * The tightest room left in an `imageBytes` quota over `projectId` and its
   * ancestors (their subtrees' live image rows, `except` one of them), with
   * the rows of every limiting ancestor locked, root first; undefined when
   * none limits image bytes. `not_found` for an unknown project.
   */
  async #imageRoom(
    q: SqlQuery,
    projectId: string,
    now: number,
    except: string | undefined,
  ): Promise<{ project: ProjectRow; used: number; left: number } | undefined> {
    if (!(await q.get('SELECT 1 AS x FROM projects WHERE id = ?', [projectId])))
      throw new DsecError('not_found', `no project ${JSON.stringify(projectId)}`);
    const limited = await q.all<ProjectRow>(
      `${ANCESTORS_CTE} SELECT ${PROJECT_COLUMNS} FROM anc JOIN projects p ON p.id = anc.id
         WHERE p.quota_image_bytes IS NOT NULL ORDER BY anc.depth DESC${lockSuffix(q, 'p')}`,
      [projectId],
    );
    let tightest: { project: ProjectRow; used: number; left: number } | undefined;
    // Nearest first, so that of equally full limits the nearest is the one named.
    for (const p of limited.reverse()) {
      const used = await this.#imageBytesUsed(q, p.id, now, except);
      const left = Number(p.quota_image_bytes) - used;
      if (tightest === undefined || left < tightest.left) tightest = { project: p, used, left };
    }
    return tightest;
  }

  async #imageBytesUsed(
    q: SqlQuery,
    projectId: string,
    now: number,
    except?: string,
  ): Promise<number> {
    const row = await q.get<{ bytes: number }>(
      `${SUBTREE_CTE} SELECT COALESCE(SUM(bytes), 0) AS bytes FROM image_reservations
         WHERE project_id IN (SELECT id FROM sub) AND (expires_at IS NULL OR expires_at > ?)
         AND id <> ?`,
      [projectId, now, except ?? ''],
    );
    return Number(row?.bytes ?? 0);
  }

  async #usageRaw(
    q: SqlQuery,
    projectId: string,
    now: number,
  ): Promise<{ n: number; mem: number; cpu: number }> {
    const row = await q.get<{ n: number; mem: number; cpu: number }>(
      `${SUBTREE_CTE} SELECT COUNT(*) AS n, COALESCE(SUM(memory_mb), 0) AS mem, COALESCE(SUM(cpu_millis), 0) AS cpu
         FROM reservations WHERE project_id IN (SELECT id FROM sub) AND expires_at > ?`,
      [projectId, now],
    );
    return row ?? { n: 0, mem: 0, cpu: 0 };
  }

  /**
   * Deletes lapsed reservations, at most every `SWEEP_INTERVAL_MS`, outside
   * any reservation's transaction: usage sums skip them already, so this only
   * keeps the table small, and a failure here must not fail a create.
   */
  async #sweep(): Promise<void> {
    const now = this.#now();
    if (now - this.#lastSweepMs < SWEEP_INTERVAL_MS) return;
    this.#lastSweepMs = now;
    await this.#db
      .run('DELETE FROM reservations WHERE expires_at <= ?', [now])
      .catch(() => undefined);
    await this.#db
      .run('DELETE FROM image_reservations WHERE expires_at <= ?', [now])
      .catch(() => undefined);
  }
}

/** Sets `key` as the newest entry of `map`, dropping the oldest past `max` entries. */
function setNewest<K, V>(map: Map<K, V>, key: K, value: V, max: number): void {
  map.delete(key);
  map.set(key, value);
  while (map.size > max) {
    const oldest = map.keys().next();
    if (oldest.done) break;
    map.delete(oldest.value);
  }
}

/**
 * A stored scope list; NULL is an unscoped key. Anything unreadable (only a
 * hand edit makes it) is a scoped key without scopes: fail closed.
 */
function parseScopes(raw: string | null): string[] | undefined {
  if (raw === null) return undefined;
  try {
    const v: unknown = JSON.parse(raw);
    if (Array.isArray(v) && v.every((x) => typeof x === 'string')) return v;
  } catch {
    // Unreadable: as below.
  }
  return [];
}

function toMillis(cores: number | undefined): number | null {
  return cores === undefined ? null : Math.round(cores * 1000);
}

function cleanQuota(q: Quota): Quota {
  const out: Quota = {};
  if (q.sandboxes !== undefined) out.sandboxes = q.sandboxes;
  if (q.memoryMb !== undefined) out.memoryMb = q.memoryMb;
  if (q.cpuCores !== undefined) out.cpuCores = Math.round(q.cpuCores * 1000) / 1000;
  if (q.fncallsPerSecond !== undefined) out.fncallsPerSecond = q.fncallsPerSecond;
  if (q.imageBytes !== undefined) out.imageBytes = q.imageBytes;
  if (q.volumeBytes !== undefined) out.volumeBytes = q.volumeBytes;
  return out;
}

function checkQuotaShape(q: Quota): void {
  for (const f of [
    'sandboxes',
    'memoryMb',
    'fncallsPerSecond',
    'imageBytes',
    'volumeBytes',
  ] as const) {
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

interface VolumeRow {
  project_id: string;
  name: string;
  size_bytes: number;
  edge_id: string;
  state: string;
  created_at: string;
}

function toVolume(r: VolumeRow): VolumeRecord {
  return {
    projectId: r.project_id,
    name: r.name,
    sizeBytes: Number(r.size_bytes),
    edgeId: r.edge_id,
    state: r.state === 'ready' ? 'ready' : 'creating',
    createdAt: r.created_at,
  };
}

function toProject(r: ProjectRow): Project {
  const quota: Quota = {};
  if (r.quota_sandboxes !== null) quota.sandboxes = r.quota_sandboxes;
  if (r.quota_memory_mb !== null) quota.memoryMb = r.quota_memory_mb;
  if (r.quota_cpu_millis !== null) quota.cpuCores = r.quota_cpu_millis / 1000;
  if (r.quota_fncalls_per_second !== null) quota.fncallsPerSecond = r.quota_fncalls_per_second;
  if (r.quota_image_bytes !== null) quota.imageBytes = Number(r.quota_image_bytes);
  if (r.quota_volume_bytes !== null) quota.volumeBytes = Number(r.quota_volume_bytes);
  return { id: r.id, name: r.name, parentId: r.parent_id, quota, createdAt: r.created_at };
}
