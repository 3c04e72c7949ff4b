import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify';
import { DsecError, randomId } from '@dsec/core';
import { FNCALL_SCOPE, type Iam, type Principal } from '@dsec/iam';
import { authenticateRequest, principalOf } from '../auth.js';
import { toHttpError } from '../errors.js';
import type { FnCallService } from '../fncall-service.js';
import { clientGone, socketTimeout } from '../routes/io-common.js';
import { SANDBOXFUSION_LANGUAGES } from './languages.js';
import { runCode, SANDBOXFUSION_MAX_TOTAL_SECONDS, type SandboxFusionDeps } from './service.js';

/** The request body cap of `/run_code` (DSec's JSON body limit, docs/CONVENTIONS.md). */
export const SANDBOXFUSION_BODY_LIMIT = 1024 * 1024;
/** Socket idle allowance past a call's own time (queueing on a busy pool). */
const SOCKET_GRACE_MS = 60_000;

export interface SandboxFusionRouteOptions {
  /** Runs the calls (scope, quota, routing). */
  fncall: Pick<FnCallService, 'run'>;
  /** The caller of a request: the key's principal, or the listener's project. */
  principal: (req: FastifyRequest) => Principal;
  /** Runs before the body is read (the key check and per-key bounds): a refusal reads no body. */
  admit?: ((req: FastifyRequest, reply: FastifyReply) => Promise<void>) | undefined;
  /** Path prefix (`/sandboxfusion`, or `''` on a listener of its own). */
  prefix: string;
  executorName?: string | undefined;
}

/** `GET /languages`: each language, its runtime and the Debian packages of its tools. */
function languageList() {
  return Object.entries(SANDBOXFUSION_LANGUAGES).map(([name, l]) => ({
    language: name,
    runtime: l.runtime,
    compiled: l.compile !== undefined,
    maxMemoryMb: l.maxMemoryMb,
    debian: l.debian,
  }));
}

/**
 * SandboxFusion's routes (docs/fncall.md "SandboxFusion-compatible endpoint"):
 * `POST {prefix}/run_code`, `GET {prefix}/v1/ping` (`"pong"`, as its server
 * answers) and `GET {prefix}/languages` (DSec's: SandboxFusion lists its
 * languages only in its OpenAPI enum).
 */
export function sandboxFusionRoutes(app: FastifyInstance, o: SandboxFusionRouteOptions): void {
  const deps: SandboxFusionDeps = {
    run: (p, req, signal) => o.fncall.run(p, req, signal),
    executorName: o.executorName,
  };
  // FastAPI's answer: the JSON string "pong".
  app.get(`${o.prefix}/v1/ping`, async (_req, reply) =>
    reply.header('content-type', 'application/json').send('"pong"'),
  );
  app.get(`${o.prefix}/languages`, async () => languageList());
  const admit = o.admit;
  const routeOptions = {
    bodyLimit: SANDBOXFUSION_BODY_LIMIT,
    ...(admit
      ? { onRequest: async (req: FastifyRequest, reply: FastifyReply) => admit(req, reply) }
      : {}),
  };
  app.post(`${o.prefix}/run_code`, routeOptions, async (req, reply) => {
    const principal = o.principal(req);
    socketTimeout(req, SANDBOXFUSION_MAX_TOTAL_SECONDS * 1000 + SOCKET_GRACE_MS);
    return reply.send(await runCode(deps, principal, req.body, clientGone(reply)));
  });
}

/**
 * On the apiserver: `/sandboxfusion/*`, `run_code` with the caller's key (and
 * `fncall:run`), authenticated before its body is read and counted in the
 * key's requests in flight (`enterRequest` returns the leave function), as
 * `/v1/` routes are.
 */
export function sandboxFusionApiRoutes(
  app: FastifyInstance,
  iam: Iam,
  fncall: FnCallService,
  enterRequest?: (keyId: string) => () => void,
): void {
  sandboxFusionRoutes(app, {
    fncall,
    prefix: '/sandboxfusion',
    principal: principalOf,
    admit: async (req, reply) => {
      await authenticateRequest(iam, req);
      if (enterRequest) {
        const leave = enterRequest(principalOf(req).keyId);
        reply.raw.once('close', leave).once('finish', leave);
      }
    },
  });
}

export interface SandboxFusionListenerOptions {
  fncall: Pick<FnCallService, 'run'>;
  /** The one project every call runs in (its quotas count them). */
  projectId: string;
  /** Requests in flight at most; more are `capacity_exhausted` (503). Default 512. */
  maxInFlight?: number | undefined;
  logger?: boolean | undefined;
  executorName?: string | undefined;
}

/**
 * The keyless listener (`dsec up --sandboxfusion-listen ADDR
 * --sandboxfusion-project P`): SandboxFusion's routes at the root (and under
 * `/sandboxfusion`), for clients that send no key (veRL, tinker-cookbook).
 * Every call is project P's, whatever the request carries: a bearer header is
 * ignored, never authenticated, and no other DSec route is served. The
 * listener is as open as its address: bind it to loopback or a private
 * network.
 */
export function buildSandboxFusionListener(o: SandboxFusionListenerOptions): FastifyInstance {
  const app = Fastify({
    logger: o.logger ?? false,
    bodyLimit: SANDBOXFUSION_BODY_LIMIT,
    requestTimeout: 60_000,
    connectionTimeout: SANDBOXFUSION_MAX_TOTAL_SECONDS * 1000 + SOCKET_GRACE_MS,
    genReqId: () => randomId('req', 9),
    return503OnClosing: true,
  }) as unknown as FastifyInstance;
  const principal: Principal = {
    keyId: `sandboxfusion-listener:${o.projectId}`,
    projectId: o.projectId,
    role: 'member',
    scopes: [FNCALL_SCOPE],
  };
  const maxInFlight = o.maxInFlight ?? 512;
  let inFlight = 0;
  app.addHook('onRequest', async (req, reply) => {
    reply.header('x-request-id', req.id);
    if (req.method !== 'POST') return;
    if (inFlight >= maxInFlight)
      throw new DsecError('capacity_exhausted', `more than ${maxInFlight} calls in flight`);
    inFlight++;
    let left = false;
    const leave = () => {
      if (!left) inFlight--;
      left = true;
    };
    reply.raw.once('close', leave).once('finish', leave);
  });
  app.setErrorHandler((err, req, reply) => {
    const e = toHttpError(err, req.id);
    if (e.status >= 500 && e.code === 'internal')
      req.log.error({ err }, 'sandboxfusion call failed');
    return reply.code(e.status).send(e.toJSON());
  });
  for (const prefix of ['', '/sandboxfusion'])
    sandboxFusionRoutes(app, {
      fncall: o.fncall,
      prefix,
      principal: () => principal,
      executorName: o.executorName,
    });
  return app;
}
