/**
 * @dsec/iam — durable identity and quota state for a DSec cluster: nested
 * projects with delegated quotas, hashed API keys with roles, quota
 * reservations checked against every ancestor in one transaction,
 * idempotency records for creates, and an audit log of every mutation and
 * denial (paper 3.2). One SQLite file (WAL, `synchronous=FULL`).
 *
 * @example
 * ```ts
 * import { Iam } from '@dsec/iam';
 * const iam = Iam.open({ path: '/var/lib/dsec/iam.db' });
 * const { key } = iam.bootstrap();           // raw admin key, shown once
 * const admin = iam.authenticate(key!);
 * const team = iam.createProject(admin, { name: 'team-a', quota: { sandboxes: 100 } });
 * iam.reserve(team.id, { memoryMb: 512, cpuCores: 1 }, 'rsv-1'); // throws quota_exceeded when full
 * iam.release('rsv-1');
 * ```
 */
export { Iam, PROJECT_NAME_PATTERN } from './iam.js';
export type { IamOptions } from './iam.js';
export { API_KEY_PATTERN, hashApiKey } from './keys.js';
export { ROLE_RANK } from './types.js';
export type {
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
