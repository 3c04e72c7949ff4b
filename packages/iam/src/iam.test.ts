import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { Iam } from './index.js';

function withDir(t: { after: (fn: () => void) => void }): string {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-iam-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  return dir;
}

function fresh() {
  const iam = Iam.open({ path: ':memory:' });
  const boot = iam.bootstrap();
  const root = iam.authenticate(boot.key);
  return { iam, root, boot };
}

test('bootstrap creates one root and one admin key, once', () => {
  const { iam, root, boot } = fresh();
  assert.equal(boot.created, true);
  assert.match(boot.key!, /^dsk_/);
  assert.equal(root.role, 'admin');
  assert.equal(root.projectId, boot.projectId);
  const again = iam.bootstrap();
  assert.equal(again.created, false);
  assert.equal(again.key, undefined);
  assert.equal(again.projectId, boot.projectId);
  iam.close();
});

test('authenticate rejects malformed, unknown and revoked keys', () => {
  const { iam, root } = fresh();
  const unauth = (e: unknown) => isDsecError(e, 'unauthenticated');
  assert.throws(() => iam.authenticate(undefined), unauth);
  assert.throws(() => iam.authenticate('nope'), unauth);
  assert.throws(() => iam.authenticate('dsk_' + 'A'.repeat(43)), unauth);
  const k = iam.createKey(root, { projectId: root.projectId, role: 'member' });
  assert.equal(iam.authenticate(k.key).keyId, k.id);
  iam.revokeKey(root, k.id);
  assert.throws(() => iam.authenticate(k.key), unauth);
  const denials = iam.listAudit().filter((a) => a.action === 'auth' && a.outcome === 'denied');
  assert.equal(denials.length, 4);
  iam.close();
});

test('nested projects: access flows down, quota bounded by the parent', () => {
  const { iam, root } = fresh();
  const a = iam.createProject(root, { name: 'a', quota: { sandboxes: 10, memoryMb: 4096 } });
  const aAdmin = iam.authenticate(iam.createKey(root, { projectId: a.id, role: 'admin' }).key);
  const a1 = iam.createProject(aAdmin, { name: 'a1', quota: { sandboxes: 5 } });
  const a11 = iam.createProject(aAdmin, { name: 'a11', parentId: a1.id });
  assert.ok(iam.canAccess(aAdmin, a11.id));
  assert.ok(iam.canAccess(root, a11.id));
  assert.ok(!iam.canAccess(aAdmin, root.projectId));
  // a11 inherits a1's limit of 5, so asking for 6 anywhere below a1 is refused.
  assert.throws(
    () => iam.createProject(aAdmin, { name: 'x', parentId: a11.id, quota: { sandboxes: 6 } }),
    (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.sandboxes',
  );
  assert.throws(
    () => iam.createProject(aAdmin, { name: 'y', quota: { memoryMb: 5000 } }),
    (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.memoryMb',
  );
  const b = iam.createProject(root, { name: 'b' });
  assert.throws(
    () => iam.createProject(aAdmin, { name: 'z', parentId: b.id }),
    (e) => isDsecError(e, 'not_found'),
  );
  assert.deepEqual(
    iam.listProjects(aAdmin).map((p) => p.name),
    ['a', 'a1', 'a11'],
  );
  const denied = iam
    .listAudit()
    .filter((e) => e.outcome === 'denied' && e.action === 'project.create');
  assert.equal(denied.length, 3);
  iam.close();
});

test('members cannot create projects or grant admin; keys only in own subtree', () => {
  const { iam, root } = fresh();
  const a = iam.createProject(root, { name: 'a' });
  const b = iam.createProject(root, { name: 'b' });
  const member = iam.authenticate(iam.createKey(root, { projectId: a.id, role: 'member' }).key);
  assert.throws(
    () => iam.createProject(member, { name: 'm' }),
    (e) => isDsecError(e, 'permission_denied'),
  );
  assert.throws(
    () => iam.createKey(member, { projectId: a.id, role: 'admin' }),
    (e) => isDsecError(e, 'permission_denied') && e.field === 'role',
  );
  assert.throws(
    () => iam.createKey(member, { projectId: b.id }),
    (e) => isDsecError(e, 'not_found'),
  );
  const sibling = iam.createKey(member, { projectId: a.id, role: 'member' });
  assert.equal(sibling.role, 'member');
  const adminOfA = iam.createKey(root, { projectId: a.id, role: 'admin' });
  assert.throws(
    () => iam.revokeKey(member, adminOfA.id),
    (e) => isDsecError(e, 'permission_denied'),
  );
  iam.close();
});

test('reserve checks every ancestor over its subtree; release frees', () => {
  const { iam, root } = fresh();
  const a = iam.createProject(root, { name: 'a', quota: { sandboxes: 3, cpuCores: 0.3 } });
  const a1 = iam.createProject(root, { name: 'a1', parentId: a.id });
  const a2 = iam.createProject(root, { name: 'a2', parentId: a.id });
  iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's1');
  iam.reserve(a2.id, { memoryMb: 1, cpuCores: 0.1 }, 's2');
  iam.reserve(a2.id, { memoryMb: 1, cpuCores: 0.1 }, 's3'); // 0.1+0.1+0.1 is exactly 0.3
  assert.throws(
    () => iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0 }, 's4'),
    (e) =>
      isDsecError(e, 'quota_exceeded') &&
      e.details?.['projectId'] === a.id &&
      e.details['resource'] === 'sandboxes',
  );
  assert.deepEqual(iam.usage(a.id), { sandboxes: 3, memoryMb: 3, cpuCores: 0.3 });
  assert.equal(iam.release('s2'), true);
  assert.equal(iam.release('s2'), false);
  iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's4');
  assert.throws(
    () => iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's5'),
    (e) => isDsecError(e, 'quota_exceeded'),
  );
  assert.ok(iam.listAudit().some((e) => e.action === 'quota.reserve' && e.outcome === 'denied'));
  iam.close();
});

test('pending reservations lapse; bound ones live until the sandbox expires', () => {
  let now = 1_000_000;
  const iam = Iam.open({ path: ':memory:', now: () => now, pendingTtlMs: 1000, expiryGraceMs: 0 });
  const root = iam.authenticate(iam.bootstrap().key);
  const p = iam.createProject(root, { name: 'p', quota: { sandboxes: 1 } });
  iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-a');
  now += 1001;
  iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-b');
  iam.bindReservation('rsv-b', 'sb-b', { expiresAt: now + 5000 });
  now += 2000;
  assert.equal(iam.reservationProject('sb-b'), p.id);
  assert.throws(
    () => iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-c'),
    (e) => isDsecError(e, 'quota_exceeded'),
  );
  now += 3001;
  iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-c');
  iam.close();
});

test('idempotency claims: claimed, pending, done, abandoned', () => {
  const { iam, root } = fresh();
  assert.deepEqual(iam.claimRequest(root.projectId, 'r1', 'h1'), { state: 'claimed' });
  assert.deepEqual(iam.claimRequest(root.projectId, 'r1', 'h2'), { state: 'pending' });
  iam.abandonRequest(root.projectId, 'r1', 'h1');
  assert.deepEqual(iam.claimRequest(root.projectId, 'r1', 'h2'), { state: 'claimed' });
  iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 1 }, 'h2');
  iam.bindReservation('h2', 'sb-1', { expiresAt: Date.now() + 60_000, requestId: 'r1' });
  assert.deepEqual(iam.claimRequest(root.projectId, 'r1', 'h3'), {
    state: 'done',
    sandboxId: 'sb-1',
  });
  iam.close();
});

test('state survives reopen; raw keys are never stored', (t) => {
  const dir = withDir(t);
  const path = join(dir, 'iam.db');
  let iam = Iam.open({ path });
  const boot = iam.bootstrap();
  const root = iam.authenticate(boot.key);
  const p = iam.createProject(root, { name: 'team', quota: { memoryMb: 1024 } });
  const k = iam.createKey(root, { projectId: p.id, role: 'member', name: 'ci' });
  iam.reserve(p.id, { memoryMb: 512, cpuCores: 1 }, 'sb-x');
  iam.close();

  iam = Iam.open({ path });
  assert.equal(iam.bootstrap().created, false);
  assert.equal(iam.authenticate(k.key).projectId, p.id);
  assert.deepEqual(iam.getProject(root, p.id).quota, { memoryMb: 1024 });
  assert.equal(iam.usage(p.id).memoryMb, 512);
  iam.close();

  for (const f of readdirSync(dir)) {
    const bytes = readFileSync(join(dir, f)).toString('latin1');
    assert.ok(!bytes.includes(boot.key!), `raw key found in ${f}`);
    assert.ok(!bytes.includes(k.key), `raw key found in ${f}`);
  }
});
