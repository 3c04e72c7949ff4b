import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import { principalOf } from '../auth.js';
import { IdParams, parse } from '../schemas.js';
import { DisplayInputBody } from '../schemas-display.js';
import type { SandboxService } from '../sandbox-service.js';
import { clientGone } from './io-common.js';

/**
 * The screen of a sandbox with a display (the `vm` backend, issue 15):
 * `GET /v1/sandboxes/:id/screenshot` (image/png) and
 * `POST /v1/sandboxes/:id/input` (`{ events }` or `{ text }`). A sandbox
 * without a display, or an edge without the methods, answers `unavailable`.
 * Access is checked like every sandbox route (another tenant's sandbox is a 404).
 */
export function displayRoutes(app: FastifyInstance, service: SandboxService): void {
  app.get('/v1/sandboxes/:id/screenshot', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const signal = clientGone(reply);
    const { edge } = await service.open(principalOf(req), id, signal);
    if (!edge.screenshot) throw noDisplay(edge.edgeId);
    const png = await edge.screenshot(id, signal);
    return reply.header('content-type', 'image/png').header('cache-control', 'no-store').send(png);
  });

  app.post('/v1/sandboxes/:id/input', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const input = parse(DisplayInputBody, req.body);
    const signal = clientGone(reply);
    const { edge } = await service.open(principalOf(req), id, signal);
    if (!edge.sendInput) throw noDisplay(edge.edgeId);
    await edge.sendInput(id, input, signal);
    return reply.code(204).send();
  });
}

function noDisplay(edgeId: string): DsecError {
  return new DsecError('unavailable', `edge ${edgeId} runs no sandboxes with a display`);
}
