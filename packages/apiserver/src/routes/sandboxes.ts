import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { toDsecError } from '@dsec/core';
import type { CommandSpec } from '@dsec/core';
import { principalOf } from '../auth.js';
import {
  CommandBody,
  CreateSandboxBody,
  IdParams,
  ListSandboxesQuery,
  parse,
  toSandboxSpec,
} from '../schemas.js';
import type { OpenSandbox, SandboxService } from '../sandbox-service.js';
import { clientGone, openStream, requireIo, sendCommandStream, wantsNdjson } from './io-common.js';

/** Socket idle allowance beyond a command's own timeout. */
const COMMAND_SOCKET_GRACE_MS = 60_000;

export function sandboxRoutes(app: FastifyInstance, service: SandboxService): void {
  app.post('/v1/sandboxes', async (req, reply) => {
    const body = parse(CreateSandboxBody, req.body);
    const info = await service.create(
      principalOf(req),
      { spec: toSandboxSpec(body), projectId: body.projectId, requestId: body.requestId },
      clientGone(reply),
    );
    return reply.code(201).send(info);
  });

  app.get('/v1/sandboxes', async (req, reply) => {
    const q = parse(ListSandboxesQuery, req.query, 'query');
    return {
      sandboxes: await service.list(principalOf(req), q.projectId, clientGone(reply), {
        labels: q.labels,
      }),
    };
  });

  app.get('/v1/sandboxes/:id', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    return service.get(principalOf(req), id, clientGone(reply));
  });

  app.delete('/v1/sandboxes/:id', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    await service.delete(principalOf(req), id, clientGone(reply));
    return reply.code(204).send();
  });

  app.post('/v1/sandboxes/:id/commands', async (req, reply) => {
    const { id } = parse(IdParams, req.params, 'path');
    const command = parse(CommandBody, req.body);
    const principal = principalOf(req);
    if (command.background) {
      const { edge } = await service.open(principal, id, clientGone(reply));
      return reply.code(202).send(await requireIo(edge).startCommand(id, command));
    }
    // A quiet command must not trip the idle-socket timeout before its own timeout.
    const socket = req.raw.socket as { setTimeout?: unknown } | undefined;
    if (typeof socket?.setTimeout === 'function')
      req.raw.socket.setTimeout(command.timeoutMs + COMMAND_SOCKET_GRACE_MS);
    const signal = clientGone(reply);
    if (wantsRawStdout(req)) {
      const sandbox = await service.open(principal, id, signal);
      return streamRawStdout(req, reply, service, sandbox, command, signal);
    }
    if (!wantsNdjson(req)) return service.run(principal, id, command, { signal });

    // Authorise before streaming so a bad ID is a plain 404, not an event in a 200 stream.
    const sandbox = await service.open(principal, id, signal);
    return sendCommandStream(req, reply, signal, (o) => service.runIn(sandbox, command, o));
  });
}

function wantsRawStdout(req: FastifyRequest): boolean {
  const accept = req.headers.accept;
  return typeof accept === 'string' && accept.toLowerCase().includes('application/octet-stream');
}

/**
 * The fast path for bulk output: the body is the command's stdout, byte for
 * byte, with no framing or encoding; the CommandResult (without the stdout
 * and stderr text, which stay readable by command ID) comes in the
 * `x-dsec-result` trailer, base64 JSON, or `x-dsec-error` on failure.
 */
async function streamRawStdout(
  req: FastifyRequest,
  reply: FastifyReply,
  service: SandboxService,
  sandbox: OpenSandbox,
  command: CommandSpec,
  signal: AbortSignal,
): Promise<void> {
  const res = reply.raw;
  const stop = new AbortController();
  // Before the hijack: past the key's stream cap this is a plain 429 answer.
  const ticket = openStream(
    req,
    reply,
    () => res.writableLength,
    () => stop.abort(new Error('client is not reading the stream')),
  );
  reply.hijack();
  res.writeHead(200, {
    'content-type': 'application/octet-stream',
    'cache-control': 'no-store',
    'x-request-id': req.id,
    trailer: 'x-dsec-result, x-dsec-error',
  });
  const encode = (value: unknown) => Buffer.from(JSON.stringify(value)).toString('base64');
  try {
    const result = await service.runIn(sandbox, command, {
      signal: AbortSignal.any([signal, stop.signal]),
      onStdout: (chunk) => {
        if (res.destroyed) return;
        res.write(chunk);
        ticket.check();
      },
    });
    if (res.destroyed) return;
    res.addTrailers({ 'x-dsec-result': encode({ ...result, stdout: '', stderr: '' }) });
  } catch (err) {
    if (res.destroyed) return;
    const e = toDsecError(err);
    if (e.code === 'internal') req.log.error({ err }, 'streamed command failed');
    res.addTrailers({ 'x-dsec-error': encode({ code: e.code, message: e.message }) });
  }
  res.end();
}
