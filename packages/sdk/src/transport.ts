import http from 'node:http';
import https from 'node:https';
import type { Duplex } from 'node:stream';
import { urlToHttpOptions } from 'node:url';
import { DsecError, isDsecError, toDsecError } from '@dsec/core';
import type { RetryOptions } from './types.js';

/**
 * The SDK's HTTP transport: node:http with a keep-alive agent rather than
 * fetch, because the exec round trip is the hot path of every rollout and a
 * pooled socket with Nagle off keeps it near a millisecond.
 *
 * Contract of every request:
 * - resolves with the parsed JSON body (undefined for an empty body) on 2xx;
 * - rejects with `DsecError.fromBody(body, status)` on any other status;
 * - rejects with `aborted` when `signal` fires, `deadline_exceeded` when
 *   `timeoutMs` passes, and `unavailable` when the server cannot be reached;
 *   in each case the request and its socket are destroyed.
 */
export interface TransportOptions {
  url: string;
  apiKey?: string | undefined;
  /** Sockets kept open per host; commands from many sandboxes share them. */
  maxSockets?: number | undefined;
  /** Backoff for resending safe calls; `false`: never resend (but a stale keep-alive socket). */
  retry?: RetryOptions | false | undefined;
}

/** Codes after which a call that is safe to resend is resent (see `RetryOptions`). */
export const RETRY_CODES: ReadonlySet<string> = new Set([
  'unavailable',
  'capacity_exhausted',
  'quota_exceeded',
  'rate_limited',
]);
export const DEFAULT_RETRY = { maxRetries: 3, baseDelayMs: 250, maxDelayMs: 4000 } as const;

export interface RequestOptions {
  method: 'GET' | 'POST' | 'PATCH' | 'DELETE';
  path: string;
  body?: unknown;
  signal?: AbortSignal | undefined;
  /** Deadline for the whole exchange, response body included. */
  timeoutMs: number;
  /**
   * Safe to resend: idempotent by nature, or deduplicated by a request ID.
   * Resent on a stale keep-alive socket, and with backoff on `RETRY_CODES`.
   */
  idempotent?: boolean | undefined;
}

export interface RawRequestOptions {
  method: string;
  path: string;
  headers?: http.OutgoingHttpHeaders | undefined;
  /** Streamed with back-pressure; a Buffer is sent with its length. */
  body?: NodeJS.ReadableStream | Buffer | undefined;
  signal?: AbortSignal | undefined;
  /** Deadline for the status line. */
  timeoutMs: number;
  /** Resolve with any response that is not a DSec error body (proxied services). */
  acceptAnyStatus?: boolean | undefined;
  /** Safe to resend (as `RequestOptions.idempotent`); only a body-less or Buffer request is resent. */
  idempotent?: boolean | undefined;
}

export interface StreamRequestOptions extends RequestOptions {
  accept: string;
  /** Called with each body chunk of a streamed 2xx answer; throwing rejects and destroys the request. */
  onChunk: (chunk: Buffer) => void;
  /** Called when a streamed 2xx body ends; its return value resolves the request. */
  onEnd: () => unknown;
  /** Called instead of the above when the server answered with plain JSON. */
  onJson: (body: unknown) => unknown;
}

/** Errors that mean no connection was made, so the server is likely not running. */
const CONNECT_ERRORS = new Set([
  'ECONNREFUSED',
  'ENOTFOUND',
  'EAI_AGAIN',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ETIMEDOUT',
]);

export class HttpTransport {
  readonly baseUrl: URL;
  readonly #agent: http.Agent;
  readonly #request: typeof http.request;
  readonly #retry: Required<RetryOptions>;
  /** Protocol, host, port (and credentials) of `baseUrl`; `#basePath` is its path without the trailing slash. */
  readonly #target: http.RequestOptions;
  readonly #basePath: string;
  /** `Bearer <key>`, made once. */
  readonly #authorization: string | undefined;
  #closed = false;

  constructor(options: TransportOptions) {
    let base: URL;
    try {
      base = new URL(options.url);
    } catch (cause) {
      throw new DsecError('invalid_argument', `invalid DSec URL ${JSON.stringify(options.url)}`, {
        field: 'url',
        cause,
      });
    }
    if (base.protocol !== 'http:' && base.protocol !== 'https:') {
      throw new DsecError('invalid_argument', `DSec URL must be http(s): ${options.url}`, {
        field: 'url',
      });
    }
    this.baseUrl = base;
    this.#authorization = options.apiKey ? `Bearer ${options.apiKey}` : undefined;
    const { protocol, hostname, port, auth } = urlToHttpOptions(base);
    this.#target = {
      protocol,
      hostname,
      ...(port !== undefined ? { port } : {}),
      ...(auth !== undefined ? { auth } : {}),
    };
    this.#basePath = base.pathname.replace(/\/+$/, '');
    const agentOptions = {
      keepAlive: true,
      keepAliveMsecs: 10_000,
      maxSockets: options.maxSockets ?? 256,
      // Nagle would hold the small request bodies for an ACK and add ~40 ms.
      noDelay: true,
    };
    const isHttps = base.protocol === 'https:';
    this.#agent = isHttps ? new https.Agent(agentOptions) : new http.Agent(agentOptions);
    this.#request = isHttps ? https.request : http.request;
    this.#retry =
      options.retry === false
        ? { maxRetries: 0, baseDelayMs: 0, maxDelayMs: 0 }
        : {
            maxRetries: options.retry?.maxRetries ?? DEFAULT_RETRY.maxRetries,
            baseDelayMs: options.retry?.baseDelayMs ?? DEFAULT_RETRY.baseDelayMs,
            maxDelayMs: options.retry?.maxDelayMs ?? DEFAULT_RETRY.maxDelayMs,
          };
  }

  /** Resends the client's retry policy allows (0 with `retry: false`). */
  get maxRetries(): number {
    return this.#retry.maxRetries;
  }

  /** The policy's wait before resend number `retry` (0-based), jittered. */
  retryDelayMs(retry: number): number {
    return backoffMs(this.#retry, retry);
  }

  /** Destroys pooled sockets; later requests reject with `unavailable`. */
  close(): void {
    this.#closed = true;
    this.#agent.destroy();
  }

  async json<T>(options: RequestOptions): Promise<T> {
    return (await this.#send(options, undefined)) as T;
  }

  async stream<T>(options: StreamRequestOptions): Promise<T> {
    return (await this.#send(options, options)) as T;
  }

  async #send(options: RequestOptions, stream: StreamRequestOptions | undefined): Promise<unknown> {
    // Output handed to the caller cannot be taken back: such a call is never resent.
    let delivered = false;
    const watched = stream && {
      ...stream,
      onChunk: (chunk: Buffer) => {
        delivered = true;
        stream.onChunk(chunk);
      },
    };
    return this.#withRetries(
      options,
      () => delivered,
      (timeoutMs) => this.#once({ ...options, timeoutMs }, watched),
    );
  }

  /**
   * Runs `attempt` until it succeeds or may not be resent: a stale
   * keep-alive socket (the server saw nothing) is retried at once when the
   * call is idempotent; `RETRY_CODES` with backoff when it is, and nothing
   * was delivered; a connection never made, with backoff, whatever the call.
   * All attempts share the call's deadline.
   */
  async #withRetries<T>(
    options: {
      method: string;
      path: string;
      timeoutMs: number;
      signal?: AbortSignal | undefined;
      idempotent?: boolean | undefined;
    },
    delivered: () => boolean,
    attempt: (timeoutMs: number) => Promise<T>,
  ): Promise<T> {
    const deadline = Date.now() + options.timeoutMs;
    let staleRetried = false;
    for (let retry = 0; ; retry++) {
      try {
        return await attempt(Math.max(1, deadline - Date.now()));
      } catch (err) {
        if (err instanceof StaleSocketError && options.idempotent && !staleRetried) {
          staleRetried = true;
          retry--;
          continue;
        }
        const error = err instanceof StaleSocketError ? err.error : err;
        const neverSent = isDsecError(error) && notSent.has(error);
        const resend =
          isDsecError(error) &&
          !delivered() &&
          retry < this.#retry.maxRetries &&
          (neverSent ||
            (options.idempotent === true &&
              (RETRY_CODES.has(error.code) ||
                // A create with this requestId is still being served: its answer comes shortly.
                (error.code === 'conflict' && error.field === 'requestId'))));
        const wait = resend ? backoffMs(this.#retry, retry) : 0;
        if (!resend || Date.now() + wait >= deadline) throw error;
        await sleep(wait, options.signal);
      }
    }
  }

  #once(options: RequestOptions, stream: StreamRequestOptions | undefined): Promise<unknown> {
    const { signal } = options;
    if (this.#closed) {
      return Promise.reject(new DsecError('unavailable', 'the DSec client is closed'));
    }
    if (signal?.aborted) {
      return Promise.reject(abortedError(signal));
    }
    const payload =
      options.body === undefined ? undefined : Buffer.from(JSON.stringify(options.body));
    const headers: http.OutgoingHttpHeaders = {
      accept: stream?.accept ?? 'application/json',
    };
    if (this.#authorization) headers.authorization = this.#authorization;
    if (payload) {
      headers['content-type'] = 'application/json';
      headers['content-length'] = payload.length;
    }

    return new Promise<unknown>((resolve, reject) => {
      let settled = false;
      // Nothing is sent before end(), so listeners can be attached below.
      const request = this.#request({
        ...this.#requestTarget(options.path),
        method: options.method,
        headers,
        agent: this.#agent,
      });
      const fail = (err: unknown) => {
        if (settled) return;
        settled = true;
        cleanup();
        // Destroying rather than aborting drops the socket from the pool, so
        // a half-read answer never leaks into the next request.
        request.destroy();
        reject(err instanceof Error ? err : toDsecError(err));
      };
      const succeed = (value: unknown) => {
        if (settled) return;
        settled = true;
        cleanup();
        resolve(value);
      };
      const timer = setTimeout(() => {
        fail(
          new DsecError(
            'deadline_exceeded',
            `${options.method} ${options.path} ran past its ${options.timeoutMs} ms deadline`,
          ),
        );
      }, options.timeoutMs);
      const stopWatching = onAbort(signal, () => fail(abortedError(signal)));
      const cleanup = () => {
        clearTimeout(timer);
        stopWatching();
      };

      request.on('error', (err: NodeJS.ErrnoException) => {
        const error = this.#networkError(err);
        // No response byte came back on a reused socket: the server closed it.
        fail(
          request.reusedSocket && err.code === 'ECONNRESET' ? new StaleSocketError(error) : error,
        );
      });
      request.on('response', (res) => {
        res.on('error', (err) => fail(this.#networkError(err)));
        const status = res.statusCode ?? 0;
        const contentType = String(res.headers['content-type'] ?? '');
        const mediaType = contentType.split(';')[0]?.trim().toLowerCase();
        if (stream && status >= 200 && status < 300 && mediaType === stream.accept) {
          res.on('data', (chunk: Buffer) => {
            if (settled) return;
            try {
              stream.onChunk(chunk);
            } catch (err) {
              fail(err);
            }
          });
          res.on('end', () => {
            if (settled) return;
            try {
              succeed(stream.onEnd());
            } catch (err) {
              fail(err);
            }
          });
          return;
        }
        const chunks: Buffer[] = [];
        res.on('data', (chunk: Buffer) => chunks.push(chunk));
        res.on('end', () => {
          const text = Buffer.concat(chunks).toString('utf8');
          let body: unknown;
          try {
            body = text.length > 0 ? JSON.parse(text) : undefined;
          } catch (cause) {
            if (status >= 200 && status < 300) {
              fail(
                new DsecError('internal', `DSec answered ${status} with a body that is not JSON`, {
                  cause,
                }),
              );
              return;
            }
          }
          if (status < 200 || status >= 300) {
            fail(DsecError.fromBody(body, status));
            return;
          }
          try {
            succeed(stream ? stream.onJson(body) : body);
          } catch (err) {
            fail(err);
          }
        });
      });
      request.end(payload);
    });
  }

  /**
   * A request whose body and answer are byte streams (files, ports): resolves
   * with the response once a 2xx status arrived (the caller reads it, with
   * back-pressure); any other status rejects with its `DsecError`. `timeoutMs`
   * bounds the wait for the status line only; `signal` aborts the whole exchange.
   */
  raw(options: RawRequestOptions): Promise<http.IncomingMessage> {
    const replayable = options.body === undefined || Buffer.isBuffer(options.body);
    return this.#withRetries(
      { ...options, idempotent: options.idempotent === true && replayable },
      // A streamed body is gone after one try, sent or not.
      () => !replayable,
      (timeoutMs) => this.#rawOnce({ ...options, timeoutMs }),
    );
  }

  #rawOnce(options: RawRequestOptions): Promise<http.IncomingMessage> {
    const { signal } = options;
    if (this.#closed)
      return Promise.reject(new DsecError('unavailable', 'the DSec client is closed'));
    if (signal?.aborted) return Promise.reject(abortedError(signal));
    const headers: http.OutgoingHttpHeaders = { ...options.headers };
    if (this.#authorization) headers.authorization = this.#authorization;
    const body = options.body;
    if (Buffer.isBuffer(body)) headers['content-length'] = body.length;
    return new Promise((resolve, reject) => {
      let settled = false;
      const request = this.#request(this.#url(options.path), {
        method: options.method,
        headers,
        agent: this.#agent,
      });
      const fail = (err: unknown) => {
        clearTimeout(timer);
        request.destroy();
        if (!settled) {
          settled = true;
          reject(err instanceof Error ? err : toDsecError(err));
        }
      };
      const stopWatching = onAbort(signal, () => fail(abortedError(signal)));
      const timer = setTimeout(
        () =>
          fail(
            new DsecError(
              'deadline_exceeded',
              `${options.method} ${options.path} got no answer within ${options.timeoutMs} ms`,
            ),
          ),
        options.timeoutMs,
      );
      request.on('error', (err: NodeJS.ErrnoException) => fail(this.#networkError(err)));
      request.on('close', stopWatching);
      request.on('response', (res) => {
        clearTimeout(timer);
        const status = res.statusCode ?? 0;
        const dsecError = String(res.headers['x-dsec-error'] ?? '') !== '';
        if ((status >= 200 && status < 300) || (options.acceptAnyStatus && !dsecError)) {
          settled = true;
          resolve(res);
          return;
        }
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('error', (err) => fail(this.#networkError(err)));
        res.on('end', () => {
          let parsed: unknown;
          try {
            parsed = JSON.parse(Buffer.concat(chunks).toString('utf8'));
          } catch {
            parsed = undefined;
          }
          fail(DsecError.fromBody(parsed, status));
        });
      });
      if (body === undefined || Buffer.isBuffer(body)) request.end(body);
      else {
        body.on('error', (err) => fail(toDsecError(err, 'aborted')));
        body.pipe(request);
      }
    });
  }

  /** Opens an HTTP/1.1 upgrade (`Upgrade: <protocol>`) and resolves with the raw socket after `101`. */
  upgrade(
    path: string,
    protocol: string,
    options: { signal?: AbortSignal | undefined; timeoutMs: number },
  ): Promise<Duplex> {
    if (this.#closed)
      return Promise.reject(new DsecError('unavailable', 'the DSec client is closed'));
    if (options.signal?.aborted) return Promise.reject(abortedError(options.signal));
    const headers: http.OutgoingHttpHeaders = { connection: 'Upgrade', upgrade: protocol };
    if (this.#authorization) headers.authorization = this.#authorization;
    return new Promise((resolve, reject) => {
      // Not pooled: the socket becomes the caller's.
      const request = this.#request(this.#url(path), { method: 'GET', headers, agent: false });
      const fail = (err: Error) => {
        clearTimeout(timer);
        stopWatching();
        request.destroy();
        reject(err);
      };
      const timer = setTimeout(
        () => fail(new DsecError('deadline_exceeded', `GET ${path} got no answer in time`)),
        options.timeoutMs,
      );
      const stopWatching = onAbort(options.signal, () => fail(abortedError(options.signal)));
      request.on('error', (err: NodeJS.ErrnoException) => fail(this.#networkError(err)));
      request.on('upgrade', (_res, socket, head) => {
        clearTimeout(timer);
        stopWatching(); // the socket is the caller's now, and so is aborting it
        if (head.length > 0) socket.unshift(head);
        resolve(socket);
      });
      request.on('response', (res) => {
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('end', () => {
          let parsed: unknown;
          try {
            parsed = JSON.parse(Buffer.concat(chunks).toString('utf8'));
          } catch {
            parsed = undefined;
          }
          fail(DsecError.fromBody(parsed, res.statusCode ?? 500));
        });
      });
      request.end();
    });
  }

  /**
   * Where a request goes: the base URL's host and port with `path` (and its
   * query) under the base path. A plain path (see `PLAIN_PATH`, no dot
   * segments) is used as it is, without building a URL per request; anything
   * else is normalised through `URL` as before.
   */
  #requestTarget(path: string): http.RequestOptions {
    if (PLAIN_PATH.test(path) && !DOT_SEGMENT.test(path)) {
      return { ...this.#target, path: this.#basePath + path };
    }
    const url = this.#url(path);
    return { ...this.#target, path: url.pathname + url.search };
  }

  #url(path: string): URL {
    const url = new URL(this.baseUrl.href);
    url.pathname = url.pathname.replace(/\/+$/, '') + path.replace(/\?.*$/, '');
    const q = path.indexOf('?');
    if (q >= 0) url.search = path.slice(q);
    return url;
  }

  #networkError(err: NodeJS.ErrnoException): DsecError {
    if (err instanceof DsecError) return err;
    if (err.code !== undefined && CONNECT_ERRORS.has(err.code)) {
      const error = new DsecError(
        'unavailable',
        `cannot reach DSec at ${this.baseUrl.origin}: ${err.message} — is \`dsec up\` running?`,
        { cause: err, details: { errno: err.code } },
      );
      // No connection, so no byte of the request reached the server: safe to resend.
      notSent.add(error);
      return error;
    }
    return new DsecError(
      'unavailable',
      `connection to DSec at ${this.baseUrl.origin} failed: ${err.message}`,
      { cause: err, details: { errno: err.code } },
    );
  }
}

/**
 * A request path `URL` would leave as it is: RFC 3986 path and query characters
 * that it neither percent-encodes nor rewrites (no quotes, `#`, backslashes).
 */
const PLAIN_PATH = /^\/[\w\-.~!$&()*+,;=:@%/?]*$/;
const DOT_SEGMENT = /\/\.\.?(?:[/?#]|$)/;

/** Errors after which no byte of the request reached the server. */
const notSent = new WeakSet<DsecError>();

class StaleSocketError extends Error {
  constructor(readonly error: DsecError) {
    super(error.message);
  }
}

/**
 * The callbacks of the requests in flight on each caller signal. A caller
 * commonly passes one signal (Ctrl-C, a rollout's deadline) to many
 * concurrent calls (`dsec sandbox rm` of 100 sandboxes); one 'abort' listener
 * per signal, however many requests share it, keeps the signal's listener
 * list short (Node warns past 10) and costs O(1) to leave.
 */
const abortWaiters = new WeakMap<AbortSignal, { fire: () => void; waiters: Set<() => void> }>();

/**
 * Calls `fn` once when `signal` aborts, until the returned function is
 * called (idempotent). No signal: nothing to watch.
 */
function onAbort(signal: AbortSignal | undefined, fn: () => void): () => void {
  if (!signal) return () => undefined;
  let entry = abortWaiters.get(signal);
  if (!entry) {
    const waiters = new Set<() => void>();
    const fire = () => {
      abortWaiters.delete(signal);
      for (const waiter of waiters) waiter();
      waiters.clear();
    };
    entry = { fire, waiters };
    abortWaiters.set(signal, entry);
    signal.addEventListener('abort', fire, { once: true });
  }
  const { waiters, fire } = entry;
  // A distinct wrapper per call: the same `fn` registered twice is two waiters.
  const waiter = () => fn();
  waiters.add(waiter);
  return () => {
    if (!waiters.delete(waiter) || waiters.size > 0) return;
    signal.removeEventListener('abort', fire);
    if (abortWaiters.get(signal)?.waiters === waiters) abortWaiters.delete(signal);
  };
}

/** Exponential backoff with full jitter in its upper half (as the Python SDK's `RetryPolicy`). */
function backoffMs(policy: Required<RetryOptions>, retry: number): number {
  const ceiling = Math.min(policy.maxDelayMs, policy.baseDelayMs * 2 ** retry);
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal?.aborted) return Promise.reject(abortedError(signal));
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      stop();
      resolve();
    }, ms);
    const stop = onAbort(signal, () => {
      clearTimeout(timer);
      reject(abortedError(signal));
    });
  });
}

function abortedError(signal: AbortSignal | undefined): DsecError {
  return new DsecError('aborted', 'operation aborted', { cause: signal?.reason });
}
