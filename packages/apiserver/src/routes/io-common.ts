import { PassThrough, type Readable } from 'node:stream';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { requireIo, toDsecError } from '@dsec/core';
import type { CommandResult, SandboxIoApi } from '@dsec/core';
import { principalOf } from '../auth.js';
import { destroyConnection, limitsOf } from '../limits.js';
import type { StreamTicket } from '../limits.js';
import type { SandboxService } from '../sandbox-service.js';

/**
 * A stream whose reader has fallen this far behind is cut off: a client that
 * never reads must not grow memory (the default of `ApiLimits.streamBufferBytes`).
 */
export const MAX_STREAM_BUFFER_BYTES = 8 * 1024 * 1024;

/**
 * Opens a long-lived answer of the request's key: counted against the key's
 * `maxStreamsPerKey` (throws `rate_limited` past it, before anything is
 * sent) and, through `measure` (the bytes it has queued now), against the
 * output budget. When it must stop (its client does not read), `stop` runs
 * and then its connection is destroyed, dropping what it had queued.
 * Released when the response closes.
 */
export function openStream(
  req: FastifyRequest,
  reply: FastifyReply,
  measure: () => number,
  stop: () => void,
): StreamTicket {
  const cut = () => {
    stop();
    destroyConnection(reply);
  };
  const limits = limitsOf(req);
  const ticket: StreamTicket = limits
    ? limits.openStream(principalOf(req), measure, cut)
    : {
        check: () => {
          if (measure() <= MAX_STREAM_BUFFER_BYTES) return true;
          cut();
          return false;
        },
        release: () => undefined,
      };
  reply.raw.once('close', () => ticket.release());
  return ticket;
}

export { requireIo };

/** Authorises the caller for the sandbox and returns its edge's in-sandbox interface. */
export async function openIo(
  service: SandboxService,
  req: FastifyRequest,
  id: string,
  signal: AbortSignal,
): Promise<SandboxIoApi> {
  const { edge } = await service.authorize(principalOf(req), id, signal);
  return requireIo(edge);
}

/** Aborts when the client goes away before the answer is complete. */
export function clientGone(reply: FastifyReply): AbortSignal {
  const ac = new AbortController();
  reply.raw.once('close', () => {
    if (!reply.raw.writableFinished) ac.abort(new Error('client closed the connection'));
  });
  return ac.signal;
}

export function wantsNdjson(req: FastifyRequest): boolean {
  const accept = req.headers.accept;
  return typeof accept === 'string' && accept.toLowerCase().includes('application/x-ndjson');
}

/**
 * Sockets whose request body is being streamed to a handler (an upload, a
 * stdin stream). Such a body may rightly take longer than the server's
 * `requestTimeout`; the server's client-error handler lets the idle socket
 * timeout govern these instead (see `buildApiServer`).
 */
export const streamingBodySockets = new WeakSet<object>();

/**
 * Streamed request bodies arrive as the raw stream (no buffering, no size
 * limit, no total time limit: only headers are bounded by time, by the
 * server's `headersTimeout`).
 */
export function rawBodies(scope: FastifyInstance, types: string | string[] | RegExp): void {
  scope.addContentTypeParser(types, (req, payload, done) => {
    const socket = req.raw.socket as object | null;
    if (socket && !req.raw.complete) {
      streamingBodySockets.add(socket);
      const release = () => streamingBodySockets.delete(socket);
      req.raw.once('end', release).once('close', release);
    }
    done(null, payload);
  });
}

/** A raw body as a stream (undefined when the request had none). */
export function bodyStream(req: FastifyRequest): Readable | undefined {
  const b: unknown = req.body;
  if (b && typeof (b as Readable).pipe === 'function') return b as Readable;
  return undefined;
}

/**
 * Answers with the NDJSON command event stream of docs/CONVENTIONS.md:
 * `stdout`/`stderr` events (base64), then `result` or `error`. `run` gets
 * the callbacks and a signal that fires when the client leaves or stops
 * reading (`openStream`: the stream is then cut with its connection).
 */
export function sendCommandStream(
  req: FastifyRequest,
  reply: FastifyReply,
  signal: AbortSignal,
  run: (o: {
    signal: AbortSignal;
    onStdout: (chunk: Buffer) => void;
    onStderr: (chunk: Buffer) => void;
  }) => Promise<CommandResult>,
): FastifyReply {
  const out = new PassThrough();
  out.on('error', () => undefined);
  const stop = new AbortController();
  const both = AbortSignal.any([signal, stop.signal]);
  const ticket = openStream(
    req,
    reply,
    () => out.writableLength + out.readableLength + reply.raw.writableLength,
    () => {
      stop.abort(new Error('client is not reading the stream'));
      out.destroy();
    },
  );
  const write = (event: unknown) => {
    if (out.destroyed || out.writableEnded) return;
    out.write(`${JSON.stringify(event)}\n`);
    ticket.check();
  };
  run({
    signal: both,
    onStdout: (chunk) => write({ type: 'stdout', data: chunk.toString('base64') }),
    onStderr: (chunk) => write({ type: 'stderr', data: chunk.toString('base64') }),
  })
    .then(
      (result) => write({ type: 'result', result }),
      (err: unknown) => {
        const e = toDsecError(err);
        if (e.code === 'internal') req.log.error({ err }, 'streamed command failed');
        write({ type: 'error', error: { code: e.code, message: e.message } });
      },
    )
    .finally(() => {
      if (!out.destroyed) out.end();
    });
  return reply
    .header('content-type', 'application/x-ndjson')
    .header('cache-control', 'no-store')
    .header('x-accel-buffering', 'no')
    .send(out);
}

/** Sets the idle timeout of the request's socket (0: none), where there is a real socket. */
export function socketTimeout(req: FastifyRequest, ms: number): void {
  const socket = req.raw.socket as { setTimeout?: unknown } | undefined;
  if (typeof socket?.setTimeout === 'function') req.raw.socket.setTimeout(ms);
}
