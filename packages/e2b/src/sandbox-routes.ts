import type { IncomingMessage, ServerResponse } from 'node:http';
import { createContextValues } from '@connectrpc/connect';
import type { ServiceImpl } from '@connectrpc/connect';
import { connectNodeAdapter } from '@connectrpc/connect-node';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { DsecError, toDsecError } from '@dsec/core';
import { clientGone, retryAfterSeconds, sourceOf } from '@dsec/apiserver';
import type { ApiMetrics, CallerLimits, SandboxService } from '@dsec/apiserver';
import type { Iam } from '@dsec/iam';
import { authenticateE2b, credentialOf } from './auth.js';
import { envdHttpStatus } from './errors.js';
import { toDsecSandboxId } from './ids.js';
import { proxyToPort } from './port-proxy.js';
import { lifecycleOf } from './lifecycle.js';
import type { E2bSandboxAccess } from './lifecycle.js';
import { ENVD_PORT, SANDBOX_ROUTE_PREFIX, sandboxAddressOf } from './sandbox-routing.js';
import type { SandboxRouting } from './sandbox-routing.js';
import { ConnectStreamServer } from './envd/connect-stream.js';
import { downloadFile, uploadFiles } from './envd/files-http.js';
import { filesystemService } from './envd/filesystem-service.js';
import { processService } from './envd/process-service.js';
import type { ProcessTable } from './envd/process-table.js';
import { envdTargetKey } from './envd/rpc-context.js';
import type { EnvdTarget } from './envd/rpc-context.js';
import { Filesystem } from './gen/filesystem/filesystem_pb.js';
import { Process } from './gen/process/process_pb.js';

/** Largest unary RPC message (stdin chunks are the large ones). */
const RPC_READ_MAX_BYTES = 16 * 1024 * 1024;

const RPC_SERVICES = ['/process.Process/', '/filesystem.Filesystem/'];
/** The route of a request to a path in a sandbox; the fast path's streams are counted under it. */
const ROUTED = `${SANDBOX_ROUTE_PREFIX}/:port/:id/*`;

export interface SandboxRouteDeps {
  service: SandboxService;
  iam: Iam;
  access: E2bSandboxAccess;
  processes: ProcessTable;
  watchIntervalMs: number;
  /** Aborts running streams when the server closes. */
  shutdown: AbortSignal;
  /** Where the hot streams take their path around the router (`installSandboxRouting`). */
  routing?: SandboxRouting | undefined;
  /** Where the streams that skip the router are counted, under the route that would have served them. */
  metrics?: ApiMetrics | undefined;
  /** Per-key stream cap and output budget of the apiserver. */
  limits?: CallerLimits | undefined;
}

/**
 * Requests addressed to a sandbox (see `sandbox-routing.ts`): envd's port is
 * answered here (Connect RPC for the process and filesystem services, HTTP
 * for files and health), any other port is forwarded into the sandbox.
 * Every request is authenticated with the caller's DSec key and authorised
 * for the sandbox before anything reaches an edge.
 */
export function sandboxRoutes(scope: FastifyInstance, deps: SandboxRouteDeps): () => void {
  const { access, iam } = deps;
  const targets = new WeakMap<IncomingMessage, EnvdTarget>();
  const fs = filesystemService({ access, watchIntervalMs: deps.watchIntervalMs });
  const processes: ServiceImpl<typeof Process> = processService({
    access,
    processes: deps.processes,
  });
  // The streams the SDKs open (a command's output, a directory watch) on a lean path; the rest through Connect's adapter.
  const streams = new ConnectStreamServer({
    readMaxBytes: RPC_READ_MAX_BYTES,
    shutdownSignal: deps.shutdown,
    limits: deps.limits,
  })
    .add(Process, processes)
    .add(Filesystem, fs.impl);
  const rpc = connectNodeAdapter({
    routes(router) {
      router.service(Process, processes);
      router.service(Filesystem, fs.impl);
    },
    contextValues: (req) =>
      createContextValues().set(envdTargetKey, targets.get(req as IncomingMessage)),
    readMaxBytes: RPC_READ_MAX_BYTES,
    shutdownSignal: deps.shutdown,
  });

  // The streams the SDKs open per command (`commands.run` is one `Start`) skip the router:
  // fastify's request and reply objects, hooks and hijack cost more than the rest of the
  // E2B layer. Same checks as `handler` below (key, sandbox ID, envd port), in that order;
  // anything else (no key, a bad ID, another shape or port) goes the routed way.
  if (deps.routing) {
    deps.routing.fastPath = (req, res, address) => {
      if (address.port !== ENVD_PORT || deps.shutdown.aborted) return false;
      const call = streams.accepts(address.url.split('?')[0] ?? '/', req);
      const found = call && credentialOf(req.headers);
      if (!call || !found) return false;
      let sandboxId: string;
      try {
        sandboxId = toDsecSandboxId(address.sandboxId);
      } catch {
        return false;
      }
      const { metrics } = deps;
      if (metrics) {
        const started = performance.now();
        res.once('close', () =>
          metrics.record(
            req.method ?? 'POST',
            ROUTED,
            res.statusCode,
            (performance.now() - started) / 1000,
          ),
        );
      }
      iam.authenticate(found.key, { source: sourceOf(req) }).then(
        (principal) => {
          const target: EnvdTarget = { caller: { principal, ...found }, sandboxId };
          streams.start(call, req, res, createContextValues().set(envdTargetKey, target));
        },
        (err: unknown) => rawError(req, res, toDsecError(err)),
      );
      return true;
    };
  }

  // Bodies stay unread: the RPC adapter, uploads and forwarded requests stream them.
  scope.removeAllContentTypeParsers();
  scope.addContentTypeParser('*', (_req, payload, done) => done(null, payload));

  const handler = async (req: FastifyRequest, reply: FastifyReply) => {
    const address = sandboxAddressOf(req.raw);
    if (!address) return replyError(reply, new DsecError('not_found', 'no such route'));
    const signal = clientGone(reply);
    const path = address.url.split('?')[0] ?? '/';
    const envd = address.port === ENVD_PORT;
    try {
      if (address.port === 0) {
        throw new DsecError('invalid_argument', 'E2b-Sandbox-Port must be a port number', {
          field: 'E2b-Sandbox-Port',
        });
      }
      // A public sandbox's ports (E2B's allowPublicTraffic) take traffic with no key; envd never.
      if (!envd && !carriesDsecKey(req.headers)) {
        const pub = await access.openPublic(toDsecSandboxId(address.sandboxId), signal);
        if (pub)
          return await proxyToPort(pub, address.port, address.url, req, reply, signal, undefined);
      }
      const caller = await authenticateE2b(iam, req.headers, sourceOf(req.raw));
      const sandboxId = toDsecSandboxId(address.sandboxId);
      if (envd && RPC_SERVICES.some((p) => path.startsWith(p))) {
        reply.hijack();
        req.raw.url = address.url;
        const values = createContextValues().set(envdTargetKey, { caller, sandboxId });
        if (!streams.serve(path, req.raw, reply.raw, values)) {
          targets.set(req.raw, values.get(envdTargetKey)!);
          rpc(req.raw, reply.raw);
        }
        return reply;
      }
      if (envd && path === '/health' && req.method === 'GET') {
        // E2B's isRunning(): a paused sandbox is not running (502), unless the request resumes it.
        let info = await deps.service.get(caller.principal, sandboxId, signal);
        if (info.state === 'paused' && lifecycleOf(info).autoResume && !access.holds(sandboxId)) {
          info = await deps.service.resume(caller.principal, sandboxId, signal);
        }
        const alive = info.state === 'running' || info.state === 'creating';
        return reply.code(alive ? 204 : 502).send();
      }
      const sb = await access.open(caller.principal, sandboxId, signal);
      if (envd && path === '/files' && req.method === 'GET') {
        return await downloadFile(access, sb, req, reply, signal);
      }
      if (envd && path === '/files' && req.method === 'POST') {
        return reply.send(await uploadFiles(access, sb, req, signal));
      }
      if (envd && path === '/envs' && req.method === 'GET') {
        return reply.send((await deps.service.get(caller.principal, sandboxId, signal)).spec.env);
      }
      if (envd) throw new DsecError('not_found', `envd has no ${req.method} ${path.slice(0, 200)}`);
      return await proxyToPort(sb, address.port, address.url, req, reply, signal, caller.key);
    } catch (err) {
      if (reply.sent || reply.raw.headersSent) {
        reply.raw.destroy();
        return reply;
      }
      // A body left unread (a refused upload) would keep the connection busy: close it instead.
      if (!req.raw.complete) reply.header('connection', 'close');
      return replyError(reply, toDsecError(err));
    }
  };
  scope.all(`${SANDBOX_ROUTE_PREFIX}/:port/:id`, handler);
  scope.all(ROUTED, handler);
  return () => fs.close();
}

/**
 * Whether a request names a DSec key: one of E2B's key headers, or a Bearer
 * token of DSec's form (a web app's own `Authorization` is not one).
 */
function carriesDsecKey(headers: IncomingMessage['headers']): boolean {
  const found = credentialOf(headers);
  return found !== undefined && (found.header !== 'authorization' || found.key.startsWith('dsk_'));
}

/** envd's error answers: `{ code, message }` with the HTTP status; DSec's code alongside. */
function replyError(reply: FastifyReply, e: DsecError): FastifyReply {
  const status = envdHttpStatus(e);
  if (e.code === 'rate_limited') reply.header('retry-after', retryAfterSeconds(e.details));
  return reply
    .code(status)
    .header('content-type', 'application/json; charset=utf-8')
    .send(errorBody(status, e));
}

function errorBody(status: number, e: DsecError) {
  const message = e.code === 'internal' ? 'internal error' : e.message;
  return { code: status, message, error_code: e.code };
}

/** `replyError` for a request the fast path took: the same answer, on the raw response. */
function rawError(req: IncomingMessage, res: ServerResponse, e: DsecError): void {
  if (res.headersSent || res.destroyed) {
    res.destroy();
    return;
  }
  const status = envdHttpStatus(e);
  const body = JSON.stringify(errorBody(status, e));
  // The body is left unread: the connection closes with the answer, as the routed way does.
  res.writeHead(status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
    ...(e.code === 'rate_limited' ? { 'retry-after': String(retryAfterSeconds(e.details)) } : {}),
    ...(req.complete ? {} : { connection: 'close' }),
  });
  res.end(body);
}
