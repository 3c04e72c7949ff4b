import http from 'node:http';
import type { IncomingMessage, OutgoingHttpHeaders } from 'node:http';
import https from 'node:https';
import { Duplex, PassThrough } from 'node:stream';
import type { Readable } from 'node:stream';
import { DsecError, toDsecError } from '@dsec/core';
import type {
  DisplayInput,
  FnCallOptions,
  FnCallRequest,
  FnCallResult,
  CommandInfo,
  CommandResult,
  CommandSpec,
  CreateSandboxRequest,
  EdgeApi,
  EdgeStatus,
  FileInfo,
  FileOptions,
  NetworkPolicyPatch,
  PtyOptions,
  PtySession,
  RunCommandOptions,
  SandboxEvent,
  SandboxInfo,
  SandboxIoApi,
  SessionInfo,
  SessionResult,
  SessionRunSpec,
  SnapshotInfo,
  EdgeSnapshotRequest,
  StartCommandSpec,
} from '@dsec/core';
import { checkSecret, signRequest, validProof } from './auth.js';
import {
  CMD_ERROR,
  CMD_RESULT,
  CMD_STDERR,
  CMD_STDOUT,
  frame,
  FrameReader,
  FRAMES_CONTENT_TYPE,
  MAX_COMMAND_FRAME_BYTES,
  MAX_PTY_FRAME_BYTES,
  parseExit,
  PORT_UPGRADE,
  PTY_DATA,
  PTY_EOF,
  PTY_EXIT,
  PTY_KILL,
  PTY_RESIZE,
  PTY_UPGRADE,
} from './frames.js';
import { decodeStreamError, EDGE_PATH_PREFIX, HEADER_STREAM_ERROR } from './protocol.js';

export interface RemoteEdgeOptions {
  /** The edge's ID; it is part of every signature, so a misdirected call is refused. */
  edgeId: string;
  /** The served edge's base URL (`http://10.0.0.7:7443`, or `https:`). */
  url: string;
  /** The per-edge secret the edge was served with. */
  secret: string;
  /**
   * Deadline for the answer's status line of calls that answer at once
   * (status, get, list, stat, …; default 30 s). Calls that wait on work
   * (create, stop, commands, waits, file bodies) are bounded by their
   * signal and their own timeouts instead.
   */
  requestTimeoutMs?: number;
}

/** Errors that mean no connection was made: the edge process is most likely down. */
const CONNECT_ERRORS = new Set(['ECONNREFUSED', 'EHOSTUNREACH', 'ENETUNREACH', 'ETIMEDOUT']);
const MAX_ERROR_BODY_BYTES = 1 << 20;

interface Exchange {
  method: 'GET' | 'POST' | 'PUT' | 'DELETE';
  /** Path below the protocol prefix, with its query. */
  path: string;
  json?: unknown;
  body?: Readable | Buffer | undefined;
  signal?: AbortSignal | undefined;
  /** Bound the wait for the status line by the client's `requestTimeoutMs`. */
  quick?: boolean;
  /** Safe to send again when a pooled socket turns out closed before any answer. */
  idempotent?: boolean;
}

/**
 * `EdgeApi` over the network: the client of `serveEdge`. Each call is one
 * signed HTTP/1.1 exchange on a pooled keep-alive socket (sized for
 * hundreds of concurrent calls); an answer without the edge's proof is
 * refused with `unavailable`. Aborting a call's signal destroys its
 * exchange, which aborts the edge call on the server (a command without a
 * `requestId` is killed, as in-process). `io`, `updateNetwork`,
 * `listEvents` and the lifecycle methods (`pauseSandbox`, `resumeSandbox`,
 * `setSandboxTimeout`, `snapshotSandbox`) are always present: an edge that
 * lacks one answers `unavailable`, as the apiserver does for in-process
 * edges without them.
 * `DsecError`s arrive as thrown (code, message, field, details).
 *
 * @example
 * ```ts
 * const edge = new RemoteEdge({ edgeId: 'edge-7', url: 'http://10.0.0.7:7443', secret });
 * const r = await edge.runCommand(id, { argv: ['echo', 'hi'] }, { projectId, onStdout });
 * ```
 */
export class RemoteEdge implements EdgeApi {
  readonly edgeId: string;
  readonly io: SandboxIoApi;
  readonly #link: EdgeLink;

  constructor(options: RemoteEdgeOptions) {
    this.edgeId = options.edgeId;
    this.#link = new EdgeLink(options);
    this.io = new RemoteSandboxIo(this.#link);
  }

  /** Drops pooled sockets; later calls reject with `unavailable`. */
  close(): void {
    this.#link.close();
  }

  status(signal?: AbortSignal): Promise<EdgeStatus> {
    return this.#link.json({
      method: 'GET',
      path: '/status',
      signal,
      quick: true,
      idempotent: true,
    });
  }

  createSandbox(req: CreateSandboxRequest, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({
      method: 'POST',
      path: '/sandboxes',
      json: req,
      signal,
      idempotent: req.requestId !== undefined,
    });
  }

  getSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({ method: 'GET', path: sb(id), signal, quick: true, idempotent: true });
  }

  async listSandboxes(
    filter: { projectIds?: string[]; includeEnded?: boolean },
    signal?: AbortSignal,
  ): Promise<SandboxInfo[]> {
    const q = query({
      projectIds: filter.projectIds ? JSON.stringify(filter.projectIds) : undefined,
      includeEnded: filter.includeEnded ? 1 : undefined,
    });
    const body = await this.#link.json<{ sandboxes: SandboxInfo[] }>({
      method: 'GET',
      path: `/sandboxes${q}`,
      signal,
      quick: true,
      idempotent: true,
    });
    return body.sandboxes;
  }

  async stopSandbox(id: string, signal?: AbortSignal): Promise<void> {
    await this.#link.json({ method: 'POST', path: `${sb(id)}/stop`, signal, idempotent: true });
  }

  runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    return this.#link.frames(
      { method: 'POST', path: `${sb(id)}/run`, json: { command, projectId: options.projectId } },
      options,
    );
  }

  updateNetwork(id: string, patch: NetworkPolicyPatch, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({
      method: 'POST',
      path: `${sb(id)}/network`,
      json: patch,
      signal,
      quick: true,
      idempotent: true,
    });
  }

  /** Not `quick`: a screendump of an emulated display takes a moment. */
  async screenshot(id: string, signal?: AbortSignal): Promise<Buffer> {
    const res = await this.#link.open({
      method: 'GET',
      path: `${sb(id)}/screenshot`,
      signal,
      idempotent: true,
    });
    const chunks: Buffer[] = [];
    for await (const chunk of this.#link.bodyStream(res, signal)) chunks.push(chunk as Buffer);
    return Buffer.concat(chunks);
  }

  async sendInput(id: string, input: DisplayInput, signal?: AbortSignal): Promise<void> {
    await this.#link.json({ method: 'POST', path: `${sb(id)}/input`, json: input, signal });
  }

  /** Not `quick`: pausing squeezes the sandbox's memory out, which takes a moment. */
  pauseSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({ method: 'POST', path: `${sb(id)}/pause`, signal, idempotent: true });
  }

  resumeSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({ method: 'POST', path: `${sb(id)}/resume`, signal, idempotent: true });
  }

  setSandboxTimeout(id: string, ttlSeconds: number, signal?: AbortSignal): Promise<SandboxInfo> {
    return this.#link.json({
      method: 'POST',
      path: `${sb(id)}/timeout`,
      json: { ttlSeconds },
      signal,
      quick: true,
      idempotent: true,
    });
  }

  /** Never resent: a second attempt would find the name taken by the first. */
  snapshotSandbox(
    id: string,
    req: EdgeSnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo> {
    return this.#link.json({ method: 'POST', path: `${sb(id)}/snapshot`, json: req, signal });
  }

  /**
   * One FnCall (issue 14). Not `quick`: a call runs up to its own time limit.
   * Resent on a stale socket: calls are stateless. An edge without FnCall
   * answers `unavailable`, and the apiserver tries another.
   */
  fncall(req: FnCallRequest, options: FnCallOptions): Promise<FnCallResult> {
    return this.#link.json({
      method: 'POST',
      path: '/fncall',
      json: { req, projectId: options.projectId },
      signal: options.signal,
      idempotent: true,
    });
  }

  async listEvents(
    id: string,
    q: { afterId?: number | undefined; limit?: number | undefined },
    signal?: AbortSignal,
  ): Promise<SandboxEvent[]> {
    const body = await this.#link.json<{ events: SandboxEvent[] }>({
      method: 'GET',
      path: `${sb(id)}/events${query({ afterId: q.afterId, limit: q.limit })}`,
      signal,
      quick: true,
      idempotent: true,
    });
    return body.events;
  }
}

/** The in-sandbox interface of a served edge. */
class RemoteSandboxIo implements SandboxIoApi {
  constructor(readonly link: EdgeLink) {}

  runCommand(
    sandboxId: string,
    spec: StartCommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    return this.link.frames(
      {
        method: 'POST',
        path: `${sb(sandboxId)}/io/run`,
        json: { spec, projectId: options.projectId },
      },
      options,
    );
  }

  startCommand(sandboxId: string, spec: StartCommandSpec): Promise<CommandInfo> {
    return this.link.json({
      method: 'POST',
      path: `${sb(sandboxId)}/commands`,
      json: spec,
      idempotent: spec.requestId !== undefined,
    });
  }

  getCommand(sandboxId: string, commandId: string): Promise<CommandInfo> {
    return this.link.json({
      method: 'GET',
      path: cmd(sandboxId, commandId),
      quick: true,
      idempotent: true,
    });
  }

  async listCommands(sandboxId: string): Promise<CommandInfo[]> {
    const body = await this.link.json<{ commands: CommandInfo[] }>({
      method: 'GET',
      path: `${sb(sandboxId)}/commands`,
      quick: true,
      idempotent: true,
    });
    return body.commands;
  }

  waitCommand(
    sandboxId: string,
    commandId: string,
    options: { timeoutMs?: number | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<CommandResult> {
    return this.link.json({
      method: 'GET',
      path: `${cmd(sandboxId, commandId)}/wait${query({ timeoutMs: options.timeoutMs })}`,
      signal: options.signal,
      idempotent: true,
    });
  }

  watchCommand(
    sandboxId: string,
    commandId: string,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    return this.link.frames(
      { method: 'GET', path: `${cmd(sandboxId, commandId)}/output`, idempotent: true },
      options,
    );
  }

  async killCommand(sandboxId: string, commandId: string): Promise<void> {
    await this.link.json({
      method: 'POST',
      path: `${cmd(sandboxId, commandId)}/kill`,
      quick: true,
      idempotent: true,
    });
  }

  async signalCommand(
    sandboxId: string,
    commandId: string,
    signal: string | number,
  ): Promise<void> {
    await this.link.json({
      method: 'POST',
      path: `${cmd(sandboxId, commandId)}/signal`,
      json: { signal },
      quick: true,
    });
  }

  writeStdin(
    sandboxId: string,
    commandId: string,
    data: Readable | Buffer | undefined,
    options: { eof?: boolean | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<{ bytes: number }> {
    return this.link.json({
      method: 'POST',
      path: `${cmd(sandboxId, commandId)}/stdin${query({ eof: options.eof ? 1 : undefined })}`,
      body: data,
      signal: options.signal,
    });
  }

  runInSession(
    sandboxId: string,
    name: string,
    spec: SessionRunSpec,
    options: RunCommandOptions = {},
  ): Promise<SessionResult> {
    return this.link.frames(
      {
        method: 'POST',
        path: `${sb(sandboxId)}/sessions/${enc(name)}/run`,
        json: { spec, projectId: options.projectId },
      },
      options,
    );
  }

  async listSessions(sandboxId: string): Promise<SessionInfo[]> {
    const body = await this.link.json<{ sessions: SessionInfo[] }>({
      method: 'GET',
      path: `${sb(sandboxId)}/sessions`,
      quick: true,
      idempotent: true,
    });
    return body.sessions;
  }

  async closeSession(sandboxId: string, name: string): Promise<void> {
    await this.link.json({
      method: 'DELETE',
      path: `${sb(sandboxId)}/sessions/${enc(name)}`,
      quick: true,
      idempotent: true,
    });
  }

  async readFile(sandboxId: string, path: string, options: FileOptions = {}): Promise<Readable> {
    const res = await this.link.open({
      method: 'GET',
      path: `${sb(sandboxId)}/files${query({ path, user: options.user })}`,
      signal: options.signal,
      quick: true,
      idempotent: true,
    });
    return this.link.bodyStream(res, options.signal);
  }

  writeFile(
    sandboxId: string,
    path: string,
    body: Readable | Buffer,
    options: FileOptions & { mode?: number | undefined } = {},
  ): Promise<FileInfo> {
    return this.link.json({
      method: 'PUT',
      path: `${sb(sandboxId)}/files${query({ path, user: options.user, mode: options.mode })}`,
      body,
      signal: options.signal,
    });
  }

  statFile(sandboxId: string, path: string, options: FileOptions = {}): Promise<FileInfo> {
    return this.link.json({
      method: 'GET',
      path: `${sb(sandboxId)}/files/stat${query({ path, user: options.user })}`,
      signal: options.signal,
      quick: true,
      idempotent: true,
    });
  }

  async listDir(sandboxId: string, path: string, options: FileOptions = {}): Promise<FileInfo[]> {
    const body = await this.link.json<{ entries: FileInfo[] }>({
      method: 'GET',
      path: `${sb(sandboxId)}/files/list${query({ path, user: options.user })}`,
      signal: options.signal,
      quick: true,
      idempotent: true,
    });
    return body.entries;
  }

  async mkdir(
    sandboxId: string,
    path: string,
    options: FileOptions & { parents?: boolean | undefined; mode?: number | undefined } = {},
  ): Promise<void> {
    const { signal, ...rest } = options;
    await this.link.json({
      method: 'POST',
      path: `${sb(sandboxId)}/files/mkdir`,
      json: { path, ...rest },
      signal,
      quick: true,
    });
  }

  async remove(
    sandboxId: string,
    path: string,
    options: FileOptions & { recursive?: boolean | undefined } = {},
  ): Promise<void> {
    const { signal, ...rest } = options;
    await this.link.json({
      method: 'POST',
      path: `${sb(sandboxId)}/files/remove`,
      json: { path, ...rest },
      signal,
    });
  }

  async rename(
    sandboxId: string,
    from: string,
    to: string,
    options: FileOptions & { overwrite?: boolean | undefined } = {},
  ): Promise<void> {
    const { signal, ...rest } = options;
    await this.link.json({
      method: 'POST',
      path: `${sb(sandboxId)}/files/rename`,
      json: { from, to, ...rest },
      signal,
      quick: true,
    });
  }

  async connectPort(
    sandboxId: string,
    port: number,
    options: { signal?: AbortSignal | undefined } = {},
  ): Promise<Duplex> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) {
      throw new DsecError('invalid_argument', 'port must be 1–65535', { field: 'port' });
    }
    const socket = await this.link.upgrade(
      `${sb(sandboxId)}/ports/${port}`,
      PORT_UPGRADE,
      options.signal,
    );
    return portStream(socket, this.link.edgeId, port);
  }

  async openPty(sandboxId: string, options: PtyOptions = {}): Promise<PtySession> {
    const { signal, ...rest } = options;
    const socket = await this.link.upgrade(
      `${sb(sandboxId)}/pty${query({ options: JSON.stringify(rest) })}`,
      PTY_UPGRADE,
      signal,
    );
    return remotePty(socket);
  }
}

/** The signed HTTP exchanges of one `RemoteEdge`. */
class EdgeLink {
  readonly edgeId: string;
  readonly #secret: string;
  readonly #origin: string;
  readonly #target: { protocol: string; hostname: string; port: string };
  readonly #agent: http.Agent;
  readonly #request: typeof http.request;
  readonly #quickMs: number;
  #closed = false;

  constructor(options: RemoteEdgeOptions) {
    checkSecret(options.secret, 'secret');
    let url: URL;
    try {
      url = new URL(options.url);
    } catch (cause) {
      throw new DsecError('invalid_argument', `invalid edge URL ${JSON.stringify(options.url)}`, {
        field: 'url',
        cause,
      });
    }
    if (url.protocol !== 'http:' && url.protocol !== 'https:') {
      throw new DsecError('invalid_argument', `edge URL must be http(s): ${options.url}`, {
        field: 'url',
      });
    }
    this.edgeId = options.edgeId;
    this.#secret = options.secret;
    this.#origin = url.origin;
    this.#target = {
      protocol: url.protocol,
      hostname: url.hostname.replace(/^\[|\]$/g, ''),
      port: url.port,
    };
    const agentOptions = {
      keepAlive: true,
      keepAliveMsecs: 10_000,
      // Commands of many sandboxes run at once, each holding a socket for its duration.
      maxSockets: 1024,
      maxFreeSockets: 256,
      // Reuse the most recent socket: the extra ones of a burst then idle out.
      scheduling: 'lifo' as const,
      // Nagle would hold small requests for an ACK (~40 ms).
      noDelay: true,
    };
    const isHttps = url.protocol === 'https:';
    this.#agent = isHttps ? new https.Agent(agentOptions) : new http.Agent(agentOptions);
    this.#request = isHttps ? https.request : http.request;
    this.#quickMs = options.requestTimeoutMs ?? 30_000;
  }

  close(): void {
    this.#closed = true;
    this.#agent.destroy();
  }

  /** A verified 2xx answer, its body unread; any other status rejects with its `DsecError`. */
  open(x: Exchange): Promise<IncomingMessage> {
    return this.#attempt(x, true);
  }

  async json<T>(x: Exchange): Promise<T> {
    const res = await this.open(x);
    if (res.statusCode === 204) {
      res.resume();
      return undefined as T;
    }
    const text = (await this.#readAll(res, x.signal, Infinity)).toString('utf8');
    try {
      return JSON.parse(text) as T;
    } catch (cause) {
      throw new DsecError('internal', `edge ${this.edgeId} answered with a body that is not JSON`, {
        cause,
      });
    }
  }

  /** A command stream: output to the callbacks as it comes, then the result. */
  async frames<T>(x: Exchange, o: RunCommandOptions): Promise<T> {
    const signal = o.signal;
    const res = await this.open({ ...x, signal });
    const type = String(res.headers['content-type'] ?? '');
    if (type !== FRAMES_CONTENT_TYPE) {
      res.destroy();
      throw new DsecError('internal', `edge ${this.edgeId} answered a command with ${type}`);
    }
    return new Promise<T>((resolve, reject) => {
      let outcome: { ok: T } | { err: DsecError } | undefined;
      let thrown: unknown;
      const reader = new FrameReader(MAX_COMMAND_FRAME_BYTES, (t, payload) => {
        if (t === CMD_STDOUT) o.onStdout?.(payload);
        else if (t === CMD_STDERR) o.onStderr?.(payload);
        else if (t === CMD_RESULT) outcome = { ok: JSON.parse(payload.toString('utf8')) as T };
        else if (t === CMD_ERROR) {
          outcome = { err: DsecError.fromBody(JSON.parse(payload.toString('utf8'))) };
        }
      });
      res.on('data', (chunk: Buffer) => {
        try {
          reader.push(chunk);
        } catch (err) {
          // A callback threw, or the stream is malformed: stop here, with that error.
          thrown = err;
          res.destroy();
        }
      });
      res.once('error', (err) => reject(this.#lost(err, signal)));
      res.once('close', () => {
        if (thrown !== undefined) reject(thrown instanceof Error ? thrown : toDsecError(thrown));
        else if (!res.complete) reject(this.#lost(new Error('the stream was cut'), signal));
      });
      res.once('end', () => {
        if (!outcome) {
          reject(new DsecError('unavailable', `edge ${this.edgeId}'s command stream ended early`));
        } else if ('ok' in outcome) resolve(outcome.ok);
        else reject(outcome.err);
      });
    });
  }

  /** A byte answer as a stream; an error the server sent after the first byte destroys it. */
  bodyStream(res: IncomingMessage, signal: AbortSignal | undefined): Readable {
    const out = new PassThrough();
    // The consumer's listeners get failures; none may crash the caller meanwhile.
    out.on('error', () => undefined);
    res.once('end', () => {
      const failed = res.trailers[HEADER_STREAM_ERROR];
      if (failed) out.destroy(decodeStreamError(failed));
      else out.end();
    });
    res.once('error', (err) => out.destroy(this.#lost(err, signal)));
    out.once('close', () => {
      if (!res.complete) res.destroy();
    });
    res.pipe(out, { end: false });
    return out;
  }

  /** An HTTP upgrade: the raw socket after a verified `101`. Not pooled: it is the caller's. */
  upgrade(path: string, protocol: string, signal: AbortSignal | undefined): Promise<Duplex> {
    if (this.#closed) return Promise.reject(this.#closedError());
    if (signal?.aborted) return Promise.reject(abortedError(signal));
    const full = EDGE_PATH_PREFIX + path;
    const { headers: auth, nonce } = signRequest(this.#secret, this.edgeId, 'GET', full);
    return new Promise<Duplex>((resolve, reject) => {
      const request = this.#request({
        ...this.#target,
        method: 'GET',
        path: full,
        headers: { ...auth, connection: 'Upgrade', upgrade: protocol },
        agent: false,
      });
      let settled = false;
      const finish = (err: Error | undefined, socket?: Duplex) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        if (err) {
          request.destroy();
          reject(err);
        } else resolve(socket!);
      };
      const onAbort = () => finish(abortedError(signal));
      signal?.addEventListener('abort', onAbort, { once: true });
      const timer = setTimeout(
        () => finish(new DsecError('deadline_exceeded', `edge ${this.edgeId}: no answer in time`)),
        this.#quickMs,
      );
      request.on('error', (err: NodeJS.ErrnoException) => finish(this.#networkError(err)));
      request.on('upgrade', (res, socket, head) => {
        if (!validProof(this.#secret, this.edgeId, nonce, res.headers)) {
          socket.destroy();
          finish(this.#impostor(res.statusCode));
          return;
        }
        socket.on('error', () => undefined);
        socket.setNoDelay(true);
        if (head.length > 0) socket.unshift(head);
        if (settled) socket.destroy();
        finish(undefined, socket);
      });
      request.on('response', (res) => {
        if (!validProof(this.#secret, this.edgeId, nonce, res.headers)) {
          res.destroy();
          finish(this.#impostor(res.statusCode));
          return;
        }
        this.#readAll(res, undefined, MAX_ERROR_BODY_BYTES).then(
          (buf) => finish(errorFromBody(buf, res.statusCode ?? 500)),
          (err: unknown) => finish(toDsecError(err, 'unavailable')),
        );
      });
      request.end();
    });
  }

  #attempt(x: Exchange, mayRetry: boolean): Promise<IncomingMessage> {
    if (this.#closed) return Promise.reject(this.#closedError());
    const signal = x.signal;
    if (signal?.aborted) return Promise.reject(abortedError(signal));
    const path = EDGE_PATH_PREFIX + x.path;
    const { headers: auth, nonce } = signRequest(this.#secret, this.edgeId, x.method, path);
    const headers: OutgoingHttpHeaders = auth;
    let payload: Buffer | undefined;
    const stream = x.body !== undefined && !Buffer.isBuffer(x.body) ? x.body : undefined;
    if (x.json !== undefined) {
      payload = Buffer.from(JSON.stringify(x.json));
      headers['content-type'] = 'application/json';
    } else if (Buffer.isBuffer(x.body)) {
      payload = x.body;
      headers['content-type'] = 'application/octet-stream';
    } else if (stream) {
      headers['content-type'] = 'application/octet-stream';
    }
    if (!stream && x.method !== 'GET') headers['content-length'] = payload?.length ?? 0;

    return new Promise<IncomingMessage>((resolve, reject) => {
      let settled = false;
      let response: IncomingMessage | undefined;
      const request = this.#request({
        ...this.#target,
        method: x.method,
        path,
        headers,
        agent: this.#agent,
      });
      // The one abort listener of this call; it stays until the answer is read or dropped.
      const onAbort = () => {
        const err = abortedError(signal);
        response?.destroy(err);
        request.destroy(err);
        fail(err);
      };
      signal?.addEventListener('abort', onAbort, { once: true });
      const release = () => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
      };
      const fail = (err: Error) => {
        if (settled) return;
        settled = true;
        release();
        request.destroy();
        reject(err);
      };
      const timer = x.quick
        ? setTimeout(
            () =>
              fail(
                new DsecError(
                  'deadline_exceeded',
                  `edge ${this.edgeId}: ${x.method} ${x.path} got no answer within ${this.#quickMs} ms`,
                ),
              ),
            this.#quickMs,
          )
        : undefined;
      request.on('error', (err: NodeJS.ErrnoException) => {
        // A pooled socket the server closed while idle fails on reuse before
        // the server saw anything; an idempotent call goes again, once.
        if (
          !settled &&
          !response &&
          mayRetry &&
          x.idempotent &&
          !stream &&
          request.reusedSocket &&
          (err.code === 'ECONNRESET' || err.code === 'EPIPE')
        ) {
          settled = true;
          release();
          resolve(this.#attempt(x, false));
          return;
        }
        fail(this.#networkError(err));
      });
      request.on('response', (res) => {
        response = res;
        clearTimeout(timer);
        if (!validProof(this.#secret, this.edgeId, nonce, res.headers)) {
          res.destroy();
          fail(this.#impostor(res.statusCode));
          return;
        }
        const status = res.statusCode ?? 0;
        if (status >= 200 && status < 300) {
          settled = true;
          res.once('close', release);
          resolve(res);
          return;
        }
        this.#readAll(res, signal, MAX_ERROR_BODY_BYTES).then(
          (buf) => fail(errorFromBody(buf, status)),
          (err: unknown) => fail(toDsecError(err, 'unavailable')),
        );
      });
      if (stream) {
        stream.once('error', (err) => fail(toDsecError(err, 'aborted')));
        stream.pipe(request);
      } else request.end(payload);
    });
  }

  #readAll(res: IncomingMessage, signal: AbortSignal | undefined, cap: number): Promise<Buffer> {
    return new Promise<Buffer>((resolve, reject) => {
      const chunks: Buffer[] = [];
      let size = 0;
      res.on('data', (c: Buffer) => {
        size += c.length;
        if (size <= cap) chunks.push(c);
      });
      res.once('end', () => resolve(Buffer.concat(chunks)));
      res.once('error', (err) => reject(this.#lost(err, signal)));
    });
  }

  /** A stream broke after the answer began. */
  #lost(err: unknown, signal: AbortSignal | undefined): DsecError {
    if (err instanceof DsecError) return err;
    if (signal?.aborted) return abortedError(signal);
    return new DsecError(
      'unavailable',
      `lost the connection to edge ${this.edgeId} at ${this.#origin}: ${String((err as Error)?.message ?? err)}`,
      { cause: err },
    );
  }

  #networkError(err: NodeJS.ErrnoException): DsecError {
    if (err instanceof DsecError) return err;
    const what = err.code !== undefined && CONNECT_ERRORS.has(err.code) ? 'cannot reach' : 'lost';
    return new DsecError(
      'unavailable',
      `${what} edge ${this.edgeId} at ${this.#origin}: ${err.message}`,
      { cause: err, details: { edgeId: this.edgeId, errno: err.code } },
    );
  }

  #impostor(status: number | undefined): DsecError {
    return new DsecError(
      'unavailable',
      `edge ${this.edgeId} at ${this.#origin} failed to authenticate its answer ` +
        '(a different secret, or not that edge)',
      { details: { edgeId: this.edgeId, status } },
    );
  }

  #closedError(): DsecError {
    return new DsecError('unavailable', `the client of edge ${this.edgeId} is closed`);
  }
}

/**
 * The byte stream of a port over an upgraded socket. The edge resets the
 * connection when the sandbox side fails (nothing listens), and that
 * becomes `unavailable`; as in-process, a failure waits for the consumer's
 * first read or write, so a consumer that attaches late still gets it.
 */
function portStream(socket: Duplex, edgeId: string, port: number): Duplex {
  let used = false;
  let failure: DsecError | undefined;
  let ended = false;
  const stream = new Duplex({
    read: () => {
      used = true;
      if (failure) stream.destroy(failure);
      else socket.resume();
    },
    write: (chunk: Buffer, _enc, cb) => {
      used = true;
      if (failure) return cb(failure);
      if (socket.write(chunk)) cb();
      else socket.once('drain', () => cb());
    },
    final: (cb) => {
      socket.end();
      cb();
    },
    destroy: (err, cb) => {
      socket.destroy();
      cb(err);
    },
  });
  stream.on('error', () => undefined);
  const fail = (why: string) => {
    failure ??= new DsecError('unavailable', `port ${port} in the sandbox failed: ${why}`, {
      details: { edgeId, port },
    });
    if (used) stream.destroy(failure);
  };
  socket.on('data', (chunk: Buffer) => {
    if (!stream.push(chunk)) socket.pause();
  });
  socket.once('end', () => {
    ended = true;
    stream.push(null);
  });
  socket.once('error', (err) => fail(err.message));
  socket.once('close', () => {
    if (!ended) fail('the edge closed the connection');
  });
  return stream;
}

/** A terminal over an upgraded socket (frames of docs/edge-protocol.md). */
function remotePty(socket: Duplex): PtySession {
  const listeners: ((chunk: Buffer) => void)[] = [];
  const early: Buffer[] = [];
  let exit: { exitCode: number; signal?: string | undefined } | undefined;
  const exited = new Promise<{ exitCode: number; signal?: string | undefined }>((resolve) => {
    const reader = new FrameReader(MAX_PTY_FRAME_BYTES, (type, payload) => {
      if (type === PTY_DATA) {
        if (listeners.length === 0) early.push(payload);
        for (const l of listeners) l(payload);
      } else if (type === PTY_EXIT) exit = parseExit(payload);
    });
    socket.on('data', (chunk: Buffer) => {
      try {
        reader.push(chunk);
      } catch {
        socket.destroy();
      }
    });
    // No exit frame: the connection was lost, which the edge reports as 255.
    socket.once('close', () => resolve(exit ?? { exitCode: 255, signal: undefined }));
  });
  const send = (type: number, payload: Buffer) => {
    if (socket.writable) socket.write(frame(type, payload));
  };
  return {
    onOutput(cb) {
      listeners.push(cb);
      for (const c of early.splice(0)) cb(c);
    },
    write: (data) => send(PTY_DATA, data),
    resize(rows, cols) {
      const p = Buffer.alloc(4);
      p.writeUInt16BE(rows & 0xffff, 0);
      p.writeUInt16BE(cols & 0xffff, 2);
      send(PTY_RESIZE, p);
    },
    end: () => send(PTY_EOF, Buffer.alloc(0)),
    kill: () => send(PTY_KILL, Buffer.alloc(0)),
    exited,
  };
}

function errorFromBody(buf: Buffer, status: number): DsecError {
  let parsed: unknown;
  try {
    parsed = JSON.parse(buf.toString('utf8'));
  } catch {
    parsed = undefined;
  }
  return DsecError.fromBody(parsed, status);
}

function abortedError(signal: AbortSignal | undefined): DsecError {
  return new DsecError('aborted', 'operation aborted', { cause: signal?.reason });
}

function enc(s: string): string {
  return encodeURIComponent(s);
}

function sb(id: string): string {
  return `/sandboxes/${enc(id)}`;
}

function cmd(sandboxId: string, commandId: string): string {
  return `${sb(sandboxId)}/commands/${enc(commandId)}`;
}

function query(params: Record<string, string | number | undefined>): string {
  const parts: string[] = [];
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined) parts.push(`${k}=${encodeURIComponent(String(v))}`);
  }
  return parts.length ? `?${parts.join('&')}` : '';
}
