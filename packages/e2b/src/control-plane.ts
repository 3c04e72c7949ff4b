import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { DsecError, isDsecError, parseLayerRef } from '@dsec/core';
import type {
  LayerInfo,
  NetworkTarget,
  SandboxInfo,
  SnapshotInfo,
  SnapshotRequest,
} from '@dsec/core';
import { clientGone, retryAfterSeconds, schemas, sourceOf, toHttpError } from '@dsec/apiserver';
import type { CallerLimits, SandboxService } from '@dsec/apiserver';
import type { Iam, Principal } from '@dsec/iam';
import { authenticateE2b, checkUser } from './auth.js';
import type { E2bCaller } from './auth.js';
import { e2bErrorBody } from './errors.js';
import { toDsecSandboxId, toE2bSandboxId } from './ids.js';
import {
  AUTO_RESUME_LABEL,
  dsecTtl,
  E2B_LABEL_PREFIX,
  e2bEndAt,
  lifecycleOf,
  ON_TIMEOUT_LABEL,
  PUBLIC_TRAFFIC_LABEL,
  TIMEOUT_LABEL,
  USER_LABEL,
} from './lifecycle.js';
import type { AutoPauser, E2bSandboxAccess } from './lifecycle.js';
import { resolveTemplate } from './templates.js';
import type { E2bTemplates } from './templates.js';
import { E2B_USER, E2B_USER_IDS, setUpE2bUser } from './user-setup.js';
import { volumeMountsOf } from './volumes.js';

/**
 * The E2B control plane (`api.e2b.dev`'s sandbox routes) over
 * `SandboxService`: create from a template, list with metadata filters and
 * pages, get, connect, timeout, kill, pause and resume, metrics, snapshot
 * and fork. Each route authenticates the `X-API-Key` as the native API does
 * and calls the same service method, so quota, placement, idempotency and
 * project isolation are exactly the native ones.
 */

/** The envd version DSec answers as: every feature the SDKs gate on a version is served (docs/e2b.md). */
export const ENVD_VERSION = '0.6.4';

/** Where the template a sandbox was made from is kept (E2B lists and filters by it). */
export const TEMPLATE_LABEL = 'e2b.dev/template';

/** E2B's page size bound. */
const MAX_PAGE = 100;

/** DSec's TTL bounds, in seconds. */
const MIN_TTL_S = 1;
const MAX_TTL_S = 604_800;

/** The apiserver's image service as the control plane uses it (snapshots are a project's layers). */
export interface E2bImages {
  list(principal: Principal, options: { all: boolean }): Promise<LayerInfo[]>;
  remove(principal: Principal, ref: string, options: { projectId?: string }): Promise<void>;
}

/** E2B's default sandbox timeout (seconds) when a create names none. */
const DEFAULT_TIMEOUT_S = 300;

export interface ControlPlaneDeps {
  service: SandboxService;
  iam: Iam;
  access: E2bSandboxAccess;
  /** Pauses `autoPause` sandboxes at their timeout. */
  pauser: AutoPauser;
  /** Snapshot listing and deletion; without it those routes answer `unavailable`. */
  images?: E2bImages | undefined;
  templates?: E2bTemplates | undefined;
  /** The wildcard domain of the host-routed form, answered as `domain` (null without). */
  sandboxDomain?: string | undefined;
  /** The apiserver's per-key bounds: a key's control-plane requests count as its /v1 ones do. */
  limits?: CallerLimits | undefined;
}

/** The lifecycle methods SandboxService gains with issue 11; absent on servers without them. */
interface LifecycleMethods {
  pause?(p: Principal, id: string, signal?: AbortSignal): Promise<SandboxInfo>;
  resume?(p: Principal, id: string, signal?: AbortSignal): Promise<SandboxInfo>;
  setTimeout?(
    p: Principal,
    id: string,
    seconds: number,
    signal?: AbortSignal,
  ): Promise<SandboxInfo>;
  snapshot?(
    p: Principal,
    id: string,
    req: SnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo>;
  fork?(
    p: Principal,
    id: string,
    count: number,
    signal?: AbortSignal,
  ): Promise<{ ids: string[]; image: string }>;
}

function lifecycle<K extends keyof LifecycleMethods>(
  service: SandboxService,
  name: K,
): NonNullable<LifecycleMethods[K]> {
  const fn = (service as unknown as LifecycleMethods)[name];
  if (typeof fn !== 'function') {
    throw new DsecError('unavailable', `this DSec server does not ${name} sandboxes`);
  }
  return fn.bind(service) as NonNullable<LifecycleMethods[K]>;
}

type Body = Record<string, unknown>;

const callers = new WeakMap<FastifyRequest, E2bCaller>();

export function callerOf(req: FastifyRequest): E2bCaller {
  const c = callers.get(req);
  if (!c) throw new DsecError('unauthenticated', 'missing API key (X-API-Key)');
  return c;
}

function bodyOf(req: FastifyRequest): Body {
  const b: unknown = req.body;
  if (b === undefined || b === null) return {};
  if (typeof b !== 'object' || Array.isArray(b)) {
    throw new DsecError('invalid_argument', 'request body must be a JSON object');
  }
  return b as Body;
}

function idParam(req: FastifyRequest): string {
  const { sandboxID } = req.params as { sandboxID: string };
  return toDsecSandboxId(sandboxID);
}

/** A whole number of seconds within DSec's TTL bounds, or undefined when absent. */
function seconds(v: unknown, field: string): number | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 0) {
    throw new DsecError('invalid_argument', `${field} must be a whole number of seconds`, {
      field,
    });
  }
  return Math.min(Math.max(v, MIN_TTL_S), MAX_TTL_S);
}

function stringMap(v: unknown, field: string): Record<string, string> {
  if (v === undefined || v === null) return {};
  if (typeof v !== 'object' || Array.isArray(v)) {
    throw new DsecError('invalid_argument', `${field} must be an object of strings`, { field });
  }
  for (const [k, x] of Object.entries(v)) {
    if (typeof x !== 'string') {
      throw new DsecError('invalid_argument', `${field}.${k} must be a string`, {
        field: `${field}.${k}`,
      });
    }
  }
  return v as Record<string, string>;
}

/** `1.2.3.4`, `10.0.0.0/8`, `::/0` are CIDRs; anything else a domain (`*.x.org` included). */
export function egressTarget(entry: unknown, field: string): NetworkTarget {
  if (typeof entry !== 'string' || entry === '') {
    throw new DsecError('invalid_argument', `${field} entries must be strings`, { field });
  }
  const v4 = /^\d{1,3}(?:\.\d{1,3}){3}(?:\/\d{1,2})?$/.test(entry);
  const v6 = entry.includes(':') && /^[0-9a-f:.]+(?:\/\d{1,3})?$/i.test(entry);
  return v4 || v6 ? { cidr: entry } : { domain: entry };
}

const ALL_V4: NetworkTarget = { cidr: '0.0.0.0/0' };
const ALL_V6: NetworkTarget = { cidr: '::/0' };

/** The most bytes of JSON an `mcp` config may take (the SDK passes it on a command line). */
export const MAX_MCP_BYTES = 64 * 1024;

/**
 * `mcp` is accepted but not acted on: E2B's SDK itself starts the template's `mcp-gateway`
 * binary with this config once the sandbox runs (and kills the sandbox when that fails), so
 * DSec only checks that it is an object of bounded size.
 */
function checkMcp(v: unknown): void {
  if (v === undefined || v === null) return;
  if (typeof v !== 'object' || Array.isArray(v)) {
    throw new DsecError('invalid_argument', 'mcp must be an object', { field: 'mcp' });
  }
  const bytes = Buffer.byteLength(JSON.stringify(v));
  if (bytes > MAX_MCP_BYTES) {
    throw new DsecError('invalid_argument', `mcp: at most ${MAX_MCP_BYTES} bytes of JSON`, {
      field: 'mcp',
    });
  }
}

/** Features of E2B's create that DSec does not have, refused by name rather than ignored. */
function refuseUnsupported(b: Body): void {
  const refuse = (field: string, why: string) => {
    throw new DsecError('invalid_argument', `${field}: ${why}`, { field });
  };
  checkMcp(b.mcp);
  const iam = b.iam as Body | undefined;
  if (
    iam &&
    typeof iam === 'object' &&
    Object.keys((iam.tokens as Body | undefined) ?? {}).length > 0
  ) {
    refuse('iam', 'identity tokens are not part of DSec');
  }
  const net = b.network as Body | undefined;
  if (net && typeof net === 'object') {
    if (net.egressProxy) refuse('network.egressProxy', 'DSec has no egress proxy setting');
    if (net.rules && typeof net.rules === 'object' && Object.keys(net.rules).length > 0) {
      refuse('network.rules', 'request transforms are not part of DSec; use allowOut/denyOut');
    }
  }
}

/** The native create body an E2B `NewSandbox` stands for (DSec's schema then checks it). */
export function createBodyOf(b: Body, templates: E2bTemplates | undefined): Body {
  const templateID = b.templateID;
  if (typeof templateID !== 'string' || templateID === '') {
    throw new DsecError('invalid_argument', 'templateID is required', { field: 'templateID' });
  }
  refuseUnsupported(b);
  const { user: templateUser, ...base } = resolveTemplate(templateID, templates);
  const metadata = stringMap(b.metadata, 'metadata');
  for (const k of Object.keys(metadata)) {
    if (k.startsWith(E2B_LABEL_PREFIX)) {
      throw new DsecError(
        'invalid_argument',
        `metadata.${k}: the ${E2B_LABEL_PREFIX} prefix is reserved`,
        {
          field: `metadata.${k}`,
        },
      );
    }
  }
  // E2B's sandboxes run as `user`; a template may name another (`user` or `initUser`).
  const user = e2bUserOf(templateUser ?? base.initUser);
  const lifecycleLabels: Record<string, string> = {};
  const autoPause = flag(b.autoPause, 'autoPause');
  const autoResume = flag(
    b.autoResume !== null && typeof b.autoResume === 'object'
      ? (b.autoResume as Body).enabled
      : b.autoResume,
    'autoResume.enabled',
  );
  if (autoPause) lifecycleLabels[ON_TIMEOUT_LABEL] = 'pause';
  if (autoResume) lifecycleLabels[AUTO_RESUME_LABEL] = 'true';
  const net = (b.network ?? {}) as Body;
  if (flag(net.allowPublicTraffic, 'network.allowPublicTraffic'))
    lifecycleLabels[PUBLIC_TRAFFIC_LABEL] = 'true';
  const out: Body = {
    ...base,
    initUser: user === E2B_USER ? E2B_USER_IDS : user,
    env: {
      ...(base.env ?? {}),
      ...stringMap(b.envVars, 'envVars'),
    },
    labels: {
      ...(base.labels ?? {}),
      ...metadata,
      ...lifecycleLabels,
      [USER_LABEL]: user,
      [TEMPLATE_LABEL]: templateID,
    },
  };
  const ttl = seconds(b.timeout, 'timeout');
  if (ttl !== undefined) out.ttlSeconds = ttl;
  if (autoPause) {
    // Paused at the E2B timeout; the DSec TTL, a little later, is the backstop (lifecycle.ts).
    const timeout = typeof out.ttlSeconds === 'number' ? out.ttlSeconds : DEFAULT_TIMEOUT_S;
    (out.labels as Record<string, string>)[TIMEOUT_LABEL] = String(timeout);
    out.ttlSeconds = dsecTtl(
      { spec: { labels: lifecycleLabels } } as Pick<SandboxInfo, 'spec'>,
      timeout,
    );
  }
  const allow = [...((base.networkAllow as NetworkTarget[] | undefined) ?? [])];
  const deny = [...((base.networkDeny as NetworkTarget[] | undefined) ?? [])];
  for (const e of (net.allowOut as unknown[] | undefined) ?? [])
    allow.push(egressTarget(e, 'network.allowOut'));
  for (const e of (net.denyOut as unknown[] | undefined) ?? [])
    deny.push(egressTarget(e, 'network.denyOut'));
  // E2B's switch for the whole internet; DSec denies egress unless allowed, and a deny wins.
  if (b.allow_internet_access === true) allow.push(ALL_V4, ALL_V6);
  if (b.allow_internet_access === false) deny.push(ALL_V4, ALL_V6);
  if (allow.length > 0) out.networkAllow = allow;
  if (deny.length > 0) out.networkDeny = deny;
  if (Array.isArray(b.volumeMounts) && b.volumeMounts.length > 0)
    out.volumes = volumeMountsOf(b.volumeMounts);
  return out;
}

/** A template's user, checked: `user` (E2B's) unless it names another. */
function e2bUserOf(v: unknown): string {
  if (v === undefined || v === null || v === '') return E2B_USER;
  if (typeof v !== 'string') {
    throw new DsecError('invalid_argument', "the template's user must be a string", {
      field: 'templateID',
    });
  }
  return checkUser(v) ?? E2B_USER;
}

function flag(v: unknown, field: string): boolean {
  if (v === undefined || v === null) return false;
  if (typeof v !== 'boolean') {
    throw new DsecError('invalid_argument', `${field} must be true or false`, { field });
  }
  return v;
}

/** Whether a create body is an E2B `user` sandbox that needs its user made (user-setup.ts). */
export function needsUserSetup(body: Body): boolean {
  return body.initUser === E2B_USER_IDS && (body.labels as Body)[USER_LABEL] === E2B_USER;
}

/** DSec's field names in a schema error, read back as the E2B names the client sent. */
function e2bField(err: unknown): never {
  if (err instanceof DsecError && err.field !== undefined) {
    const map: [string, string][] = [
      ['labels', 'metadata'],
      ['env', 'envVars'],
      ['ttlSeconds', 'timeout'],
      ['initUser', 'templateID'],
      ['image', 'templateID'],
      ['workspace', 'templateID'],
      ['toolkits', 'templateID'],
      ['networkAllow', 'network.allowOut'],
      ['networkDeny', 'network.denyOut'],
      ['volumes', 'volumeMounts'],
    ];
    for (const [from, to] of map) {
      if (err.field === from || err.field.startsWith(`${from}.`)) {
        const field = to + err.field.slice(from.length);
        throw new DsecError(err.code, err.message.replace(err.field, field), {
          field,
          cause: err,
        });
      }
    }
  }
  throw err;
}

function liveState(info: SandboxInfo): 'running' | 'paused' | undefined {
  if (info.state === 'paused') return 'paused';
  if (info.state === 'running' || info.state === 'creating') return 'running';
  return undefined;
}

function templateOf(info: SandboxInfo): string {
  return info.spec.labels[TEMPLATE_LABEL] ?? info.spec.image;
}

function metadataOf(info: SandboxInfo): Record<string, string> {
  return Object.fromEntries(
    Object.entries(info.spec.labels).filter(([k]) => !k.startsWith(E2B_LABEL_PREFIX)),
  );
}

/** E2B's `ListedSandbox` (and, with more, `SandboxDetail`). */
export function listedSandbox(info: SandboxInfo, state: 'running' | 'paused'): Body {
  return {
    templateID: templateOf(info),
    sandboxID: toE2bSandboxId(info.id),
    clientID: info.edgeId,
    startedAt: info.createdAt,
    endAt: state === 'paused' && info.pausedExpiresAt ? info.pausedExpiresAt : e2bEndAt(info),
    cpuCount: Math.max(1, Math.ceil(info.spec.cpuCoresLimit)),
    memoryMB: info.spec.memoryLimitMb,
    diskSizeMB: info.spec.diskLimitMb ?? 0,
    metadata: metadataOf(info),
    state,
    envdVersion: ENVD_VERSION,
    volumeMounts: info.spec.volumes ?? [],
  };
}

export function controlPlaneRoutes(scope: FastifyInstance, deps: ControlPlaneDeps): void {
  const { service, iam, access, pauser } = deps;

  /** E2B's `Sandbox`: what a client needs to reach the sandbox's envd. */
  const sandboxAnswer = (info: SandboxInfo, caller: E2bCaller): Body => ({
    templateID: templateOf(info),
    sandboxID: toE2bSandboxId(info.id),
    clientID: info.edgeId,
    envdVersion: ENVD_VERSION,
    // The caller's own key: the envd calls it authorises are the caller's, checked as such.
    envdAccessToken: caller.key,
    // Port traffic needs the key unless the sandbox is public (sandbox-routes.ts).
    trafficAccessToken: info.spec.labels[PUBLIC_TRAFFIC_LABEL] === 'true' ? null : caller.key,
    domain: deps.sandboxDomain ?? null,
  });

  /** A sandbox that exists for the caller and still lives; otherwise `sandbox_not_found`. */
  const live = async (p: Principal, id: string, signal: AbortSignal) => {
    const info = await service.get(p, id, signal);
    const state = liveState(info);
    if (!state)
      throw new DsecError('sandbox_not_found', `sandbox ${toE2bSandboxId(id)} is ${info.state}`);
    return { info, state };
  };

  scope.addHook('onRequest', async (req, reply) => {
    const caller = await authenticateE2b(iam, req.headers, sourceOf(req.raw));
    callers.set(req, caller);
    // One key's requests in flight are bounded (`maxRequestsPerKey`), on this door too.
    const leave = deps.limits?.enterRequest(caller.principal.keyId);
    if (leave) reply.raw.once('close', leave).once('finish', leave);
  });
  scope.setErrorHandler((err, req, reply) => {
    // A sandbox that stopped between the lookup and the call is gone to E2B too.
    const e = toHttpError(
      isDsecError(err, 'sandbox_not_running') && isGoneState(err)
        ? new DsecError('sandbox_not_found', err.message, { cause: err })
        : err,
      req.id,
    );
    if (e.status >= 500 && e.code !== 'unavailable' && e.code !== 'capacity_exhausted') {
      req.log.error({ err, reqId: req.id }, 'request failed');
    }
    if (e.code === 'rate_limited') reply.header('retry-after', retryAfterSeconds(e.details));
    return reply
      .code(e.status)
      .header('content-type', 'application/json; charset=utf-8')
      .send(e2bErrorBody(e.status, e));
  });

  const create = async (req: FastifyRequest, reply: FastifyReply) => {
    const caller = callerOf(req);
    const body = createBodyOf(bodyOf(req), deps.templates);
    let input;
    try {
      input = schemas.parse(schemas.CreateSandboxBody, body);
    } catch (err) {
      e2bField(err);
    }
    const signal = clientGone(reply);
    const info = await service.create(
      caller.principal,
      {
        spec: schemas.toSandboxSpec(input),
        projectId: input.projectId,
        requestId: input.requestId,
      },
      signal,
    );
    if (needsUserSetup(body)) {
      try {
        await setUpE2bUser(
          service,
          caller.principal,
          info.id,
          String(bodyOf(req).templateID),
          signal,
        );
      } catch (err) {
        await service.delete(caller.principal, info.id).catch(() => undefined);
        throw err;
      }
    }
    pauser.watch(caller.principal, info);
    return reply.code(201).send(sandboxAnswer(info, caller));
  };
  scope.post('/sandboxes', create);
  scope.post('/v2/sandboxes', create);

  // v1: running sandboxes, one unpaged array.
  scope.get('/sandboxes', async (req, reply) => {
    const q = req.query as Record<string, unknown>;
    const wanted = metadataFilter(q.metadata);
    const all = await service.list(callerOf(req).principal, undefined, clientGone(reply));
    return all
      .filter((s) => liveState(s) === 'running' && matches(s, wanted))
      .map((s) => listedSandbox(s, 'running'));
  });

  scope.get('/v2/sandboxes', async (req, reply) => {
    const q = listQuery(req.query as Record<string, unknown>);
    const all = await service.list(callerOf(req).principal, undefined, clientGone(reply));
    const rows = all
      .map((info) => ({ info, state: liveState(info) }))
      .filter(
        (r): r is { info: SandboxInfo; state: 'running' | 'paused' } =>
          r.state !== undefined &&
          q.states.has(r.state) &&
          matches(r.info, q.metadata) &&
          (q.template === undefined || templateOf(r.info) === q.template) &&
          (q.startedAfter === undefined || Date.parse(r.info.createdAt) >= q.startedAfter),
      )
      .map((r) => ({ ...r, key: [r.info.createdAt, toE2bSandboxId(r.info.id)] as const }));
    const dir = q.order === 'asc' ? 1 : -1;
    const cmp = (a: readonly [string, string], b: readonly [string, string]) =>
      dir * (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0);
    rows.sort((a, b) => cmp(a.key, b.key));
    const after = q.nextToken;
    const start = after === undefined ? 0 : rows.findIndex((r) => cmp(r.key, after) > 0);
    const page = start < 0 ? [] : rows.slice(start, start + q.limit);
    const last = page.at(-1);
    if (last && start + q.limit < rows.length) reply.header('x-next-token', pageToken(last.key));
    reply.header('x-total-running', String(rows.filter((r) => r.state === 'running').length));
    return page.map((r) => listedSandbox(r.info, r.state));
  });

  scope.get('/sandboxes/:sandboxID', async (req, reply) => {
    const caller = callerOf(req);
    const { info, state } = await live(caller.principal, idParam(req), clientGone(reply));
    return {
      ...listedSandbox(info, state),
      // SandboxDetail carries it: the Python SDK's `connect` takes envd's token from this answer.
      envdAccessToken: caller.key,
      allowInternetAccess: null,
      domain: deps.sandboxDomain ?? null,
      lifecycle: lifecycleOf(info),
      network: { allowPublicTraffic: info.spec.labels[PUBLIC_TRAFFIC_LABEL] === 'true' },
    };
  });

  scope.delete('/sandboxes/:sandboxID', async (req, reply) => {
    const id = idParam(req);
    const p = callerOf(req).principal;
    const signal = clientGone(reply);
    // A sandbox already stopped (still kept by its edge for a while) is gone to E2B: 404.
    await live(p, id, signal);
    await service.delete(p, id, signal);
    access.forget(id);
    pauser.forget(id);
    return reply.code(204).send();
  });

  const setTimeoutRoute = (field: string) => async (req: FastifyRequest, reply: FastifyReply) => {
    const ttl = seconds(bodyOf(req)[field], field);
    if (ttl === undefined)
      throw new DsecError('invalid_argument', `${field} is required`, { field });
    const p = callerOf(req).principal;
    const id = idParam(req);
    const signal = clientGone(reply);
    const { info } = await live(p, id, signal);
    const set = await lifecycle(service, 'setTimeout')(p, id, dsecTtl(info, ttl), signal);
    pauser.watch(p, set);
    return reply.code(204).send();
  };
  scope.post('/sandboxes/:sandboxID/timeout', setTimeoutRoute('timeout'));
  // The older keepalive: "stop `duration` seconds from now".
  scope.post('/sandboxes/:sandboxID/refreshes', setTimeoutRoute('duration'));

  scope.post('/sandboxes/:sandboxID/pause', async (req, reply) => {
    const p = callerOf(req).principal;
    const id = idParam(req);
    const signal = clientGone(reply);
    const { state } = await live(p, id, signal);
    // E2B answers 409 for a sandbox already paused (the SDKs' pause() then returns false).
    if (state === 'paused') {
      return reply
        .code(409)
        .send({ code: 409, message: `sandbox ${toE2bSandboxId(id)} is already paused` });
    }
    const paused = await lifecycle(service, 'pause')(p, id, signal);
    access.paused(paused);
    pauser.watch(p, paused);
    return reply.code(204).send();
  });

  /** Connect: resumes a paused sandbox (201) or answers a running one (200); the TTL only grows. */
  const connect = (legacyResume: boolean) => async (req: FastifyRequest, reply: FastifyReply) => {
    const caller = callerOf(req);
    const p = caller.principal;
    const id = idParam(req);
    const signal = clientGone(reply);
    const ttl = seconds(bodyOf(req).timeout, 'timeout');
    const found = await live(p, id, signal);
    let info = found.info;
    const state = found.state;
    if (legacyResume && state === 'running') {
      return reply
        .code(409)
        .send({ code: 409, message: `sandbox ${toE2bSandboxId(id)} is already running` });
    }
    const resumed = state === 'paused';
    if (resumed) {
      info = await lifecycle(service, 'resume')(p, id, signal);
      access.resumed(id);
    }
    const wanted =
      ttl ?? (resumed && lifecycleOf(info).onTimeout === 'pause' ? timeoutOf(info) : undefined);
    if (wanted !== undefined && Date.now() + wanted * 1000 > Date.parse(e2bEndAt(info))) {
      info = await lifecycle(service, 'setTimeout')(p, id, dsecTtl(info, wanted), signal);
    }
    pauser.watch(p, info);
    return reply.code(resumed || legacyResume ? 201 : 200).send(sandboxAnswer(info, caller));
  };
  scope.post('/sandboxes/:sandboxID/connect', connect(false));
  scope.post('/v2/sandboxes/:sandboxID/connect', connect(false));
  scope.post('/sandboxes/:sandboxID/resume', connect(true));

  // One sample of what DSec measures cheaply: the memory charged to the sandbox now.
  scope.get('/sandboxes/:sandboxID/metrics', async (req, reply) => {
    const q = req.query as Record<string, unknown>;
    const start = unixSeconds(q.start, 'start');
    const end = unixSeconds(q.end, 'end');
    if (start !== undefined && end !== undefined && start > end) {
      throw new DsecError('invalid_argument', 'start must not be after end', { field: 'start' });
    }
    const { info } = await live(callerOf(req).principal, idParam(req), clientGone(reply));
    if (info.memoryBytes === undefined) return [];
    const now = new Date();
    // The one sample there is, now: inside the asked window or not at all.
    const nowS = Math.floor(now.getTime() / 1000);
    if ((start !== undefined && nowS < start) || (end !== undefined && nowS > end)) return [];
    return [
      {
        timestamp: now.toISOString(),
        timestampUnix: Math.floor(now.getTime() / 1000),
        cpuCount: Math.max(1, Math.ceil(info.spec.cpuCoresLimit)),
        cpuUsedPct: 0,
        memUsed: info.memoryBytes,
        memTotal: info.spec.memoryLimitMb * 1024 * 1024,
        memCache: 0,
        diskUsed: 0,
        diskTotal: (info.spec.diskLimitMb ?? 0) * 1024 * 1024,
      },
    ];
  });

  scope.post('/sandboxes/:sandboxID/snapshots', async (req, reply) => {
    const name = bodyOf(req).name;
    if (name !== undefined && typeof name !== 'string') {
      throw new DsecError('invalid_argument', 'name must be a string', { field: 'name' });
    }
    const id = idParam(req);
    await live(callerOf(req).principal, id, clientGone(reply));
    const layer = name ?? `${snapshotPrefix(id)}-${Date.now().toString(36)}`;
    const snap = await lifecycle(service, 'snapshot')(
      callerOf(req).principal,
      id,
      schemas.parse(schemas.SnapshotBody, { name: layer }),
      clientGone(reply),
    );
    return reply.code(201).send({ snapshotID: snap.image, names: [snap.image] });
  });

  scope.post('/sandboxes/:sandboxID/fork', async (req, reply) => {
    const caller = callerOf(req);
    const b = bodyOf(req);
    const count = b.count ?? 1;
    if (typeof count !== 'number' || !Number.isInteger(count) || count < 1) {
      throw new DsecError('invalid_argument', 'count must be a positive whole number', {
        field: 'count',
      });
    }
    const ttl = seconds(b.timeout, 'timeout');
    const signal = clientGone(reply);
    const id = idParam(req);
    // A killed sandbox is not found (404), as in E2B, not "not running".
    await live(caller.principal, id, signal);
    const { ids } = await lifecycle(service, 'fork')(caller.principal, id, count, signal);
    const results = await Promise.all(
      ids.map(async (id) => {
        let info = await service.get(caller.principal, id, signal);
        if (ttl !== undefined)
          info = await lifecycle(service, 'setTimeout')(
            caller.principal,
            id,
            dsecTtl(info, ttl),
            signal,
          );
        pauser.watch(caller.principal, info);
        return { sandbox: sandboxAnswer(info, caller) };
      }),
    );
    return reply.code(201).send(results);
  });

  const images = (): E2bImages => {
    if (!deps.images) throw new DsecError('unavailable', 'this apiserver has no image store');
    return deps.images;
  };

  // The caller's project's snapshots (layers its sandboxes' snapshots made), by name, paged.
  scope.get('/snapshots', async (req, reply) => {
    const q = req.query as Record<string, unknown>;
    const limit = q.limit === undefined || q.limit === '' ? MAX_PAGE : Number(q.limit);
    if (!Number.isInteger(limit) || limit < 1 || limit > MAX_PAGE) {
      throw new DsecError('invalid_argument', `limit must be 1–${MAX_PAGE}`, { field: 'limit' });
    }
    const after = snapshotToken(q.nextToken);
    const name = optionalString(q.name, 'name');
    const from = optionalString(q.sandboxID, 'sandboxID');
    // Snapshots this API names by default carry their sandbox's ID (`snapshot-<id>-…`).
    const fromPrefix = from === undefined ? undefined : `${snapshotPrefix(toDsecSandboxId(from))}-`;
    const p = callerOf(req).principal;
    const rows = (await images().list(p, { all: false }))
      .filter((l) => l.kind === 'snapshot' && l.project === p.projectId)
      .map((l) => ({ l, id: `${l.name}:${l.version}` }))
      .filter(
        ({ l, id }) =>
          (name === undefined || l.name === name || id === name) &&
          (fromPrefix === undefined || l.name.startsWith(fromPrefix)),
      )
      .sort((x, y) => (x.id < y.id ? -1 : x.id > y.id ? 1 : 0));
    const start = after === undefined ? 0 : rows.findIndex((x) => x.id > after);
    const page = start < 0 ? [] : rows.slice(start, start + limit);
    const last = page.at(-1);
    // The token is the page's last ID: stateless, any apiserver continues the listing.
    if (last && start + limit < rows.length) {
      reply.header('x-next-token', Buffer.from(last.id).toString('base64url'));
    }
    return page.map(({ id }) => ({ snapshotID: id, names: [id] }));
  });

  // Deleting a template: here, a snapshot of the caller's project (E2B's `deleteSnapshot`).
  scope.delete('/templates/:templateID', async (req, reply) => {
    const { templateID } = req.params as { templateID: string };
    const p = callerOf(req).principal;
    try {
      await images().remove(p, templateID, {});
    } catch (err) {
      if (isDsecError(err, 'image_not_found')) {
        throw new DsecError(
          'not_found',
          `no template ${JSON.stringify(templateID.slice(0, 200))}`,
          {
            field: 'templateID',
            cause: err,
          },
        );
      }
      throw err;
    }
    return reply.code(204).send();
  });
}

/**
 * Anything else under E2B's route families answers in E2B's shape (the SDKs print `message`),
 * after the control plane's key check. Call last in the control plane's scope: a route added
 * after it under these paths would be a duplicate.
 */
export function unknownE2bRoutes(scope: FastifyInstance): void {
  const unknown = async (req: FastifyRequest) => {
    throw new DsecError(
      'not_found',
      `DSec's E2B API has no ${req.method} ${(req.url.split('?')[0] ?? '').slice(0, 200)} (docs/e2b.md)`,
    );
  };
  const methods = ['GET', 'POST', 'PUT', 'PATCH', 'DELETE'] as const;
  for (const family of E2B_ROUTE_FAMILIES) {
    for (const url of [family, `${family}/*`]) {
      const free = methods.filter((method) => !scope.hasRoute({ method, url }));
      if (free.length > 0) scope.route({ method: [...free], url, handler: unknown });
    }
  }
}

/** The top-level paths of E2B's API (its OpenAPI document); under them an unknown route is E2B's 404. */
const E2B_ROUTE_FAMILIES = [
  '/sandboxes',
  '/v2/sandboxes',
  '/v3/sandboxes',
  '/snapshots',
  '/templates',
  '/v2/templates',
  '/v3/templates',
  '/teams',
  '/nodes',
  '/admin',
  '/access-tokens',
  '/api-keys',
  '/volumes',
  '/secrets',
];

/** The name prefix of the snapshots this API names by default (`snapshot-<16 chars of the ID>`). */
function snapshotPrefix(id: string): string {
  return `snapshot-${toE2bSandboxId(id).slice(2, 18)}`;
}

function optionalString(v: unknown, field: string): string | undefined {
  if (v === undefined || v === '') return undefined;
  if (typeof v !== 'string' || v.length > 512) {
    throw new DsecError(
      'invalid_argument',
      `${field} must be one string of at most 512 characters`,
      {
        field,
      },
    );
  }
  return v;
}

function snapshotToken(raw: unknown): string | undefined {
  if (raw === undefined || raw === '') return undefined;
  const text =
    typeof raw === 'string' && raw.length <= 1024
      ? Buffer.from(raw, 'base64url').toString('utf8')
      : '';
  if (text === '' || parseLayerRef(text) === undefined) {
    throw new DsecError('invalid_argument', 'nextToken is not a token this server gave', {
      field: 'nextToken',
    });
  }
  return text;
}

/** Unix seconds in a query (`start`, `end` of getMetrics). */
function unixSeconds(v: unknown, field: string): number | undefined {
  if (v === undefined || v === '') return undefined;
  const n = Number(v);
  if (typeof v !== 'string' || !Number.isInteger(n) || n < 0 || n > 1e11) {
    throw new DsecError('invalid_argument', `${field} must be a Unix time in seconds`, { field });
  }
  return n;
}

/** The E2B timeout an `autoPause` sandbox was made with (seconds). */
function timeoutOf(info: SandboxInfo): number {
  const n = Number(info.spec.labels[TIMEOUT_LABEL]);
  return Number.isInteger(n) && n > 0 ? n : DEFAULT_TIMEOUT_S;
}

/** A `sandbox_not_running` for a sandbox that stopped (not one merely paused or starting). */
function isGoneState(err: DsecError): boolean {
  const state = (err.details as { state?: unknown } | undefined)?.state;
  return state === 'stopped' || state === 'stopping' || state === 'failed';
}

function matches(info: SandboxInfo, wanted: Record<string, string>): boolean {
  return Object.entries(wanted).every(([k, v]) => info.spec.labels[k] === v);
}

/**
 * E2B's metadata filter: `k=v&k2=v2` with each key and value URL-encoded
 * inside the (itself encoded) query value.
 */
export function metadataFilter(raw: unknown): Record<string, string> {
  if (raw === undefined || raw === '') return {};
  if (typeof raw !== 'string') {
    throw new DsecError('invalid_argument', 'metadata must be a query string', {
      field: 'metadata',
    });
  }
  const out: Record<string, string> = {};
  try {
    for (const [k, v] of new URLSearchParams(raw))
      out[decodeURIComponent(k)] = decodeURIComponent(v);
  } catch {
    throw new DsecError('invalid_argument', 'metadata is not a valid query string', {
      field: 'metadata',
    });
  }
  return out;
}

function pageToken(key: readonly [string, string]): string {
  return Buffer.from(JSON.stringify(key)).toString('base64url');
}

function readPageToken(raw: unknown): [string, string] | undefined {
  if (raw === undefined || raw === '') return undefined;
  try {
    const v: unknown = JSON.parse(Buffer.from(String(raw), 'base64url').toString('utf8'));
    if (Array.isArray(v) && v.length === 2 && v.every((x) => typeof x === 'string')) {
      return [v[0] as string, v[1] as string];
    }
  } catch {
    // falls through to the error below
  }
  throw new DsecError('invalid_argument', 'nextToken is not a token this server gave', {
    field: 'nextToken',
  });
}

function listQuery(q: Record<string, unknown>) {
  const list = (v: unknown) =>
    (Array.isArray(v) ? v : v === undefined ? [] : [v]).flatMap((x) => String(x).split(','));
  const states = new Set(list(q.state));
  for (const s of states) {
    if (s !== 'running' && s !== 'paused') {
      throw new DsecError(
        'invalid_argument',
        `state ${JSON.stringify(s)} is not running or paused`,
        {
          field: 'state',
        },
      );
    }
  }
  if (states.size === 0) states.add('running').add('paused');
  const limit = q.limit === undefined ? MAX_PAGE : Number(q.limit);
  if (!Number.isInteger(limit) || limit < 1 || limit > MAX_PAGE) {
    throw new DsecError('invalid_argument', `limit must be 1–${MAX_PAGE}`, { field: 'limit' });
  }
  const order = q.order ?? 'desc';
  if (order !== 'asc' && order !== 'desc') {
    throw new DsecError('invalid_argument', 'order must be asc or desc', { field: 'order' });
  }
  let startedAfter: number | undefined;
  if (q.startedAfter !== undefined) {
    startedAfter = Date.parse(String(q.startedAfter));
    if (Number.isNaN(startedAfter)) {
      throw new DsecError('invalid_argument', 'startedAfter must be a date-time', {
        field: 'startedAfter',
      });
    }
  }
  return {
    states,
    limit,
    order,
    startedAfter,
    template: typeof q.template === 'string' && q.template !== '' ? q.template : undefined,
    metadata: metadataFilter(q.metadata),
    nextToken: readPageToken(q.nextToken),
  };
}
