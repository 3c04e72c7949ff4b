import type { FastifyRequest } from 'fastify';
import { DsecError } from '@dsec/core';
import type { Iam, Principal } from '@dsec/iam';

const principals = new WeakMap<FastifyRequest, Principal>();

/**
 * Reads `Authorization: Bearer <key>`; the key itself is never logged or kept.
 * IAM answers a key it looked up within the last `authCacheTtlMs` from
 * memory, so a busy apiserver does not query the database per request.
 */
export async function authenticateRequest(iam: Iam, req: FastifyRequest): Promise<void> {
  const header = req.headers.authorization;
  const m = typeof header === 'string' ? /^Bearer +(\S+) *$/i.exec(header) : null;
  principals.set(req, await iam.authenticate(m?.[1]));
}

/** The principal `authenticateRequest` stored; routes without auth must not call this. */
export function principalOf(req: FastifyRequest): Principal {
  const p = principals.get(req);
  if (!p) throw new DsecError('unauthenticated', 'missing API key');
  return p;
}
