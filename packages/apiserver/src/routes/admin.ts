import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import type { EdgeStatus, LayerInfo } from '@dsec/core';
import type { Iam } from '@dsec/iam';
import type { FleetView } from '@dsec/watcher';
import { principalOf } from '../auth.js';
import { IdParams, KeyBody, ProjectBody, parse } from '../schemas.js';
import { ListImagesQuery } from '../schemas-io.js';

export interface AdminRouteDeps {
  iam: Iam;
  fleet: () => Pick<FleetView, 'edges'> | undefined;
  /** The store's layers; without `all`, the plumbing records registry imports keep are left out. */
  imagesList?: ((options: { all: boolean }) => Promise<LayerInfo[]>) | undefined;
}

/** Identity, projects, keys, images and the fleet. */
export function adminRoutes(
  app: FastifyInstance,
  { iam, fleet, imagesList }: AdminRouteDeps,
): void {
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
    const { all } = parse(ListImagesQuery, req.query, 'query');
    if (!imagesList)
      throw new DsecError('unavailable', 'this apiserver has no image store configured');
    return { layers: await imagesList({ all: all ?? false }) };
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
