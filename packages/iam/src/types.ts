/** Vocabulary of identity and quota. */

export type Role = 'admin' | 'member';

/** Rank of each role: a key may grant only roles ranked at or below its own. */
export const ROLE_RANK: Record<Role, number> = { member: 1, admin: 2 };

/**
 * Limits on what a project's whole subtree may hold at once. An unset field
 * means "no limit of its own"; every ancestor's limit still applies.
 */
export interface Quota {
  sandboxes?: number | undefined;
  memoryMb?: number | undefined;
  cpuCores?: number | undefined;
  /**
   * Function calls (`/v1/fncall`) the subtree may start per second, a rate
   * rather than a count of live things: enforced by `FnCallRateLimiter`
   * with a burst of one second's worth.
   */
  fncallsPerSecond?: number | undefined;
  /**
   * Bytes of image layers the subtree's projects may own (their snapshots
   * and forks; docs/adr/0019-layer-ownership.md), reserved before a snapshot
   * is taken and given back when its layer is deleted.
   */
  imageBytes?: number | undefined;
  /**
   * Bytes of volumes (their size limits, docs/volumes.md) the subtree's
   * projects may hold, charged when a volume is created and given back when
   * it is deleted.
   */
  volumeBytes?: number | undefined;
}

/** One project's own calls-per-second limit, as `Iam.fncallRateLimits` returns it. */
export interface FnCallRateLimit {
  projectId: string;
  /** For error messages. */
  name: string;
  perSecond: number;
}

export interface Project {
  id: string;
  name: string;
  /** `null` for the root project. */
  parentId: string | null;
  quota: Quota;
  createdAt: string;
}

/** Who is calling: the authenticated API key. */
export interface Principal {
  keyId: string;
  projectId: string;
  role: Role;
  /** The key's scopes (`scopes.ts`); undefined: unscoped, every right of its role. */
  scopes?: readonly string[] | undefined;
}

export interface ApiKeyInfo {
  id: string;
  projectId: string;
  role: Role;
  name: string;
  createdAt: string;
  revokedAt: string | null;
  /** Absent for an unscoped key. */
  scopes?: string[] | undefined;
}

/** Returned once when a key is created; `key` is never stored or shown again. */
export interface CreatedKey {
  id: string;
  key: string;
  projectId: string;
  role: Role;
  /** Absent for an unscoped key. */
  scopes?: string[] | undefined;
}

/** What one sandbox holds against quotas. */
export interface Resources {
  memoryMb: number;
  cpuCores: number;
}

export interface Usage {
  sandboxes: number;
  memoryMb: number;
  cpuCores: number;
  /** Bytes of layers the subtree owns, plus snapshots being taken now. */
  imageBytes: number;
  /** Bytes of volumes (their sizes) the subtree holds. */
  volumeBytes: number;
}

/** A project's volume as the control plane records it (docs/volumes.md). */
export interface VolumeRecord {
  projectId: string;
  name: string;
  sizeBytes: number;
  edgeId: string;
  state: 'creating' | 'ready';
  createdAt: string;
}

export type AuditOutcome = 'ok' | 'denied';

export interface AuditEntry {
  id: number;
  at: string;
  /** `null` for the system itself (bootstrap) or an unidentified caller. */
  actorKeyId: string | null;
  action: string;
  target: string;
  outcome: AuditOutcome;
  details?: Record<string, unknown> | undefined;
}

/** Result of claiming an idempotency key for a create. */
export type RequestClaim =
  { state: 'claimed' } | { state: 'done'; sandboxId: string } | { state: 'pending' };
