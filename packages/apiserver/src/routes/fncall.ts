import { PassThrough } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { DsecError } from '@dsec/core';
import { principalOf } from '../auth.js';
import type { FnCallService } from '../fncall-service.js';
import { parse } from '../schemas.js';
import { FnCallBatchBody, FnCallBody } from '../schemas-fncall.js';
import { clientGone, openStream, socketTimeout } from './io-common.js';

/** Socket idle allowance beyond a call's own time limit (queueing on a busy pool included). */
const CALL_SOCKET_GRACE_MS = 60_000;
/** The most a call may run (the schema's bound on `timeoutMs`). */
const MAX_CALL_MS = 300_000;

/**
 * Stateless function calls (issue 14; docs/fncall.md): one call answered as
 * its `FnCallResult`, or a batch streamed back as NDJSON, one line per call
 * as it finishes: `{ index, result }` or `{ index, error: { code, message } }`.
 */
export function fncallRoutes(app: FastifyInstance, service: FnCallService): void {
  app.post('/v1/fncall', async (req, reply) => {
    const body = parse(FnCallBody, req.body);
    socketTimeout(req, (body.timeoutMs ?? MAX_CALL_MS) + CALL_SOCKET_GRACE_MS);
    return service.run(principalOf(req), body, clientGone(reply));
  });

  app.post('/v1/fncall/batch', async (req, reply) => {
    const body = parse(FnCallBatchBody, req.body);
    const principal = principalOf(req);
    // Admission (the quota) comes before the stream starts: a refusal is a plain error answer.
    await service.admit(principal, body.calls.length);
    // A batch may rightly outlast any one call; the socket is idle only between results.
    socketTimeout(req, MAX_CALL_MS + CALL_SOCKET_GRACE_MS);
    const gone = clientGone(reply);
    const stop = new AbortController();
    const signal = AbortSignal.any([gone, stop.signal]);
    const out = new PassThrough();
    out.on('error', () => undefined);
    const ticket = openStream(
      req,
      reply,
      () => out.writableLength + out.readableLength + reply.raw.writableLength,
      () => {
        stop.abort(new DsecError('aborted', 'the client is not reading the stream'));
        out.destroy();
      },
    );
    const batch = service.batch(
      principal,
      body.calls,
      body.concurrency,
      (item) => {
        if (out.destroyed) return;
        out.write(`${JSON.stringify(item)}\n`);
        ticket.check();
      },
      signal,
    );
    batch
      .catch((err: unknown) => {
        req.log.error({ err }, 'fncall batch failed');
        out.destroy(err instanceof Error ? err : new Error(String(err)));
      })
      .finally(() => {
        if (!out.destroyed) out.end();
      });
    return reply
      .header('content-type', 'application/x-ndjson')
      .header('cache-control', 'no-store')
      .header('x-accel-buffering', 'no')
      .send(out);
  });
}
