import http from 'node:http';
import type net from 'node:net';
import type { IncomingMessage } from 'node:http';
import type { Duplex, Readable } from 'node:stream';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { DsecError, toDsecError } from '@dsec/core';
import type { PtySession } from '@dsec/core';
import type { Iam } from '@dsec/iam';
import type { CallerLimits, StreamTicket } from '../limits.js';
import { parse } from '../schemas.js';
import { PortParams, PtyQuery } from '../schemas-io.js';
import type { SandboxService } from '../sandbox-service.js';
import { bearerKey, sourceOf } from '../auth.js';
import { bodyStream, clientGone, openIo, rawBodies, requireIo } from './io-common.js';
import { sandboxBoundHeaders, sandboxBoundUrl } from './port-credentials.js';

const DROP_RESPONSE = new Set([
  'connection',
  'keep-alive',
  'transfer-encoding',
  'trailer',
  'upgrade',
  'proxy-authenticate',
]);

/**
 * `ANY /v1/sandboxes/:id/ports/:port/*`: one HTTP/1.1 request to a service
 * listening on `127.0.0.1:port` inside the sandbox, carried over a byte
 * stream the edge opens in the sandbox's network namespace (`Connection:
 * close`, one request per stream). Bodies stream both ways.
 */
export function portRoutes(app: FastifyInstance, service: SandboxService): void {
  app.removeAllContentTypeParsers();
  rawBodies(app, '*');
  // Tells a DSec error (no such sandbox, nothing listening) from the service's own answers.
  app.addHook('onError', async (_req, reply) => {
    reply.header('x-dsec-error', '1');
  });
  const handler = async (req: FastifyRequest, reply: FastifyReply) => {
    const params = parse(PortParams, req.params, 'path');
    // The path as the client sent it (still percent-encoded: `%2F` or `%3F` must not turn into
    // a separator for the service), after `/v1/sandboxes/:id/ports/:port`.
    const url = req.raw.url ?? '/';
    const q = url.indexOf('?');
    const rest = (q >= 0 ? url.slice(0, q) : url).split('/').slice(6).join('/');
    // Hop-by-hop headers and every credential of the caller stay here (port-credentials.ts).
    const secrets = [bearerKey(req.headers.authorization) ?? ''];
    const path = sandboxBoundUrl(`/${rest}${q >= 0 ? url.slice(q) : ''}`, secrets);
    const headers = sandboxBoundHeaders(req.headers, {
      secrets,
      dropAuthorization: true,
      dropHost: true,
    });
    headers.host = `127.0.0.1:${params.port}`;
    headers.connection = 'close';
    const signal = clientGone(reply);
    const io = await openIo(service, req, params.id, signal);
    const socket = await io.connectPort(params.id, params.port, { signal });
    const res = await forwardToPort(socket, req.method, path, headers, bodyStream(req), signal);
    return reply
      .code(res.statusCode ?? 502)
      .headers(responseHeaders(res))
      .send(res);
  };
  app.all('/v1/sandboxes/:id/ports/:port', handler);
  app.all('/v1/sandboxes/:id/ports/:port/*', handler);
}

/** A response's headers without the hop-by-hop ones, to pass on to the client. */
export function responseHeaders(res: IncomingMessage): Record<string, string | string[]> {
  const out: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(res.headers)) {
    if (!DROP_RESPONSE.has(k.toLowerCase()) && v !== undefined) out[k] = v;
  }
  return out;
}

/**
 * Sends one HTTP/1.1 request over `socket` (a stream into the sandbox's
 * port) and resolves with the response; `body` streams up, if any. Also
 * used by the E2B-compatible API's port routing.
 */
export function forwardToPort(
  socket: Duplex,
  method: string,
  path: string,
  headers: http.OutgoingHttpHeaders,
  body: Readable | undefined,
  signal: AbortSignal,
): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => {
    let upstream: http.ClientRequest;
    try {
      upstream = http.request({
        method,
        path,
        headers,
        createConnection: () => socket,
        signal,
      });
    } catch (err) {
      // A method or header value Node will not send (the path is encoded already).
      socket.destroy();
      reject(new DsecError('invalid_argument', `cannot forward this request: ${String(err)}`));
      return;
    }
    let answered = false;
    upstream.on('response', (res) => {
      answered = true;
      resolve(res);
    });
    // The tunnel can fail (nothing listens) before the client has attached
    // to it; its own error then never reaches `upstream`, so watch it too.
    let tunnelError: unknown;
    socket.once('error', (err) => (tunnelError = err));
    socket.once('close', () => {
      if (!answered) {
        upstream.destroy(
          tunnelError instanceof Error
            ? tunnelError
            : new DsecError('unavailable', 'the port tunnel closed'),
        );
      }
    });
    upstream.on('error', (err) => {
      socket.destroy();
      reject(
        err instanceof DsecError
          ? err
          : new DsecError('unavailable', `the sandbox's service did not answer: ${err.message}`),
      );
    });
    if (body) body.pipe(upstream);
    else upstream.end();
  });
}

/** Frame types of the terminal stream: `u8 type | u32be length | payload`. */
export const PTY_DATA = 0;
export const PTY_RESIZE = 1;
export const PTY_EOF = 2;
export const PTY_EXIT = 3;
export const PTY_UPGRADE = 'dsec-pty';

/**
 * `GET /v1/sandboxes/:id/pty` with `Upgrade: dsec-pty`: an interactive
 * terminal. After `101 Switching Protocols` both directions carry frames:
 * the client sends DATA (keystrokes), RESIZE (u16be rows, u16be cols) and
 * EOF; the server sends DATA (terminal output) and finally EXIT (i32be code).
 * An upgraded connection is outside the HTTP request timeouts, as a terminal
 * session must be.
 */
export function ptyUpgrade(
  app: FastifyInstance,
  service: SandboxService,
  iam: Iam,
  limits?: CallerLimits,
): void {
  app.server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    // Browsers' WebSocket terminals are served by ./pty-ws.ts.
    if (String(req.headers.upgrade).toLowerCase() === 'websocket') return;
    void handleUpgrade(req, socket, head, service, iam, limits);
  });
}

async function handleUpgrade(
  req: IncomingMessage,
  socket: Duplex,
  head: Buffer,
  service: SandboxService,
  iam: Iam,
  limits: CallerLimits | undefined,
): Promise<void> {
  socket.on('error', () => undefined);
  let pty: PtySession | undefined;
  let ticket: StreamTicket | undefined;
  try {
    const url = new URL(req.url ?? '/', 'http://x');
    const m = /^\/v1\/sandboxes\/([^/]{1,256})\/pty$/.exec(url.pathname);
    if (!m || String(req.headers.upgrade).toLowerCase() !== PTY_UPGRADE) {
      throw new DsecError('not_found', 'no such upgrade route');
    }
    const principal = await iam.authenticate(bearerKey(req.headers.authorization), {
      source: sourceOf(req),
    });
    const q = parse(PtyQuery, Object.fromEntries(url.searchParams), 'query');
    const id = decodeURIComponent(m[1] ?? '');
    // A terminal is a stream of its key (`maxStreamsPerKey`), and its unread output counts
    // against the output budget: a client that stops reading is cut, its backlog dropped.
    const stream = limits?.openStream(
      principal,
      () => socket.writableLength,
      () => {
        pty?.kill();
        resetAndDestroy(socket);
      },
    );
    ticket = stream;
    socket.once('close', () => stream?.release());
    const ac = new AbortController();
    socket.once('close', () => ac.abort());
    const { edge } = await service.open(principal, id, ac.signal);
    pty = await requireIo(edge).openPty(id, {
      rows: q.rows,
      cols: q.cols,
      shell: q.shell,
      user: q.user,
      env: q.term ? { TERM: q.term } : undefined,
    });
  } catch (err) {
    const e = toDsecError(err);
    const body = JSON.stringify(e.toJSON());
    socket.end(
      `HTTP/1.1 ${e.status} ${http.STATUS_CODES[e.status] ?? 'Error'}\r\n` +
        `content-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`,
    );
    return;
  }
  const session = pty;
  socket.write(
    `HTTP/1.1 101 Switching Protocols\r\nupgrade: ${PTY_UPGRADE}\r\nconnection: Upgrade\r\n\r\n`,
  );
  session.onOutput((chunk) => {
    if (socket.destroyed) return;
    socket.write(ptyFrame(PTY_DATA, chunk));
    ticket?.check();
  });
  void session.exited.then(({ exitCode }) => {
    const p = Buffer.alloc(4);
    p.writeInt32BE(exitCode, 0);
    socket.end(ptyFrame(PTY_EXIT, p));
  });
  socket.once('close', () => session.kill());
  const reader = new PtyFrameReader((type, payload) => {
    if (type === PTY_DATA) session.write(payload);
    else if (type === PTY_RESIZE && payload.length >= 4) {
      session.resize(payload.readUInt16BE(0), payload.readUInt16BE(2));
    } else if (type === PTY_EOF) session.end();
  });
  if (head.length > 0) reader.push(head);
  socket.on('data', (chunk: Buffer) => {
    try {
      reader.push(chunk);
    } catch {
      socket.destroy();
    }
  });
}

/** Closes with a TCP reset where it can: what is queued for the socket goes with it. */
export function resetAndDestroy(socket: Duplex): void {
  const s = socket as Partial<net.Socket> & Duplex;
  if (typeof s.resetAndDestroy === 'function') s.resetAndDestroy();
  else socket.destroy();
}

export function ptyFrame(type: number, payload: Buffer): Buffer {
  const h = Buffer.alloc(5);
  h.writeUInt8(type, 0);
  h.writeUInt32BE(payload.length, 1);
  return Buffer.concat([h, payload]);
}

/**
 * Splits a byte stream into terminal frames (at most 1 MiB each). Pieces
 * are kept as they come and joined once, when their frame is whole: the
 * client chooses how its bytes are cut, and joining on every piece copied
 * all gathered so far each time (a 1 MiB frame in 16-byte pieces cost 48 s
 * of the event loop). Each byte is copied at most three times.
 */
export class PtyFrameReader {
  /** Unconsumed pieces, oldest first; together `#bytes` long. */
  #pieces: Buffer[] = [];
  #bytes = 0;
  constructor(readonly onFrame: (type: number, payload: Buffer) => void) {}

  push(chunk: Buffer): void {
    if (chunk.length === 0) return;
    this.#pieces.push(chunk);
    this.#bytes += chunk.length;
    while (this.#bytes >= 5) {
      // A header split across pieces: join them once (this frame's first piece is then whole).
      if (this.#pieces[0]!.length < 5) this.#pieces = [Buffer.concat(this.#pieces, this.#bytes)];
      const head = this.#pieces[0]!;
      const len = head.readUInt32BE(1);
      if (len > 1 << 20) throw new DsecError('invalid_argument', 'terminal frame too large');
      if (this.#bytes < 5 + len) break;
      const all = this.#pieces.length === 1 ? head : Buffer.concat(this.#pieces, this.#bytes);
      const rest = all.subarray(5 + len);
      this.#pieces = rest.length > 0 ? [rest] : [];
      this.#bytes = rest.length;
      this.onFrame(all.readUInt8(0), all.subarray(5, 5 + len));
    }
  }
}
