import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import type { EdgeStatus } from '@dsec/core';
import type { Iam } from '@dsec/iam';
import type { FleetView } from '@dsec/watcher';
import { principalOf } from '../auth.js';
import type { ImageService } from '../image-service.js';
import { IdParams, KeyBody, ProjectBody, parse } from '../schemas.js';
import { ImageParams, ImageQuery, ListImagesQuery } from '../schemas-io.js';

export interface AdminRouteDeps {
  iam: Iam;
  fleet: () => Pick<FleetView, 'edges'> | undefined;
  images: ImageService;
}

/** Identity, projects, keys, images and the fleet. */
export function adminRoutes(app: FastifyInstance, { iam, fleet, images }: AdminRouteDeps): void {
  app.get('/v1/whoami', async (req) => {
    const { keyId, projectId, role, scopes } = principalOf(req);
    return { keyId, projectId, role, ...(scopes ? { scopes } : {}) };
  });

  app.post('/v1/projects', async (req, reply) => {
    const body = parse(ProjectBody, req.body);
    return reply.code(201).send(await iam.createProject(principalOf(req), body));
  });

  app.get('/v1/projects', async (req) => ({
    projects: await iam.listProjects(principalOf(req)),
  }));

  app.post('/v1/keys', async (req, reply) => {
    const body = parse(KeyBody, req.body);
    return reply.code(201).send(await iam.createKey(principalOf(req), body));
  });

  app.delete('/v1/keys/:id', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    await iam.revokeKey(principalOf(req), id);
    return reply.code(204).send();
  });

  app.get('/v1/images', async (req) => {
    const { all, projectId } = parse(ListImagesQuery, req.query, 'query');
    return { layers: await images.list(principalOf(req), { all: all ?? false, projectId }) };
  });

  app.delete('/v1/images/:ref', async (req, reply) => {
    const { ref } = parse(ImageParams, req.params, 'path');
    const { projectId } = parse(ImageQuery, req.query, 'query');
    await images.remove(principalOf(req), ref, { projectId });
    return reply.code(204).send();
  });

  // The fleet shows every tenant's load, so only an admin of the root project may see it.
  app.get('/v1/edges', async (req) => {
    const principal = principalOf(req);
    const project = await iam.getProject(principal, principal.projectId);
    if (principal.role !== 'admin' || project.parentId !== null) {
      await iam.audit(principal.keyId, 'edges.list', '', 'denied');
      throw new DsecError(
        'permission_denied',
        'listing edges needs an admin key of the root project',
      );
    }
    const edges: EdgeStatus[] = (fleet()?.edges ?? []).map((e) => ({
      edgeId: e.edgeId,
      url: e.status?.url ?? '',
      healthy: e.healthy,
      backends: [...e.backends],
      capacity: { ...e.capacity },
      used: { ...e.used },
      sandboxesByProject: { ...(e.status?.sandboxesByProject ?? {}) },
      labels: { ...(e.status?.labels ?? {}) },
      ...(e.status?.pressure ? { pressure: e.status.pressure } : {}),
      ...(e.status?.fncall ? { fncall: e.status.fncall.map((p) => ({ ...p })) } : {}),
      ...(e.status?.gpus ? { gpus: e.status.gpus.map((g) => ({ ...g })) } : {}),
      ...(e.cordoned ? { cordoned: true } : {}),
    }));
    return { edges };
  });
}
