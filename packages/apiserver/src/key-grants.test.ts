import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createTestApi } from './testing/index.js';
import type { TestApi } from './testing/index.js';

// Issue 24 point 3, through the real HTTP path (a listening socket, not inject()): a run pattern
// that a backtracking RegExp takes hours over, and a member granting itself metrics:read.

type T = { after: (fn: () => Promise<void> | void) => void };

async function listening(
  t: T,
  options: Parameters<typeof createTestApi>[0] = {},
): Promise<{ a: TestApi; call: Call }> {
  const a = await createTestApi(options);
  t.after(() => a.close());
  await a.app.listen({ host: '127.0.0.1', port: 0 });
  const { port } = a.app.server.address() as AddressInfo;
  const call: Call = async (method, path, key, body) => {
    const res = await fetch(`http://127.0.0.1:${port}${path}`, {
      method,
      headers: {
        ...(key ? { authorization: `Bearer ${key}` } : {}),
        ...(body === undefined ? {} : { 'content-type': 'application/json' }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await res.text();
    const json: unknown = res.headers.get('content-type')?.includes('json')
      ? JSON.parse(text)
      : undefined;
    return { status: res.status, body: json as Json, text };
  };
  return { a, call };
}

type Json = Record<string, any>; // eslint-disable-line @typescript-eslint/no-explicit-any
type Call = (
  method: 'GET' | 'POST' | 'DELETE',
  path: string,
  key?: string,
  body?: unknown,
) => Promise<{ status: number; body: Json; text: string }>;

async function tenantMember(a: TestApi, call: Call, name: string) {
  const p = await call('POST', '/v1/projects', a.rootKey, { name });
  assert.equal(p.status, 201, p.text);
  const k = await call('POST', '/v1/keys', a.rootKey, { projectId: p.body.id, role: 'member' });
  assert.equal(k.status, 201, k.text);
  return { projectId: p.body.id as string, key: k.body.key as string };
}

const REDOS = 'images:run:a*a*a*a*a*a*a*a*b';
const LONG = 'a'.repeat(120);

test('a key with an eight-star pattern and a 120-character image name answers at once', async (t) => {
  const { a, call } = await listening(t);
  const tenant = await tenantMember(a, call, 'redos');
  // Any unscoped member may mint the pattern (it is within the wildcard cap)...
  const evil = await call('POST', '/v1/keys', tenant.key, {
    projectId: tenant.projectId,
    scopes: [REDOS],
  });
  assert.equal(evil.status, 201, evil.text);
  // ...and its create is refused like any other image it may not run, not stuck.
  const create = await call('POST', '/v1/sandboxes', evil.body.key, { image: LONG });
  assert.equal(create.status, 403, create.text);
  assert.equal(create.body.error.code, 'permission_denied');
  assert.equal(create.body.error.field, 'image');
  // The same through every layer slot and with a long version too.
  const layers = await call('POST', '/v1/sandboxes', evil.body.key, {
    image: `${'a'.repeat(119)}b`,
    workspace: `${LONG}:${'a'.repeat(120)}`,
    toolkits: Array.from({ length: 32 }, () => 'a'.repeat(128)),
  });
  assert.equal(layers.status, 403, layers.text);
  assert.equal(layers.body.error.field, 'workspace');
  // Granting from it matches its pattern against the wanted one: also at once.
  const grant = await call('POST', '/v1/keys', evil.body.key, {
    projectId: tenant.projectId,
    scopes: [`images:run:${LONG}`, `images:run:${LONG}*`],
  });
  assert.equal(grant.status, 403, grant.text);
  assert.equal(grant.body.error.field, 'scopes');
  // The server is still answering everyone.
  assert.equal((await call('GET', '/healthz')).status, 200);
  // A pattern past the cap is refused at creation, naming the entry.
  const over = await call('POST', '/v1/keys', tenant.key, {
    projectId: tenant.projectId,
    scopes: ['sandboxes:snapshot', `images:run:${'a*'.repeat(9)}b`],
  });
  assert.equal(over.status, 400, over.text);
  assert.equal(over.body.error.code, 'invalid_argument');
  assert.equal(over.body.error.field, 'scopes.1');
});

test('a root-project member cannot grant itself metrics:read (403, audited)', async (t) => {
  const { a, call } = await listening(t);
  const member = await call('POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    role: 'member',
  });
  assert.equal(member.status, 201, member.text);
  assert.equal((await call('GET', '/metrics', member.body.key)).status, 403);
  const self = await call('POST', '/v1/keys', member.body.key, {
    projectId: a.rootProjectId,
    role: 'member',
    scopes: ['metrics:read'],
  });
  assert.equal(self.status, 403, self.text);
  assert.equal(self.body.error.code, 'permission_denied');
  assert.equal(self.body.error.field, 'scopes');
  assert.deepEqual(self.body.error.details, { scopes: ['metrics:read'] });
  const audit = (await a.iam.listAudit()).find(
    (e) => e.action === 'key.create' && e.actorKeyId === member.body.id,
  );
  assert.equal(audit?.outcome, 'denied');
  assert.deepEqual(audit?.details?.['ungrantable'], ['metrics:read']);
  // No key came of it, and the member still reads no metrics.
  const keys = await a.iam.listKeys(await a.iam.authenticate(a.rootKey));
  assert.ok(!keys.some((k) => (k.scopes ?? []).includes('metrics:read')));
  assert.equal((await call('GET', '/metrics', member.body.key)).status, 403);
  // The root admin may make a monitoring key, which then may pass on only that.
  const monitor = await call('POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    scopes: ['metrics:read'],
  });
  assert.equal(monitor.status, 201, monitor.text);
  assert.equal((await call('GET', '/metrics', monitor.body.key)).status, 200);
  const wider = await call('POST', '/v1/keys', monitor.body.key, {
    projectId: a.rootProjectId,
    scopes: ['metrics:read', 'images:run:*'],
  });
  assert.equal(wider.status, 403, wider.text);
});

test('a key revoked on one apiserver mints no key on another that still trusts it', async (t) => {
  // Two apiservers over one control database; b has seen the key and trusts it from memory
  // (`authCacheTtlMs`, long here so the test does not race the clock; 1 s by default). A key
  // it mints in that window would outlive the revocation for good.
  const dir = mkdtempSync(join(tmpdir(), 'dsec-rev1-keys-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const iamPath = join(dir, 'control.db');
  const { a, call } = await listening(t, { iamPath });
  const { call: callB } = await listening(t, { iamPath, authCacheTtlMs: 600_000 });
  const tenant = await call('POST', '/v1/projects', a.rootKey, { name: 'leaky' });
  const leaked = await call('POST', '/v1/keys', a.rootKey, {
    projectId: tenant.body.id,
    role: 'admin',
  });
  assert.equal(leaked.status, 201, leaked.text);
  assert.equal((await callB('GET', '/v1/whoami', leaked.body.key)).status, 200);
  assert.equal((await call('DELETE', `/v1/keys/${leaked.body.id}`, a.rootKey)).status, 204);
  assert.equal((await call('GET', '/v1/whoami', leaked.body.key)).status, 401);
  for (const body of [
    { projectId: tenant.body.id, role: 'admin' },
    { projectId: tenant.body.id, scopes: ['images:run:*'] },
  ]) {
    const minted = await callB('POST', '/v1/keys', leaked.body.key, body);
    assert.equal(minted.status, 401, minted.text);
    assert.equal(minted.body.error.code, 'unauthenticated');
  }
  const keys = await a.iam.listKeys(await a.iam.authenticate(a.rootKey));
  assert.ok(!keys.some((k) => k.projectId === tenant.body.id && k.revokedAt === null));
});

test('a narrow key cannot revoke the monitoring key, whose metrics:read it lacks', async (t) => {
  // The scoped-revocation rule keeps a runtime key handed to a trainer from taking its project's
  // wider keys away; a monitoring key is wider by the right it adds. Revoking what it could not
  // have granted is refused, as granting it is.
  const { a, call } = await listening(t);
  const monitor = await call('POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    scopes: ['metrics:read'],
  });
  const runtime = await call('POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    scopes: ['images:run:task-*'],
  });
  assert.equal(runtime.status, 201, runtime.text);
  const revoke = await call('DELETE', `/v1/keys/${monitor.body.id}`, runtime.body.key);
  assert.equal(revoke.status, 403, revoke.text);
  assert.equal(revoke.body.error.code, 'permission_denied');
  assert.equal((await call('GET', '/metrics', monitor.body.key)).status, 200);
  // A scoped admin of the root project grants it (it reads metrics by role), so it may revoke it.
  const scopedAdmin = await call('POST', '/v1/keys', a.rootKey, {
    projectId: a.rootProjectId,
    role: 'admin',
    scopes: ['images:run:task-*'],
  });
  const byAdmin = await call('DELETE', `/v1/keys/${monitor.body.id}`, scopedAdmin.body.key);
  assert.equal(byAdmin.status, 204, byAdmin.text);
  assert.equal((await call('GET', '/metrics', monitor.body.key)).status, 401);
});
