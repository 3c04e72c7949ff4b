import http from 'node:http';
import type { IncomingMessage } from 'node:http';
import type { Duplex } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { WebSocketServer } from 'ws';
import { z } from 'zod';
import type { RawData, WebSocket } from 'ws';
import { DsecError, requireIo, toDsecError } from '@dsec/core';
import type { ConnectionGuard, PtySession } from '@dsec/core';
import type { Iam } from '@dsec/iam';
import { sourceOf } from '../auth.js';
import type { CallerLimits, StreamTicket } from '../limits.js';
import { resetAndDestroy } from './ports.js';
import { parse } from '../schemas.js';
import { PtyQuery } from '../schemas-io.js';
import type { SandboxService } from '../sandbox-service.js';

/** The first message must arrive this soon after the handshake, or the socket is closed. */
export const PTY_WS_AUTH_TIMEOUT_MS = 10_000;
/** Largest message either way: keystrokes and resizes are tiny, output is chunked by the edge. */
const MAX_MESSAGE_BYTES = 1024 * 1024;
/** Close codes (RFC 6455 §7.4.1): normal end, policy (auth), internal error. */
const CLOSE_NORMAL = 1000;
const CLOSE_POLICY = 1008;
const CLOSE_ERROR = 1011;

const PATH = /^\/v1\/sandboxes\/([^/]{1,256})\/pty$/;

const AuthMessage = z.object({ type: z.literal('auth'), key: z.string().max(1024) }).strict();
const dim = z.number().int().min(1).max(1000);
/** Control messages; others (a newer client's) are ignored, as clients skip unknown events. */
const ControlMessage = z.discriminatedUnion('type', [
  z.object({ type: z.literal('resize'), rows: dim, cols: dim }).strict(),
  z.object({ type: z.literal('eof') }).strict(),
]);

/**
 * `GET /v1/sandboxes/:id/pty` with `Upgrade: websocket`: the same terminal
 * as `Upgrade: dsec-pty`, for browsers, which can neither send that upgrade
 * nor an `Authorization` header on a WebSocket. The key travels in the first
 * message, `{"type":"auth","key":"..."}`, never in the URL (URLs end up in
 * access logs and browser history). Then binary messages are terminal bytes
 * both ways; text messages are JSON control: the client sends
 * `{"type":"resize","rows","cols"}` and `{"type":"eof"}`, the server sends
 * `{"type":"ready"}` once the terminal is open, `{"type":"exit","exitCode"}`
 * when the shell ends, or `{"type":"error","error":{code,message}}` (the
 * API's error shape), each followed by a close.
 *
 * Handles every `Upgrade: websocket` request on the server (answering 404 to
 * paths that are not a terminal), so the `dsec-pty` handler skips them.
 */
export function ptyWebSocket(
  app: FastifyInstance,
  service: SandboxService,
  iam: Iam,
  bounds: { limits?: CallerLimits; guard?: ConnectionGuard } = {},
): void {
  const wss = new WebSocketServer({ noServer: true, maxPayload: MAX_MESSAGE_BYTES });
  app.server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    if (String(req.headers.upgrade).toLowerCase() !== 'websocket') return;
    socket.on('error', () => undefined);
    const url = new URL(req.url ?? '/', 'http://x');
    const m = PATH.exec(url.pathname);
    let query: ReturnType<typeof PtyQuery.parse>;
    try {
      if (!m) throw new DsecError('not_found', 'no such upgrade route');
      query = parse(PtyQuery, Object.fromEntries(url.searchParams), 'query');
    } catch (err) {
      refuse(socket, err);
      return;
    }
    const id = decodeURIComponent(m[1] ?? '');
    wss.handleUpgrade(req, socket, head, (ws) => {
      // Until its key has authenticated, the connection holds no room another client needs.
      const authenticated = bounds.guard?.waiting(socket) ?? (() => undefined);
      serve(ws, socket, id, query, { service, iam, limits: bounds.limits, authenticated }, req);
    });
  });
  app.addHook('onClose', async () => {
    for (const ws of wss.clients) ws.terminate();
    wss.close();
  });
}

/** Answers a refused handshake in the API's error shape. */
function refuse(socket: Duplex, err: unknown): void {
  const e = toDsecError(err);
  const body = JSON.stringify(e.toJSON());
  socket.end(
    `HTTP/1.1 ${e.status} ${http.STATUS_CODES[e.status] ?? 'Error'}\r\n` +
      `content-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`,
  );
}

function sendError(ws: WebSocket, err: unknown): void {
  const e = toDsecError(err);
  ws.send(JSON.stringify({ type: 'error', ...e.toJSON() }));
  ws.close(e.code === 'unauthenticated' ? CLOSE_POLICY : CLOSE_ERROR, e.code);
}

function serve(
  ws: WebSocket,
  socket: Duplex,
  id: string,
  query: ReturnType<typeof PtyQuery.parse>,
  deps: {
    service: SandboxService;
    iam: Iam;
    limits: CallerLimits | undefined;
    authenticated: () => void;
  },
  req: IncomingMessage,
): void {
  const { service, iam, limits } = deps;
  const source = sourceOf(req);
  const ac = new AbortController();
  let pty: PtySession | undefined;
  let ticket: StreamTicket | undefined;
  const authTimer = setTimeout(
    () => sendError(ws, new DsecError('unauthenticated', 'no key sent in time')),
    PTY_WS_AUTH_TIMEOUT_MS,
  );
  ws.once('close', () => {
    clearTimeout(authTimer);
    ac.abort();
    pty?.kill();
    ticket?.release();
  });
  ws.on('error', () => ws.terminate());
  ws.once('message', (data, isBinary) => {
    clearTimeout(authTimer);
    void open(data, isBinary).catch((err: unknown) => {
      if (ws.readyState === ws.OPEN) sendError(ws, err);
    });
  });

  const open = async (data: RawData, isBinary: boolean): Promise<void> => {
    const first = AuthMessage.safeParse(isBinary ? undefined : parseJson(data));
    if (!first.success) {
      throw new DsecError('unauthenticated', 'the first message must be {"type":"auth","key":...}');
    }
    const principal = await iam.authenticate(first.data.key, { source });
    if (ws.readyState !== ws.OPEN) return;
    deps.authenticated();
    // A terminal is a stream of its key (`maxStreamsPerKey`) whose unread output counts
    // against the output budget: a client that stops reading is cut, its backlog dropped.
    ticket = limits?.openStream(
      principal,
      () => ws.bufferedAmount,
      () => {
        pty?.kill();
        resetAndDestroy(socket);
      },
    );
    const { edge } = await service.open(principal, id, ac.signal);
    const session = await requireIo(edge).openPty(id, {
      rows: query.rows,
      cols: query.cols,
      shell: query.shell,
      user: query.user,
      env: query.term ? { TERM: query.term } : undefined,
    });
    if (ws.readyState !== ws.OPEN) {
      session.kill();
      return;
    }
    pty = session;
    session.onOutput((chunk) => {
      if (ws.readyState !== ws.OPEN) return;
      ws.send(chunk, { binary: true });
      ticket?.check();
    });
    void session.exited.then(({ exitCode }) => {
      if (ws.readyState !== ws.OPEN) return;
      ws.send(JSON.stringify({ type: 'exit', exitCode }));
      ws.close(CLOSE_NORMAL, 'exit');
    });
    ws.on('message', (msg, binary) => {
      if (binary) {
        session.write(toBuffer(msg));
        return;
      }
      const c = ControlMessage.safeParse(parseJson(msg));
      if (!c.success) return;
      if (c.data.type === 'resize') session.resize(c.data.rows, c.data.cols);
      else session.end();
    });
    ws.send(JSON.stringify({ type: 'ready' }));
  };
}

function toBuffer(data: RawData): Buffer {
  if (Buffer.isBuffer(data)) return data;
  if (Array.isArray(data)) return Buffer.concat(data);
  return Buffer.from(data);
}

function parseJson(data: RawData): unknown {
  try {
    return JSON.parse(toBuffer(data).toString('utf8'));
  } catch {
    return undefined;
  }
}
