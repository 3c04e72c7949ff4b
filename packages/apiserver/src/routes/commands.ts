import type { FastifyInstance } from 'fastify';
import { IdParams, parse } from '../schemas.js';
import {
  CommandParams,
  SessionParams,
  SessionRunBody,
  SignalBody,
  StdinQuery,
  WaitQuery,
} from '../schemas-io.js';
import type { SandboxService } from '../sandbox-service.js';
import {
  bodyStream,
  clientGone,
  openIo,
  rawBodies,
  sendCommandStream,
  socketTimeout,
  wantsNdjson,
} from './io-common.js';

/** Socket idle allowance beyond a command's own timeout. */
const COMMAND_SOCKET_GRACE_MS = 60_000;

/**
 * Commands by ID (the command log, background commands, streamed stdin) and
 * shell sessions. `POST /v1/sandboxes/:id/commands` itself is in
 * `sandboxes.ts`.
 */
export function commandRoutes(app: FastifyInstance, service: SandboxService): void {
  rawBodies(app, ['application/octet-stream']);

  app.get('/v1/sandboxes/:id/commands', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const io = await openIo(service, req, id, clientGone(reply));
    return { commands: await io.listCommands(id) };
  });

  app.get('/v1/sandboxes/:id/commands/:cid', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const io = await openIo(service, req, id, clientGone(reply));
    return io.getCommand(id, cid);
  });

  app.get('/v1/sandboxes/:id/commands/:cid/wait', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const q = parse(WaitQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    socketTimeout(req, q.timeoutMs === undefined ? 0 : q.timeoutMs + COMMAND_SOCKET_GRACE_MS);
    return io.waitCommand(id, cid, { timeoutMs: q.timeoutMs, signal });
  });

  // Output kept so far (head and tail within the cap), then live output, then the result.
  app.get('/v1/sandboxes/:id/commands/:cid/output', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    await io.getCommand(id, cid); // a plain 404 before any stream starts
    socketTimeout(req, 0);
    return sendCommandStream(req, reply, signal, (o) => io.watchCommand(id, cid, o));
  });

  app.post('/v1/sandboxes/:id/commands/:cid/kill', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const io = await openIo(service, req, id, clientGone(reply));
    await io.killCommand(id, cid);
    return reply.code(204).send();
  });

  app.post('/v1/sandboxes/:id/commands/:cid/signal', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const { signal: sig } = parse(SignalBody, req.body);
    const io = await openIo(service, req, id, clientGone(reply));
    await io.signalCommand(id, cid, sig);
    return reply.code(204).send();
  });

  // Raw body → the command's stdin, with back-pressure; `?eof=1` closes it afterwards.
  app.post('/v1/sandboxes/:id/commands/:cid/stdin', async (req, reply) => {
    const { id, cid } = parse(CommandParams, req.params, 'path');
    const q = parse(StdinQuery, req.query, 'query');
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    return io.writeStdin(id, cid, bodyStream(req), { eof: q.eof, signal });
  });

  app.post('/v1/sandboxes/:id/sessions/:name/run', async (req, reply) => {
    const { id, name } = parse(SessionParams, req.params, 'path');
    const body = parse(SessionRunBody, req.body);
    socketTimeout(req, body.timeoutMs + COMMAND_SOCKET_GRACE_MS);
    const signal = clientGone(reply);
    const io = await openIo(service, req, id, signal);
    if (!wantsNdjson(req)) return io.runInSession(id, name, body, { signal });
    return sendCommandStream(req, reply, signal, (o) => io.runInSession(id, name, body, o));
  });

  app.get('/v1/sandboxes/:id/sessions', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const io = await openIo(service, req, id, clientGone(reply));
    return { sessions: await io.listSessions(id) };
  });

  app.delete('/v1/sandboxes/:id/sessions/:name', async (req, reply) => {
    const { id, name } = parse(SessionParams, req.params, 'path');
    const io = await openIo(service, req, id, clientGone(reply));
    await io.closeSession(id, name);
    return reply.code(204).send();
  });
}
