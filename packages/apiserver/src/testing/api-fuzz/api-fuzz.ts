import { randomBytes } from 'node:crypto';
import type fcModule from 'fast-check';
import { ERROR_CODES } from '@dsec/core';
import type { ErrorCode } from '@dsec/core';
import { createTestApi } from '../harness.js';
import type { TestApi } from '../harness.js';
import { TEST_LAYERS } from '../scripted-edge.js';
import { FuzzEdge } from './fuzz-edge.js';
import { SchemaArbitraries, HOSTILE_STRINGS } from './schema-arbitrary.js';
import type { JsonSchema } from './schema-arbitrary.js';

/**
 * The API fuzzer (issue 24 item 10a; SECURITY.md F31, G33): requests
 * generated from the server's own OpenAPI document (`GET /openapi.json`)
 * with fast-check, for every route and method: path parameters from a pool
 * that mixes two projects' real resources with forged and hostile values,
 * query strings and JSON bodies valid and invalid for their schemas, raw
 * bodies, and no key, a malformed one, a revoked one, or the key of project
 * B. Each answer is checked against these properties:
 *
 * - `no-5xx`: never a status of 500 or more (the edge here serves every
 *   route, so nothing is legitimately unavailable);
 * - `no-hang`: an answer within `requestTimeoutMs`;
 * - `error-shape`: an error is `{ error: { code, message, field?, details? } }`
 *   with a code of `ERROR_CODES` and that code's status (docs/errors.md);
 * - `documented-status`: the status is one the document lists for the route;
 * - `authentication`: a route that needs a key answers 401 `unauthenticated`
 *   to none, a malformed or a revoked one;
 * - `cross-project`: B's key is never answered 2xx for a request that names
 *   one of A's resources (sandbox, command, key, project) in its path or
 *   body, no answer to B shows any of A's identifiers or marks it did not
 *   name itself, and after the run A's resources are as they were (its
 *   sandbox running with the same spec and deadline, its command, session,
 *   key and child project there);
 * - `no-half-created`: B's quota usage matches the sandboxes it has.
 *
 * It runs in process (the real apiserver, IAM and routes over `inject()`,
 * a `FuzzEdge`), so the unit test runs it for a few seconds in CI and
 * `dsec bench fuzz --seconds N` for longer. Violations are kept one per
 * property and route, with the first request that broke it and a count.
 */

export type FuzzProperty =
  | 'no-5xx'
  | 'no-hang'
  | 'error-shape'
  | 'documented-status'
  | 'authentication'
  | 'cross-project'
  | 'no-half-created';

export interface FuzzRequest {
  method: string;
  url: string;
  /** Which key it carried: `none`, `malformed`, `revoked`, `B` (the other project's). */
  key: string;
  headers: Record<string, string>;
  /** The body as sent, cut to 2 KiB. */
  body?: string | undefined;
}

export interface FuzzViolation {
  property: FuzzProperty;
  /** `METHOD /path/{param}` as the document names it. */
  route: string;
  /** The first request that broke it. */
  request: FuzzRequest;
  expected: string;
  got: string;
  /** Requests that broke it on this route. */
  occurrences: number;
}

export interface ApiFuzzOptions {
  /** Fuzz until this many seconds passed (rounds over every route). */
  seconds?: number | undefined;
  /** Or until each route got this many requests (deterministic with `seed`); the first bound reached ends the run. */
  requestsPerRoute?: number | undefined;
  /** fast-check seed (default: random; the report says which). */
  seed?: number | undefined;
  /** The `no-hang` deadline of each request. Default 10 000. */
  requestTimeoutMs?: number | undefined;
  onProgress?: ((requests: number) => void) | undefined;
  signal?: AbortSignal | undefined;
}

export interface ApiFuzzReport {
  benchmark: 'fuzz';
  seed: number;
  results: {
    requests: number;
    routes: number;
    /** Answers by status code. */
    statuses: Record<string, number>;
    properties: FuzzProperty[];
    violations: FuzzViolation[];
  };
  durationMs: number;
  method: string;
}

interface Operation {
  method: string;
  path: string;
  route: string;
  params: { name: string; in: 'path' | 'query'; required: boolean; schema: JsonSchema }[];
  body?: { type: string; schema?: JsonSchema } | undefined;
  responses: Set<string>;
  open: boolean;
}

interface Built {
  method: string;
  url: string;
  key: KeyChoice;
  headers: Record<string, string>;
  payload?: string | Buffer | undefined;
}

type KeyChoice = 'none' | 'malformed' | 'revoked' | 'B';

/** What project A (the victim) owns; B (the attacker) must never reach it. */
interface World {
  api: TestApi;
  edge: FuzzEdge;
  keys: Record<Exclude<KeyChoice, 'none'>, string>;
  a: {
    projectId: string;
    childProjectId: string;
    keyId: string;
    key: string;
    extraKeyId: string;
    sandboxId: string;
    commandId: string;
    session: string;
    /** A string only A's resources hold (a label, an env value, a command's output, names). */
    mark: string;
    before: string;
  };
  b: { projectId: string; sandboxId: string; commandId: string; session: string; keyId: string };
}

const PROPERTIES: FuzzProperty[] = [
  'no-5xx',
  'no-hang',
  'error-shape',
  'documented-status',
  'authentication',
  'cross-project',
  'no-half-created',
];

const REPORT_BODY_MAX = 2048;

/** Runs the fuzzer (see the module comment) and reports what it found. */
export async function runApiFuzz(options: ApiFuzzOptions = {}): Promise<ApiFuzzReport> {
  // Loaded here: fast-check is a development dependency, and the CLI loads this module with it.
  const fc = (await import('fast-check')).default;
  const seed = options.seed ?? randomBytes(4).readInt32LE(0);
  const timeoutMs = options.requestTimeoutMs ?? 10_000;
  const started = performance.now();
  const world = await setUp();
  const violations = new Map<string, FuzzViolation>();
  const statuses: Record<string, number> = {};
  let requests = 0;
  const note = (
    property: FuzzProperty,
    route: string,
    req: Built,
    expected: string,
    got: string,
  ) => {
    const k = `${property} ${route}`;
    const known = violations.get(k);
    if (known) known.occurrences++;
    else
      violations.set(k, {
        property,
        route,
        request: describe(req, world),
        expected,
        got: got.slice(0, 600),
        occurrences: 1,
      });
  };
  try {
    const doc = (await world.api.app.inject({ method: 'GET', url: '/openapi.json' })).json<{
      paths: Record<string, Record<string, RawOperation>>;
      components: { schemas: Record<string, JsonSchema> };
    }>();
    const ops = operations(doc.paths);
    const schemas = new SchemaArbitraries({
      fc,
      resolve: (ref) => doc.components.schemas[ref.replace('#/components/schemas/', '')] ?? {},
      hint: (name) => hints(fc, world, name),
    });
    const arbitraries = ops.map((op) => ({ op, arb: requestArbitrary(fc, schemas, op, world) }));
    const deadline =
      options.seconds !== undefined
        ? Date.now() + options.seconds * 1000
        : Number.POSITIVE_INFINITY;
    const perRoute = options.requestsPerRoute ?? (options.seconds === undefined ? 8 : Infinity);
    let round = 0;
    for (; round < perRoute && Date.now() < deadline && !options.signal?.aborted; round++) {
      for (const { op, arb } of arbitraries) {
        if (Date.now() >= deadline || options.signal?.aborted) break;
        const [req] = fc.sample(arb, { numRuns: 1, seed: seed + round * 7919 + ops.indexOf(op) });
        if (!req) continue;
        requests++;
        const res = await send(world.api, req, timeoutMs);
        if (res === 'timeout') {
          note('no-hang', op.route, req, `an answer within ${timeoutMs} ms`, 'no answer');
          continue;
        }
        statuses[res.status] = (statuses[res.status] ?? 0) + 1;
        check(op, req, res, world, note);
        options.onProgress?.(requests);
      }
    }
    await checkWorld(world, note);
    return {
      benchmark: 'fuzz',
      seed,
      results: {
        requests,
        routes: ops.length,
        statuses,
        properties: PROPERTIES,
        violations: [...violations.values()],
      },
      durationMs: Math.round(performance.now() - started),
      method:
        `requests generated with fast-check from the server's GET /openapi.json (${ops.length} routes, ` +
        'round-robin, one request per route per round), sent with inject() to an in-process apiserver ' +
        '(real IAM on SQLite, real routes and schemas) over FuzzEdge, a fake edge that serves every route; ' +
        'keys: none, malformed, revoked, or project B’s; path parameters and body fields mix project A’s ' +
        'and B’s resources with forged and hostile values. Violations: one per property and route.',
    };
  } finally {
    await world.api.close();
    await world.edge.close();
  }
}

interface RawOperation {
  parameters?: {
    name: string;
    in: string;
    required?: boolean;
    schema?: JsonSchema;
  }[];
  requestBody?: { content?: Record<string, { schema?: JsonSchema }> };
  responses?: Record<string, unknown>;
  security?: unknown[];
}

function operations(paths: Record<string, Record<string, RawOperation>>): Operation[] {
  const out: Operation[] = [];
  for (const [path, byMethod] of Object.entries(paths)) {
    for (const [method, op] of Object.entries(byMethod)) {
      const content = op.requestBody?.content ?? {};
      const type = Object.keys(content)[0];
      out.push({
        method: method.toUpperCase(),
        path,
        route: `${method.toUpperCase()} ${path}`,
        params: (op.parameters ?? [])
          .filter((p) => p.in === 'path' || p.in === 'query')
          .map((p) => ({
            name: p.name,
            in: p.in as 'path' | 'query',
            required: p.required ?? false,
            schema: p.schema ?? {},
          })),
        body: type ? { type, schema: content[type]?.schema } : undefined,
        responses: new Set(Object.keys(op.responses ?? {})),
        open: Array.isArray(op.security) && op.security.length === 0,
      });
    }
  }
  return out;
}

async function setUp(): Promise<World> {
  const edge = await FuzzEdge.start();
  const api = await createTestApi({
    edges: [edge],
    imagesList: async () => TEST_LAYERS,
    // Every fuzzed request comes from one address and many carry bad keys on purpose: the
    // per-address limit of failed authentications (SECURITY.md J38, its own tests) stays out of the way.
    iamOptions: { authFailureBurst: 1_000_000, authFailuresPerSecond: 1_000_000 },
  });
  const root = await api.iam.authenticate(api.rootKey);
  const mark = `mark-a-${randomBytes(6).toString('hex')}`;
  const projectA = await api.iam.createProject(root, { name: `a-${mark}` });
  const projectB = await api.iam.createProject(root, {
    name: 'b',
    quota: { sandboxes: 20, memoryMb: 64 * 1024, cpuCores: 64 },
  });
  const keyA = await api.iam.createKey(root, { projectId: projectA.id, role: 'admin' });
  const keyB = await api.iam.createKey(root, { projectId: projectB.id, role: 'admin' });
  // B's own second key: its ID is in the pool, so B may revoke it (never the one it calls with).
  const spareB = await api.iam.createKey(root, { projectId: projectB.id, name: 'spare' });
  const revoked = await api.iam.createKey(root, { projectId: projectB.id, role: 'admin' });
  await api.iam.revokeKey(root, revoked.id);
  const principalA = await api.iam.authenticate(keyA.key);
  const childA = await api.iam.createProject(principalA, { name: `child-${mark}` });
  const extraA = await api.iam.createKey(principalA, { projectId: projectA.id, name: mark });
  const call = async (key: string, method: string, url: string, payload?: unknown) => {
    const r = await api.app.inject({
      method: method as 'POST',
      url,
      headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
      ...(payload !== undefined ? { payload: JSON.stringify(payload) } : {}),
    });
    if (r.statusCode >= 300) throw new Error(`fuzz set-up: ${method} ${url}: ${r.body}`);
    return r.json<Record<string, unknown>>();
  };
  const sbA = await call(keyA.key, 'POST', '/v1/sandboxes', {
    image: 'busybox',
    labels: { owner: mark },
    env: { SECRET: mark },
  });
  const sandboxA = String(sbA.id);
  const cmdA = await call(keyA.key, 'POST', `/v1/sandboxes/${sandboxA}/commands`, {
    argv: ['echo', mark],
  });
  await call(keyA.key, 'POST', `/v1/sandboxes/${sandboxA}/sessions/s-${mark}/run`, {
    line: `echo ${mark}`,
  });
  const sbB = await call(keyB.key, 'POST', '/v1/sandboxes', { image: 'busybox' });
  const sandboxB = String(sbB.id);
  const cmdB = await call(keyB.key, 'POST', `/v1/sandboxes/${sandboxB}/commands`, {
    argv: ['echo', 'b'],
  });
  await call(keyB.key, 'POST', `/v1/sandboxes/${sandboxB}/sessions/s-b/run`, { line: 'true' });
  const world: World = {
    api,
    edge,
    keys: {
      malformed: `dsk_${randomBytes(32).toString('base64url')}`,
      revoked: revoked.key,
      B: keyB.key,
    },
    a: {
      projectId: projectA.id,
      childProjectId: childA.id,
      keyId: keyA.id,
      key: keyA.key,
      extraKeyId: extraA.id,
      sandboxId: sandboxA,
      commandId: String(cmdA.commandId),
      session: `s-${mark}`,
      mark,
      before: '',
    },
    b: {
      projectId: projectB.id,
      sandboxId: sandboxB,
      commandId: String(cmdB.commandId),
      session: 's-b',
      keyId: spareB.id,
    },
  };
  world.a.before = await stateOfA(world);
  return world;
}

/** What must not change in A: its sandbox (state, spec, deadline), command, sessions, keys, projects. */
async function stateOfA(w: World): Promise<string> {
  const get = async (url: string) => {
    const r = await w.api.app.inject({
      method: 'GET',
      url,
      headers: { authorization: `Bearer ${w.a.key}` },
    });
    return `${r.statusCode} ${r.body}`;
  };
  const sandbox = JSON.parse((await get(`/v1/sandboxes/${w.a.sandboxId}`)).slice(4)) as Record<
    string,
    unknown
  >;
  delete sandbox.memoryBytes; // the fake's reading, not state
  return JSON.stringify({
    sandbox,
    command: await get(`/v1/sandboxes/${w.a.sandboxId}/commands/${w.a.commandId}`),
    sessions: await get(`/v1/sandboxes/${w.a.sandboxId}/sessions`),
    projects: await get('/v1/projects'),
    key: (await w.api.iam.authenticate(w.a.key)).keyId,
    keys: (await w.api.iam.listKeys(await w.api.iam.authenticate(w.a.key))).map(
      (k) => `${k.id}:${k.revokedAt ?? ''}`,
    ),
  });
}

/** Identifiers of A that an answer to B must never hold unless B's request named them. */
function secretsOfA(w: World): string[] {
  return [
    w.a.projectId,
    w.a.childProjectId,
    w.a.keyId,
    w.a.extraKeyId,
    w.a.sandboxId,
    w.a.commandId,
    w.a.mark,
    w.a.key,
  ];
}

function hints(
  fc: typeof fcModule,
  w: World,
  name: string,
): fcModule.Arbitrary<unknown> | undefined {
  const forged = `sb-${randomBytes(24).toString('base64url')}`;
  switch (name) {
    case 'projectId':
    case 'parentId':
      return fc.constantFrom(w.a.projectId, w.a.childProjectId, w.b.projectId, 'prj-nope');
    case 'ids':
    case 'sandboxId':
      return fc.constantFrom(w.a.sandboxId, w.b.sandboxId, forged);
    case 'labels':
      return fc.constantFrom({ owner: w.a.mark }, {}, { owner: 'b' });
    case 'image':
    case 'workspace':
      return fc.constantFrom('busybox', 'base', 'python');
    default:
      return undefined;
  }
}

function requestArbitrary(
  fc: typeof fcModule,
  schemas: SchemaArbitraries,
  op: Operation,
  w: World,
): fcModule.Arbitrary<Built> {
  const hostile = fc.constantFrom(...HOSTILE_STRINGS.filter((s) => s.length < 400));
  const forgedSandbox = `sb-${randomBytes(24).toString('base64url')}`;
  const otherEdge = w.api.ids.mint('edge-nowhere');
  const pathValue = (name: string, schema: JsonSchema): fcModule.Arbitrary<string> => {
    const keysRoute = op.path.startsWith('/v1/keys/');
    const pools: Record<string, string[]> = {
      id: keysRoute
        ? [w.a.keyId, w.a.extraKeyId, w.b.keyId, 'key-nope']
        : [w.a.sandboxId, w.b.sandboxId, forgedSandbox, otherEdge, 'x'.repeat(300)],
      cid: [w.a.commandId, w.b.commandId, 'cmd-nope'],
      name: [w.a.session, w.b.session, 'fresh', 'x'.repeat(80)],
      port: ['8080', '1', '0', '65536', 'abc'],
      path: ['', 'app', 'a/b/c', '%2e%2e/%2e%2e/x'],
    };
    const pool = pools[name] ?? [];
    return fc.oneof(
      { weight: 6, arbitrary: pool.length ? fc.constantFrom(...pool) : fc.constant('x') },
      { weight: 1, arbitrary: schemas.valid(schema, name).map(String) },
      { weight: 1, arbitrary: hostile },
    );
  };
  const pathParams = op.params.filter((p) => p.in === 'path');
  const queryParams = op.params.filter((p) => p.in === 'query');
  const query = fc.tuple(
    ...queryParams.map((p) =>
      fc.oneof(
        { weight: p.required ? 0 : 2, arbitrary: fc.constant(undefined) },
        { weight: 4, arbitrary: schemas.valid(p.schema, p.name) },
        { weight: 2, arbitrary: schemas.invalid(p.schema, p.name) },
      ),
    ),
    fc.option(fc.constantFrom('unknown=1', '__proto__=x', 'path=a&path=b'), { freq: 8 }),
  );
  const body = bodyArbitrary(fc, schemas, op);
  const key = fc.constantFrom<KeyChoice>('B', 'B', 'B', 'B', 'none', 'malformed', 'revoked');
  const accept = fc.constantFrom(
    undefined,
    undefined,
    'application/json',
    'application/x-ndjson',
    'application/octet-stream',
  );
  return fc
    .record({
      path: fc.tuple(...pathParams.map((p) => pathValue(p.name, p.schema))),
      query,
      body,
      key,
      accept,
    })
    .map(({ path, query: q, body: b, key: k, accept: a }) => {
      let url = op.path;
      pathParams.forEach((p, i) => {
        const v = path[i] ?? '';
        url = url.replace(`{${p.name}}`, p.name === 'path' ? v : encode(v));
      });
      const parts: string[] = [];
      queryParams.forEach((p, i) => {
        const v = q[i];
        if (v === undefined) return;
        parts.push(`${encode(p.name)}=${encode(asQueryValue(v))}`);
      });
      const extra = q[queryParams.length];
      if (typeof extra === 'string') parts.push(extra);
      if (parts.length) url += `?${parts.join('&')}`;
      const headers: Record<string, string> = {};
      if (k !== 'none') headers.authorization = `Bearer ${w.keys[k]}`;
      if (k === 'malformed' && url.length % 2) headers.authorization = 'Basic bm9wZTpub3Bl';
      if (a) headers.accept = a;
      if (b !== undefined) headers['content-type'] = b.type;
      return { method: op.method, url, key: k, headers, payload: b?.payload };
    });
}

/** Percent-encoding of any string (a lone surrogate goes as U+FFFD). */
function encode(v: string): string {
  return encodeURIComponent(Buffer.from(v, 'utf8').toString('utf8'));
}

function asQueryValue(v: unknown): string {
  return typeof v === 'string' ? v : (JSON.stringify(v) ?? '');
}

function bodyArbitrary(
  fc: typeof fcModule,
  schemas: SchemaArbitraries,
  op: Operation,
): fcModule.Arbitrary<{ type: string; payload: string | Buffer } | undefined> {
  const b = op.body;
  if (!b) return fc.constant(undefined);
  if (b.type === 'application/json' && b.schema) {
    const json = fc.oneof(
      { weight: 5, arbitrary: schemas.valid(b.schema) },
      { weight: 4, arbitrary: schemas.invalid(b.schema) },
    );
    return fc.oneof(
      {
        weight: 12,
        arbitrary: json.map((v) => ({ type: b.type, payload: JSON.stringify(v) ?? 'null' })),
      },
      {
        weight: 1,
        arbitrary: fc.constantFrom('', '{', '{"a":', 'nul', '[]'.repeat(3000)).map((payload) => ({
          type: b.type,
          payload,
        })),
      },
    );
  }
  return fc.uint8Array({ maxLength: 256 }).map((bytes) => ({
    type: b.type === '*/*' ? 'application/octet-stream' : b.type,
    payload: Buffer.from(bytes),
  }));
}

interface Answer {
  status: number;
  body: string;
  headers: Record<string, unknown>;
}

async function send(api: TestApi, req: Built, timeoutMs: number): Promise<Answer | 'timeout'> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'timeout'>((resolve) => {
    timer = setTimeout(() => resolve('timeout'), timeoutMs);
  });
  const answer = api.app
    .inject({
      method: req.method as 'GET',
      url: req.url,
      headers: req.headers,
      ...(req.payload !== undefined ? { payload: req.payload } : {}),
    })
    .then((r) => ({ status: r.statusCode, body: r.body, headers: r.headers }));
  try {
    return await Promise.race([answer, late]);
  } finally {
    clearTimeout(timer);
  }
}

type Note = (
  property: FuzzProperty,
  route: string,
  req: Built,
  expected: string,
  got: string,
) => void;

function check(op: Operation, req: Built, res: Answer, w: World, note: Note): void {
  const got = `${res.status} ${res.body.slice(0, 400)}`;
  if (res.status >= 500 && !unplaceable(req, res))
    note('no-5xx', op.route, req, 'a status below 500', got);
  // A port route's 2xx-4xx without x-dsec-error is the sandbox's own web server talking.
  const fromSandbox = op.path.includes('/ports/') && res.headers['x-dsec-error'] === undefined;
  // An answer to HEAD has no body to check.
  if (res.status >= 400 && !fromSandbox && req.method !== 'HEAD') {
    const why = errorShapeProblem(res);
    if (why)
      note('error-shape', op.route, req, 'DSec’s error shape with a stable code', `${why}: ${got}`);
  }
  // A path parameter that is a dot segment leaves the route (the URL is resolved first).
  const onRoute = !req.url
    .split('?')[0]!
    .split('/')
    .some((seg) => ['.', '..'].includes(seg.replaceAll('%2e', '.').replaceAll('%2E', '.')));
  if (onRoute && !op.responses.has(String(res.status)) && !(fromSandbox && res.status < 500))
    note('documented-status', op.route, req, `one of ${[...op.responses].join(', ')}`, got);
  // The router refuses a path segment past its 256-character limit, or a malformed
  // percent-escape, before any route runs.
  const path = req.url.split('?')[0]!;
  const routable = !path.split('/').some((segment) => segment.length > 256) && decodes(path);
  // The terminal route answers only an Upgrade request (which inject cannot make); others miss it.
  const upgradeOnly = op.responses.has('101');
  if (onRoute && routable && !upgradeOnly && !op.open && req.key !== 'B' && res.status !== 401)
    note('authentication', op.route, req, '401 unauthenticated', got);
  if (req.key === 'B' || !op.open) {
    const sent = `${req.url} ${typeof req.payload === 'string' ? req.payload : ''}`;
    if (res.status < 300 && namesResourceOfA(sent, w))
      note('cross-project', op.route, req, 'not found (or another refusal) for A’s resource', got);
    const leaked = secretsOfA(w).filter((s) => res.body.includes(s) && !sent.includes(s));
    if (leaked.length)
      note(
        'cross-project',
        op.route,
        req,
        'nothing of project A in the answer',
        `shows ${leaked.join(', ')}: ${got}`,
      );
  }
}

/**
 * A 503 `capacity_exhausted` or `unavailable` for a request that asked for
 * placement the fleet cannot give (an `edgeSelector`, a GPU: the fuzz edge
 * has no labels and no GPUs) is the documented, retryable answer, not a fault.
 */
function unplaceable(req: Built, res: Answer): boolean {
  if (res.status !== 503 || typeof req.payload !== 'string') return false;
  let code: unknown;
  let body: unknown;
  try {
    code = (JSON.parse(res.body) as { error?: { code?: unknown } }).error?.code;
    body = JSON.parse(req.payload);
  } catch {
    return false;
  }
  if (code !== 'capacity_exhausted' && code !== 'unavailable') return false;
  const asked = (b: unknown) =>
    typeof b === 'object' &&
    b !== null &&
    (('gpu' in b && b.gpu !== undefined) ||
      ('edgeSelector' in b &&
        Object.keys((b as { edgeSelector: object }).edgeSelector ?? {}).length > 0));
  const calls = (body as { calls?: unknown[] } | null)?.calls;
  return asked(body) || (Array.isArray(calls) && calls.some(asked));
}

function decodes(path: string): boolean {
  try {
    decodeURIComponent(path);
    return true;
  } catch {
    return false;
  }
}

function namesResourceOfA(sent: string, w: World): boolean {
  return [w.a.sandboxId, w.a.keyId, w.a.extraKeyId, w.a.projectId, w.a.childProjectId].some((id) =>
    sent.includes(id),
  );
}

function errorShapeProblem(res: Answer): string | undefined {
  let body: unknown;
  try {
    body = JSON.parse(res.body);
  } catch {
    return 'not JSON';
  }
  if (typeof body !== 'object' || body === null || Array.isArray(body)) return 'not an object';
  const keys = Object.keys(body);
  if (keys.length !== 1 || keys[0] !== 'error') return `top-level keys ${keys.join(',')}`;
  const e = (body as { error: unknown }).error as Record<string, unknown> | null;
  if (typeof e !== 'object' || e === null) return 'error is not an object';
  const code = e.code;
  if (typeof code !== 'string' || !(code in ERROR_CODES))
    return `code ${String(code)} is not one of ERROR_CODES`;
  if (ERROR_CODES[code as ErrorCode].status !== res.status)
    return `code ${code} is HTTP ${ERROR_CODES[code as ErrorCode].status}, answered ${res.status}`;
  if (typeof e.message !== 'string') return 'no message';
  if (e.field !== undefined && typeof e.field !== 'string') return 'field is not a string';
  for (const k of Object.keys(e))
    if (!['code', 'message', 'field', 'details'].includes(k)) return `unknown error key ${k}`;
  return undefined;
}

async function checkWorld(w: World, note: Note): Promise<void> {
  const none: Built = { method: 'GET', url: '(after the run)', key: 'B', headers: {} };
  const now = await stateOfA(w);
  if (now !== w.a.before)
    note('cross-project', '(project A after the run)', none, w.a.before.slice(0, 600), now);
  const principal = await w.api.iam.authenticate(w.keys.B);
  const listed = await w.api.app.inject({
    method: 'GET',
    url: '/v1/sandboxes',
    headers: { authorization: `Bearer ${w.keys.B}` },
  });
  const live = (listed.json<{ sandboxes: { state: string }[] }>().sandboxes ?? []).filter((s) =>
    ['creating', 'running', 'paused'].includes(s.state),
  ).length;
  const usage = await w.api.iam.usage(principal.projectId);
  if (usage.sandboxes !== live)
    note(
      'no-half-created',
      '(project B after the run)',
      none,
      `quota usage of ${live} sandboxes (those listed)`,
      `${usage.sandboxes}`,
    );
}

function describe(req: Built, w: World): FuzzRequest {
  const names: [string, string][] = [
    [w.keys.B, '<key of B>'],
    [w.keys.revoked, '<revoked key>'],
    [w.keys.malformed, '<malformed key>'],
  ];
  const scrub = (s: string) => names.reduce((t, [k, n]) => t.replaceAll(k, n), s);
  const body =
    req.payload === undefined
      ? undefined
      : typeof req.payload === 'string'
        ? req.payload.slice(0, REPORT_BODY_MAX)
        : `<${req.payload.length} bytes>`;
  return {
    method: req.method,
    url: req.url.slice(0, REPORT_BODY_MAX),
    key: req.key,
    headers: Object.fromEntries(Object.entries(req.headers).map(([k, v]) => [k, scrub(v)])),
    ...(body !== undefined ? { body } : {}),
  };
}
