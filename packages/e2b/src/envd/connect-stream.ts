import type { IncomingHttpHeaders, IncomingMessage, ServerResponse } from 'node:http';
import { create, isMessage } from '@bufbuild/protobuf';
import type { DescMessage, DescMethodServerStreaming, DescService } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import type { ContextValues, HandlerContext } from '@connectrpc/connect';
import {
  createMethodSerializationLookup,
  getAbortSignalReason,
  getJsonOptions,
} from '@connectrpc/connect/protocol';
import type { MethodSerializationLookup } from '@connectrpc/connect/protocol';
import {
  createEndStreamSerialization,
  endStreamFlag,
  parseContentType,
  parseTimeout,
} from '@connectrpc/connect/protocol-connect';
import { isDsecError } from '@dsec/core';
import type { CallerLimits } from '@dsec/apiserver';
import { toConnectError } from '../errors.js';
import { isQueueOverflow } from './event-queue.js';
import { envdTargetKey, streamBacklogKey } from './rpc-context.js';
import type { StreamBacklog } from './rpc-context.js';

/**
 * Connect's server-streaming RPCs (envd's `Process.Start`, `Process.Connect`,
 * `Filesystem.WatchDir`) served straight on node:http, for the requests the
 * E2B SDKs send: one enveloped message, uncompressed, JSON or protobuf.
 *
 * `connectNodeAdapter` serves every Connect, gRPC and gRPC-web shape through
 * layers of async iterables, web `Headers` and linked abort signals; on an
 * exec round trip that machinery was most of what the E2B route cost over
 * the native one (docs/benchmarks.md, "SDKs"). This
 * path calls the same service implementation with a Connect handler context
 * and writes what the implementation yields with the same serializers and
 * the same end-of-stream message, so a client sees the same bytes (fewer
 * HTTP chunks: messages ready together leave in one write, the last message
 * with the end of the stream). Requests it does not take (compression,
 * gRPC, unary methods) go to the adapter as before.
 */

/** Connect's request header names (lower case, as node:http has them). */
const H_CONTENT_TYPE = 'content-type';
const H_TIMEOUT = 'connect-timeout-ms';
const H_CONTENT_ENCODING = 'connect-content-encoding';
const H_ACCEPT_ENCODING = 'connect-accept-encoding';

/** Envelope flag of a compressed message. */
const COMPRESSED_FLAG = 0b00000001;

/** The adapter's default, kept so a deadline header is read the same way. */
const MAX_TIMEOUT_MS = Number.MAX_SAFE_INTEGER;

/**
 * Abort reasons for the handler context. Connect aborts it with no reason
 * (a fresh `DOMException`, stack trace included) at the end of every call;
 * nothing reads the reason then, so one shared value does.
 */
const STREAM_DONE = new ConnectError('the stream has ended', Code.Canceled);
const CLIENT_GONE = new ConnectError('the client closed the connection', Code.Canceled);

/** The end-of-stream metadata of a call that set no trailers (never handed to an implementation). */
const NO_TRAILERS = new Headers();

// eslint-disable-next-line @typescript-eslint/no-explicit-any -- implementations of any method's shapes
type StreamImpl = (req: any, ctx: HandlerContext) => AsyncIterable<unknown>;

interface StreamRoute {
  service: DescService;
  method: DescMethodServerStreaming;
  impl: StreamImpl;
  serialization: MethodSerializationLookup<DescMessage, DescMessage>;
}

/** A request the lean path takes: its method, and how it is framed. */
export interface StreamCall {
  route: StreamRoute;
  binary: boolean;
  timeoutMs: number | undefined;
}

export interface ConnectStreamOptions {
  /** Largest request message. */
  readMaxBytes: number;
  /** Aborts every call's context when the server closes. */
  shutdownSignal: AbortSignal;
  /**
   * The apiserver's per-key stream cap and output budget (`CallerLimits`):
   * each call is one of its caller's streams, and its queue's backlog counts.
   */
  limits?: Pick<CallerLimits, 'openStream'> | undefined;
}

export class ConnectStreamServer {
  readonly #routes = new Map<string, StreamRoute>();
  readonly #o: ConnectStreamOptions;
  readonly #endStream = createEndStreamSerialization(getJsonOptions(undefined));

  constructor(options: ConnectStreamOptions) {
    this.#o = options;
  }

  /** Serves the service's server-streaming methods that `impl` has. */
  add(service: DescService, impl: Record<string, unknown>): this {
    for (const method of service.methods) {
      if (method.methodKind !== 'server_streaming') continue;
      const fn = impl[method.localName];
      if (typeof fn !== 'function') continue;
      this.#routes.set(`/${service.typeName}/${method.name}`, {
        service,
        method: method as DescMethodServerStreaming,
        impl: (fn as StreamImpl).bind(impl),
        serialization: createMethodSerializationLookup(method, undefined, undefined, {
          readMaxBytes: this.#o.readMaxBytes,
          writeMaxBytes: 0xffffffff,
        }),
      });
    }
    return this;
  }

  /**
   * Serves the request when it is a server-streaming call this path takes
   * (see the class); false leaves it, untouched, to the generic adapter.
   */
  serve(
    path: string,
    req: IncomingMessage,
    res: ServerResponse,
    contextValues: ContextValues,
  ): boolean {
    const call = this.accepts(path, req);
    if (!call) return false;
    this.start(call, req, res, contextValues);
    return true;
  }

  /**
   * The call when the request is one this path takes (see the class), read
   * from the method, path and headers only (nothing consumed); undefined
   * leaves it to the generic adapter.
   */
  accepts(path: string, req: IncomingMessage): StreamCall | undefined {
    if (req.method !== 'POST') return undefined;
    const route = this.#routes.get(path);
    if (!route) return undefined;
    const h = req.headers;
    const type = parseContentType(h[H_CONTENT_TYPE] ?? null);
    if (!type?.stream) return undefined;
    if (!identityEncoding(h[H_CONTENT_ENCODING]) || !identityEncoding(h[H_ACCEPT_ENCODING])) {
      return undefined;
    }
    const rawTimeout = h[H_TIMEOUT];
    if (Array.isArray(rawTimeout)) return undefined;
    const timeout = parseTimeout(rawTimeout ?? null, MAX_TIMEOUT_MS);
    if (timeout.error) return undefined;
    return { route, binary: type.binary, timeoutMs: timeout.timeoutMs };
  }

  /** Serves a call `accepts` took: every failure of the call is answered on the stream. */
  start(
    call: StreamCall,
    req: IncomingMessage,
    res: ServerResponse,
    contextValues: ContextValues,
  ): void {
    // Anything #run cannot answer on the stream leaves the response unusable.
    this.#run(call.route, call.binary, call.timeoutMs, req, res, contextValues).catch(() =>
      res.destroy(),
    );
  }

  async #run(
    route: StreamRoute,
    binary: boolean,
    timeoutMs: number | undefined,
    req: IncomingMessage,
    res: ServerResponse,
    contextValues: ContextValues,
  ): Promise<void> {
    const ctx = new StreamContext(
      route,
      `http://${req.headers.host ?? 'localhost'}${req.url ?? '/'}`,
      req,
      binary ? 'application/connect+proto' : 'application/connect+json',
      contextValues,
      timeoutMs,
      this.#o.shutdownSignal,
    );
    const writer = new EnvelopeWriter(res, () => ctx.headerFields());
    res.once('close', () => {
      if (!res.writableFinished) ctx.abort(CLIENT_GONE);
      writer.closed();
    });
    let failure: unknown;
    try {
      this.#account(res, contextValues);
      const input = route.serialization
        .getI(binary)
        .parse(singleMessage(await readBody(req, this.#o.readMaxBytes), this.#o.readMaxBytes));
      const output = route.serialization.getO(binary);
      const schema: DescMessage = route.method.output;
      for await (const item of route.impl(input, ctx)) {
        const message = isMessage(item, schema) ? item : create(schema, item as never);
        await writer.message(output.serialize(message));
      }
    } catch (err) {
      failure = err;
    }
    if (isQueueOverflow(failure)) {
      // Its client stopped reading: what it has not read goes with the connection.
      ctx.abort(failure);
      resetConnection(res);
      return;
    }
    const error =
      failure === undefined || failure instanceof ConnectError
        ? failure
        : isDsecError(failure)
          ? toConnectError(failure)
          : new ConnectError('internal error', Code.Internal, undefined, undefined, failure);
    ctx.abort(failure ?? STREAM_DONE);
    writer.end(this.#endStream.serialize({ metadata: ctx.trailerIfSet() ?? NO_TRAILERS, error }));
  }

  /**
   * Counts the call as one of its caller's streams (`rate_limited` past the
   * key's cap) and hands its queue the budget's check (`streamBacklogKey`).
   */
  #account(res: ServerResponse, values: ContextValues): void {
    const target = values.get(envdTargetKey);
    if (!this.#o.limits || !target) return;
    const backlog: StreamBacklog = { check: () => true };
    const ticket = this.#o.limits.openStream(
      target.caller.principal,
      () => res.writableLength + (backlog.measure?.() ?? 0),
      () => resetConnection(res),
    );
    backlog.check = () => ticket.check();
    values.set(streamBacklogKey, backlog);
    res.once('close', () => ticket.release());
  }
}

/** Destroys a response's connection with a TCP reset: nothing queued for it stays. */
function resetConnection(res: ServerResponse): void {
  const socket = res.socket;
  res.destroy();
  socket?.resetAndDestroy();
}

function identityEncoding(value: string | string[] | undefined): boolean {
  return value === undefined || value === 'identity';
}

/** The request headers as Connect's adapter gives them to a handler. */
function nodeHeaders(req: IncomingMessage): Headers {
  const headers = new Headers();
  for (const [name, value] of Object.entries(req.headers)) {
    if (typeof value === 'string') headers.append(name, value);
    else if (value) for (const v of value) headers.append(name, v);
  }
  return headers;
}

/**
 * The handler context of one call: what `createHandlerContext` makes (its
 * signal aborts at the deadline, when the client leaves, when the server
 * shuts down, and when the call ends), with one abort controller instead of
 * three linked ones.
 */
class StreamContext implements HandlerContext {
  readonly service: DescService;
  readonly method: DescMethodServerStreaming;
  readonly protocolName = 'connect';
  readonly requestMethod = 'POST';
  readonly #contentType: string;
  #responseHeader: Headers | undefined;
  #responseTrailer: Headers | undefined;
  readonly signal: AbortSignal;
  readonly timeoutMs: () => number | undefined;
  readonly #abort = new AbortController();
  readonly #shutdown: AbortSignal;
  readonly #timer: NodeJS.Timeout | undefined;
  readonly #req: IncomingMessage;
  #requestHeader: Headers | undefined;

  constructor(
    route: StreamRoute,
    readonly url: string,
    req: IncomingMessage,
    contentType: string,
    readonly values: ContextValues,
    timeoutMs: number | undefined,
    shutdown: AbortSignal,
  ) {
    this.service = route.service;
    this.method = route.method;
    this.#req = req;
    this.#contentType = contentType;
    this.signal = this.#abort.signal;
    this.#shutdown = shutdown;
    if (timeoutMs === undefined) {
      this.timeoutMs = () => undefined;
    } else {
      const deadline = Date.now() + timeoutMs;
      this.timeoutMs = () => deadline - Date.now();
      if (timeoutMs <= 0) this.#onDeadline();
      else this.#timer = setTimeout(this.#onDeadline, timeoutMs);
    }
    if (shutdown.aborted) this.#onShutdown();
    else shutdown.addEventListener('abort', this.#onShutdown);
  }

  /** The response headers; web `Headers` are made only when the implementation reads them. */
  get responseHeader(): Headers {
    return (this.#responseHeader ??= new Headers({ 'content-type': this.#contentType }));
  }

  get responseTrailer(): Headers {
    return (this.#responseTrailer ??= new Headers());
  }

  /** The response headers as node:http takes them. */
  headerFields(): Record<string, string> {
    if (this.#responseHeader === undefined) return { 'content-type': this.#contentType };
    const fields: Record<string, string> = {};
    this.#responseHeader.forEach((value, name) => (fields[name] = value));
    return fields;
  }

  /** The trailers, when the implementation set any. */
  trailerIfSet(): Headers | undefined {
    return this.#responseTrailer;
  }

  /** The request headers as web `Headers`, made when first read (the SDKs' calls never do). */
  get requestHeader(): Headers {
    return (this.#requestHeader ??= nodeHeaders(this.#req));
  }

  /** The request headers as node:http has them, for the implementation's own reads. */
  get nodeRequestHeader(): IncomingHttpHeaders {
    return this.#req.headers;
  }

  /** Ends the call's signal (first reason wins) and what would abort it later. */
  abort(reason: unknown): void {
    clearTimeout(this.#timer);
    this.#shutdown.removeEventListener('abort', this.#onShutdown);
    if (!this.signal.aborted) this.#abort.abort(reason);
  }

  readonly #onDeadline = () =>
    this.abort(new ConnectError('the operation timed out', Code.DeadlineExceeded));

  readonly #onShutdown = () => this.abort(getAbortSignalReason(this.#shutdown));
}

/** The whole request body, refused past one envelope header and `readMaxBytes`. */
function readBody(req: IncomingMessage, readMaxBytes: number): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const onData = (chunk: Buffer) => {
      chunks.push(chunk);
      size += chunk.length;
      if (size > readMaxBytes + 5) {
        req.off('data', onData);
        req.off('end', onEnd);
        // Oversized: the length in the first envelope header says by how much, as the adapter does.
        const body = Buffer.concat(chunks);
        reject(
          new ConnectError(
            `message size ${body.length >= 5 ? body.readUInt32BE(1) : size} is larger than configured readMaxBytes ${readMaxBytes}`,
            Code.ResourceExhausted,
          ),
        );
      }
    };
    const onEnd = () => resolve(chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks));
    req.on('data', onData);
    req.once('end', onEnd);
    req.once('error', (err) => reject(ConnectError.from(err, Code.Aborted)));
  });
}

/**
 * The one message of a server-streaming request, with the adapter's
 * protocol errors for anything else (an end-of-stream envelope is skipped,
 * as there).
 */
export function singleMessage(body: Buffer, readMaxBytes = Infinity): Uint8Array {
  let message: Uint8Array | undefined;
  let offset = 0;
  while (offset < body.length) {
    if (body.length - offset < 5) {
      throw new ConnectError('protocol error: incomplete envelope', Code.InvalidArgument);
    }
    const flags = body[offset]!;
    const length = body.readUInt32BE(offset + 1);
    if (length > readMaxBytes) {
      throw new ConnectError(
        `message size ${length} is larger than configured readMaxBytes ${readMaxBytes}`,
        Code.ResourceExhausted,
      );
    }
    if (body.length - offset - 5 < length) {
      throw new ConnectError('protocol error: incomplete envelope', Code.InvalidArgument);
    }
    const data = body.subarray(offset + 5, offset + 5 + length);
    offset += 5 + length;
    if ((flags & COMPRESSED_FLAG) === COMPRESSED_FLAG) {
      throw new ConnectError(
        'received compressed envelope, but do not know how to decompress',
        Code.Internal,
      );
    }
    if ((flags & endStreamFlag) === endStreamFlag) continue;
    if (message !== undefined) {
      throw new ConnectError(
        'protocol error: received extra input message for server-streaming method',
        Code.Unimplemented,
      );
    }
    message = data;
  }
  if (message === undefined) {
    throw new ConnectError(
      'protocol error: missing input message for server-streaming method',
      Code.Unimplemented,
    );
  }
  return message;
}

/** A 5-byte Connect envelope header (flags, big-endian length) and the data. */
export function envelope(flags: number, data: Uint8Array): Buffer {
  const out = Buffer.allocUnsafe(5 + data.byteLength);
  out[0] = flags;
  out.writeUInt32BE(data.byteLength, 1);
  out.set(data, 5);
  return out;
}

/**
 * Writes envelopes to the response. Messages produced in one turn of the
 * event loop (a command's last output, its end, the end of the stream) go
 * out in one write; the first write carries the response headers. A full
 * socket holds the producer (`message` waits for `drain`), so a client that
 * stops reading leaves the output in the implementation's bounded queue.
 */
export class EnvelopeWriter {
  readonly #res: ServerResponse;
  readonly #headers: Headers | (() => Record<string, string>);
  #pending: Buffer[] = [];
  #scheduled = false;
  #ending = false;
  #gone = false;
  #drained: Promise<void> | undefined;
  #wake: (() => void) | undefined;

  /** `headers`: the response headers, read at the first write (the implementation may add some). */
  constructor(res: ServerResponse, headers: Headers | (() => Record<string, string>)) {
    this.#res = res;
    this.#headers = headers;
  }

  /** Queues a message; the promise, when there is one, resolves once the socket takes more. */
  message(data: Uint8Array): Promise<void> | undefined {
    this.#push(envelope(0, data));
    return this.#drained;
  }

  /** Queues the end-of-stream message: the write that carries it ends the response. */
  end(endStream: Uint8Array): void {
    this.#ending = true;
    this.#push(envelope(endStreamFlag, endStream));
  }

  /** The connection closed: nothing more is written, and a waiting producer goes on. */
  closed(): void {
    this.#gone = true;
    this.#pending = [];
    this.#wake?.();
  }

  #push(buf: Buffer): void {
    if (this.#gone) return;
    this.#pending.push(buf);
    if (this.#scheduled) return;
    this.#scheduled = true;
    // After the current run of promise reactions: what the producer yields meanwhile joins this write.
    process.nextTick(() => this.#flush());
  }

  /**
   * The headers go with the first write. When that write is the whole
   * answer (a command that ended at once, an error), it has a length
   * instead of chunked framing.
   */
  #writeHead(bodyBytes: number): void {
    const res = this.#res;
    if (res.headersSent) return;
    const source = this.#headers;
    const headers: Record<string, string | number> = typeof source === 'function' ? source() : {};
    if (typeof source !== 'function') source.forEach((value, name) => (headers[name] = value));
    if (this.#ending) headers['content-length'] = bodyBytes;
    res.writeHead(200, headers);
  }

  #flush(): void {
    this.#scheduled = false;
    const res = this.#res;
    // A socket that failed before its 'close' event: writing now would only raise errors.
    if (this.#gone || res.destroyed || res.writableEnded) return;
    const pending = this.#pending;
    this.#pending = [];
    const body = pending.length === 1 ? pending[0]! : Buffer.concat(pending);
    this.#writeHead(body.length);
    if (this.#ending) {
      res.end(body);
      return;
    }
    if (!res.write(body) && !this.#drained) {
      this.#drained = new Promise<void>((resolve) => {
        this.#wake = resolve;
        res.once('drain', () => this.#wake?.());
      }).then(() => {
        this.#drained = undefined;
        this.#wake = undefined;
      });
    }
  }
}
