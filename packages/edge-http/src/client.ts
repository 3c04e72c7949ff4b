import { createHash } from 'node:crypto';
import http from 'node:http';
import type { IncomingMessage, OutgoingHttpHeaders } from 'node:http';
import https from 'node:https';
import { Duplex, PassThrough, Readable } from 'node:stream';
import { DsecError, toDsecError } from '@dsec/core';
import type {
  EdgeVolumeApi,
  EdgeVolumeInfo,
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
import {
  checkSecret,
  digestOf,
  safeEqual,
  signRequest,
  STREAMED,
  TRAILER_BODY_MAC,
} from './auth.js';
import type { SignedExchange } from './auth.js';
import {
  BODY_DATA,
  BODY_END,
  BODY_FRAME_BYTES,
  CMD_ERROR,
  CMD_RESULT,
  CMD_STDERR,
  CMD_STDOUT,
  frame,
  FrameMacError,
  FrameReader,
  FRAMES_CONTENT_TYPE,
  MAX_COMMAND_FRAME_BYTES,
  MAX_PORT_FRAME_BYTES,
  MAX_PTY_FRAME_BYTES,
  parseExit,
  PORT_DATA,
  PORT_END,
  PORT_FRAME_BYTES,
  PORT_UPGRADE,
  PTY_DATA,
  PTY_EOF,
  PTY_EXIT,
  PTY_KILL,
  PTY_RESIZE,
  PTY_UPGRADE,
} from './frames.js';
import { decodeStreamError, EDGE_PATH_PREFIX, HEADER_STREAM_ERROR } from './protocol.js';
import { normalizeFingerprint, PinnedAgent, shownFingerprint } from './tls.js';

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
  /**
   * Pin the edge's TLS certificate (an `https:` URL): the SHA-256
   * fingerprints of the certificates accepted (hex, colons optional, as
   * `openssl x509 -noout -fingerprint -sha256` prints them). Any other
   * certificate is refused before a byte of a request is sent, whatever
   * signed it (`unavailable`, `details.reason` `edge_certificate`); no CA,
   * name or date is consulted. Without pins an `https:` URL is checked
   * against the system's CAs, as Node does.
   */
  tls?: { pinSha256: readonly string[] } | undefined;
}

/** Errors that mean no connection was made: the edge process is most likely down. */
const CONNECT_ERRORS = new Set(['ECONNREFUSED', 'EHOSTUNREACH', 'ENETUNREACH', 'ETIMEDOUT']);
/**
 * Whole answers are read before they are believed, so they are bounded: an
 * error body (the edge's are a few hundred bytes) and a JSON answer. The
 * largest JSON answer is a command's result from `waitCommand`, as large as
 * the same result in a command stream's last frame (both streams' kept
 * output, up to 64 MiB each, and every control byte is six bytes of JSON),
 * so it has that frame's bound. An answer past its bound is dropped.
 */
const MAX_ERROR_BODY_BYTES = 1 << 20;
const MAX_JSON_ANSWER_BYTES = MAX_COMMAND_FRAME_BYTES;

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
  /** A 2xx answer streams (frames, bytes): proven as `stream`, its bytes checked as they come. */
  stream?: boolean;
}

/** A verified answer: its exchange, and the whole body unless it streams. */
interface Answer {
  res: IncomingMessage;
  exchange: SignedExchange;
  body?: Buffer;
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
  /** The edge's volumes (docs/volumes.md); an edge that keeps none answers `unavailable`. */
  readonly volumes: EdgeVolumeApi;
  readonly #link: EdgeLink;

  constructor(options: RemoteEdgeOptions) {
    this.edgeId = options.edgeId;
    this.#link = new EdgeLink(options);
    this.io = new RemoteSandboxIo(this.#link);
    this.volumes = new RemoteVolumes(this.#link);
  }

  /** Drops pooled sockets; later calls reject with `unavailable`. */
  close(): void {
    this.#link.close();
  }

  /**
   * Hands over to a client of the same edge with other pins (a certificate
   * rotation): later calls here reject with `unavailable`, idle sockets
   * close now, and a call in flight finishes on its connection if that
   * connection's certificate is one of `pinSha256`, or is cut now (a pin
   * withdrawn). `close()` cuts every call in flight, which kills commands.
   */
  retire(pinSha256: readonly string[]): void {
    this.#link.retire(new Set(pinSha256.map((p) => normalizeFingerprint(p))));
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
    const answer = await this.#link.open({
      method: 'GET',
      path: `${sb(id)}/screenshot`,
      signal,
      idempotent: true,
    });
    const chunks: Buffer[] = [];
    for await (const chunk of this.#link.bodyStream(answer, signal)) chunks.push(chunk as Buffer);
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

/** The volumes of a served edge. Creates and deletes are never resent: a retry would find the first's result. */
class RemoteVolumes implements EdgeVolumeApi {
  constructor(readonly link: EdgeLink) {}

  create(
    req: { projectId: string; name: string; sizeMb: number },
    signal?: AbortSignal,
  ): Promise<EdgeVolumeInfo> {
    return this.link.json({ method: 'POST', path: '/volumes/create', json: req, signal });
  }

  get(projectId: string, name: string, signal?: AbortSignal): Promise<EdgeVolumeInfo> {
    return this.link.json({
      method: 'POST',
      path: '/volumes/get',
      json: { projectId, name },
      signal,
      quick: true,
      idempotent: true,
    });
  }

  async list(projectId: string | undefined, signal?: AbortSignal): Promise<EdgeVolumeInfo[]> {
    const body = await this.link.json<{ volumes: EdgeVolumeInfo[] }>({
      method: 'POST',
      path: '/volumes/list',
      json: projectId === undefined ? {} : { projectId },
      signal,
      quick: true,
      idempotent: true,
    });
    return body.volumes;
  }

  async delete(projectId: string, name: string, signal?: AbortSignal): Promise<void> {
    await this.link.json({
      method: 'POST',
      path: '/volumes/delete',
      json: { projectId, name },
      signal,
    });
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
    const answer = await this.link.open({
      method: 'GET',
      path: `${sb(sandboxId)}/files${query({ path, user: options.user })}`,
      signal: options.signal,
      quick: true,
      idempotent: true,
    });
    return this.link.bodyStream(answer, options.signal);
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
    const { socket, exchange } = await this.link.upgrade(
      `${sb(sandboxId)}/ports/${port}`,
      PORT_UPGRADE,
      options.signal,
    );
    return portStream(socket, exchange, this.link.edgeId, port);
  }

  async openPty(sandboxId: string, options: PtyOptions = {}): Promise<PtySession> {
    const { signal, ...rest } = options;
    const { socket, exchange } = await this.link.upgrade(
      `${sb(sandboxId)}/pty${query({ options: JSON.stringify(rest) })}`,
      PTY_UPGRADE,
      signal,
    );
    return remotePty(socket, exchange);
  }
}

/** The signed HTTP exchanges of one `RemoteEdge`. */
class EdgeLink {
  readonly edgeId: string;
  readonly #secret: string;
  readonly #origin: string;
  readonly #target: { protocol: string; hostname: string; port: string };
  readonly #agent: http.Agent;
  /** Upgrades get a connection of their own: none (a fresh socket), or a pinned agent's. */
  readonly #upgradeAgent: http.Agent | false;
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
    const pins = options.tls?.pinSha256;
    if (pins !== undefined) {
      if (!isHttps) {
        throw new DsecError(
          'invalid_argument',
          `pinned TLS needs an https: edge URL, not ${url.origin}`,
          {
            field: 'url',
          },
        );
      }
      if (!Array.isArray(pins) || pins.length === 0) {
        throw new DsecError(
          'invalid_argument',
          'tls.pinSha256 must list at least one fingerprint',
          {
            field: 'tls.pinSha256',
          },
        );
      }
      const set = new Set(pins.map((p) => normalizeFingerprint(p)));
      const refuse = (got: string | undefined) => this.#certificateError(got);
      this.#agent = new PinnedAgent(agentOptions, set, refuse);
      this.#upgradeAgent = new PinnedAgent({ keepAlive: false, noDelay: true }, set, refuse);
    } else {
      this.#agent = isHttps ? new https.Agent(agentOptions) : new http.Agent(agentOptions);
      this.#upgradeAgent = false;
    }
    this.#request = isHttps ? https.request : http.request;
    this.#quickMs = options.requestTimeoutMs ?? 30_000;
  }

  close(): void {
    this.#closed = true;
    this.#agent.destroy();
    if (this.#upgradeAgent) this.#upgradeAgent.destroy();
  }

  retire(pins: ReadonlySet<string>): void {
    this.#closed = true;
    for (const agent of [this.#agent, this.#upgradeAgent]) {
      if (!agent) continue;
      // A socket a call frees is closed instead of pooled.
      agent.maxFreeSockets = 0;
      for (const list of Object.values(agent.freeSockets)) for (const s of list ?? []) s.destroy();
      for (const list of Object.values(agent.sockets))
        for (const s of list ?? []) {
          const fingerprint = shownFingerprint(s);
          if (fingerprint === undefined || !pins.has(fingerprint)) s.destroy();
        }
    }
  }

  /** A verified 2xx answer whose body streams, unread; any other status rejects with its `DsecError`. */
  open(x: Exchange): Promise<Answer> {
    return this.#attempt({ ...x, stream: true }, true);
  }

  async json<T>(x: Exchange): Promise<T> {
    const { res, body } = await this.#attempt({ ...x, stream: false }, true);
    if (res.statusCode === 204) return undefined as T;
    try {
      return JSON.parse((body ?? Buffer.alloc(0)).toString('utf8')) as T;
    } catch (cause) {
      throw new DsecError('internal', `edge ${this.edgeId} answered with a body that is not JSON`, {
        cause,
      });
    }
  }

  /**
   * A command stream: each frame's MAC checked before its output reaches
   * the callbacks, then the result. A frame that fails, or any byte after
   * the last frame, ends the call with the client's refusal.
   */
  async frames<T>(x: Exchange, o: RunCommandOptions): Promise<T> {
    const signal = o.signal;
    const { res, exchange } = await this.open({ ...x, signal });
    const type = String(res.headers['content-type'] ?? '');
    if (type !== FRAMES_CONTENT_TYPE) {
      res.destroy();
      throw new DsecError('internal', `edge ${this.edgeId} answered a command with ${type}`);
    }
    return new Promise<T>((resolve, reject) => {
      let outcome: { ok: T } | { err: DsecError } | undefined;
      let thrown: unknown;
      const reader = new FrameReader(
        MAX_COMMAND_FRAME_BYTES,
        exchange.sealer('answer'),
        (t, payload) => {
          if (outcome) throw new FrameMacError();
          if (t === CMD_STDOUT) o.onStdout?.(payload);
          else if (t === CMD_STDERR) o.onStderr?.(payload);
          else if (t === CMD_RESULT) outcome = { ok: JSON.parse(payload.toString('utf8')) as T };
          else if (t === CMD_ERROR) {
            outcome = { err: DsecError.fromBody(JSON.parse(payload.toString('utf8'))) };
          }
        },
      );
      res.on('data', (chunk: Buffer) => {
        try {
          if (outcome) throw new FrameMacError();
          reader.push(chunk);
        } catch (err) {
          // A frame failed its MAC, a callback threw, or the stream is malformed: stop here.
          thrown = err instanceof FrameMacError ? this.#impostor(200, 'frame') : err;
          res.destroy();
        }
      });
      res.once('error', (err) => reject(this.#lost(err, signal)));
      res.once('close', () => {
        if (thrown !== undefined) reject(thrown instanceof Error ? thrown : toDsecError(thrown));
        else if (!res.complete) reject(this.#lost(new Error('the stream was cut'), signal));
      });
      res.once('end', () => {
        if (thrown !== undefined) return;
        if (!outcome) {
          reject(new DsecError('unavailable', `edge ${this.edgeId}'s command stream ended early`));
        } else if ('ok' in outcome) resolve(outcome.ok);
        else reject(outcome.err);
      });
    });
  }

  /**
   * A byte answer as a stream. It ends only once the MAC trailer over its
   * SHA-256 (and the error trailer, if any) checks out; otherwise it fails
   * with the client's refusal, or with the error the edge sent after the
   * first byte. Bytes flow before that check: a consumer that must not act
   * on unchecked bytes waits for the end.
   */
  bodyStream({ res, exchange }: Answer, signal: AbortSignal | undefined): Readable {
    const out = new PassThrough();
    // The consumer's listeners get failures; none may crash the caller meanwhile.
    out.on('error', () => undefined);
    const hash = createHash('sha256');
    res.on('data', (chunk: Buffer) => hash.update(chunk));
    res.once('end', () => {
      const failed = res.trailers[HEADER_STREAM_ERROR] ?? '';
      const mac = res.trailers[TRAILER_BODY_MAC];
      const want = exchange.bodyMac('answer', digestOf(hash), failed);
      if (typeof mac !== 'string' || !safeEqual(mac, want))
        out.destroy(this.#impostor(200, 'trailer'));
      else if (failed) out.destroy(decodeStreamError(failed));
      else out.end();
    });
    res.once('error', (err) => out.destroy(this.#lost(err, signal)));
    out.once('close', () => {
      if (!res.complete) res.destroy();
    });
    res.pipe(out, { end: false });
    return out;
  }

  /**
   * An HTTP upgrade: the raw socket after a verified `101`, and its
   * exchange (whose keys seal the frames both ways). Not pooled: it is the
   * caller's.
   */
  upgrade(
    path: string,
    protocol: string,
    signal: AbortSignal | undefined,
  ): Promise<{ socket: Duplex; exchange: SignedExchange }> {
    if (this.#closed) return Promise.reject(this.#closedError());
    if (signal?.aborted) return Promise.reject(abortedError(signal));
    const full = EDGE_PATH_PREFIX + path;
    const { headers: auth, exchange } = signRequest(this.#secret, this.edgeId, 'GET', full, {
      upgrade: protocol,
    });
    return new Promise((resolve, reject) => {
      const request = this.#request({
        ...this.#target,
        method: 'GET',
        path: full,
        headers: { ...auth, connection: 'Upgrade', upgrade: protocol },
        agent: this.#upgradeAgent,
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
        } else resolve({ socket: socket!, exchange });
      };
      const onAbort = () => finish(abortedError(signal));
      signal?.addEventListener('abort', onAbort, { once: true });
      const timer = setTimeout(
        () => finish(new DsecError('deadline_exceeded', `edge ${this.edgeId}: no answer in time`)),
        this.#quickMs,
      );
      request.on('error', (err: NodeJS.ErrnoException) => finish(this.#networkError(err)));
      request.on('upgrade', (res, socket, head) => {
        const proven =
          res.headers.upgrade === protocol &&
          exchange.validProof(res.headers, {
            status: 101,
            contentType: res.headers['content-type'] ?? '',
            upgrade: protocol,
            body: STREAMED,
          });
        if (!proven) {
          socket.destroy();
          finish(this.#impostor(101, 'proof'));
          return;
        }
        socket.on('error', () => undefined);
        socket.setNoDelay(true);
        if (head.length > 0) socket.unshift(head);
        if (settled) socket.destroy();
        finish(undefined, socket);
      });
      request.on('response', (res) => {
        this.#readAll(res, undefined, MAX_ERROR_BODY_BYTES).then(
          ({ body, digest }) =>
            finish(
              this.#refusal(res, body, digest, exchange) ??
                errorFromBody(body, res.statusCode ?? 500),
            ),
          (err: unknown) => finish(toDsecError(err, 'unavailable')),
        );
      });
      request.end();
    });
  }

  #attempt(x: Exchange, mayRetry: boolean): Promise<Answer> {
    if (this.#closed) return Promise.reject(this.#closedError());
    const signal = x.signal;
    if (signal?.aborted) return Promise.reject(abortedError(signal));
    const path = EDGE_PATH_PREFIX + x.path;
    let payload: Buffer | undefined;
    // A raw body (stdin, an upload), a buffer too, goes in frames the edge checks one by one
    // before it passes their bytes on.
    const stream =
      x.body === undefined ? undefined : Buffer.isBuffer(x.body) ? Readable.from([x.body]) : x.body;
    let contentType: string | undefined;
    if (x.json !== undefined) {
      payload = Buffer.from(JSON.stringify(x.json));
      contentType = 'application/json';
    } else if (stream) {
      contentType = FRAMES_CONTENT_TYPE;
    }
    const { headers: auth, exchange } = signRequest(this.#secret, this.edgeId, x.method, path, {
      body: stream ? STREAMED : (payload ?? Buffer.alloc(0)),
    });
    const headers: OutgoingHttpHeaders = auth;
    if (contentType) headers['content-type'] = contentType;
    if (!stream && x.method !== 'GET') headers['content-length'] = payload?.length ?? 0;

    return new Promise<Answer>((resolve, reject) => {
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
        const status = res.statusCode ?? 0;
        const ok = status >= 200 && status < 300;
        if (ok && x.stream) {
          // Streamed: the head is proven now, the bytes by their frames or trailer.
          const proven = exchange.validProof(res.headers, {
            status,
            contentType: res.headers['content-type'] ?? '',
            upgrade: '',
            body: STREAMED,
          });
          if (!proven) {
            res.destroy();
            fail(this.#impostor(status, 'proof'));
            return;
          }
          settled = true;
          res.once('close', release);
          resolve({ res, exchange });
          return;
        }
        // Whole: the proof covers the body, so nothing is believed before it is all read.
        this.#readAll(res, signal, ok ? MAX_JSON_ANSWER_BYTES : MAX_ERROR_BODY_BYTES).then(
          ({ body, digest }) => {
            const refused = this.#refusal(res, body, digest, exchange);
            if (refused) fail(refused);
            else if (!ok) fail(errorFromBody(body, status));
            else if (!settled) {
              settled = true;
              release();
              resolve({ res, exchange, body });
            }
          },
          (err: unknown) => fail(toDsecError(err, 'unavailable')),
        );
      });
      if (stream) this.#sendStream(stream, request, exchange, fail);
      else request.end(payload);
    });
  }

  /**
   * A raw request body in `BODY_DATA` frames with their MACs, with
   * back-pressure, then `BODY_END`: the edge passes on only bytes whose
   * frame checked out, and ends the body only at its checked end.
   */
  #sendStream(
    stream: Readable,
    request: http.ClientRequest,
    exchange: SignedExchange,
    fail: (err: Error) => void,
  ): void {
    const up = exchange.sealer('request');
    stream.on('data', (chunk: Buffer | string) => {
      const bytes = typeof chunk === 'string' ? Buffer.from(chunk) : chunk;
      let ok = true;
      for (let at = 0; at < bytes.length; at += BODY_FRAME_BYTES)
        ok = request.write(frame(up, BODY_DATA, bytes.subarray(at, at + BODY_FRAME_BYTES)));
      if (!ok) stream.pause();
    });
    request.on('drain', () => stream.resume());
    stream.once('end', () => request.end(frame(up, BODY_END, Buffer.alloc(0))));
    stream.once('error', (err) => fail(toDsecError(err, 'aborted')));
  }

  /**
   * Why a whole answer cannot be believed, or undefined when it can: its
   * proof must cover this exchange, its status, type and body; and a proven
   * 401 means the edge refused our own signature.
   */
  #refusal(
    res: IncomingMessage,
    body: Buffer,
    digest: string,
    exchange: SignedExchange,
  ): DsecError | undefined {
    const status = res.statusCode ?? 0;
    const proven = exchange.validProof(res.headers, {
      status,
      contentType: res.headers['content-type'] ?? '',
      upgrade: '',
      body: digest,
    });
    if (!proven) return this.#impostor(status, 'proof', body);
    if (status === 401) {
      const e = errorFromBody(body, status);
      return new DsecError(
        'unavailable',
        `edge ${this.edgeId} at ${this.#origin} refused the request's signature: ${e.message}`,
        {
          details: {
            edgeId: this.edgeId,
            status,
            reason: 'edge_unauthenticated',
            check: 'request',
          },
        },
      );
    }
    return undefined;
  }

  /** A whole body and its digest; one over `cap` bytes is dropped (`unavailable`). */
  #readAll(
    res: IncomingMessage,
    signal: AbortSignal | undefined,
    cap: number,
  ): Promise<{ body: Buffer; digest: string }> {
    return new Promise((resolve, reject) => {
      const chunks: Buffer[] = [];
      const hash = createHash('sha256');
      let size = 0;
      res.on('data', (c: Buffer) => {
        hash.update(c);
        size += c.length;
        if (size <= cap) chunks.push(c);
        else {
          res.destroy();
          reject(
            new DsecError(
              'unavailable',
              `edge ${this.edgeId} at ${this.#origin} sent an answer over ${cap} bytes`,
              { details: { edgeId: this.edgeId, status: res.statusCode } },
            ),
          );
        }
      });
      res.once('end', () => resolve({ body: Buffer.concat(chunks), digest: digestOf(hash) }));
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

  /**
   * The stable refusal of an answer that is not the edge's: `unavailable`
   * with `details.reason` `edge_unauthenticated` and `details.check` naming
   * what failed (`proof`, `frame`, `trailer`). An error text the answer
   * carried is kept as `details.unverified`, marked so: it may be anyone's.
   */
  #impostor(status: number | undefined, check: string, body?: Buffer): DsecError {
    const details: Record<string, unknown> = {
      edgeId: this.edgeId,
      status,
      reason: 'edge_unauthenticated',
      check,
    };
    const hint = body && unverifiedHint(body);
    if (hint) details.unverified = hint;
    return new DsecError(
      'unavailable',
      `edge ${this.edgeId} at ${this.#origin} failed to authenticate its answer ` +
        `(${check}: a different secret, not that edge, or changed on the way)`,
      { details },
    );
  }

  #certificateError(got: string | undefined): DsecError {
    return new DsecError(
      'unavailable',
      `edge ${this.edgeId} at ${this.#origin} showed a TLS certificate that is not pinned` +
        (got ? ` (SHA-256 ${got})` : ''),
      { details: { edgeId: this.edgeId, reason: 'edge_certificate', sha256: got } },
    );
  }

  #closedError(): DsecError {
    return new DsecError('unavailable', `the client of edge ${this.edgeId} is closed`);
  }
}

/** `code: message` of an error body nobody vouched for, cut short; undefined if there is none. */
function unverifiedHint(body: Buffer): string | undefined {
  try {
    const e = (JSON.parse(body.subarray(0, 4096).toString('utf8')) as { error?: unknown }).error as
      { code?: unknown; message?: unknown } | undefined;
    if (typeof e?.code === 'string' && typeof e.message === 'string')
      return `${e.code}: ${e.message}`.slice(0, 200);
  } catch {
    // Not an error body: nothing to show.
  }
  return undefined;
}

/**
 * The byte stream of a port over an upgraded socket, in frames with MACs
 * both ways (`PORT_DATA`, `PORT_END` for a half-close). The edge resets the
 * connection when the sandbox side fails (nothing listens), and that
 * becomes `unavailable`, as does a connection that closes without the
 * edge's END or a frame that fails its MAC (`details.reason`
 * `edge_unauthenticated`); as in-process, a failure waits for the
 * consumer's first read or write, so a consumer that attaches late still
 * gets it. The connection closes once both sides have ended.
 */
function portStream(
  socket: Duplex,
  exchange: SignedExchange,
  edgeId: string,
  port: number,
): Duplex {
  const up = exchange.sealer('request');
  let used = false;
  let failure: DsecError | undefined;
  let gotEnd = false;
  let sentEnd = false;
  const closeWhenDone = () => {
    if (gotEnd && sentEnd) socket.end();
  };
  const stream = new Duplex({
    read: () => {
      used = true;
      if (failure) stream.destroy(failure);
      else socket.resume();
    },
    write: (chunk: Buffer, _enc, cb) => {
      used = true;
      if (failure) return cb(failure);
      let ok = true;
      for (let at = 0; at < chunk.length; at += PORT_FRAME_BYTES)
        ok = socket.write(frame(up, PORT_DATA, chunk.subarray(at, at + PORT_FRAME_BYTES)));
      if (ok) cb();
      else socket.once('drain', () => cb());
    },
    final: (cb) => {
      sentEnd = true;
      if (socket.writable) socket.write(frame(up, PORT_END, Buffer.alloc(0)));
      closeWhenDone();
      cb();
    },
    destroy: (err, cb) => {
      socket.destroy();
      cb(err);
    },
  });
  stream.on('error', () => undefined);
  const fail = (why: string, reason?: string) => {
    failure ??= new DsecError('unavailable', `port ${port} in the sandbox failed: ${why}`, {
      details: { edgeId, port, ...(reason ? { reason } : {}) },
    });
    if (used) stream.destroy(failure);
  };
  const reader = new FrameReader(
    MAX_PORT_FRAME_BYTES,
    exchange.sealer('answer'),
    (type, payload) => {
      if (type === PORT_DATA && !gotEnd) {
        if (!stream.push(payload)) socket.pause();
      } else if (type === PORT_END && !gotEnd) {
        gotEnd = true;
        stream.push(null);
        closeWhenDone();
      }
    },
  );
  socket.on('data', (chunk: Buffer) => {
    try {
      reader.push(chunk);
    } catch (err) {
      if (err instanceof FrameMacError) {
        fail(`edge ${edgeId}'s stream failed to authenticate a frame`, 'edge_unauthenticated');
      } else fail(String((err as Error).message));
      socket.destroy();
    }
  });
  socket.once('error', (err) => fail(err.message));
  socket.once('close', () => {
    if (!gotEnd) fail('the edge closed the connection');
  });
  return stream;
}

/**
 * A terminal over an upgraded socket (frames of docs/edge-protocol.md, each
 * with its MAC). A frame that fails its MAC drops the connection: the
 * session then exits as a lost one does (255), with nothing of that frame
 * shown.
 */
function remotePty(socket: Duplex, exchange: SignedExchange): PtySession {
  const up = exchange.sealer('request');
  const listeners: ((chunk: Buffer) => void)[] = [];
  const early: Buffer[] = [];
  let exit: { exitCode: number; signal?: string | undefined } | undefined;
  const exited = new Promise<{ exitCode: number; signal?: string | undefined }>((resolve) => {
    const reader = new FrameReader(
      MAX_PTY_FRAME_BYTES,
      exchange.sealer('answer'),
      (type, payload) => {
        if (type === PTY_DATA) {
          if (listeners.length === 0) early.push(payload);
          for (const l of listeners) l(payload);
        } else if (type === PTY_EXIT) exit = parseExit(payload);
      },
    );
    socket.on('data', (chunk: Buffer) => {
      try {
        reader.push(chunk);
      } catch {
        exit = undefined;
        socket.destroy();
      }
    });
    // No exit frame: the connection was lost, which the edge reports as 255.
    socket.once('close', () => resolve(exit ?? { exitCode: 255, signal: undefined }));
  });
  const send = (type: number, payload: Buffer) => {
    if (socket.writable) socket.write(frame(up, type, payload));
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
