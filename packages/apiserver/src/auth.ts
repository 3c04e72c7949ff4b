import type { FastifyRequest } from 'fastify';
import { addressKey, DsecError } from '@dsec/core';
import { mayReadMetrics } from '@dsec/iam';
import type { Iam, Principal } from '@dsec/iam';

const principals = new WeakMap<FastifyRequest, Principal>();

/**
 * Reads `Authorization: Bearer <key>`; the key itself is never logged or kept.
 * IAM answers a key it looked up within the last `authCacheTtlMs` from
 * memory, so a busy apiserver does not query the database per request.
 * Failures are limited per client address (`rate_limited` past the budget).
 */
export async function authenticateRequest(iam: Iam, req: FastifyRequest): Promise<void> {
  principals.set(
    req,
    await iam.authenticate(bearerKey(req.headers.authorization), { source: sourceOf(req.raw) }),
  );
}

/** The key of an `Authorization: Bearer <key>` header; undefined for any other value. */
export function bearerKey(header: string | undefined): string | undefined {
  return typeof header === 'string' ? /^Bearer +(\S+) *$/i.exec(header)?.[1] : undefined;
}

/** The unit failed authentications are counted in: the client's address (`addressKey`). */
export function sourceOf(req: { socket?: { remoteAddress?: string | undefined } | null }): string {
  return addressKey(req.socket?.remoteAddress);
}

/** The principal `authenticateRequest` stored; routes without auth must not call this. */
export function principalOf(req: FastifyRequest): Principal {
  const p = principals.get(req);
  if (!p) throw new DsecError('unauthenticated', 'missing API key');
  return p;
}

/**
 * `/metrics` on the public listener: an admin key of the root project, or a
 * root-project key with the `metrics:read` scope. Throws `permission_denied`
 * (audited) otherwise.
 */
export async function requireMetricsReader(iam: Iam, principal: Principal): Promise<void> {
  const project = await iam.getProject(principal, principal.projectId);
  if (project.parentId === null && mayReadMetrics(principal)) return;
  await iam.audit(principal.keyId, 'metrics.read', '', 'denied');
  throw new DsecError(
    'permission_denied',
    'reading metrics needs an admin key of the root project or the metrics:read scope',
  );
}
