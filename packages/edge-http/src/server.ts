import { createHash } from 'node:crypto';
import http from 'node:http';
import type { IncomingMessage, OutgoingHttpHeaders, ServerResponse } from 'node:http';
import https from 'node:https';
import net from 'node:net';
import { TLSSocket } from 'node:tls';
import type { AddressInfo } from 'node:net';
import { PassThrough, Readable } from 'node:stream';
import type { Duplex } from 'node:stream';
import { pino } from 'pino';
import { ConnectionGuard, DsecError, requireIo, requireLifecycle, toDsecError } from '@dsec/core';
import type { ConnectionLimits } from '@dsec/core';
import type {
  EdgeVolumeApi,
  CommandResult,
  CreateSandboxRequest,
  DisplayInput,
  EdgeApi,
  NetworkPolicyPatch,
  PtyOptions,
  PtySession,
  SandboxIoApi,
  EdgeSnapshotRequest,
} from '@dsec/core';
import {
  bodyDigest,
  bodyMatches,
  checkSecret,
  digestOf,
  HEADER_PROOF,
  RequestVerifier,
  STREAMED,
  TRAILER_BODY_MAC,
  unauthenticated,
} from './auth.js';
import type { SignedExchange, VerifiedRequest } from './auth.js';
import {
  BODY_DATA,
  BODY_END,
  CMD_ERROR,
  CMD_RESULT,
  CMD_STDERR,
  CMD_STDOUT,
  exitPayload,
  frame,
  FrameMacError,
  FrameReader,
  FRAMES_CONTENT_TYPE,
  MAX_BODY_FRAME_BYTES,
  MAX_PORT_FRAME_BYTES,
  MAX_PTY_FRAME_BYTES,
  PORT_FRAME_BYTES,
  PORT_DATA,
  PORT_END,
  PORT_UPGRADE,
  PTY_DATA,
  PTY_EOF,
  PTY_EXIT,
  PTY_KILL,
  PTY_RESIZE,
  PTY_UPGRADE,
} from './frames.js';
import {
  encodeStreamError,
  EDGE_PATH_PREFIX,
  HEADER_STREAM_ERROR,
  MAX_JSON_BODY_BYTES,
} from './protocol.js';

/** What the server logs with: pino, or anything with the same three methods. */
export interface EdgeLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
  error(obj: object, msg: string): void;
}

export interface EdgeServerOptions {
  /** The edge to serve (an in-process `Edge`, or any `EdgeApi`). */
  edge: EdgeApi;
  /** The per-edge secret shared with the apiservers (`newEdgeSecret()`). */
  secret: string;
  /** Address to listen on. Default `127.0.0.1`. */
  host?: string;
  /** Port to listen on; 0 (the default) picks a free one. */
  port?: number;
  /** A pino(-compatible) logger, `true` for a pino logger to stdout, `false` for none (default). */
  logger?: EdgeLogger | boolean;
  /**
   * The edge's Prometheus text (`metricsText([edgeMetrics.registry])`), served
   * at `GET /edge/v1/metrics` to signed requests only; an unauthenticated
   * scraper uses the edge's admin listener (`metricsListen`) instead.
   */
  metrics?: (() => Promise<string>) | undefined;
  /**
   * Serve over TLS (1.3) with this certificate and key (PEM); apiservers pin
   * the certificate (`RemoteEdge`'s `tls.pinSha256`). A plaintext request
   * is answered with a plain `400` naming the problem, and closed.
   */
  tls?: EdgeTlsOptions | undefined;
  /**
   * How long a connection may take to bring a request head: from its first
   * byte to a TLS handshake's end, from there (or from a plaintext accept)
   * to its first request head, and for every later head (Node's own).
   * Default 30 000. A peer needs no secret to open connections, so each is
   * bounded in time.
   */
  headersTimeoutMs?: number | undefined;
  /**
   * Connection caps (`ConnectionGuard`: idle connections make room for new
   * ones, per-address cap, keep-alive shortened under pressure). Anyone who
   * reaches the port can connect, signed or not. Default
   * `CONNECTION_LIMIT_DEFAULTS`.
   */
  connectionLimits?: Partial<ConnectionLimits> | undefined;
}

export interface EdgeTlsOptions {
  /** The edge's certificate, PEM (a self-signed one is the usual choice: it is pinned, not chained). */
  cert: string | Buffer;
  /** Its private key, PEM. */
  key: string | Buffer;
}

export interface EdgeServer {
  /** `http://host:port` (or `https:` with `tls`), what `RemoteEdge` dials. */
  url: string;
  /**
   * Stops listening and cuts every connection, upgraded ones included: calls
   * still running see their client go away (a command without a `requestId`
   * is killed, as when an apiserver disconnects). The edge itself stays open.
   */
  close(): Promise<void>;
}

/** A reader this far behind on a command stream is cut off (as the public API does). */
const MAX_STREAM_BUFFER_BYTES = 8 * 1024 * 1024;
const HANDLED = Symbol('handled');
const EMPTY = Buffer.alloc(0);
/** The first byte of every TLS connection (a handshake record); anything else is plaintext. */
const TLS_HANDSHAKE = 0x16;

type StreamOptions = {
  signal: AbortSignal;
  onStdout: (chunk: Buffer) => void;
  onStderr: (chunk: Buffer) => void;
};

/**
 * Serves the whole `EdgeApi` over HTTP/1.1 (docs/edge-protocol.md): JSON
 * calls, command output as frames while it comes, request and answer
 * bodies streamed with back-pressure, ports and terminals over upgrades.
 * Every request must be signed with `secret` (its body included) and is
 * refused with 401 `unauthenticated`, without a proof, before the edge is
 * touched otherwise; every answer to a verified request carries the
 * server's proof over that request and the answer's status and body, and a
 * streamed answer authenticates each frame (or its trailer). A client that
 * goes away aborts the edge call it made, as a public API client's
 * disconnect does.
 *
 * @example
 * ```ts
 * const secret = newEdgeSecret();
 * const server = await serveEdge({ edge, secret, port: 7443 });
 * const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
 * ```
 */
export async function serveEdge(options: EdgeServerOptions): Promise<EdgeServer> {
  checkSecret(options.secret, 'secret');
  const { edge, secret } = options;
  const edgeId = edge.edgeId;
  const log = loggerOf(options.logger);
  const refused = refusalLog(log);
  const verifier = new RequestVerifier({ secret, edgeId });
  const routes = edgeRoutes(edge);
  const { metrics } = options;
  if (metrics) {
    routes.push(
      route('GET', '/metrics', async (c) => {
        c.answer(200, Buffer.from(await metrics()), 'text/plain; version=0.0.4; charset=utf-8');
        return HANDLED;
      }),
    );
  }
  const upgraded = new Set<Duplex>();
  const headMs = options.headersTimeoutMs ?? 30_000;

  const httpOptions = {
    // Streamed bodies (stdin, uploads) and quiet commands may take as long as
    // they take; only the headers are bounded in time.
    requestTimeout: 0,
    headersTimeout: headMs,
    // Longer than a busy apiserver's gap between calls, so pooled sockets stay warm.
    keepAliveTimeout: 65_000,
    noDelay: true,
  };
  const server = options.tls
    ? https.createServer({
        ...httpOptions,
        cert: options.tls.cert,
        key: options.tls.key,
        // Both ends are DSec: nothing older needs to be spoken.
        minVersion: 'TLSv1.3',
        handshakeTimeout: headMs,
      })
    : http.createServer(httpOptions);
  server.timeout = 0;
  // Node's header timeout starts with a connection's second request: the first one gets
  // its own deadline here, from the accept (or the TLS handshake's end) to its head.
  const firstHead = new WeakMap<Duplex, NodeJS.Timeout>();
  server.on(options.tls ? 'secureConnection' : 'connection', (socket: Duplex) => {
    const timer = setTimeout(() => socket.destroy(), headMs);
    firstHead.set(socket, timer);
    socket.once('close', () => clearTimeout(timer));
  });
  const headArrived = (socket: Duplex) => {
    clearTimeout(firstHead.get(socket));
    firstHead.delete(socket);
  };

  server.on('request', (req: IncomingMessage, res: ServerResponse) => {
    headArrived(req.socket);
    const method = req.method ?? 'GET';
    const url = req.url ?? '/';
    let verified: VerifiedRequest;
    try {
      verified = verifier.verify(method, url, req.headers);
    } catch (err) {
      refused({ remote: req.socket.remoteAddress, method, url, err: String(err) }, 'refused');
      req.resume();
      // No proof: only an answer to a verified request is ever proven.
      sendError(res, err, log, undefined);
      return;
    }
    const x = verified.exchange;
    const q = url.indexOf('?');
    const pathname = q < 0 ? url : url.slice(0, q);
    const found = match(routes, method, pathname);
    if (!found) {
      req.resume();
      sendError(res, new DsecError('not_found', `no edge route ${method} ${pathname}`), log, x);
      return;
    }
    const ac = new AbortController();
    // The one listener of this request: the client left before the answer was complete.
    res.once('close', () => {
      if (!res.writableFinished) {
        ac.abort(new DsecError('aborted', 'the client closed the connection'));
      }
    });
    const call = new Call(
      req,
      res,
      found.params,
      new URLSearchParams(q < 0 ? '' : url.slice(q)),
      ac,
      verified,
    );
    found.route.handler(call).then(
      (out) => {
        if (out === HANDLED) return;
        // A streamed request body that failed its MAC fails the call, whatever the edge made of it.
        if (call.bodyError) {
          sendError(res, call.bodyError, log, x);
          return;
        }
        if (out === undefined) call.answer(204);
        else call.answer(200, Buffer.from(JSON.stringify(out)), 'application/json');
      },
      (err: unknown) => {
        req.resume();
        if (call.bodyError)
          refused({ remote: req.socket.remoteAddress, method, url }, 'refused a request body');
        sendError(res, call.bodyError ?? err, log, x);
      },
    );
  });

  server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    headArrived(socket);
    upgraded.add(socket);
    socket.once('close', () => upgraded.delete(socket));
    void onUpgrade(req, socket, head, { edge, verifier, log, refused });
  });

  // Connection caps on the HTTP(S) server. A TLS edge's front listener holds no more sockets
  // waiting for their first byte (or refused as plaintext) than the caps allow connections, the
  // longest waiting making room for a new one; Node's own cap on it is only a backstop above
  // both (at the guard's cap it would drop a new connection before an idle one made room).
  const connectionGuard = new ConnectionGuard(options.connectionLimits);
  connectionGuard.attach(server);
  const cap = connectionGuard.limits.maxConnections;
  const guard = options.tls
    ? plaintextGuard(server as https.Server, edgeId, refused, headMs, cap)
    : undefined;
  if (guard) guard.listener.maxConnections = 2 * cap + 1;
  const listener = guard?.listener ?? server;
  await new Promise<void>((resolve, reject) => {
    listener.once('error', reject);
    listener.listen(options.port ?? 0, options.host ?? '127.0.0.1', () => {
      listener.off('error', reject);
      resolve();
    });
  });
  const address = listener.address() as AddressInfo;
  const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
  const url = `${options.tls ? 'https' : 'http'}://${host}:${address.port}`;
  log?.info({ url, edgeId }, 'edge API listening');

  let closing: Promise<void> | undefined;
  return {
    url,
    close() {
      closing ??= new Promise<void>((resolve) => {
        if (listener !== server) {
          listener.close(() => resolve());
          // Not listening itself: this stops its connection checks and idle sockets.
          server.close(() => undefined);
        } else server.close(() => resolve());
        server.closeAllConnections();
        for (const socket of upgraded) socket.destroy();
        for (const socket of guard?.sockets ?? []) socket.destroy();
      });
      return closing;
    },
  };
}

/**
 * The listener of a TLS edge: it looks at each connection's first byte and
 * hands TLS to `server`, but answers a plaintext request (an `http:` URL
 * for a TLS edge) with a plain `400` that says so, instead of the reset
 * TLS would give it. That answer has no proof: the client refuses it as
 * not authenticated, with its text as an unverified hint.
 *
 * `server`'s ConnectionGuard sees a connection only once it is handed
 * over, so the ones not handed over (waiting for their first byte, or
 * refused as plaintext) are bounded here: at `maxWaiting`, the longest
 * waiting is closed to make room, as the guard closes its longest idle.
 */
function plaintextGuard(
  server: https.Server,
  edgeId: string,
  refused: RefusalLog,
  headMs: number,
  maxWaiting: number,
): { listener: net.Server; sockets: Set<net.Socket> } {
  // `server` never listens itself; its connection tracking (header timeouts) starts here.
  server.emit('listening');
  const sockets = new Set<net.Socket>();
  /** Not handed to `server`, longest waiting first. */
  const waiting = new Set<net.Socket>();
  const listener = net.createServer({ pauseOnConnect: true, noDelay: true }, (socket) => {
    sockets.add(socket);
    socket.once('close', () => {
      sockets.delete(socket);
      waiting.delete(socket);
    });
    socket.on('error', () => undefined);
    if (waiting.size >= maxWaiting) {
      const oldest = waiting.values().next().value!;
      waiting.delete(oldest);
      oldest.destroy();
    }
    waiting.add(socket);
    // As long as the HTTP server would wait for headers.
    socket.setTimeout(headMs, () => socket.destroy());
    socket.once('data', (first: Buffer) => {
      socket.pause();
      socket.setTimeout(0);
      socket.unshift(first);
      if (first[0] === TLS_HANDSHAKE) {
        waiting.delete(socket);
        server.emit('connection', socket);
        return;
      }
      refused({ remote: socket.remoteAddress }, 'refused a plaintext connection to a TLS edge');
      const body = JSON.stringify(
        new DsecError(
          'invalid_argument',
          `edge ${edgeId} serves TLS only: dial it at https://`,
        ).toJSON(),
      );
      socket.end(
        `HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n` +
          `content-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`,
      );
      // Read (and drop) the rest until the client hangs up, but not for long.
      socket.setTimeout(5_000, () => socket.destroy());
      socket.resume();
    });
    socket.resume();
  });
  return { listener, sockets };
}

/** One request: its parsed parts, its abort signal, and the answers (each one proven). */
class Call {
  readonly signal: AbortSignal;
  readonly exchange: SignedExchange;
  /** Set when the request's body failed its signature: the call then fails with this. */
  bodyError: DsecError | undefined;

  constructor(
    readonly req: IncomingMessage,
    readonly res: ServerResponse,
    readonly params: string[],
    readonly query: URLSearchParams,
    readonly controller: AbortController,
    readonly verified: VerifiedRequest,
  ) {
    this.signal = controller.signal;
    this.exchange = verified.exchange;
  }

  /** A path parameter, percent-decoded. */
  p(i: number): string {
    const raw = this.params[i] ?? '';
    try {
      return decodeURIComponent(raw);
    } catch {
      throw new DsecError('invalid_argument', 'malformed path parameter');
    }
  }

  str(name: string): string | undefined {
    return this.query.get(name) ?? undefined;
  }

  int(name: string): number | undefined {
    const v = this.query.get(name);
    if (v === null) return undefined;
    const n = Number(v);
    if (!Number.isSafeInteger(n)) {
      throw new DsecError('invalid_argument', `${name} must be an integer`, { field: name });
    }
    return n;
  }

  flag(name: string): boolean | undefined {
    const v = this.query.get(name);
    return v === null ? undefined : v === '1' || v === 'true';
  }

  /** A whole answer, proven over its status, content type and body. */
  answer(status: number, body?: Buffer, contentType?: string): void {
    writeWhole(this.res, status, body, contentType, this.exchange);
  }

  /** The JSON body, which must be an object and the one the request signed. */
  async json(): Promise<Record<string, unknown>> {
    const chunks: Buffer[] = [];
    let size = 0;
    for await (const chunk of this.req) {
      size += (chunk as Buffer).length;
      if (size > MAX_JSON_BODY_BYTES) {
        throw new DsecError('payload_too_large', `request body over ${MAX_JSON_BODY_BYTES} bytes`);
      }
      chunks.push(chunk as Buffer);
    }
    const raw = Buffer.concat(chunks);
    if (!bodyMatches(this.verified, bodyDigest(raw), this.req.trailers)) {
      this.bodyError = badBody();
      throw this.bodyError;
    }
    let body: unknown;
    try {
      body = JSON.parse(raw.toString('utf8'));
    } catch {
      throw new DsecError('invalid_argument', 'the request body is not JSON');
    }
    if (typeof body !== 'object' || body === null || Array.isArray(body)) {
      throw new DsecError('invalid_argument', 'the request body must be a JSON object');
    }
    return body as Record<string, unknown>;
  }

  /**
   * The raw body as a stream, or undefined when the request has none; "none"
   * must be what the request signed, or a body stripped on the way would
   * pass for an empty one (stdin: no bytes, then EOF).
   */
  body(): Readable | undefined {
    const h = this.req.headers;
    if (h['transfer-encoding'] === undefined && (h['content-length'] ?? '0') === '0') {
      if (!bodyMatches(this.verified, bodyDigest(EMPTY), this.req.trailers)) {
        this.bodyError = badBody();
        throw this.bodyError;
      }
      return undefined;
    }
    return this.rawBody();
  }

  /**
   * The raw body as a stream of the bytes of its `BODY_DATA` frames, each
   * passed on only once its MAC checks out, and ended only by its `BODY_END`
   * frame. A frame that fails, a byte after the end, or a body that stops
   * without its end fails the stream (and so the call), and nothing of that
   * frame or after it is passed on: a command reading stdin never reads a
   * byte the client did not send, in the order it sent them.
   */
  rawBody(): Readable {
    const req = this.req;
    const out = new PassThrough();
    if (this.verified.body !== STREAMED) {
      // RemoteEdge frames every raw body and signs a digest only for none: bytes here were
      // added on the way (or come from a release before frames, refused as such).
      this.bodyError = badBody();
      out.destroy(this.bodyError);
      req.resume();
      return out;
    }
    let ended = false;
    const fail = (err: DsecError) => {
      this.bodyError ??= err;
      out.destroy(this.bodyError);
      req.off('data', onData);
      req.resume();
    };
    const reader = new FrameReader(
      MAX_BODY_FRAME_BYTES,
      this.exchange.sealer('request'),
      (type, payload) => {
        if (ended || (type !== BODY_DATA && type !== BODY_END)) throw new FrameMacError();
        if (type === BODY_END) ended = true;
        // A consumer that stopped reading (the command exited) holds nothing back.
        else if (payload.length > 0 && !out.destroyed && !out.write(payload)) req.pause();
      },
    );
    const onData = (chunk: Buffer) => {
      try {
        reader.push(chunk);
      } catch {
        // A frame that fails its MAC, or a length no client sends: the bytes were changed.
        fail(badBody());
      }
    };
    out.on('drain', () => req.resume());
    req.on('data', onData);
    req.once('end', () => {
      if (out.destroyed) return;
      if (ended && reader.pending === 0) out.end();
      else fail(badBody());
    });
    req.once('close', () => {
      if (!req.complete) out.destroy(new DsecError('aborted', 'the client closed the connection'));
    });
    return out;
  }

  /**
   * Answers with a command stream: output frames as the edge calls back,
   * then the result (or the error) frame, each with its MAC. An error
   * before any frame is a plain error answer with its status.
   */
  async frames(run: (o: StreamOptions) => Promise<CommandResult>): Promise<typeof HANDLED> {
    const res = this.res;
    const mac = this.exchange.sealer('answer');
    let started = false;
    const send = (type: number, payload: Buffer, last: boolean): void => {
      if (res.destroyed) return;
      if (!started) {
        started = true;
        res.writeHead(200, {
          'content-type': FRAMES_CONTENT_TYPE,
          'cache-control': 'no-store',
          [HEADER_PROOF]: this.#streamProof(FRAMES_CONTENT_TYPE),
        });
      }
      if (last) {
        res.end(frame(mac, type, payload));
      } else if (res.writableLength > MAX_STREAM_BUFFER_BYTES) {
        this.controller.abort(new DsecError('aborted', 'the client is not reading the stream'));
        res.destroy();
      } else {
        res.write(frame(mac, type, payload));
      }
    };
    let result: CommandResult;
    try {
      result = await run({
        signal: this.signal,
        onStdout: (chunk) => send(CMD_STDOUT, chunk, false),
        onStderr: (chunk) => send(CMD_STDERR, chunk, false),
      });
    } catch (err) {
      if (!started) throw err;
      send(CMD_ERROR, Buffer.from(JSON.stringify(toDsecError(err).toJSON())), true);
      return HANDLED;
    }
    send(CMD_RESULT, Buffer.from(JSON.stringify(result)), true);
    return HANDLED;
  }

  /**
   * Answers with a byte stream, ended by a MAC trailer over its SHA-256 and
   * the error trailer, which an error after the first byte adds.
   */
  async pipe(stream: Readable): Promise<typeof HANDLED> {
    const res = this.res;
    const type = 'application/octet-stream';
    res.writeHead(200, {
      'content-type': type,
      'cache-control': 'no-store',
      trailer: `${HEADER_STREAM_ERROR}, ${TRAILER_BODY_MAC}`,
      [HEADER_PROOF]: this.#streamProof(type),
    });
    const hash = createHash('sha256');
    const finish = (error: string) => {
      const mac = this.exchange.bodyMac('answer', digestOf(hash), error);
      res.addTrailers(
        error
          ? { [HEADER_STREAM_ERROR]: error, [TRAILER_BODY_MAC]: mac }
          : { [TRAILER_BODY_MAC]: mac },
      );
      res.end();
    };
    await new Promise<void>((resolve) => {
      stream.once('end', () => {
        finish('');
        resolve();
      });
      stream.once('error', (err) => {
        stream.unpipe(res);
        finish(encodeStreamError(err));
        resolve();
      });
      res.once('close', () => {
        if (!res.writableFinished) stream.destroy();
        resolve();
      });
      // Hashed as written: `pipe` writes each chunk in its own `data` listener.
      stream.on('data', (chunk: Buffer | string) => hash.update(chunk));
      stream.pipe(res, { end: false });
    });
    return HANDLED;
  }

  #streamProof(contentType: string): string {
    return this.exchange.proof({ status: 200, contentType, upgrade: '', body: STREAMED });
  }
}

function badBody(): DsecError {
  return unauthenticated('the request body is not the one its signature covers');
}

/** A whole answer; proven when it answers a verified request (`exchange`). */
function writeWhole(
  res: ServerResponse,
  status: number,
  body: Buffer | undefined,
  contentType: string | undefined,
  exchange: SignedExchange | undefined,
): void {
  const headers: OutgoingHttpHeaders = {};
  if (contentType) headers['content-type'] = contentType;
  if (status !== 204) headers['content-length'] = body?.length ?? 0;
  if (exchange) {
    headers[HEADER_PROOF] = exchange.proof({
      status,
      contentType: contentType ?? '',
      upgrade: '',
      body: bodyDigest(body ?? EMPTY),
    });
  }
  res.writeHead(status, headers).end(body);
}

interface Route {
  method: string;
  re: RegExp;
  handler: (c: Call) => Promise<unknown>;
}

function match(
  routes: Route[],
  method: string,
  pathname: string,
): { route: Route; params: string[] } | undefined {
  if (!pathname.startsWith(EDGE_PATH_PREFIX)) return undefined;
  const rest = pathname.slice(EDGE_PATH_PREFIX.length);
  for (const route of routes) {
    if (route.method !== method) continue;
    const m = route.re.exec(rest);
    if (m) return { route, params: m.slice(1) };
  }
  return undefined;
}

function route(method: string, pattern: string, handler: (c: Call) => Promise<unknown>): Route {
  const re = new RegExp(`^${pattern.replace(/:[a-z]+/g, '([^/]+)')}$`);
  // A handler that throws before its first await still answers with its error.
  return { method, re, handler: async (c) => handler(c) };
}

/** The routes of docs/edge-protocol.md; handlers parse, call one edge method, translate. */
function edgeRoutes(edge: EdgeApi): Route[] {
  const io = (): SandboxIoApi => requireIo(edge);
  const opt = <T>(v: unknown): T | undefined =>
    v === undefined || v === null ? undefined : (v as T);
  return [
    route('GET', '/status', (c) => edge.status(c.signal)),
    route('POST', '/sandboxes', async (c) =>
      edge.createSandbox((await c.json()) as unknown as CreateSandboxRequest, c.signal),
    ),
    route('GET', '/sandboxes', async (c) => {
      const raw = c.str('projectIds');
      let projectIds: string[] | undefined;
      if (raw !== undefined) {
        try {
          projectIds = JSON.parse(raw) as string[];
        } catch {
          projectIds = undefined;
        }
        if (!Array.isArray(projectIds) || projectIds.some((p) => typeof p !== 'string')) {
          throw new DsecError('invalid_argument', 'projectIds must be a JSON array of strings', {
            field: 'projectIds',
          });
        }
      }
      const filter: { projectIds?: string[]; includeEnded?: boolean } = {};
      if (projectIds) filter.projectIds = projectIds;
      if (c.flag('includeEnded')) filter.includeEnded = true;
      return { sandboxes: await edge.listSandboxes(filter, c.signal) };
    }),
    route('GET', '/sandboxes/:id', (c) => edge.getSandbox(c.p(0), c.signal)),
    route('POST', '/sandboxes/:id/stop', async (c) => {
      await edge.stopSandbox(c.p(0), c.signal);
      return undefined;
    }),
    route('POST', '/sandboxes/:id/run', async (c) => {
      const b = await c.json();
      return c.frames((o) =>
        edge.runCommand(c.p(0), object(b.command, 'command'), {
          ...o,
          projectId: opt<string>(b.projectId),
        }),
      );
    }),
    route('POST', '/sandboxes/:id/network', async (c) => {
      if (!edge.updateNetwork) {
        throw new DsecError('unavailable', `edge ${edge.edgeId} has no network policy`);
      }
      const patch = (await c.json()) as NetworkPolicyPatch;
      return edge.updateNetwork(c.p(0), patch, c.signal);
    }),
    // ---- display (optional EdgeApi methods: 503 where the edge lacks them) ----
    route('GET', '/sandboxes/:id/screenshot', async (c) => {
      if (!edge.screenshot) {
        throw new DsecError('unavailable', `edge ${edge.edgeId} runs no sandboxes with a display`);
      }
      return c.pipe(Readable.from([await edge.screenshot(c.p(0), c.signal)]));
    }),
    route('POST', '/sandboxes/:id/input', async (c) => {
      if (!edge.sendInput) {
        throw new DsecError('unavailable', `edge ${edge.edgeId} runs no sandboxes with a display`);
      }
      await edge.sendInput(c.p(0), (await c.json()) as unknown as DisplayInput, c.signal);
      return undefined;
    }),
    // ---- lifecycle (optional EdgeApi methods: 503 where the edge lacks them) ----
    route('POST', '/sandboxes/:id/pause', async (c) =>
      requireLifecycle(edge, 'pauseSandbox').call(edge, c.p(0), c.signal),
    ),
    route('POST', '/sandboxes/:id/resume', async (c) =>
      requireLifecycle(edge, 'resumeSandbox').call(edge, c.p(0), c.signal),
    ),
    route('POST', '/sandboxes/:id/timeout', async (c) => {
      const set = requireLifecycle(edge, 'setSandboxTimeout');
      const { ttlSeconds } = await c.json();
      if (typeof ttlSeconds !== 'number' || !Number.isSafeInteger(ttlSeconds)) {
        throw new DsecError('invalid_argument', 'ttlSeconds must be an integer', {
          field: 'ttlSeconds',
        });
      }
      return set.call(edge, c.p(0), ttlSeconds, c.signal);
    }),
    route('POST', '/sandboxes/:id/snapshot', async (c) => {
      const snapshot = requireLifecycle(edge, 'snapshotSandbox');
      const b = await c.json();
      const req: EdgeSnapshotRequest = { name: text(b.name, 'name') };
      if (b.scrub !== undefined && b.scrub !== null) {
        if (!Array.isArray(b.scrub) || b.scrub.some((p) => typeof p !== 'string')) {
          throw new DsecError('invalid_argument', 'scrub must be an array of paths', {
            field: 'scrub',
          });
        }
        req.scrub = b.scrub as string[];
      }
      // What the apiserver adds: the sandbox's layer view and its image-quota reservation.
      if (b.layerView !== undefined && b.layerView !== null) {
        if (!Array.isArray(b.layerView) || b.layerView.some((p) => typeof p !== 'string')) {
          throw new DsecError('invalid_argument', 'layerView must be an array of project IDs', {
            field: 'layerView',
          });
        }
        req.layerView = b.layerView as string[];
      }
      if (b.maxBytes !== undefined && b.maxBytes !== null) {
        if (!Number.isSafeInteger(b.maxBytes) || (b.maxBytes as number) < 0) {
          throw new DsecError('invalid_argument', 'maxBytes must be an integer ≥ 0', {
            field: 'maxBytes',
          });
        }
        req.maxBytes = b.maxBytes as number;
      }
      return snapshot.call(edge, c.p(0), req, c.signal);
    }),
    // ---- volumes (docs/volumes.md; optional: 503 where the edge keeps none) ----
    route('POST', '/volumes/create', async (c) => {
      const b = await c.json();
      return volumesOf(edge).create(
        {
          projectId: text(b.projectId, 'projectId'),
          name: text(b.name, 'name'),
          sizeMb: b.sizeMb as number,
        },
        c.signal,
      );
    }),
    route('POST', '/volumes/get', async (c) => {
      const b = await c.json();
      return volumesOf(edge).get(text(b.projectId, 'projectId'), text(b.name, 'name'), c.signal);
    }),
    route('POST', '/volumes/list', async (c) => {
      const b = await c.json();
      const projectId = opt<unknown>(b.projectId);
      return {
        volumes: await volumesOf(edge).list(
          projectId === undefined ? undefined : text(projectId, 'projectId'),
          c.signal,
        ),
      };
    }),
    route('POST', '/volumes/delete', async (c) => {
      const b = await c.json();
      await volumesOf(edge).delete(text(b.projectId, 'projectId'), text(b.name, 'name'), c.signal);
      return undefined;
    }),
    // ---- FnCall (issue 14; optional: 503 where the edge has no pools) ----
    route('POST', '/fncall', async (c) => {
      if (!edge.fncall)
        throw new DsecError('unavailable', `edge ${edge.edgeId} runs no function calls`);
      const b = await c.json();
      return edge.fncall(object(b.req, 'req'), {
        projectId: text(b.projectId, 'projectId'),
        signal: c.signal,
      });
    }),
    route('GET', '/sandboxes/:id/events', async (c) => {
      if (!edge.listEvents) {
        throw new DsecError('unavailable', `edge ${edge.edgeId} keeps no sandbox events`);
      }
      const events = await edge.listEvents(
        c.p(0),
        { afterId: c.int('afterId'), limit: c.int('limit') },
        c.signal,
      );
      return { events };
    }),

    // ---- commands (SandboxIoApi) ----
    route('POST', '/sandboxes/:id/io/run', async (c) => {
      const ioApi = io();
      const b = await c.json();
      return c.frames((o) =>
        ioApi.runCommand(c.p(0), object(b.spec, 'spec'), {
          ...o,
          projectId: opt<string>(b.projectId),
        }),
      );
    }),
    route('POST', '/sandboxes/:id/commands', async (c) =>
      io().startCommand(c.p(0), object(await c.json(), 'spec')),
    ),
    route('GET', '/sandboxes/:id/commands', async (c) => ({
      commands: await io().listCommands(c.p(0)),
    })),
    route('GET', '/sandboxes/:id/commands/:cid', (c) => io().getCommand(c.p(0), c.p(1))),
    route('GET', '/sandboxes/:id/commands/:cid/wait', (c) =>
      io().waitCommand(c.p(0), c.p(1), { timeoutMs: c.int('timeoutMs'), signal: c.signal }),
    ),
    route('GET', '/sandboxes/:id/commands/:cid/output', async (c) => {
      const ioApi = io();
      return c.frames((o) => ioApi.watchCommand(c.p(0), c.p(1), o));
    }),
    route('POST', '/sandboxes/:id/commands/:cid/kill', async (c) => {
      await io().killCommand(c.p(0), c.p(1));
      return undefined;
    }),
    route('POST', '/sandboxes/:id/commands/:cid/signal', async (c) => {
      const { signal } = await c.json();
      if (typeof signal !== 'string' && typeof signal !== 'number') {
        throw new DsecError('invalid_argument', 'signal must be a name or a number', {
          field: 'signal',
        });
      }
      await io().signalCommand(c.p(0), c.p(1), signal);
      return undefined;
    }),
    route('POST', '/sandboxes/:id/commands/:cid/stdin', (c) =>
      io().writeStdin(c.p(0), c.p(1), c.body(), { eof: c.flag('eof'), signal: c.signal }),
    ),

    // ---- sessions ----
    route('POST', '/sandboxes/:id/sessions/:name/run', async (c) => {
      const ioApi = io();
      const b = await c.json();
      return c.frames((o) =>
        ioApi.runInSession(c.p(0), c.p(1), object(b.spec, 'spec'), {
          ...o,
          projectId: opt<string>(b.projectId),
        }),
      );
    }),
    route('GET', '/sandboxes/:id/sessions', async (c) => ({
      sessions: await io().listSessions(c.p(0)),
    })),
    route('DELETE', '/sandboxes/:id/sessions/:name', async (c) => {
      await io().closeSession(c.p(0), c.p(1));
      return undefined;
    }),

    // ---- files ----
    route('GET', '/sandboxes/:id/files', async (c) => {
      const stream = await io().readFile(c.p(0), pathOf(c), {
        user: c.str('user'),
        signal: c.signal,
      });
      return c.pipe(stream);
    }),
    route('PUT', '/sandboxes/:id/files', (c) =>
      io().writeFile(c.p(0), pathOf(c), c.rawBody(), {
        user: c.str('user'),
        mode: c.int('mode'),
        signal: c.signal,
      }),
    ),
    route('GET', '/sandboxes/:id/files/stat', (c) =>
      io().statFile(c.p(0), pathOf(c), { user: c.str('user'), signal: c.signal }),
    ),
    route('GET', '/sandboxes/:id/files/list', async (c) => ({
      entries: await io().listDir(c.p(0), pathOf(c), { user: c.str('user'), signal: c.signal }),
    })),
    route('POST', '/sandboxes/:id/files/mkdir', async (c) => {
      const b = await c.json();
      await io().mkdir(c.p(0), text(b.path, 'path'), {
        parents: opt<boolean>(b.parents),
        mode: opt<number>(b.mode),
        user: opt<string>(b.user),
        signal: c.signal,
      });
      return undefined;
    }),
    route('POST', '/sandboxes/:id/files/remove', async (c) => {
      const b = await c.json();
      await io().remove(c.p(0), text(b.path, 'path'), {
        recursive: opt<boolean>(b.recursive),
        user: opt<string>(b.user),
        signal: c.signal,
      });
      return undefined;
    }),
    route('POST', '/sandboxes/:id/files/rename', async (c) => {
      const b = await c.json();
      await io().rename(c.p(0), text(b.from, 'from'), text(b.to, 'to'), {
        overwrite: opt<boolean>(b.overwrite),
        user: opt<string>(b.user),
        signal: c.signal,
      });
      return undefined;
    }),
  ];
}

function volumesOf(edge: EdgeApi): EdgeVolumeApi {
  if (!edge.volumes) throw new DsecError('unavailable', `edge ${edge.edgeId} keeps no volumes`);
  return edge.volumes;
}

function object<T>(v: unknown, field: string): T {
  if (typeof v !== 'object' || v === null || Array.isArray(v)) {
    throw new DsecError('invalid_argument', `${field} must be an object`, { field });
  }
  return v as T;
}

function text(v: unknown, field: string): string {
  if (typeof v !== 'string')
    throw new DsecError('invalid_argument', `${field} must be a string`, { field });
  return v;
}

function pathOf(c: Call): string {
  return text(c.str('path'), 'path');
}

function sendError(
  res: ServerResponse,
  err: unknown,
  log: EdgeLogger | undefined,
  exchange: SignedExchange | undefined,
): void {
  const e = toDsecError(err);
  if (e.code === 'internal') log?.error({ err }, 'edge call failed');
  if (res.headersSent) {
    res.destroy();
    return;
  }
  writeWhole(res, e.status, Buffer.from(JSON.stringify(e.toJSON())), 'application/json', exchange);
}

type RefusalLog = (obj: object, msg: string) => void;

/** Refusals are logged at most once per this long; the line then says how many were not. */
export const REFUSAL_LOG_INTERVAL_MS = 10_000;

/**
 * A warning for refused callers (unsigned or badly signed requests, frames,
 * plaintext to a TLS edge), written at most once per `everyMs` with the
 * number left out since the last one (`suppressed`): anyone who reaches the
 * port can send those, and a flood of them must not cost a log line each
 * (SECURITY J38: no disk in proportion to what an unauthenticated caller sends).
 */
export function refusalLog(
  log: EdgeLogger | undefined,
  everyMs = REFUSAL_LOG_INTERVAL_MS,
  now: () => number = Date.now,
): RefusalLog {
  let nextMs = 0;
  let suppressed = 0;
  return (obj, msg) => {
    if (!log) return;
    const t = now();
    if (t < nextMs) {
      suppressed++;
      return;
    }
    nextMs = t + everyMs;
    log.warn(suppressed > 0 ? { ...obj, suppressed } : obj, msg);
    suppressed = 0;
  };
}

function loggerOf(option: EdgeLogger | boolean | undefined): EdgeLogger | undefined {
  if (option === true) return pino({ name: 'dsec-edge-http' });
  if (!option) return undefined;
  return option;
}

// ---- upgrades: ports and terminals ----

const PTY_PATH = /^\/sandboxes\/([^/]+)\/pty$/;
const PORT_PATH = /^\/sandboxes\/([^/]+)\/ports\/([0-9]{1,5})$/;

interface UpgradeContext {
  edge: EdgeApi;
  verifier: RequestVerifier;
  log: EdgeLogger | undefined;
  refused: RefusalLog;
}

async function onUpgrade(
  req: IncomingMessage,
  socket: Duplex,
  head: Buffer,
  ctx: UpgradeContext,
): Promise<void> {
  socket.on('error', () => undefined);
  const gone = new AbortController();
  socket.once('close', () =>
    gone.abort(new DsecError('aborted', 'the client closed the connection')),
  );
  const url = req.url ?? '/';
  let exchange: SignedExchange | undefined;
  let protocol: string;
  let wire: () => void;
  try {
    try {
      const asked = req.headers.upgrade ?? '';
      exchange = ctx.verifier.verify(req.method ?? 'GET', url, req.headers, asked).exchange;
    } catch (err) {
      ctx.refused({ remote: req.socket.remoteAddress, url, err: String(err) }, 'refused');
      throw err;
    }
    const x = exchange;
    const parsed = new URL(url, 'http://edge');
    const rest = parsed.pathname.startsWith(EDGE_PATH_PREFIX)
      ? parsed.pathname.slice(EDGE_PATH_PREFIX.length)
      : '';
    const want = String(req.headers.upgrade ?? '').toLowerCase();
    const pty = PTY_PATH.exec(rest);
    const port = PORT_PATH.exec(rest);
    const refusedFrame = () =>
      ctx.refused({ remote: req.socket.remoteAddress, url }, 'refused a stream frame');
    if (pty && want === PTY_UPGRADE) {
      protocol = PTY_UPGRADE;
      const id = decodeURIComponent(pty[1] ?? '');
      const options = ptyOptions(parsed.searchParams.get('options'));
      const session = await requireIo(ctx.edge).openPty(id, options);
      wire = () => wirePty(socket, head, session, x, refusedFrame);
    } else if (port && want === PORT_UPGRADE) {
      protocol = PORT_UPGRADE;
      const id = decodeURIComponent(port[1] ?? '');
      const stream = await requireIo(ctx.edge).connectPort(id, Number(port[2]), {
        signal: gone.signal,
      });
      wire = () => wirePort(socket, head, stream, x, refusedFrame);
      if (socket.destroyed) stream.destroy();
    } else {
      throw new DsecError('not_found', 'no such upgrade route');
    }
  } catch (err) {
    const e = toDsecError(err);
    if (e.code === 'internal') ctx.log?.error({ err }, 'edge upgrade failed');
    const body = Buffer.from(JSON.stringify(e.toJSON()));
    const type = 'application/json';
    // Proven only when the request verified, as every answer.
    const proof = exchange
      ? `${HEADER_PROOF}: ${exchange.proof({ status: e.status, contentType: type, upgrade: '', body: bodyDigest(body) })}\r\n`
      : '';
    socket.write(
      `HTTP/1.1 ${e.status} ${http.STATUS_CODES[e.status] ?? 'Error'}\r\n${proof}` +
        `content-type: ${type}\r\ncontent-length: ${body.length}\r\nconnection: close\r\n\r\n`,
    );
    socket.end(body);
    return;
  }
  const proof = exchange.proof({ status: 101, contentType: '', upgrade: protocol, body: STREAMED });
  socket.write(
    `HTTP/1.1 101 Switching Protocols\r\nupgrade: ${protocol}\r\nconnection: Upgrade\r\n` +
      `${HEADER_PROOF}: ${proof}\r\n\r\n`,
  );
  wire();
}

function ptyOptions(raw: string | null): PtyOptions {
  if (raw === null) return {};
  let o: unknown;
  try {
    o = JSON.parse(raw);
  } catch {
    throw new DsecError('invalid_argument', 'terminal options must be JSON', { field: 'options' });
  }
  const { signal: _signal, ...rest } = object<PtyOptions>(o, 'options');
  return rest;
}

/**
 * Terminal frames both ways, each with its MAC; the socket closing kills
 * the shell, and so does a client frame that fails its MAC.
 */
function wirePty(
  socket: Duplex,
  head: Buffer,
  session: PtySession,
  exchange: SignedExchange,
  refused: () => void,
): void {
  if (socket.destroyed) {
    session.kill();
    return;
  }
  const down = exchange.sealer('answer');
  session.onOutput((chunk) => socket.write(frame(down, PTY_DATA, chunk)));
  void session.exited.then(({ exitCode, signal }) => {
    socket.end(frame(down, PTY_EXIT, exitPayload(exitCode, signal)));
  });
  socket.once('close', () => session.kill());
  const reader = new FrameReader(
    MAX_PTY_FRAME_BYTES,
    exchange.sealer('request'),
    (type, payload) => {
      if (type === PTY_DATA) session.write(payload);
      else if (type === PTY_RESIZE && payload.length >= 4) {
        session.resize(payload.readUInt16BE(0), payload.readUInt16BE(2));
      } else if (type === PTY_EOF) session.end();
      else if (type === PTY_KILL) session.kill();
    },
  );
  const push = (chunk: Buffer) => {
    try {
      reader.push(chunk);
    } catch (err) {
      if (err instanceof FrameMacError) refused();
      socket.destroy();
    }
  };
  if (head.length > 0) push(head);
  socket.on('data', push);
}

/**
 * Port bytes both ways in frames with MACs: `PORT_DATA`, then `PORT_END`
 * for a half-close, passed on as one. The connection closes once both
 * sides have ended (so neither end relies on TCP half-close, which TLS
 * servers do not keep). A failure of the sandbox side resets the
 * connection (drops it, over TLS), so the client can tell it from a clean end; a client frame
 * that fails its MAC drops the connection and the sandbox side with it.
 */
function wirePort(
  socket: Duplex,
  head: Buffer,
  stream: Duplex,
  exchange: SignedExchange,
  refused: () => void,
): void {
  if (socket.destroyed) return;
  const down = exchange.sealer('answer');
  let sentEnd = false;
  let gotEnd = false;
  const closeWhenDone = () => {
    if (sentEnd && gotEnd) socket.end();
  };
  stream.on('error', () => {
    // A TLS socket cannot be reset (its handle is not TCP's); closed without END, the
    // client takes it for the failure it is all the same.
    const s = socket as Duplex & { resetAndDestroy?: () => void };
    if (!(socket instanceof TLSSocket) && typeof s.resetAndDestroy === 'function') {
      s.resetAndDestroy();
    } else socket.destroy();
  });
  socket.once('close', () => stream.destroy());
  stream.on('data', (chunk: Buffer) => {
    for (let at = 0; at < chunk.length; at += PORT_FRAME_BYTES) {
      const ok = socket.write(frame(down, PORT_DATA, chunk.subarray(at, at + PORT_FRAME_BYTES)));
      if (!ok) stream.pause();
    }
  });
  socket.on('drain', () => stream.resume());
  stream.once('end', () => {
    sentEnd = true;
    socket.write(frame(down, PORT_END, EMPTY));
    closeWhenDone();
  });
  let waiting = false;
  const reader = new FrameReader(
    MAX_PORT_FRAME_BYTES,
    exchange.sealer('request'),
    (type, payload) => {
      if (type === PORT_DATA && !gotEnd) {
        if (!stream.write(payload) && !waiting) {
          waiting = true;
          socket.pause();
          stream.once('drain', () => {
            waiting = false;
            socket.resume();
          });
        }
      } else if (type === PORT_END && !gotEnd) {
        gotEnd = true;
        stream.end();
        closeWhenDone();
      }
    },
  );
  const push = (chunk: Buffer) => {
    try {
      reader.push(chunk);
    } catch (err) {
      if (err instanceof FrameMacError) refused();
      socket.destroy();
    }
  };
  // The client's bytes end only with its authenticated END; a bare TCP end is a cut.
  socket.once('end', () => {
    if (!gotEnd) socket.destroy();
  });
  if (head.length > 0) push(head);
  socket.on('data', push);
}
