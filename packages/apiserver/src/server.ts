import { STATUS_CODES } from 'node:http';
import type { Duplex } from 'node:stream';
import Fastify from 'fastify';
import type { FastifyBaseLogger, FastifyInstance, FastifyReply } from 'fastify';
import { ConnectionGuard, randomId } from '@dsec/core';
import type { SandboxIdCodec } from '@dsec/core';
import { FnCallRateLimiter } from '@dsec/iam';
import type { Iam } from '@dsec/iam';
import type { Placer } from '@dsec/placement';
import type { FleetView } from '@dsec/watcher';
import { authenticateRequest, principalOf, requireMetricsReader } from './auth.js';
import { toHttpError } from './errors.js';
import { bindLimits, CallerLimits, retryAfterSeconds } from './limits.js';
import type { ApiLimits } from './limits.js';
import { ApiMetrics } from './metrics.js';
import { installRequestGate } from './request-gate.js';
import { openApiRoute, recordRoutes } from './openapi.js';
import { adminRoutes } from './routes/admin.js';
import { volumeRoutes } from './routes/volumes.js';
import { VolumeService } from './volume-service.js';
import { sandboxRoutes } from './routes/sandboxes.js';
import { networkRoutes } from './routes/network.js';
import { displayRoutes } from './routes/display.js';
import { lifecycleRoutes } from './routes/lifecycle.js';
import { commandRoutes } from './routes/commands.js';
import { fileRoutes } from './routes/files.js';
import { portRoutes, ptyUpgrade } from './routes/ports.js';
import { ptyWebSocket } from './routes/pty-ws.js';
import { uiRoutes } from './routes/ui.js';
import { streamingBodySockets } from './routes/io-common.js';
import { ImageService, type ImageCatalog } from './image-service.js';
import { ImageBuildService, type ImageBuilder, type ImageBuildLimits } from './image-builds.js';
import { imageBuildRoutes } from './routes/image-builds.js';
import { SandboxService } from './sandbox-service.js';
import { fncallRoutes } from './routes/fncall.js';
import { FnCallService } from './fncall-service.js';
import { sandboxFusionApiRoutes } from './sandboxfusion/routes.js';
import type { FnCallServiceDeps } from './fncall-service.js';
import type { EdgeDirectory } from './sandbox-service.js';

export const API_VERSION = '0.1.0';
export const BODY_LIMIT_BYTES = 1024 * 1024;
/** Longest path segment (an ID); longer is 400 `invalid_argument` (the status a code has everywhere). Sandbox IDs run past fastify's 100. */
export const MAX_PARAM_LENGTH = 256;

export interface ApiServerOptions {
  iam: Iam;
  /** Clients of the edges, by edge ID. */
  edges: EdgeDirectory;
  /** Source of the fleet view (a `Watcher`). */
  watcher: { view(): FleetView };
  placer: Placer;
  ids: SandboxIdCodec;
  /** A pino logger, `true` for a default one, or nothing for silence. */
  logger?: FastifyBaseLogger | boolean | undefined;
  /**
   * The image store's layers: the platform's and those of `projects` (every
   * owner's without it); without `all`, the plumbing records registry imports
   * keep are left out. Callers see what their project's view holds
   * (`ImageService`).
   */
  imagesList?: ImageCatalog['list'] | undefined;
  /** Removes a project's layer from the image store (`DELETE /v1/images/:ref`, fork clean-up). */
  imagesRemove?: ((ref: string, project: string) => Promise<void>) | undefined;
  /**
   * The node's Dockerfile builder (`POST /v1/images/builds`): `dsec up`
   * wires it where the image store and buildah are; without it builds are
   * refused (503 `unavailable`, `details.reason: builds_unavailable`).
   */
  imageBuilder?: ImageBuilder | undefined;
  /** Bounds of API builds (`ImageBuildLimits`; defaults in `DEFAULT_IMAGE_BUILD_LIMITS`). */
  imageBuildLimits?: Partial<ImageBuildLimits> | undefined;
  /**
   * Time allowed to receive a request's headers, from its first byte
   * (slow-header, "slowloris", defence): past it the client gets 408 and the
   * connection is closed. Default 10 000.
   */
  headersTimeoutMs?: number;
  /**
   * Time allowed to receive a whole request, headers and JSON body
   * (slow-body defence): 408 and close past it. Raw streamed bodies (file
   * uploads, stdin streams) are exempt once authenticated and routed: they
   * may rightly last longer, and the idle socket timeout bounds them instead.
   * It never applies to responses: output streams and downloads start after
   * the request is complete. Default 60 000.
   */
  requestTimeoutMs?: number;
  /**
   * Idle socket timeout: a connection with no bytes moving either way (a
   * client that stopped reading included) is closed. Command routes extend it
   * to the command's own timeout. Default 600 000.
   */
  connectionTimeoutMs?: number;
  /** Keep-alive idle time, above common load-balancer idle timeouts. Default 72 000. */
  keepAliveTimeoutMs?: number;
  /**
   * Open connections at most. At the cap a new connection closes the one
   * idle longest; only when all are busy is it refused (503). Default 10 000.
   */
  maxConnections?: number;
  /** Per-address, per-key and per-stream bounds (`ApiLimits`; docs/security.md). */
  limits?: Partial<ApiLimits> | undefined;
  /**
   * Host names the server answers to besides IP literals, `localhost`,
   * `*.localhost` and the machine's name: `api.example.com`, `*.example.com`,
   * or `*` for any (request-gate.ts; refuses DNS-rebinding pages).
   */
  allowedHosts?: readonly string[] | undefined;
  /**
   * Mounts more routes on the same service before the server listens (the
   * E2B-compatible API, `@dsec/e2b`), so they share its metrics, state and
   * per-caller limits.
   */
  extend?:
    | ((
        app: FastifyInstance,
        ctx: {
          service: SandboxService;
          iam: Iam;
          metrics: ApiMetrics;
          limits: CallerLimits;
          images: ImageService;
          volumes: VolumeService;
          /** Dockerfile builds (`POST /v1/images/builds`; E2B's template builds use them too). */
          builds: ImageBuildService;
        },
      ) => void)
    | undefined;
  /** The server's metrics (default new ones); pass them to also serve them on an admin listener. */
  metrics?: ApiMetrics | undefined;
  /**
   * Admission of `POST /v1/fncall*` calls; default: IAM's calls-per-second
   * quota (`FnCallRateLimiter`) with this apiserver's own buckets.
   */
  admitFnCalls?: FnCallServiceDeps['admitCalls'];
  /**
   * How many apiservers serve the cluster: each admits `1 / shares` of every
   * project's `fncallsPerSecond`, so together they stay within it without
   * talking to each other. Default 1.
   */
  fncallQuotaShares?: number | undefined;
  /**
   * Handed the server's FnCall service once built: the keyless SandboxFusion
   * listener (`buildSandboxFusionListener`) runs its calls through it, so they
   * share this server's routing and quota buckets.
   */
  onFnCallService?: ((fncall: FnCallService) => void) | undefined;
}

export const TRANSPORT_DEFAULTS = {
  headersTimeoutMs: 10_000,
  requestTimeoutMs: 60_000,
  connectionTimeoutMs: 600_000,
  keepAliveTimeoutMs: 72_000,
  maxConnections: 10_000,
} as const;

/**
 * Answers a connection-level error (a timeout, a bad request line, headers
 * too large) in the API's error shape, then closes the connection. The
 * request timeout of a streamed upload is ignored (see `requestTimeoutMs`).
 */
function clientErrorHandler(
  this: FastifyInstance,
  err: Error & { code?: string },
  socket: Duplex,
): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const timeout = err.code === 'ERR_HTTP_REQUEST_TIMEOUT';
  if (timeout && streamingBodySockets.has(socket)) return;
  const [status, code, message] = timeout
    ? [408, 'invalid_argument', 'request not received in time']
    : err.code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'invalid_argument', 'request headers too large']
      : [400, 'invalid_argument', 'malformed HTTP request'];
  this.log.debug({ err }, 'client error');
  if (socket.writable) {
    const body = JSON.stringify({ error: { code, message } });
    socket.write(
      `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nConnection: close\r\n` +
        `Content-Type: application/json; charset=utf-8\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
    );
  }
  socket.destroy();
}

/**
 * Builds the HTTP API v1 server (docs/CONVENTIONS.md). Stateless: every
 * decision comes from IAM, the sandbox ID and the edges. The caller owns the
 * lifecycle: `await app.listen({ port })`, then `await app.close()`.
 * `app.inject()` works without listening.
 */
export function buildApiServer(options: ApiServerOptions): FastifyInstance {
  const { iam, watcher } = options;
  const loggerOpts =
    typeof options.logger === 'object'
      ? { loggerInstance: options.logger }
      : {
          logger: options.logger ? { level: 'info', redact: ['req.headers.authorization'] } : false,
        };
  const requestTimeout = options.requestTimeoutMs ?? TRANSPORT_DEFAULTS.requestTimeoutMs;
  // Node refuses a headers timeout above a (non-zero) request timeout.
  const headersTimeout = Math.min(
    options.headersTimeoutMs ?? TRANSPORT_DEFAULTS.headersTimeoutMs,
    requestTimeout || Infinity,
  );
  const app = Fastify({
    ...loggerOpts,
    bodyLimit: BODY_LIMIT_BYTES,
    http: {
      headersTimeout,
      requestTimeout,
      // Node checks these deadlines on this interval (its default, 30 s, would triple a 10 s bound).
      connectionsCheckingInterval: Math.max(
        10,
        Math.min(1_000, Math.floor(Math.min(headersTimeout || 4_000, requestTimeout || 4_000) / 4)),
      ),
    },
    requestTimeout,
    connectionTimeout: options.connectionTimeoutMs ?? TRANSPORT_DEFAULTS.connectionTimeoutMs,
    keepAliveTimeout: options.keepAliveTimeoutMs ?? TRANSPORT_DEFAULTS.keepAliveTimeoutMs,
    clientErrorHandler,
    routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
    // The router's own refusals (a path segment over the limit, a bad escape) in DSec's shape.
    frameworkErrors: (err, req, rawReply) => {
      const tooLong = err.code === 'FST_ERR_MAX_PARAM_LENGTH';
      const reply = rawReply as unknown as FastifyReply;
      void reply
        .code(400)
        .header('x-request-id', req.id)
        .header('content-type', 'application/json; charset=utf-8')
        .send({
          error: {
            code: 'invalid_argument',
            message: tooLong
              ? `a path segment is longer than ${MAX_PARAM_LENGTH} characters`
              : 'the URL is malformed',
            field: 'path',
          },
        });
    },
    genReqId: () => randomId('req', 9),
    return503OnClosing: true,
  }) as unknown as FastifyInstance;
  recordRoutes(app);

  const metrics = options.metrics ?? new ApiMetrics();
  const limits = new CallerLimits(options.limits, {
    onCut: (reason) => metrics.streamsCut.inc({ reason }),
    onRefused: (reason) => metrics.requestsRefused.inc({ reason }),
  });
  metrics.sources.authStats = () => iam.authStats();
  metrics.sources.streams = () => ({
    open: limits.budget.streams,
    queuedBytes: limits.budget.queuedBytes(),
  });
  // Attached last (below); the browser terminal tells it which upgraded connections still wait.
  const guard = new ConnectionGuard(
    {
      maxConnections: options.maxConnections ?? TRANSPORT_DEFAULTS.maxConnections,
      maxConnectionsPerAddress: limits.limits.maxConnectionsPerAddress,
      pressureKeepAliveMs: limits.limits.pressureKeepAliveMs,
    },
    { onEvent: (reason) => metrics.connectionEvents.inc({ reason }) },
  );
  const images = new ImageService({
    iam,
    catalog: options.imagesList && {
      list: options.imagesList,
      ...(options.imagesRemove ? { remove: options.imagesRemove } : {}),
    },
  });
  const volumes = new VolumeService({
    iam,
    edges: options.edges,
    watcher: options.watcher,
    onWarning: (message, context) => app.log.warn(context, message),
  });
  const builds = new ImageBuildService({
    iam,
    images,
    builder: options.imageBuilder,
    limits: options.imageBuildLimits,
  });
  app.addHook('onClose', async () => await builds.close());
  const service = new SandboxService({
    ...options,
    metrics,
    volumes,
    onWarning: (message, context) => app.log.warn(context, message),
  });

  // JSON only; an empty body (a DELETE sent with a JSON content type) is simply no body.
  const json = app.getDefaultJsonParser('error', 'error');
  app.removeAllContentTypeParsers();
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (req, body, done) => {
    if (body === '') return done(null, undefined);
    void json(req, body as string, done);
  });

  app.addHook('onRequest', async (req, reply) => {
    reply.header('x-request-id', req.id);
    bindLimits(req, limits);
    // Authenticate before the body is read: an anonymous client gets 401, not a parse of its upload.
    if (!req.routeOptions.url?.startsWith('/v1/')) return;
    await authenticateRequest(iam, req);
    // One key's requests in flight are bounded (`limits.maxRequestsPerKey`).
    const leave = limits.enterRequest(principalOf(req).keyId);
    reply.raw.once('close', leave).once('finish', leave);
  });
  app.addHook('onResponse', async (req, reply) => {
    const route = req.routeOptions.url ?? 'unmatched';
    metrics.record(req.method, route, reply.statusCode, reply.elapsedTime / 1000);
  });

  app.setErrorHandler((err, req, reply) => {
    const e = toHttpError(err, req.id);
    if (e.status >= 500 && e.code !== 'unavailable' && e.code !== 'capacity_exhausted') {
      req.log.error({ err, reqId: req.id }, 'request failed');
    } else {
      req.log.info({ code: e.code, field: e.field }, 'request rejected');
    }
    if (e.code === 'rate_limited') reply.header('retry-after', retryAfterSeconds(e.details));
    return reply
      .code(e.status)
      .header('content-type', 'application/json; charset=utf-8')
      .send(e.toJSON());
  });
  app.setNotFoundHandler((req, reply) =>
    reply.code(404).send({
      error: {
        code: 'not_found',
        message: `no route ${req.method} ${req.url.split('?')[0]?.slice(0, 200)}`,
      },
    }),
  );

  app.get('/healthz', async () => ({ ok: true, version: API_VERSION }));
  openApiRoute(app, API_VERSION);
  // Metrics show every tenant's load: root-project admins and `metrics:read` keys only
  // (an unauthenticated scraper uses the admin listener, `metricsListen`).
  app.get('/metrics', async (req, reply) => {
    await authenticateRequest(iam, req);
    await requireMetricsReader(iam, principalOf(req));
    return reply.header('content-type', metrics.registry.contentType).send(await metrics.text());
  });
  sandboxRoutes(app, service);
  volumeRoutes(app, volumes);
  networkRoutes(app, service);
  displayRoutes(app, service);
  lifecycleRoutes(app, service);
  // Routes with raw (streamed) bodies get their own parsers inside these plugins.
  void app.register(async (scope) => commandRoutes(scope, service));
  void app.register(async (scope) => fileRoutes(scope, service));
  void app.register(async (scope) => portRoutes(scope, service));
  void app.register(async (scope) => imageBuildRoutes(scope, builds));
  ptyUpgrade(app, service, iam, limits);
  // Calls per second per project (IAM quota `fncallsPerSecond`), counted by this apiserver.
  const fncallLimiter = new FnCallRateLimiter({
    limits: (p) => iam.fncallRateLimits(p),
    shares: options.fncallQuotaShares,
  });
  const fncall = new FnCallService({
    edges: options.edges,
    watcher,
    admitCalls:
      options.admitFnCalls ?? ((_principal, projectId, n) => fncallLimiter.acquire(projectId, n)),
    audit: (keyId, action, outcome, details) => iam.audit(keyId, action, '', outcome, details),
  });
  fncallRoutes(app, fncall);
  // SandboxFusion's /run_code on FnCall, with a key (docs/fncall.md).
  sandboxFusionApiRoutes(app, iam, fncall, (keyId) => limits.enterRequest(keyId));
  options.onFnCallService?.(fncall);
  ptyWebSocket(app, service, iam, { limits, guard });
  uiRoutes(app);
  adminRoutes(app, { iam, fleet: () => watcher.view(), images });
  options.extend?.(app, { service, iam, metrics, limits, images, volumes, builds });
  // Last, in front of every listener the routes and extensions installed: the Host and URL
  // checks, then the connection caps (which must see the requests the checks refuse too).
  installRequestGate(app.server, {
    allowedHosts: options.allowedHosts,
    onRefused: (reason) => metrics.requestsRefused.inc({ reason }),
  });
  guard.attach(app.server);
  metrics.sources.openConnections = () => guard.open;
  return app;
}
