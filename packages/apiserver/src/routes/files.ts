import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import { IdParams, parse } from '../schemas.js';
import { MkdirBody, PathQuery, RemoveBody, RenameBody, WriteQuery } from '../schemas-io.js';
import type { SandboxService } from '../sandbox-service.js';
import {
  bodyStream,
  clientGone,
  openIo,
  openStream,
  rawBodies,
  socketTimeout,
} from './io-common.js';

/**
 * Files inside a sandbox. Contents travel as raw bytes in both directions,
 * streamed with back-pressure (any size, nothing buffered whole); every
 * operation runs inside the sandbox's own root (SECURITY A9).
 */
export function fileRoutes(app: FastifyInstance, service: SandboxService): void {
  rawBodies(app, ['application/octet-stream']);

  app.get('/v1/sandboxes/:id/files', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(PathQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    // A download holds its stream with back-pressure (nothing queues); it counts as one of its key's.
    openStream(
      req,
      reply,
      () => 0,
      () => undefined,
    );
    const stream = await io.readFile(id, q.path, { user: q.user, signal });
    socketTimeout(req, 0);
    return reply
      .header('content-type', 'application/octet-stream')
      .header('cache-control', 'no-store')
      .send(stream);
  });

  app.put('/v1/sandboxes/:id/files', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(WriteQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    const body = bodyStream(req) ?? emptyBody(req.body);
    socketTimeout(req, 0);
    return io.writeFile(id, q.path, body, { user: q.user, mode: q.mode, signal });
  });

  app.get('/v1/sandboxes/:id/files/stat', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(PathQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    return io.statFile(id, q.path, { user: q.user, signal });
  });

  app.get('/v1/sandboxes/:id/files/list', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const q = parse(PathQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    return { entries: await io.listDir(id, q.path, { user: q.user, signal }) };
  });

  app.post('/v1/sandboxes/:id/files/mkdir', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const b = parse(MkdirBody, req.body);
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    await io.mkdir(id, b.path, { parents: b.parents, mode: b.mode, user: b.user, signal });
    return reply.code(204).send();
  });

  app.post('/v1/sandboxes/:id/files/remove', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const b = parse(RemoveBody, req.body);
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    await io.remove(id, b.path, { recursive: b.recursive, user: b.user, signal });
    return reply.code(204).send();
  });

  app.post('/v1/sandboxes/:id/files/rename', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const b = parse(RenameBody, req.body);
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    await io.rename(id, b.from, b.to, { overwrite: b.overwrite, user: b.user, signal });
    return reply.code(204).send();
  });
}

/** A PUT without a raw body writes an empty file; a JSON body is a mistake. */
function emptyBody(body: unknown): Buffer {
  if (body === undefined || body === null) return Buffer.alloc(0);
  throw new DsecError('invalid_argument', 'file contents must be sent as application/octet-stream');
}
