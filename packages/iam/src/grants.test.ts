import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import { isDsecError } from '@dsec/core';
import { mayRunImage, openControlDb } from './index.js';
import type { Iam, Principal } from './index.js';

// Issue 24 point 3 / SECURITY.md G34: a key grants only rights it holds. Each test is one
// escalation an attacker holding some key would try.

type T = { after: (fn: () => Promise<void> | void) => void };

async function setup(t: T, location = ':memory:') {
  const db = await openControlDb(location);
  t.after(() => db.close());
  const { iam } = db;
  const root = await iam.authenticate((await iam.bootstrap()).key);
  const keyOf = async (
    caller: Principal,
    input: Parameters<Iam['createKey']>[1],
  ): Promise<Principal> => iam.authenticate((await iam.createKey(caller, input)).key);
  return { iam, root, keyOf };
}

const denied = (field?: string) => (e: unknown) =>
  isDsecError(e, 'permission_denied') && (field === undefined || e.field === field);

async function deniedAudits(iam: Iam, actor: string, action: string) {
  return (await iam.listAudit({ limit: 1000 })).filter(
    (a) => a.actorKeyId === actor && a.action === action && a.outcome === 'denied',
  );
}

test('a root-project member cannot mint itself metrics:read, and the attempt is audited', async (t) => {
  const { iam, root, keyOf } = await setup(t);
  const member = await keyOf(root, { projectId: root.projectId, role: 'member' });
  for (const scopes of [
    ['metrics:read'],
    ['images:run:*', 'metrics:read'],
    ['sandboxes:snapshot', 'images:run:*', 'metrics:read'],
  ]) {
    await assert.rejects(
      iam.createKey(member, { projectId: root.projectId, role: 'member', scopes }),
      (e) =>
        denied('scopes')(e) &&
        JSON.stringify((e as { details?: unknown }).details) ===
          JSON.stringify({ scopes: ['metrics:read'] }),
    );
  }
  const audits = await deniedAudits(iam, member.keyId, 'key.create');
  // Denials are audited aggregated: one row per group and minute, with its count.
  assert.equal(
    audits.reduce((n, a) => n + Number(a.details?.['count'] ?? 1), 0),
    3,
  );
  assert.deepEqual(audits[0]?.details?.['ungrantable'], ['metrics:read']);
  // Nor through a child project it may make keys in: the right is not its to hand down.
  const child = await iam.createProject(root, { name: 'child' });
  await assert.rejects(
    iam.createKey(member, { projectId: child.id, scopes: ['metrics:read'] }),
    denied('scopes'),
  );
  // Restrictive scopes it holds (unscoped: all of them) it may still grant.
  const runtime = await keyOf(member, { projectId: root.projectId, scopes: ['images:run:t-*'] });
  assert.deepEqual(runtime.scopes, ['images:run:t-*']);
});

test('metrics:read comes from a root admin (scoped or not) or a holder, nobody else', async (t) => {
  const { iam, root, keyOf } = await setup(t);
  const monitor = await keyOf(root, { projectId: root.projectId, scopes: ['metrics:read'] });
  // A holder may pass it on (its own right, nothing more).
  const second = await keyOf(monitor, { projectId: root.projectId, scopes: ['metrics:read'] });
  assert.deepEqual(second.scopes, ['metrics:read']);
  await assert.rejects(
    iam.createKey(monitor, { projectId: root.projectId, scopes: ['metrics:read', 'images:run:*'] }),
    denied('scopes'),
  );
  // A scoped admin of the root project reads metrics by role, so it may grant the scope.
  const scopedRootAdmin = await keyOf(root, {
    projectId: root.projectId,
    role: 'admin',
    scopes: ['images:run:task-*'],
  });
  const fromScopedAdmin = await keyOf(scopedRootAdmin, {
    projectId: root.projectId,
    scopes: ['metrics:read', 'images:run:task-1'],
  });
  assert.deepEqual(fromScopedAdmin.scopes, ['metrics:read', 'images:run:task-1']);
  // An admin of a tenant project is not an admin of the root: it may not.
  const tenant = await iam.createProject(root, { name: 'tenant' });
  const tenantAdmin = await keyOf(root, { projectId: tenant.id, role: 'admin' });
  await assert.rejects(
    iam.createKey(tenantAdmin, { projectId: tenant.id, scopes: ['metrics:read'] }),
    denied('scopes'),
  );
  const nested = await iam.createProject(tenantAdmin, { name: 'nested' });
  const nestedAdmin = await keyOf(tenantAdmin, { projectId: nested.id, role: 'admin' });
  await assert.rejects(
    iam.createKey(nestedAdmin, { projectId: nested.id, scopes: ['metrics:read'] }),
    denied('scopes'),
  );
  assert.equal((await deniedAudits(iam, tenantAdmin.keyId, 'key.create')).length, 1);
});

test('roles: a member makes no admin key, anywhere; no key reaches outside its subtree', async (t) => {
  const { iam, root, keyOf } = await setup(t);
  const a = await iam.createProject(root, { name: 'a' });
  const a1 = await iam.createProject(root, { name: 'a1', parentId: a.id });
  const b = await iam.createProject(root, { name: 'b' });
  const aMember = await keyOf(root, { projectId: a.id, role: 'member' });
  const aAdmin = await keyOf(root, { projectId: a.id, role: 'admin' });
  for (const projectId of [a.id, a1.id]) {
    await assert.rejects(
      iam.createKey(aMember, { projectId, role: 'admin' }),
      denied('role'),
      projectId,
    );
  }
  // Not the parent, not a sibling, not an unknown project: not_found, never a hint.
  for (const caller of [aMember, aAdmin]) {
    for (const projectId of [root.projectId, b.id, 'prj-nonexistent']) {
      await assert.rejects(
        iam.createKey(caller, { projectId, role: 'member' }),
        (e) => isDsecError(e, 'not_found') && e.field === 'projectId',
      );
    }
  }
  // A member makes no project (so no quota, no place to hang new rights).
  await assert.rejects(iam.createProject(aMember, { name: 'x' }), denied());
  await assert.rejects(iam.createProject(aMember, { name: 'x', parentId: a1.id }), denied());
  // An admin of a grants admin below itself only.
  const a1Admin = await keyOf(aAdmin, { projectId: a1.id, role: 'admin' });
  assert.equal(a1Admin.role, 'admin');
  await assert.rejects(iam.createKey(a1Admin, { projectId: a.id }), (e) =>
    isDsecError(e, 'not_found'),
  );
  // A role outside the ranks is refused before anything is written.
  for (const role of ['root', 'owner', '__proto__', 'toString']) {
    await assert.rejects(
      iam.createKey(aAdmin, { projectId: a.id, role: role as never }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'role',
      role,
    );
  }
  const keys = await iam.listKeys(root);
  assert.ok(keys.every((k) => k.role === 'admin' || k.role === 'member'));
});

test('a scoped key never widens: no unscoped key, no wider pattern, no extra scope', async (t) => {
  const { iam, root, keyOf } = await setup(t);
  const tenant = await iam.createProject(root, { name: 'tenant' });
  const runtime = await keyOf(root, {
    projectId: tenant.id,
    role: 'admin',
    scopes: ['images:run:task-*'],
  });
  for (const scopes of [
    undefined,
    ['images:run:*'],
    ['images:run:task*'],
    ['images:run:*-*'],
    ['images:run:task-*', 'sandboxes:snapshot'],
    ['metrics:read'],
  ]) {
    await assert.rejects(
      iam.createKey(runtime, { projectId: tenant.id, ...(scopes ? { scopes } : {}) }),
      denied('scopes'),
      JSON.stringify(scopes),
    );
  }
  // Down the tree the key is no wider than at home.
  const child = await iam.createProject(runtime, { name: 'child' });
  await assert.rejects(
    iam.createKey(runtime, { projectId: child.id, scopes: ['images:run:*'] }),
    denied('scopes'),
  );
  const narrower = await keyOf(runtime, { projectId: child.id, scopes: ['images:run:task-7:v*'] });
  assert.ok(mayRunImage(narrower, 'task-7:v2'));
  assert.ok(!mayRunImage(narrower, 'task-7:latest'));
  // A grandchild of the narrower key is narrower still.
  await assert.rejects(
    iam.createKey(narrower, { projectId: child.id, scopes: ['images:run:task-7'] }),
    denied('scopes'),
  );
});

test('a scoped key cannot revoke the wider keys of its project; it may revoke itself', async (t) => {
  const { iam, root, keyOf } = await setup(t);
  const tenant = await iam.createProject(root, { name: 'tenant' });
  const ci = await iam.createKey(root, { projectId: tenant.id, role: 'member', name: 'ci' });
  const builder = await iam.createKey(root, {
    projectId: tenant.id,
    scopes: ['sandboxes:snapshot', 'images:run:*'],
  });
  const runtime = await keyOf(root, { projectId: tenant.id, scopes: ['images:run:task-*'] });
  await assert.rejects(iam.revokeKey(runtime, ci.id), denied());
  await assert.rejects(iam.revokeKey(runtime, builder.id), denied());
  assert.equal((await deniedAudits(iam, runtime.keyId, 'key.revoke')).length, 2);
  const narrower = await iam.createKey(runtime, {
    projectId: tenant.id,
    scopes: ['images:run:task-1'],
  });
  await iam.revokeKey(runtime, narrower.id);
  await iam.revokeKey(runtime, runtime.keyId);
  const listed = await iam.listKeys(root);
  assert.equal(listed.find((k) => k.id === ci.id)?.revokedAt, null);
  assert.notEqual(listed.find((k) => k.id === runtime.keyId)?.revokedAt, null);
  // An unscoped member still revokes a scoped member key (it holds every restrictive right).
  const member = await keyOf(root, { projectId: tenant.id, role: 'member' });
  await iam.revokeKey(member, builder.id);
});

test('wildcards are capped at creation; a stored key with more still matches at once', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-grants-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const location = join(dir, 'iam.db');
  const { iam, root } = await setup(t, location);
  await assert.rejects(
    iam.createKey(root, {
      projectId: root.projectId,
      scopes: ['sandboxes:snapshot', `images:run:${'a*'.repeat(9)}b`],
    }),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'scopes.1',
  );
  // A key written before the cap (here: by hand) with 40 stars is matched in linear time.
  const legacy = await iam.createKey(root, { projectId: root.projectId, scopes: ['images:run:x'] });
  const raw = new Database(location);
  raw
    .prepare('UPDATE api_keys SET scopes = ? WHERE id = ?')
    .run(JSON.stringify([`images:run:${'a*'.repeat(40)}b`]), legacy.id);
  raw.close();
  const fresh = await openControlDb(location, { authCacheTtlMs: 0 });
  t.after(() => fresh.close());
  const p = await fresh.iam.authenticate(legacy.key);
  assert.equal(mayRunImage(p, 'a'.repeat(128)), false);
  assert.equal(mayRunImage(p, `${'a'.repeat(39)}b`), false, 'forty stars need forty a');
  assert.equal(mayRunImage(p, `${'a'.repeat(127)}b`), true);
  assert.equal(mayRunImage(p, `${'a'.repeat(40)}b`), true);
  // And the same key granting: the held pattern is matched against the wanted one, also linear.
  await assert.rejects(
    fresh.iam.createKey(p, {
      projectId: root.projectId,
      scopes: [`images:run:${'a'.repeat(120)}`],
    }),
    denied('scopes'),
  );
});

test('a revoked key mints no key: not while another instance still trusts it, nor racing its revocation', async (t) => {
  // Two instances (two apiservers) over one database. Instance b has looked the key up and trusts
  // it for `authCacheTtlMs` (here long, so the test does not race the clock); on a single
  // instance the same holds for a request that authenticated just before the revocation
  // committed. A key minted then would outlive the revocation for good.
  const dir = mkdtempSync(join(tmpdir(), 'dsec-rev1-revoked-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const file = join(dir, 'control.db');
  const { iam: a, root } = await setup(t, file);
  const other = await openControlDb(file, { authCacheTtlMs: 600_000 });
  t.after(() => other.close());
  const b = other.iam;
  const tenant = await a.createProject(root, { name: 'tenant' });
  const leaked = await a.createKey(root, { projectId: tenant.id, role: 'admin' });
  const onB = await b.authenticate(leaked.key); // cached on b from now on
  const onA = await a.authenticate(leaked.key); // a request in flight on a
  await a.revokeKey(root, leaked.id);
  await assert.rejects(a.authenticate(leaked.key), (e) => isDsecError(e, 'unauthenticated'));
  assert.deepEqual(await b.authenticate(leaked.key), onB, 'b still trusts it (its cache)');
  const before = (await a.listKeys(root)).length;
  for (const [iam, caller] of [
    [b, onB],
    [a, onA],
  ] as const) {
    await assert.rejects(iam.createKey(caller, { projectId: tenant.id, role: 'admin' }), (e) =>
      isDsecError(e, 'unauthenticated'),
    );
    await assert.rejects(
      iam.createKey(caller, { projectId: tenant.id, scopes: ['images:run:x'] }),
      (e) => isDsecError(e, 'unauthenticated'),
    );
  }
  assert.equal((await a.listKeys(root)).length, before, 'no key came of it');
  // Nor does it revoke the keys its revoker left (the tenant's other admin).
  const other2 = await a.createKey(root, { projectId: tenant.id, role: 'admin' });
  await assert.rejects(b.revokeKey(onB, other2.id), (e) => isDsecError(e, 'unauthenticated'));
  assert.equal((await a.listKeys(root)).find((k) => k.id === other2.id)?.revokedAt, null);
  assert.ok(
    (await a.listAudit({ limit: 1000 })).some(
      (e) => e.actorKeyId === leaked.id && e.action === 'key.create' && e.outcome === 'denied',
    ),
    'the attempt is audited',
  );
});
