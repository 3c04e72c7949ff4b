import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import type { z } from 'zod';
import { buildOpenApiDocument, openApiPath, operations, routesOf } from './openapi.js';
import {
  CommandEventSchema,
  CommandInfoSchema,
  CommandResultSchema,
  CreatedKeySchema,
  EdgeStatusSchema,
  ErrorBodySchema,
  FileInfoSchema,
  ForkResultSchema,
  HealthSchema,
  JobResultSchema,
  LayerInfoSchema,
  ProjectSchema,
  SandboxInfoSchema,
  SessionResultSchema,
  SnapshotInfoSchema,
  WhoamiSchema,
} from './openapi-schemas.js';
import { committedForm, OPENAPI_DOC_PATH } from './openapi-write.js';
import { API_VERSION } from './server.js';
import { startTestServer } from './testing/index.js';
import type { TestServer } from './testing/index.js';

let server: TestServer;
before(async () => {
  server = await startTestServer();
});
after(() => server.close());

test('docs/openapi.json is the document the schemas generate (else run `npm run openapi`)', async () => {
  const committed = readFileSync(OPENAPI_DOC_PATH, 'utf8');
  const generated = await committedForm();
  assert.ok(
    committed === generated,
    'docs/openapi.json differs from the schemas: run `npm run openapi` and commit the result',
  );
});

test('GET /openapi.json answers the document without a key', async () => {
  const res = await fetch(`${server.url}/openapi.json`);
  assert.equal(res.status, 200);
  assert.match(res.headers.get('content-type') ?? '', /^application\/json/);
  const doc = (await res.json()) as { openapi: string; info: { version: string } };
  assert.deepEqual(doc, buildOpenApiDocument(API_VERSION));
  assert.equal(doc.openapi, '3.1.0');
});

test('every route of the server is in the document, and nothing else is', async () => {
  await server.api.app.ready();
  // HEAD routes fastify adds for GET, and the extra methods of `app.all`, are not API surface.
  const documented = new Set(operations().map((op) => `${op.method.toUpperCase()} ${op.route}`));
  const served = routesOf(server.api.app).filter(
    (r) => !r.startsWith('HEAD ') || r.includes('/ports/'),
  );
  const missing = served.filter(
    (r) => !documented.has(r) && !/^\S+ \/v1\/sandboxes\/:id\/ports\//.test(r),
  );
  assert.deepEqual(missing, [], 'routes without a description in openapi.ts');
  const servedSet = new Set(served);
  const phantom = [...documented].filter(
    (r) => !servedSet.has(r) && r !== 'GET /v1/sandboxes/:id/pty',
  );
  assert.deepEqual(phantom, [], 'described routes the server does not have');
  // The terminal is an HTTP upgrade, outside the router: described with its 101.
  const pty = (buildOpenApiDocument(API_VERSION).paths as Record<string, Record<string, unknown>>)[
    openApiPath('/v1/sandboxes/:id/pty')
  ];
  assert.ok(pty?.get);
  // Every port method is described for both the bare and the deep path.
  for (const route of ['/v1/sandboxes/:id/ports/:port', '/v1/sandboxes/:id/ports/:port/*']) {
    for (const m of ['GET', 'PUT', 'POST', 'DELETE', 'PATCH', 'HEAD', 'OPTIONS']) {
      assert.ok(servedSet.has(`${m} ${route}`), `${m} ${route} served`);
      assert.ok(documented.has(`${m} ${route}`), `${m} ${route} described`);
    }
  }
});

test('path templates', () => {
  assert.equal(openApiPath('/v1/sandboxes/:id/commands/:cid'), '/v1/sandboxes/{id}/commands/{cid}');
  assert.equal(openApiPath('/v1/sandboxes::pause'), '/v1/sandboxes:pause');
  assert.equal(
    openApiPath('/v1/sandboxes/:id/ports/:port/*'),
    '/v1/sandboxes/{id}/ports/{port}/{path}',
  );
});

/**
 * Answers of the real server satisfy their response schemas exactly: parsing
 * must succeed and keep every field (zod drops fields a schema does not
 * name, so a field the server sends but the document lacks shows as a diff).
 */
function conforms(schema: z.ZodTypeAny, body: unknown, what: string): void {
  const r = schema.safeParse(body);
  assert.ok(r.success, `${what}: ${r.success ? '' : JSON.stringify(r.error.issues)}`);
  assert.deepEqual(r.data, body, `${what}: fields outside the schema`);
}

test("the server's answers match the response schemas", async () => {
  const key = server.key;
  const call = async (
    method: string,
    path: string,
    body?: unknown,
    accept = 'application/json',
  ) => {
    const res = await fetch(`${server.url}${path}`, {
      method,
      headers: {
        authorization: `Bearer ${key}`,
        accept,
        ...(body === undefined ? {} : { 'content-type': 'application/json' }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await res.text();
    return {
      status: res.status,
      text,
      json: text ? (JSON.parse(text.split('\n')[0] ?? '') as unknown) : undefined,
    };
  };
  conforms(HealthSchema, (await call('GET', '/healthz')).json, 'health');
  conforms(WhoamiSchema, (await call('GET', '/v1/whoami')).json, 'whoami');
  const created = await call('POST', '/v1/sandboxes', {
    image: 'busybox',
    labels: { job: 'schema' },
    networkAllow: [{ domain: 'example.com', ports: [443] }],
  });
  assert.equal(created.status, 201);
  conforms(SandboxInfoSchema, created.json, 'create');
  const id = (created.json as { id: string }).id;
  conforms(SandboxInfoSchema, (await call('GET', `/v1/sandboxes/${id}`)).json, 'get');
  const list = (await call('GET', '/v1/sandboxes')).json as { sandboxes: unknown[] };
  for (const s of list.sandboxes) conforms(SandboxInfoSchema, s, 'list');
  conforms(
    CommandResultSchema,
    (await call('POST', `/v1/sandboxes/${id}/commands`, { argv: ['echo', 'x'] })).json,
    'run',
  );
  const stream = await call(
    'POST',
    `/v1/sandboxes/${id}/commands`,
    { shell: 'echo y' },
    'application/x-ndjson',
  );
  const events = stream.text
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as unknown);
  for (const e of events) conforms(CommandEventSchema, e, 'ndjson event');
  assert.equal((events.at(-1) as { type: string }).type, 'result');
  const bg = await call('POST', `/v1/sandboxes/${id}/commands`, {
    argv: ['true'],
    background: true,
  });
  assert.equal(bg.status, 202);
  conforms(CommandInfoSchema, bg.json, 'background');
  conforms(
    SessionResultSchema,
    (await call('POST', `/v1/sandboxes/${id}/sessions/s1/run`, { line: 'pwd' })).json,
    'session',
  );
  const put = await fetch(`${server.url}/v1/sandboxes/${id}/files?path=/a.txt`, {
    method: 'PUT',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/octet-stream' },
    body: 'abc',
  });
  conforms(FileInfoSchema, await put.json(), 'write');
  conforms(SandboxInfoSchema, (await call('POST', `/v1/sandboxes/${id}/pause`)).json, 'pause');
  conforms(SandboxInfoSchema, (await call('POST', `/v1/sandboxes/${id}/resume`)).json, 'resume');
  conforms(
    SandboxInfoSchema,
    (await call('POST', `/v1/sandboxes/${id}/timeout`, { seconds: 60 })).json,
    'timeout',
  );
  conforms(
    SnapshotInfoSchema,
    (await call('POST', `/v1/sandboxes/${id}/snapshot`, { name: 'snap-schema' })).json,
    'snapshot',
  );
  conforms(
    ForkResultSchema,
    (await call('POST', `/v1/sandboxes/${id}/fork`, { count: 1 })).json,
    'fork',
  );
  conforms(
    JobResultSchema,
    (await call('POST', '/v1/sandboxes:stop', { labels: { job: 'schema' } })).json,
    'job',
  );
  const layers = (await call('GET', '/v1/images')).json as { layers: unknown[] };
  for (const l of layers.layers) conforms(LayerInfoSchema, l, 'image');
  const edges = (await call('GET', '/v1/edges')).json as { edges: unknown[] };
  assert.ok(edges.edges.length > 0);
  for (const e of edges.edges) conforms(EdgeStatusSchema, e, 'edge');
  const project = await call('POST', '/v1/projects', { name: 'schema-p', quota: { sandboxes: 2 } });
  conforms(ProjectSchema, project.json, 'project');
  const projects = (await call('GET', '/v1/projects')).json as { projects: unknown[] };
  for (const p of projects.projects) conforms(ProjectSchema, p, 'projects');
  conforms(
    CreatedKeySchema,
    (
      await call('POST', '/v1/keys', {
        projectId: (project.json as { id: string }).id,
        scopes: ['sandboxes:snapshot'],
      })
    ).json,
    'key',
  );
  const missing = await call('GET', '/v1/sandboxes/sb-nope');
  assert.equal(missing.status, 404);
  conforms(ErrorBodySchema, missing.json, 'error');
  const invalid = await call('POST', '/v1/sandboxes', { image: 'busybox', memoryLimitMb: 1 });
  assert.equal(invalid.status, 400);
  conforms(ErrorBodySchema, invalid.json, 'error with field');
});
