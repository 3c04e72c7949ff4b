import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import { principalOf } from '../auth.js';
import type { ImageBuildService } from '../image-builds.js';
import { parse } from '../schemas.js';
import { BuildParams, BuildQuery, buildArgsOf } from '../schemas-builds.js';
import { bodyStream, clientGone, rawBodies } from './io-common.js';

/**
 * Dockerfile builds over the API: `POST /v1/images/builds?name=…` with the
 * context as a tar body (202 once it is unpacked), then the build polled,
 * listed or cancelled. See `ImageBuildService`.
 */
export function imageBuildRoutes(app: FastifyInstance, builds: ImageBuildService): void {
  rawBodies(app, ['application/x-tar']);

  app.post('/v1/images/builds', async (req, reply) => {
    const q = parse(BuildQuery, req.query, 'query');
    const body = bodyStream(req);
    if (!body) {
      throw new DsecError(
        'invalid_argument',
        'send the build context as the body, a tar archive (Content-Type: application/x-tar)',
        { field: 'context' },
      );
    }
    const signal = clientGone(reply);
    const info = await builds.start(principalOf(req), {
      name: q.name,
      dockerfile: q.dockerfile,
      buildArgs: buildArgsOf(q.buildArg),
      target: q.target,
      ...(q.timeout !== undefined ? { timeoutMs: q.timeout * 1000 } : {}),
      body,
      signal,
    });
    return reply.code(202).send(info);
  });

  app.get('/v1/images/builds', async (req) => ({ builds: builds.list(principalOf(req)) }));

  app.get('/v1/images/builds/:id', async (req) => {
    const { id } = parse(BuildParams, req.params, 'path');
    return builds.get(principalOf(req), id);
  });

  app.delete('/v1/images/builds/:id', async (req) => {
    const { id } = parse(BuildParams, req.params, 'path');
    return await builds.cancel(principalOf(req), id);
  });
}
