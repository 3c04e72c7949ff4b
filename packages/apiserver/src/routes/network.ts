import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import { principalOf } from '../auth.js';
import { EventsQuery, IdParams, NetworkPatchBody, parse } from '../schemas.js';
import type { SandboxService } from '../sandbox-service.js';
import { clientGone } from './io-common.js';

/**
 * Live egress policy and audit events of a sandbox (issue 5):
 * `PATCH /v1/sandboxes/:id/network` and `GET /v1/sandboxes/:id/events`.
 * Access is checked like every sandbox route (another tenant's sandbox is a 404).
 */
export function networkRoutes(app: FastifyInstance, service: SandboxService): void {
  app.patch('/v1/sandboxes/:id/network', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const patch = parse(NetworkPatchBody, req.body);
    const signal = clientGone(reply);
    const { edge } = await service.open(principalOf(req), id, signal);
    if (!edge.updateNetwork) throw unsupported(edge.edgeId, 'network policy');
    return edge.updateNetwork(id, patch, signal);
  });

  app.get('/v1/sandboxes/:id/events', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(EventsQuery, req.query, 'query');
    const signal = clientGone(reply);
    const { edge } = await service.open(principalOf(req), id, signal);
    if (!edge.listEvents) throw unsupported(edge.edgeId, 'audit events');
    return { events: await edge.listEvents(id, { afterId: q.afterId, limit: q.limit }, signal) };
  });
}

function unsupported(edgeId: string, what: string): DsecError {
  return new DsecError('unavailable', `edge ${edgeId} does not support ${what}`);
}
