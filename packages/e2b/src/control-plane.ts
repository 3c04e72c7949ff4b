import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { DsecError } from '@dsec/core';
import type { NetworkTarget, SandboxInfo, SnapshotInfo, SnapshotRequest } from '@dsec/core';
import { clientGone, retryAfterSeconds, schemas, sourceOf, toHttpError } from '@dsec/apiserver';
import type { CallerLimits, SandboxService } from '@dsec/apiserver';
import type { Iam, Principal } from '@dsec/iam';
import { authenticateE2b } from './auth.js';
import type { E2bCaller } from './auth.js';
import { e2bErrorBody } from './errors.js';
import { toDsecSandboxId, toE2bSandboxId } from './ids.js';
import type { SandboxAccess } from './sandbox-access.js';
import { resolveTemplate } from './templates.js';
import type { E2bTemplates } from './templates.js';
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

export interface ControlPlaneDeps {
  service: SandboxService;
  iam: Iam;
  access: SandboxAccess;
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

/** Features of E2B's create that DSec does not have, refused by name rather than ignored. */
function refuseUnsupported(b: Body): void {
  const refuse = (field: string, why: string) => {
    throw new DsecError('invalid_argument', `${field}: ${why}`, { field });
  };
  if (b.autoPause === true)
    refuse('autoPause', 'DSec stops a sandbox at its timeout, it does not pause it');
  if (b.mcp !== undefined && b.mcp !== null) refuse('mcp', 'the MCP gateway is not part of DSec');
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
  const base = resolveTemplate(templateID, templates);
  const metadata = stringMap(b.metadata, 'metadata');
  if (Object.hasOwn(metadata, TEMPLATE_LABEL)) {
    throw new DsecError('invalid_argument', `metadata.${TEMPLATE_LABEL}: the key is reserved`, {
      field: `metadata.${TEMPLATE_LABEL}`,
    });
  }
  const out: Body = {
    ...base,
    env: {
      ...(base.env ?? {}),
      ...stringMap(b.envVars, 'envVars'),
    },
    labels: {
      ...(base.labels ?? {}),
      ...metadata,
      [TEMPLATE_LABEL]: templateID,
    },
  };
  const ttl = seconds(b.timeout, 'timeout');
  if (ttl !== undefined) out.ttlSeconds = ttl;
  const allow = [...((base.networkAllow as NetworkTarget[] | undefined) ?? [])];
  const deny = [...((base.networkDeny as NetworkTarget[] | undefined) ?? [])];
  const net = (b.network ?? {}) as Body;
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

/** DSec's field names in a schema error, read back as the E2B names the client sent. */
function e2bField(err: unknown): never {
  if (err instanceof DsecError && err.field !== undefined) {
    const map: [string, string][] = [
      ['labels', 'metadata'],
      ['env', 'envVars'],
      ['ttlSeconds', 'timeout'],
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
  const { [TEMPLATE_LABEL]: _template, ...rest } = info.spec.labels;
  return rest;
}

/** E2B's `ListedSandbox` (and, with more, `SandboxDetail`). */
export function listedSandbox(info: SandboxInfo, state: 'running' | 'paused'): Body {
  return {
    templateID: templateOf(info),
    sandboxID: toE2bSandboxId(info.id),
    clientID: info.edgeId,
    startedAt: info.createdAt,
    endAt: state === 'paused' && info.pausedExpiresAt ? info.pausedExpiresAt : info.expiresAt,
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
  const { service, iam } = deps;

  /** E2B's `Sandbox`: what a client needs to reach the sandbox's envd. */
  const sandboxAnswer = (info: SandboxInfo, caller: E2bCaller): Body => ({
    templateID: templateOf(info),
    sandboxID: toE2bSandboxId(info.id),
    clientID: info.edgeId,
    envdVersion: ENVD_VERSION,
    // The caller's own key: the envd calls it authorises are the caller's, checked as such.
    envdAccessToken: caller.key,
    trafficAccessToken: null,
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
    const e = toHttpError(err, req.id);
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
    const info = await service.create(
      caller.principal,
      {
        spec: schemas.toSandboxSpec(input),
        projectId: input.projectId,
        requestId: input.requestId,
      },
      clientGone(reply),
    );
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
    const { info, state } = await live(callerOf(req).principal, idParam(req), clientGone(reply));
    return {
      ...listedSandbox(info, state),
      allowInternetAccess: null,
      domain: deps.sandboxDomain ?? null,
      lifecycle: { onTimeout: 'kill', autoResume: true },
    };
  });

  scope.delete('/sandboxes/:sandboxID', async (req, reply) => {
    const id = idParam(req);
    const p = callerOf(req).principal;
    const signal = clientGone(reply);
    // A sandbox already stopped (still kept by its edge for a while) is gone to E2B: 404.
    await live(p, id, signal);
    await service.delete(p, id, signal);
    deps.access.forget(id);
    return reply.code(204).send();
  });

  const setTimeoutRoute = (field: string) => async (req: FastifyRequest, reply: FastifyReply) => {
    const ttl = seconds(bodyOf(req)[field], field);
    if (ttl === undefined)
      throw new DsecError('invalid_argument', `${field} is required`, { field });
    const p = callerOf(req).principal;
    await lifecycle(service, 'setTimeout')(p, idParam(req), ttl, clientGone(reply));
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
    await lifecycle(service, 'pause')(p, id, signal);
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
    if (resumed) info = await lifecycle(service, 'resume')(p, id, signal);
    if (ttl !== undefined && Date.now() + ttl * 1000 > Date.parse(info.expiresAt)) {
      info = await lifecycle(service, 'setTimeout')(p, id, ttl, signal);
    }
    return reply.code(resumed || legacyResume ? 201 : 200).send(sandboxAnswer(info, caller));
  };
  scope.post('/sandboxes/:sandboxID/connect', connect(false));
  scope.post('/v2/sandboxes/:sandboxID/connect', connect(false));
  scope.post('/sandboxes/:sandboxID/resume', connect(true));

  // One sample of what DSec measures cheaply: the memory charged to the sandbox now.
  scope.get('/sandboxes/:sandboxID/metrics', async (req, reply) => {
    const { info } = await live(callerOf(req).principal, idParam(req), clientGone(reply));
    if (info.memoryBytes === undefined) return [];
    const now = new Date();
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
    const layer = name ?? `snapshot-${toE2bSandboxId(id).slice(2, 18)}-${Date.now().toString(36)}`;
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
    const { ids } = await lifecycle(service, 'fork')(caller.principal, idParam(req), count, signal);
    const results = await Promise.all(
      ids.map(async (id) => {
        const info =
          ttl === undefined
            ? await service.get(caller.principal, id, signal)
            : await lifecycle(service, 'setTimeout')(caller.principal, id, ttl, signal);
        return { sandbox: sandboxAnswer(info, caller) };
      }),
    );
    return reply.code(201).send(results);
  });
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
