import type { FastifyInstance } from 'fastify';
import { principalOf } from '../auth.js';
import { ForkBody, IdParams, JobBody, parse, SnapshotBody, TimeoutBody } from '../schemas.js';
import type { JobAction, SandboxService } from '../sandbox-service.js';
import { clientGone } from './io-common.js';

/** Whole-job operations, one route each (`::` is fastify's literal colon). */
const JOB_ACTIONS: readonly JobAction[] = ['pause', 'resume', 'stop', 'extend'];

/** Pause, resume, TTL, snapshot and fork of one sandbox; the same over a label selector. */
export function lifecycleRoutes(app: FastifyInstance, service: SandboxService): void {
  app.post('/v1/sandboxes/:id/pause', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    return service.pause(principalOf(req), id, clientGone(reply));
  });

  app.post('/v1/sandboxes/:id/resume', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    return service.resume(principalOf(req), id, clientGone(reply));
  });

  app.post('/v1/sandboxes/:id/timeout', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const { seconds } = parse(TimeoutBody, req.body);
    return service.setTimeout(principalOf(req), id, seconds, clientGone(reply));
  });

  app.post('/v1/sandboxes/:id/snapshot', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const body = parse(SnapshotBody, req.body);
    const snap = await service.snapshot(principalOf(req), id, body, clientGone(reply));
    return reply.code(201).send(snap);
  });

  app.post('/v1/sandboxes/:id/fork', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const { count } = parse(ForkBody, req.body);
    const forked = await service.fork(principalOf(req), id, count, clientGone(reply));
    return reply.code(201).send(forked);
  });

  for (const action of JOB_ACTIONS) {
    app.post(`/v1/sandboxes::${action}`, async (req, reply) => {
      const body = parse(JobBody, req.body);
      return service.job(principalOf(req), { action, ...body }, clientGone(reply));
    });
  }
}
