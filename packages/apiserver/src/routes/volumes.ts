import type { FastifyInstance } from 'fastify';
import { principalOf } from '../auth.js';
import { CreateVolumeBody, parse, VolumeParams, VolumeQuery } from '../schemas.js';
import type { VolumeService } from '../volume-service.js';
import { clientGone } from './io-common.js';

/** `/v1/volumes` (docs/volumes.md): parse, then one `VolumeService` call. */
export function volumeRoutes(app: FastifyInstance, volumes: VolumeService): void {
  app.post('/v1/volumes', async (req, reply) => {
    const body = parse(CreateVolumeBody, req.body);
    const info = await volumes.create(principalOf(req), body, clientGone(reply));
    return reply.code(201).send(info);
  });

  app.get('/v1/volumes', async (req) => {
    const { projectId } = parse(VolumeQuery, req.query, 'query');
    return { volumes: await volumes.list(principalOf(req), projectId) };
  });

  app.get('/v1/volumes/:name', async (req, reply) => {
    const { name } = parse(VolumeParams, req.params, 'path');
    const { projectId } = parse(VolumeQuery, req.query, 'query');
    return volumes.get(principalOf(req), name, projectId, clientGone(reply));
  });

  app.delete('/v1/volumes/:name', async (req, reply) => {
    const { name } = parse(VolumeParams, req.params, 'path');
    const { projectId } = parse(VolumeQuery, req.query, 'query');
    await volumes.delete(principalOf(req), name, projectId, clientGone(reply));
    return reply.code(204).send();
  });
}
