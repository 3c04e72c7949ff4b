import type { FastifyInstance } from 'fastify';
import type { VolumeInfo } from '@dsec/core';
import { DsecError } from '@dsec/core';
import { clientGone } from '@dsec/apiserver';
import type { VolumeService } from '@dsec/apiserver';
import { callerOf } from './control-plane.js';
import { E2B_VOLUME_SIZE_MB } from './volumes.js';

type Body = Record<string, unknown>;

/** `/volumes` and `/volumes/:volumeID` in the E2B control plane's scope (its auth and error shapes). */
export function e2bVolumeRoutes(scope: FastifyInstance, volumes: VolumeService): void {
  const answer = (v: VolumeInfo, key: string, token: boolean): Body => ({
    volumeID: v.name,
    name: v.name,
    ...(token ? { token: key } : {}),
  });

  scope.get('/volumes', async (req) => {
    const caller = callerOf(req);
    return (await volumes.list(caller.principal, undefined)).map((v) =>
      answer(v, caller.key, false),
    );
  });

  scope.post('/volumes', async (req, reply) => {
    const caller = callerOf(req);
    const b = (req.body ?? {}) as Body;
    const extra = Object.keys(b).filter((k) => k !== 'name');
    if (extra.length > 0)
      throw new DsecError('invalid_argument', `${extra[0]}: unknown field`, { field: extra[0] });
    const made = await volumes.create(
      caller.principal,
      { name: b.name as string, sizeMb: E2B_VOLUME_SIZE_MB },
      clientGone(reply),
    );
    return reply.code(201).send(answer(made, caller.key, true));
  });

  scope.get<{ Params: { volumeID: string } }>('/volumes/:volumeID', async (req, reply) => {
    const caller = callerOf(req);
    const v = await volumes.get(
      caller.principal,
      req.params.volumeID,
      undefined,
      clientGone(reply),
    );
    return answer(v, caller.key, true);
  });

  scope.delete<{ Params: { volumeID: string } }>('/volumes/:volumeID', async (req, reply) => {
    const caller = callerOf(req);
    await volumes.delete(caller.principal, req.params.volumeID, undefined, clientGone(reply));
    return reply.code(204).send();
  });
}
