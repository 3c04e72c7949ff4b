/**
 * @dsec/iam — the control plane's durable state: nested projects with
 * delegated quotas, hashed API keys with roles, quota reservations checked
 * against every ancestor in one transaction, idempotency records bound to
 * their request, an audit log of every mutation and denial (paper 3.2), and
 * the registry of the cluster's edges. One database, SQLite (a file, the
 * default: nothing to install) or PostgreSQL (shared by a cluster's
 * apiservers and watchers); the same code and the same conformance suite
 * run on both (docs/adr/0011-control-plane-store.md).
 *
 * @example
 * ```ts
 * import { openControlDb } from '@dsec/iam';
 * const db = await openControlDb('/var/lib/dsec/iam.db'); // or 'postgres://…'
 * const { key } = await db.iam.bootstrap();              // raw admin key, shown once
 * const admin = await db.iam.authenticate(key!);
 * const team = await db.iam.createProject(admin, { name: 'team-a', quota: { sandboxes: 100 } });
 * await db.iam.reserve(team.id, { memoryMb: 512, cpuCores: 1 }, 'rsv-1'); // quota_exceeded when full
 * await db.iam.release('rsv-1');
 * await db.close();
 * ```
 */
export { openControlDb, isPostgresLocation } from './control-db.js';
export type { ControlDb, ControlDbOptions } from './control-db.js';
export {
  Iam,
  MAX_CHILD_PROJECTS,
  MAX_KEYS_PER_PROJECT,
  MAX_PROJECT_DEPTH,
  PROJECT_NAME_PATTERN,
} from './iam.js';
export { FnCallRateLimiter } from './fncall-rate-limiter.js';
export type { FnCallRateLimiterOptions, FnCallRateLimitSource } from './fncall-rate-limiter.js';
export type { AuthStats, IamOptions } from './iam.js';
export { EdgeRegistry, EDGE_ID_PATTERN } from './edge-registry.js';
export type { EdgeProbe, EdgeRecord, EdgeRegistration } from './edge-registry.js';
export { MIGRATIONS, SCHEMA_VERSION } from './db/migrations.js';
export { canonicalJson, requestFingerprint } from './fingerprint.js';
export { API_KEY_PATTERN, e2bKeyForm, fromE2bKeyForm, hashApiKey } from './keys.js';
export {
  checkScopes,
  FNCALL_SCOPE,
  isScoped,
  MAX_PATTERN_WILDCARDS,
  MAX_SCOPES,
  mayCallFnCall,
  mayRevokeScopes,
  mayRunImage,
  mayReadMetrics,
  maySnapshot,
  mayUseVolumes,
  METRICS_SCOPE,
  RUN_SCOPE_PREFIX,
  SCOPES,
  scopeSpec,
  scopesCover,
  SNAPSHOT_SCOPE,
  ungrantableScopes,
  unrunnableImages,
  VOLUMES_SCOPE,
} from './scopes.js';
export type { Grantor, ScopeKind, ScopeSpec } from './scopes.js';
export { globCovers, globMatch } from './glob.js';
export { ROLE_RANK } from './types.js';
export type {
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
