import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError, randomId } from '@dsec/core';
import { openControlDb } from '../control-db.js';
import { MAX_PROJECT_DEPTH } from '../iam.js';
import type { ControlDbOptions } from '../control-db.js';
import { PostgresDb } from '../db/drivers/postgres.js';
import { SqliteDb } from '../db/drivers/sqlite.js';
import { migrate, SCHEMA_VERSION } from '../db/migrations.js';
import type { SqlDb } from '../db/sql.js';
import { requestFingerprint } from '../fingerprint.js';

export interface ControlDbFixture {
  /** Where a fresh, empty control database is: a SQLite file path or a PostgreSQL URL. */
  fresh(): Promise<string>;
}

type TestContext = { after: (fn: () => Promise<void> | void) => void };

const SECRET = 's'.repeat(43);

/**
 * The contract every control-database store meets, run against one store
 * (`fixture`): migrations, IAM (bootstrap, keys, projects, quotas,
 * idempotency, audit, the authentication cache) and the edge registry, with
 * several instances on one database standing for several apiservers, each
 * with its own connections. Every database an instance opens is closed when
 * its test ends, passed or failed.
 */
export function controlDbConformance(name: string, fixture: ControlDbFixture): void {
  const open = async (t: TestContext, location: string, options: ControlDbOptions = {}) => {
    const db = await openControlDb(location, options);
    t.after(() => db.close());
    return db;
  };
  const fresh = async (t: TestContext, options: ControlDbOptions = {}) => {
    const location = await fixture.fresh();
    const db = await open(t, location, options);
    const boot = await db.iam.bootstrap();
    const root = await db.iam.authenticate(boot.key);
    return { db, iam: db.iam, root, boot, location };
  };

  describe(`control database conformance: ${name}`, () => {
    test('migrations: a fresh database is at the newest version; reopening runs nothing', async (t) => {
      const location = await fixture.fresh();
      await open(t, location);
      const raw = rawDb(location);
      t.after(() => raw.close());
      const versions = await raw.all<{ version: number }>(
        'SELECT version FROM schema_migrations ORDER BY version',
      );
      assert.deepEqual(
        versions.map((v) => v.version),
        Array.from({ length: SCHEMA_VERSION }, (_, i) => i + 1),
      );
      assert.deepEqual(await migrate(raw), { from: SCHEMA_VERSION, to: SCHEMA_VERSION });
      // A database from a newer release is refused rather than half understood.
      await raw.run('INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)', [
        SCHEMA_VERSION + 1,
        'from the future',
        new Date().toISOString(),
      ]);
      await assert.rejects(openControlDb(location), (e) => isDsecError(e, 'internal'));
    });

    test('migrations: instances opening a fresh database at once migrate it once', async (t) => {
      const location = await fixture.fresh();
      const dbs = await Promise.all([1, 2, 3].map(() => open(t, location)));
      assert.equal(dbs.length, 3);
      const raw = rawDb(location);
      t.after(() => raw.close());
      const rows = await raw.all<{ n: number }>('SELECT COUNT(*) AS n FROM schema_migrations');
      assert.equal(rows[0]?.n, SCHEMA_VERSION);
    });

    test('bootstrap creates one root and one admin key, once, even from instances at once', async (t) => {
      const location = await fixture.fresh();
      const dbs = await Promise.all([1, 2, 3].map(() => open(t, location)));
      const boots = await Promise.all(dbs.map((db) => db.iam.bootstrap()));
      const created = boots.filter((b) => b.created);
      assert.equal(created.length, 1);
      assert.match(created[0]?.key ?? '', /^dsk_/);
      assert.equal(new Set(boots.map((b) => b.projectId)).size, 1);
      for (const b of boots.filter((x) => !x.created)) assert.equal(b.key, undefined);
      const root = await dbs[1]!.iam.authenticate(created[0]?.key);
      assert.equal(root.role, 'admin');
      assert.equal(root.projectId, created[0]?.projectId);
      assert.equal((await dbs[2]!.iam.bootstrap()).created, false);
    });

    test('authenticate rejects malformed, unknown and revoked keys, and audits each', async (t) => {
      const { iam, root } = await fresh(t);
      const unauth = (e: unknown) => isDsecError(e, 'unauthenticated');
      await assert.rejects(iam.authenticate(undefined), unauth);
      await assert.rejects(iam.authenticate('nope'), unauth);
      await assert.rejects(iam.authenticate('dsk_' + 'A'.repeat(43)), unauth);
      const k = await iam.createKey(root, { projectId: root.projectId, role: 'member' });
      assert.equal((await iam.authenticate(k.key)).keyId, k.id);
      // Cached now; revoking through this same instance still takes effect at once.
      await iam.revokeKey(root, k.id);
      await assert.rejects(iam.authenticate(k.key), unauth);
      const denials = (await iam.listAudit()).filter(
        (a) => a.action === 'auth' && a.outcome === 'denied',
      );
      assert.equal(denials.length, 4);
    });

    // SECURITY J38: a failed authentication costs the node no database write of its own.
    test('failed authentications are audited aggregated per source and minute', async (t) => {
      let now = Date.parse('2026-12-01T10:00:05Z');
      const { iam } = await fresh(t, { now: () => now, authFailureBurst: 10_000 });
      const before = (await iam.listAudit({ limit: 1000 })).length;
      const bogus = () => 'dsk_' + randomId('x', 30).slice(2, 45).padEnd(43, 'A');
      const unauth = (e: unknown) => isDsecError(e, 'unauthenticated');
      for (let i = 0; i < 200; i++) {
        await assert.rejects(iam.authenticate(bogus(), { source: '203.0.113.7' }), unauth);
      }
      for (let i = 0; i < 30; i++) {
        await assert.rejects(iam.authenticate('nope', { source: '203.0.113.7' }), unauth);
        await assert.rejects(iam.authenticate(bogus(), { source: '198.51.100.1' }), unauth);
      }
      now += 60_000; // the next minute: a group of its own
      await assert.rejects(iam.authenticate(bogus(), { source: '203.0.113.7' }), unauth);
      const rows = (await iam.listAudit({ limit: 1000 })).filter(
        (e) => e.action === 'auth' && e.outcome === 'denied',
      );
      assert.equal((await iam.listAudit({ limit: 1000 })).length, before + rows.length);
      const count = (source: string, reason: string) =>
        rows
          .filter((r) => r.target === source && r.details?.['reason'] === reason)
          .map((r) => r.details?.['count']);
      // One row per source, reason and minute, each with its count.
      assert.equal(rows.length, 4, JSON.stringify(rows));
      assert.deepEqual(count('203.0.113.7', 'unknown').sort(), [1, 200]);
      assert.deepEqual(count('203.0.113.7', 'malformed'), [30]);
      assert.deepEqual(count('198.51.100.1', 'unknown'), [30]);
      assert.ok(!JSON.stringify(rows).includes('dsk_'), 'a key in the audit log');
      assert.equal(iam.authStats().failures['unknown'], 231);
      assert.equal(iam.authStats().failures['malformed'], 30);
    });

    test('a minute keeps a bounded number of denial groups; the rest is one overflow row', async (t) => {
      const { iam } = await fresh(t, {
        now: () => Date.parse('2026-12-01T10:00:00Z'),
        auditDenialGroupsPerMinute: 3,
        authFailureBurst: 10_000,
      });
      for (let i = 0; i < 10; i++) {
        await assert.rejects(iam.authenticate(undefined, { source: `198.51.100.${i}` }));
      }
      const rows = (await iam.listAudit()).filter((e) => e.action === 'auth');
      assert.deepEqual(
        rows.map((r) => [r.target, r.details?.['reason'], r.details?.['count']]).sort(),
        [
          ['*', 'overflow', 7],
          ['198.51.100.0', 'missing', 1],
          ['198.51.100.1', 'missing', 1],
          ['198.51.100.2', 'missing', 1],
        ],
      );
    });

    test('denied access is audited aggregated too; the audit table keeps only its retention', async (t) => {
      let now = Date.parse('2026-12-01T10:00:00Z');
      const day = 24 * 3_600_000;
      const { iam, root } = await fresh(t, { now: () => now, auditRetentionMs: 30 * day });
      for (let i = 0; i < 50; i++) await iam.audit(root.keyId, 'sandbox.access', 'sb-1', 'denied');
      await iam.audit(root.keyId, 'sandbox.access', 'sb-2', 'denied');
      const denied = (await iam.listAudit()).filter((e) => e.action === 'sandbox.access');
      assert.deepEqual(denied.map((e) => [e.target, e.details?.['count']]).sort(), [
        ['sb-1', 50],
        ['sb-2', 1],
      ]);
      assert.equal(iam.authStats().denials['sandbox.access'], 51);
      // Past the retention period every older row goes, mutations and denials alike.
      now += 31 * day;
      await iam.createProject(root, { name: 'later' });
      const removed = await iam.sweepAudit();
      assert.ok(removed >= 3, `removed ${removed}`);
      const left = await iam.listAudit({ limit: 1000 });
      assert.deepEqual(
        left.map((e) => e.action),
        ['project.create'],
      );
    });

    test('failed authentication is rate-limited per source; a known key still passes', async (t) => {
      let now = 5_000_000;
      const { iam, boot } = await fresh(t, {
        now: () => now,
        authFailureBurst: 5,
        authFailuresPerSecond: 1,
      });
      const limited = (e: unknown) =>
        isDsecError(e, 'rate_limited') &&
        typeof e.details?.['retryAfterMs'] === 'number' &&
        e.details['retryAfterMs'] > 0;
      const unauth = (e: unknown) => isDsecError(e, 'unauthenticated');
      const a = { source: '192.0.2.1' };
      // Cached before the flood: a valid key keeps working from the flooding address.
      await iam.authenticate(boot.key, a);
      for (let i = 0; i < 5; i++) await assert.rejects(iam.authenticate(undefined, a), unauth);
      await assert.rejects(iam.authenticate(undefined, a), limited);
      await assert.rejects(iam.authenticate('dsk_' + 'B'.repeat(43), a), limited);
      assert.equal((await iam.authenticate(boot.key, a)).role, 'admin');
      // Another address is not limited; no address at all (an in-process caller) never is.
      await assert.rejects(iam.authenticate(undefined, { source: '192.0.2.2' }), unauth);
      for (let i = 0; i < 20; i++) await assert.rejects(iam.authenticate(undefined), unauth);
      // One token a second comes back.
      now += 1000;
      await assert.rejects(iam.authenticate(undefined, a), unauth);
      await assert.rejects(iam.authenticate(undefined, a), limited);
      assert.equal(iam.authStats().failures['rate_limited'], 3);
      const rows = (await iam.listAudit()).filter(
        (e) => e.action === 'auth' && e.details?.['reason'] === 'rate_limited',
      );
      assert.deepEqual(
        rows.map((r) => [r.target, r.details?.['count']]),
        [['192.0.2.1', 3]],
      );
    });

    test('keys that authenticated stay known however many other keys authenticate (no wipe)', async (t) => {
      // A tenant that may mint keys authenticates more of them than the memory keeps: that
      // must not make every other key "unknown" again, or its next flood of bogus keys from
      // a shared address (loopback, a NAT) would lock those keys out with rate_limited.
      let now = 5_000_000;
      const { iam, root } = await fresh(t, {
        now: () => now,
        authFailureBurst: 5,
        authFailuresPerSecond: 1,
        authCacheMaxEntries: 50,
      });
      const shared = { source: '192.0.2.9' };
      const victim = await iam.createKey(root, { projectId: root.projectId });
      const minted = [];
      for (let i = 0; i < 60; i++)
        minted.push(await iam.createKey(root, { projectId: root.projectId }));
      const other = { source: '192.0.2.10' };
      for (const k of minted.slice(0, 45)) await iam.authenticate(k.key, other);
      // The victim authenticates; a few more of the tenant's keys pass the memory's cap: the
      // oldest entries make room, not all of them.
      await iam.authenticate(victim.key, shared);
      for (const k of minted.slice(45)) await iam.authenticate(k.key, other);
      // Its cache entry lapses; then a flood of bogus keys from the shared address.
      now += 1001;
      for (let i = 0; i < 6; i++) {
        await assert.rejects(iam.authenticate('dsk_' + 'C'.repeat(43), shared));
      }
      assert.equal((await iam.authenticate(victim.key, shared)).keyId, victim.id);
    });

    test('authentication cache: other instances see a revocation within the TTL', async (t) => {
      let now = 1_000_000;
      const clock = { now: () => now, authCacheTtlMs: 1000 };
      const { iam: a, root, location } = await fresh(t, clock);
      const b = (await open(t, location, clock)).iam;
      const uncached = (await open(t, location, { ...clock, authCacheTtlMs: 0 })).iam;
      const k = await a.createKey(root, { projectId: root.projectId });
      assert.equal((await b.authenticate(k.key)).keyId, k.id);
      await a.revokeKey(root, k.id);
      const unauth = (e: unknown) => isDsecError(e, 'unauthenticated');
      await assert.rejects(a.authenticate(k.key), unauth);
      await assert.rejects(uncached.authenticate(k.key), unauth);
      // b looked the key up before the revocation and may serve it until its TTL runs out...
      now += 999;
      const stale = await b.authenticate(k.key);
      assert.equal(stale.keyId, k.id);
      // ...but not to mint a key that would outlive the revocation, nor to revoke another.
      await assert.rejects(b.createKey(stale, { projectId: root.projectId }), unauth);
      const other = await a.createKey(root, { projectId: root.projectId });
      await assert.rejects(b.revokeKey(stale, other.id), unauth);
      assert.equal((await a.listKeys(root)).find((x) => x.id === other.id)?.revokedAt, null);
      // ...and not one millisecond longer.
      now += 1;
      await assert.rejects(b.authenticate(k.key), unauth);
    });

    test('nested projects: access flows down, quota bounded by the parent', async (t) => {
      const { iam, root } = await fresh(t);
      const a = await iam.createProject(root, {
        name: 'a',
        quota: { sandboxes: 10, memoryMb: 4096 },
      });
      const aAdmin = await iam.authenticate(
        (await iam.createKey(root, { projectId: a.id, role: 'admin' })).key,
      );
      const a1 = await iam.createProject(aAdmin, { name: 'a1', quota: { sandboxes: 5 } });
      const a11 = await iam.createProject(aAdmin, { name: 'a11', parentId: a1.id });
      assert.ok(await iam.canAccess(aAdmin, a11.id));
      assert.ok(await iam.canAccess(root, a11.id));
      assert.ok(!(await iam.canAccess(aAdmin, root.projectId)));
      assert.ok(!(await iam.canAccess(aAdmin, 'prj-nonexistent')));
      // a11 inherits a1's limit of 5, so asking for 6 anywhere below a1 is refused.
      await assert.rejects(
        iam.createProject(aAdmin, { name: 'x', parentId: a11.id, quota: { sandboxes: 6 } }),
        (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.sandboxes',
      );
      await assert.rejects(
        iam.createProject(aAdmin, { name: 'y', quota: { memoryMb: 5000 } }),
        (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.memoryMb',
      );
      const b = await iam.createProject(root, { name: 'b' });
      await assert.rejects(iam.createProject(aAdmin, { name: 'z', parentId: b.id }), (e) =>
        isDsecError(e, 'not_found'),
      );
      await assert.rejects(
        iam.createProject(root, { name: 'a' }),
        (e) => isDsecError(e, 'conflict') && e.field === 'name',
      );
      assert.deepEqual(
        (await iam.listProjects(aAdmin)).map((p) => p.name),
        ['a', 'a1', 'a11'],
      );
      assert.deepEqual(
        await iam.subtreeIds(a1.id).then((ids) => ids.sort()),
        [a1.id, a11.id].sort(),
      );
      assert.deepEqual((await iam.getProject(aAdmin, a1.id)).quota, { sandboxes: 5 });
      await assert.rejects(iam.getProject(aAdmin, b.id), (e) => isDsecError(e, 'not_found'));
      const denied = (await iam.listAudit()).filter(
        (e) => e.outcome === 'denied' && e.action === 'project.create',
      );
      assert.equal(denied.length, 3);
    });

    test('projects nest MAX_PROJECT_DEPTH deep at most, the root included', async (t) => {
      const { iam, root } = await fresh(t);
      let parentId = root.projectId;
      for (let depth = 2; depth <= MAX_PROJECT_DEPTH; depth++) {
        parentId = (await iam.createProject(root, { name: `d${depth}`, parentId })).id;
      }
      assert.equal((await iam.lineage(parentId)).length, MAX_PROJECT_DEPTH);
      await assert.rejects(
        iam.createProject(root, { name: 'too-deep', parentId }),
        (e) =>
          isDsecError(e, 'invalid_argument') &&
          e.field === 'parentId' &&
          e.details?.['maxDepth'] === MAX_PROJECT_DEPTH,
      );
      // Beside the deepest is still fine.
      await iam.createProject(root, {
        name: 'sibling',
        parentId: (await iam.lineage(parentId))[1]!,
      });
    });

    test('calls-per-second quota: stored, bounded by the parent, listed nearest first', async (t) => {
      const { iam, root } = await fresh(t);
      const a = await iam.createProject(root, { name: 'a', quota: { fncallsPerSecond: 100 } });
      const a1 = await iam.createProject(root, {
        name: 'a1',
        parentId: a.id,
        quota: { fncallsPerSecond: 40, sandboxes: 2 },
      });
      const a11 = await iam.createProject(root, { name: 'a11', parentId: a1.id });
      // a11 has no limit of its own, but a1's 40 bounds it.
      await assert.rejects(
        iam.createProject(root, { name: 'x', parentId: a11.id, quota: { fncallsPerSecond: 41 } }),
        (e) =>
          isDsecError(e, 'permission_denied') &&
          e.field === 'quota.fncallsPerSecond' &&
          e.details?.['limit'] === 40,
      );
      await assert.rejects(
        iam.createProject(root, { name: 'y', quota: { fncallsPerSecond: 1.5 } }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === 'quota.fncallsPerSecond',
      );
      assert.deepEqual((await iam.getProject(root, a1.id)).quota, {
        sandboxes: 2,
        fncallsPerSecond: 40,
      });
      assert.deepEqual(await iam.fncallRateLimits(a11.id), [
        { projectId: a1.id, name: 'a1', perSecond: 40 },
        { projectId: a.id, name: 'a', perSecond: 100 },
      ]);
      assert.deepEqual(await iam.fncallRateLimits(root.projectId), []);
      await assert.rejects(iam.fncallRateLimits('prj-nonexistent'), (e) =>
        isDsecError(e, 'not_found'),
      );
    });

    test('members cannot create projects or grant admin; keys only in own subtree', async (t) => {
      const { iam, root } = await fresh(t);
      const a = await iam.createProject(root, { name: 'a' });
      const b = await iam.createProject(root, { name: 'b' });
      const member = await iam.authenticate(
        (await iam.createKey(root, { projectId: a.id, role: 'member' })).key,
      );
      await assert.rejects(iam.createProject(member, { name: 'm' }), (e) =>
        isDsecError(e, 'permission_denied'),
      );
      await assert.rejects(
        iam.createKey(member, { projectId: a.id, role: 'admin' }),
        (e) => isDsecError(e, 'permission_denied') && e.field === 'role',
      );
      await assert.rejects(iam.createKey(member, { projectId: b.id }), (e) =>
        isDsecError(e, 'not_found'),
      );
      const sibling = await iam.createKey(member, { projectId: a.id, role: 'member', name: 'ci' });
      assert.equal(sibling.role, 'member');
      const adminOfA = await iam.createKey(root, { projectId: a.id, role: 'admin' });
      await assert.rejects(iam.revokeKey(member, adminOfA.id), (e) =>
        isDsecError(e, 'permission_denied'),
      );
      await assert.rejects(iam.revokeKey(member, 'key-nonexistent'), (e) =>
        isDsecError(e, 'not_found'),
      );
      const listed = await iam.listKeys(member);
      assert.ok(listed.some((k) => k.id === sibling.id && k.name === 'ci' && k.revokedAt === null));
      assert.ok(listed.every((k) => k.projectId === a.id && !('key' in k)));
    });

    test('key scopes: stored, authenticated, listed; unscoped keys have none', async (t) => {
      const { iam, root, location } = await fresh(t);
      const builder = await iam.createKey(root, {
        projectId: root.projectId,
        name: 'builder',
        scopes: ['sandboxes:snapshot', 'images:run:base*', 'sandboxes:snapshot'],
      });
      assert.deepEqual(builder.scopes, ['sandboxes:snapshot', 'images:run:base*']);
      const plain = await iam.createKey(root, { projectId: root.projectId });
      assert.equal('scopes' in plain, false);
      // Another instance (another apiserver) reads the same scopes from the database.
      const other = (await open(t, location)).iam;
      assert.deepEqual((await other.authenticate(builder.key)).scopes, [
        'sandboxes:snapshot',
        'images:run:base*',
      ]);
      assert.equal((await other.authenticate(plain.key)).scopes, undefined);
      assert.equal(root.scopes, undefined, 'the bootstrap key is unscoped');
      const listed = await iam.listKeys(root);
      assert.deepEqual(listed.find((k) => k.id === builder.id)?.scopes, [
        'sandboxes:snapshot',
        'images:run:base*',
      ]);
      assert.equal(listed.find((k) => k.id === plain.id)?.scopes, undefined);
      await assert.rejects(
        iam.createKey(root, { projectId: root.projectId, scopes: ['images:run:Bad Name'] }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === 'scopes.0',
      );
    });

    test('a scoped key grants only scopes its own cover, and never an unscoped key', async (t) => {
      const { iam, root } = await fresh(t);
      const runtime = await iam.authenticate(
        (
          await iam.createKey(root, {
            projectId: root.projectId,
            role: 'admin',
            scopes: ['images:run:task-*'],
          })
        ).key,
      );
      const narrower = await iam.createKey(runtime, {
        projectId: root.projectId,
        scopes: ['images:run:task-a*'],
      });
      assert.deepEqual(narrower.scopes, ['images:run:task-a*']);
      const denied = (e: unknown) => isDsecError(e, 'permission_denied') && e.field === 'scopes';
      await assert.rejects(iam.createKey(runtime, { projectId: root.projectId }), denied);
      await assert.rejects(
        iam.createKey(runtime, { projectId: root.projectId, scopes: ['sandboxes:snapshot'] }),
        denied,
      );
      await assert.rejects(
        iam.createKey(runtime, { projectId: root.projectId, scopes: ['images:run:*'] }),
        denied,
      );
      assert.ok(
        (await iam.listAudit()).some(
          (e) =>
            e.action === 'key.create' && e.outcome === 'denied' && e.actorKeyId === runtime.keyId,
        ),
      );
    });

    test('reserve checks every ancestor over its subtree; release frees', async (t) => {
      const { iam, root } = await fresh(t);
      const a = await iam.createProject(root, {
        name: 'a',
        quota: { sandboxes: 3, cpuCores: 0.3 },
      });
      const a1 = await iam.createProject(root, { name: 'a1', parentId: a.id });
      const a2 = await iam.createProject(root, { name: 'a2', parentId: a.id });
      await iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's1');
      await iam.reserve(a2.id, { memoryMb: 1, cpuCores: 0.1 }, 's2');
      await iam.reserve(a2.id, { memoryMb: 1, cpuCores: 0.1 }, 's3'); // 0.1+0.1+0.1 is exactly 0.3
      await assert.rejects(
        iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0 }, 's4'),
        (e) =>
          isDsecError(e, 'quota_exceeded') &&
          e.details?.['projectId'] === a.id &&
          e.details['resource'] === 'sandboxes',
      );
      assert.deepEqual(await iam.usage(a.id), {
        sandboxes: 3,
        memoryMb: 3,
        cpuCores: 0.3,
        imageBytes: 0,
        volumeBytes: 0,
      });
      assert.equal(await iam.release('s2'), true);
      assert.equal(await iam.release('s2'), false);
      await iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's4');
      await assert.rejects(iam.reserve(a1.id, { memoryMb: 1, cpuCores: 0.1 }, 's5'), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      await assert.rejects(iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 0 }, 's1'), (e) =>
        isDsecError(e, 'conflict'),
      );
      await assert.rejects(
        iam.reserve('prj-nonexistent', { memoryMb: 1, cpuCores: 0 }, 's9'),
        (e) => isDsecError(e, 'not_found'),
      );
      assert.equal(await iam.reservationProject('s1'), a1.id);
      assert.ok(
        (await iam.listAudit()).some((e) => e.action === 'quota.reserve' && e.outcome === 'denied'),
      );
    });

    test('volumes: sizes charged within every ancestor, names per project, freed on delete', async (t) => {
      const { iam, root } = await fresh(t);
      const team = await iam.createProject(root, { name: 'team', quota: { volumeBytes: 1000 } });
      assert.equal(team.quota.volumeBytes, 1000);
      await assert.rejects(
        iam.createProject(root, { name: 'big', parentId: team.id, quota: { volumeBytes: 1001 } }),
        (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.volumeBytes',
      );
      const a = await iam.createProject(root, { name: 'a', parentId: team.id });
      const b = await iam.createProject(root, { name: 'b', parentId: team.id });
      const v = await iam.createVolume({
        projectId: a.id,
        name: 'data',
        sizeBytes: 600,
        edgeId: 'e1',
      });
      assert.equal(v.state, 'creating');
      // Names are per project: b's `data` is another volume, charged to the same parent.
      await iam.createVolume({ projectId: b.id, name: 'data', sizeBytes: 300, edgeId: 'e2' });
      await assert.rejects(
        iam.createVolume({ projectId: a.id, name: 'data', sizeBytes: 1, edgeId: 'e1' }),
        (e) => isDsecError(e, 'conflict'),
      );
      await assert.rejects(
        iam.createVolume({ projectId: a.id, name: 'more', sizeBytes: 101, edgeId: 'e1' }),
        (e) =>
          isDsecError(e, 'quota_exceeded') &&
          e.details?.['resource'] === 'volumeBytes' &&
          e.details['projectId'] === team.id,
      );
      assert.equal((await iam.usage(team.id)).volumeBytes, 900);
      assert.equal((await iam.usage(a.id)).volumeBytes, 600);
      await iam.markVolumeReady(a.id, 'data');
      assert.equal((await iam.getVolume(a.id, 'data'))?.state, 'ready');
      assert.equal((await iam.getVolume(b.id, 'data'))?.edgeId, 'e2');
      assert.deepEqual(
        (await iam.listVolumes(a.id)).map((x) => [x.name, x.sizeBytes]),
        [['data', 600]],
      );
      assert.equal(await iam.deleteVolume(a.id, 'data'), true);
      assert.equal(await iam.deleteVolume(a.id, 'data'), false);
      assert.equal(await iam.getVolume(a.id, 'data'), undefined);
      await iam.createVolume({ projectId: a.id, name: 'more', sizeBytes: 698, edgeId: 'e1' });
      // Concurrent creates never overshoot the parent's limit (rows locked in the transaction):
      // two bytes of room, six creates of one byte.
      const burst = await Promise.allSettled(
        Array.from({ length: 6 }, (_, i) =>
          iam.createVolume({ projectId: b.id, name: `x${i}`, sizeBytes: 1, edgeId: 'e2' }),
        ),
      );
      assert.equal(burst.filter((r) => r.status === 'fulfilled').length, 2);
      assert.equal((await iam.usage(team.id)).volumeBytes, 1000);
      await assert.rejects(
        iam.createVolume({ projectId: 'prj-nope', name: 'x', sizeBytes: 1, edgeId: 'e1' }),
        (e) => isDsecError(e, 'not_found'),
      );
    });

    test('image bytes: reserved within every ancestor, bound to a layer, released on delete', async (t) => {
      let now = 1_000_000;
      const { iam, root } = await fresh(t, { now: () => now, pendingTtlMs: 1000 });
      const team = await iam.createProject(root, { name: 'team', quota: { imageBytes: 1000 } });
      assert.equal(team.quota.imageBytes, 1000);
      await assert.rejects(
        iam.createProject(root, { name: 'big', parentId: team.id, quota: { imageBytes: 1001 } }),
        (e) => isDsecError(e, 'permission_denied') && e.field === 'quota.imageBytes',
      );
      await assert.rejects(
        iam.createProject(root, { name: 'neg', parentId: team.id, quota: { imageBytes: -1 } }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === 'quota.imageBytes',
      );
      const c1 = await iam.createProject(root, { name: 'c1', parentId: team.id });
      const c2 = await iam.createProject(root, {
        name: 'c2',
        parentId: team.id,
        quota: { imageBytes: 300 },
      });
      assert.deepEqual(await iam.lineage(c2.id), [root.projectId, team.id, c2.id]);
      assert.deepEqual(await iam.lineage('prj-unknown'), []);

      // Up to what was asked, or what is left.
      assert.deepEqual(await iam.reserveImageBytes(c1.id, 'h1', 400), { maxBytes: 400 });
      // An unknown bound is told the room left but holds none of it: holding it all would
      // starve c1 (and every project under team) while that snapshot is taken.
      assert.deepEqual(await iam.reserveImageBytes(c2.id, 'h2', undefined), { maxBytes: 300 });
      assert.equal((await iam.usage(team.id)).imageBytes, 400);
      assert.deepEqual(await iam.reserveImageBytes(c1.id, 'h3', 900), { maxBytes: 600 });
      await assert.rejects(
        iam.reserveImageBytes(c1.id, 'h4', 1),
        (e) =>
          isDsecError(e, 'quota_exceeded') &&
          e.details?.['resource'] === 'imageBytes' &&
          e.details['projectId'] === team.id,
      );
      assert.equal((await iam.usage(team.id)).imageBytes, 1000);
      // Layers are charged what they weigh; the rest of the reservation goes back.
      await iam.bindImageBytes('h1', c1.id, `${c1.id}/snap:latest`, 150);
      // The unknown bound is checked when charged: no room while h3 holds its 600.
      await assert.rejects(iam.bindImageBytes('h2', c2.id, `${c2.id}/snap:latest`, 300), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      assert.equal(await iam.releaseImageBytes('h3'), true);
      await iam.bindImageBytes('h2', c2.id, `${c2.id}/snap:latest`, 300);
      assert.deepEqual(await iam.usage(c1.id), {
        sandboxes: 0,
        memoryMb: 0,
        cpuCores: 0,
        imageBytes: 150,
        volumeBytes: 0,
      });
      assert.equal((await iam.usage(team.id)).imageBytes, 450);
      // c2's own limit is full.
      await assert.rejects(iam.reserveImageBytes(c2.id, 'h5', 1), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      // Growing past the reservation is checked against every limit.
      await iam.reserveImageBytes(c1.id, 'h6', 10);
      await assert.rejects(iam.bindImageBytes('h6', c1.id, `${c1.id}/huge:latest`, 600), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      await iam.bindImageBytes('h6', c1.id, `${c1.id}/fits:latest`, 550);
      assert.equal((await iam.usage(team.id)).imageBytes, 1000);
      // Deleting a layer gives its bytes back, to the child and every ancestor.
      assert.equal(await iam.releaseImageBytes(`${c2.id}/snap:latest`), true);
      assert.equal((await iam.usage(team.id)).imageBytes, 700);
      // A pending reservation lapses; a bound one never does.
      await iam.reserveImageBytes(c1.id, 'h7', 300);
      await assert.rejects(iam.reserveImageBytes(c1.id, 'h8', 1), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      now += 1001;
      assert.equal((await iam.usage(team.id)).imageBytes, 700);
      assert.deepEqual(await iam.reserveImageBytes(c1.id, 'h7', 1), { maxBytes: 1 });
      // Without a limit nothing is reserved, but what a layer weighs is still counted.
      const free = await iam.createProject(root, { name: 'free' });
      assert.deepEqual(await iam.reserveImageBytes(free.id, 'h9', 5), { maxBytes: undefined });
      await iam.bindImageBytes('h9', free.id, `${free.id}/x:latest`, 5);
      assert.equal((await iam.usage(free.id)).imageBytes, 5);
      await assert.rejects(iam.reserveImageBytes('prj-unknown', 'h10', 1), (e) =>
        isDsecError(e, 'not_found'),
      );
      assert.ok(
        (await iam.listAudit()).some(
          (e) => e.action === 'quota.reserve' && e.details?.['resource'] === 'imageBytes',
        ),
      );
    });

    test('image bytes from 3 instances at once never overrun the quota', async (t) => {
      const { iam, root, location } = await fresh(t);
      const instances = [
        iam,
        ...(await Promise.all([1, 2].map(async () => (await open(t, location)).iam))),
      ];
      const team = await iam.createProject(root, { name: 'team', quota: { imageBytes: 1000 } });
      const kids = await Promise.all(
        ['k1', 'k2'].map((name) => iam.createProject(root, { name, parentId: team.id })),
      );
      const results = await Promise.allSettled(
        Array.from({ length: 30 }, (_, i) =>
          instances[i % 3]!.reserveImageBytes(kids[i % 2]!.id, `h${i}`, 100),
        ),
      );
      const granted = results.filter((r) => r.status === 'fulfilled').length;
      assert.equal(granted, 10);
      assert.equal((await iam.usage(team.id)).imageBytes, 1000);
    });

    test('volume bytes from 3 instances at once never overrun the quota, and one name is made once', async (t) => {
      const { iam, root, location } = await fresh(t);
      const instances = [
        iam,
        ...(await Promise.all([1, 2].map(async () => (await open(t, location)).iam))),
      ];
      const team = await iam.createProject(root, { name: 'team', quota: { volumeBytes: 1000 } });
      const kids = await Promise.all(
        ['k1', 'k2'].map((name) => iam.createProject(root, { name, parentId: team.id })),
      );
      const results = await Promise.allSettled(
        Array.from({ length: 30 }, (_, i) =>
          instances[i % 3]!.createVolume({
            projectId: kids[i % 2]!.id,
            name: `v${i}`,
            sizeBytes: 100,
            edgeId: 'e1',
          }),
        ),
      );
      assert.equal(results.filter((r) => r.status === 'fulfilled').length, 10);
      for (const r of results) {
        if (r.status === 'rejected')
          assert.ok(isDsecError(r.reason, 'quota_exceeded'), String(r.reason));
      }
      assert.equal((await iam.usage(team.id)).volumeBytes, 1000);
      // The same name from every instance at once: one volume, the others `conflict`.
      const made = results.find((r) => r.status === 'fulfilled')!.value;
      assert.equal(await iam.deleteVolume(made.projectId, made.name), true);
      const same = await Promise.allSettled(
        instances.map((x) =>
          x.createVolume({ projectId: made.projectId, name: 'same', sizeBytes: 1, edgeId: 'e1' }),
        ),
      );
      assert.equal(same.filter((r) => r.status === 'fulfilled').length, 1);
      for (const r of same) {
        if (r.status === 'rejected') assert.ok(isDsecError(r.reason, 'conflict'), String(r.reason));
      }
    });

    test('pending reservations lapse; bound ones live until the sandbox expires', async (t) => {
      let now = 1_000_000;
      const { iam, root } = await fresh(t, {
        now: () => now,
        pendingTtlMs: 1000,
        expiryGraceMs: 0,
      });
      const p = await iam.createProject(root, { name: 'p', quota: { sandboxes: 1 } });
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-a');
      now += 1001;
      await assert.rejects(iam.bindReservation('rsv-a', 'sb-a', { expiresAt: now + 5000 }), (e) =>
        isDsecError(e, 'conflict'),
      );
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-b');
      await iam.bindReservation('rsv-b', 'sb-b', { expiresAt: now + 5000 });
      now += 2000;
      assert.equal(await iam.reservationProject('sb-b'), p.id);
      assert.equal(await iam.reservationProject('rsv-b'), undefined);
      await assert.rejects(iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-c'), (e) =>
        isDsecError(e, 'quota_exceeded'),
      );
      now += 3001;
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-c');
      // A lapsed reservation's name may be taken again.
      now += 1001;
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'rsv-c');
    });

    test('setReservationExpiry moves a live reservation either way; a lapsed one stays lapsed', async (t) => {
      let now = 1_000_000;
      const { iam, root } = await fresh(t, { now: () => now, expiryGraceMs: 100 });
      const p = await iam.createProject(root, { name: 'p', quota: { sandboxes: 1 } });
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'h1');
      await iam.bindReservation('h1', 'sb-1', { expiresAt: now + 1000 });
      // Extended: still held past its first expiry.
      assert.equal(await iam.setReservationExpiry('sb-1', now + 10_000), true);
      now += 5000;
      assert.equal(await iam.reservationProject('sb-1'), p.id);
      // Shortened: freed at the new expiry plus the grace period.
      assert.equal(
        await iam.setReservationExpiry('sb-1', new Date(now + 1000).toISOString()),
        true,
      );
      now += 1100;
      assert.equal(await iam.reservationProject('sb-1'), undefined);
      assert.equal(await iam.setReservationExpiry('sb-1', now + 60_000), false);
      assert.equal(await iam.reservationProject('sb-1'), undefined);
      await iam.reserve(p.id, { memoryMb: 1, cpuCores: 1 }, 'h2');
      assert.equal(await iam.setReservationExpiry('sb-unknown', now + 1000), false);
    });

    test('idempotency claims: claimed, pending, done, abandoned, taken over', async (t) => {
      let now = 1_000_000;
      const { iam, root } = await fresh(t, { now: () => now, pendingTtlMs: 1000 });
      const fp = requestFingerprint({ projectId: root.projectId, spec: { image: 'base' } });
      const claim = (requestId: string, holder: string) =>
        iam.claimRequest(root.projectId, requestId, holder, fp);
      assert.deepEqual(await claim('r1', 'h1'), { state: 'claimed' });
      assert.deepEqual(await claim('r1', 'h2'), { state: 'pending' });
      await iam.abandonRequest(root.projectId, 'r1', 'h1');
      assert.deepEqual(await claim('r1', 'h2'), { state: 'claimed' });
      await iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 1 }, 'h2');
      await iam.bindReservation('h2', 'sb-1', { expiresAt: now + 60_000, requestId: 'r1' });
      assert.deepEqual(await claim('r1', 'h3'), { state: 'done', sandboxId: 'sb-1' });
      // A claim whose creator died is taken over once it is older than pendingTtlMs.
      assert.deepEqual(await claim('r2', 'h4'), { state: 'claimed' });
      now += 1001;
      assert.deepEqual(await claim('r2', 'h5'), { state: 'claimed' });
      // Request IDs are per project.
      const other = await iam.createProject(root, { name: 'other' });
      assert.deepEqual(await iam.claimRequest(other.id, 'r1', 'h6', fp), { state: 'claimed' });
    });

    test('idempotency records are kept for their retention period, then swept', async (t) => {
      // Each create with a requestId leaves a row; without a retention the table grows with
      // every create ever made (issue 24 point 4: no request costs unbounded disk).
      let now = 1_000_000;
      const day = 24 * 3_600_000;
      const { iam, root } = await fresh(t, { now: () => now, idempotencyRetentionMs: 7 * day });
      const fp = requestFingerprint({ projectId: root.projectId, spec: { image: 'base' } });
      const claim = (requestId: string, holder: string) =>
        iam.claimRequest(root.projectId, requestId, holder, fp);
      for (const r of ['r1', 'r2', 'r3']) {
        assert.deepEqual(await claim(r, `h-${r}`), { state: 'claimed' });
        await iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 1 }, `h-${r}`);
        await iam.bindReservation(`h-${r}`, `sb-${r}`, { expiresAt: now + 60_000, requestId: r });
      }
      assert.deepEqual(await claim('r4', 'h-r4'), { state: 'claimed' }); // never bound
      now += 6 * day;
      assert.deepEqual(await claim('r5', 'h-r5'), { state: 'claimed' });
      await iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 1 }, 'h-r5');
      await iam.bindReservation('h-r5', 'sb-r5', { expiresAt: now + 60_000, requestId: 'r5' });
      // Within the retention period a retry is still answered with its sandbox.
      assert.deepEqual(await claim('r1', 'h-x'), { state: 'done', sandboxId: 'sb-r1' });
      now += 2 * day;
      assert.equal(await iam.sweepIdempotency(), 4);
      assert.equal(await iam.sweepIdempotency(), 0);
      // Past it the ID is free again; the younger record stays.
      assert.deepEqual(await claim('r1', 'h-y'), { state: 'claimed' });
      assert.deepEqual(await claim('r5', 'h-z'), { state: 'done', sandboxId: 'sb-r5' });
    });

    test('idempotency keys are bound to their request: another body is conflict', async (t) => {
      const { iam, root } = await fresh(t);
      const fp1 = requestFingerprint({ projectId: root.projectId, spec: { image: 'base' } });
      const fp2 = requestFingerprint({ projectId: root.projectId, spec: { image: 'other' } });
      const conflict = (e: unknown) =>
        isDsecError(e, 'conflict') && e.field === 'requestId' && e.details?.['requestId'] === 'r1';
      assert.deepEqual(await iam.claimRequest(root.projectId, 'r1', 'h1', fp1), {
        state: 'claimed',
      });
      await assert.rejects(iam.claimRequest(root.projectId, 'r1', 'h2', fp2), conflict);
      await iam.reserve(root.projectId, { memoryMb: 1, cpuCores: 1 }, 'h1');
      await iam.bindReservation('h1', 'sb-1', { expiresAt: Date.now() + 60_000, requestId: 'r1' });
      await assert.rejects(
        iam.claimRequest(root.projectId, 'r1', 'h3', fp2, { actorKeyId: root.keyId }),
        conflict,
      );
      assert.deepEqual(await iam.claimRequest(root.projectId, 'r1', 'h4', fp1), {
        state: 'done',
        sandboxId: 'sb-1',
      });
      assert.ok(
        (await iam.listAudit()).some(
          (e) =>
            e.action === 'request.claim' && e.outcome === 'denied' && e.actorKeyId === root.keyId,
        ),
      );
    });

    test('idempotency: instances claiming one request at once, exactly one claims', async (t) => {
      const { iam, root, location } = await fresh(t);
      const others = await Promise.all([1, 2].map(async () => (await open(t, location)).iam));
      const fp = requestFingerprint({ n: 1 });
      const claims = await Promise.all(
        Array.from({ length: 30 }, (_, i) =>
          [iam, ...others][i % 3]!.claimRequest(root.projectId, 'same', `h${i}`, fp),
        ),
      );
      assert.equal(claims.filter((c) => c.state === 'claimed').length, 1);
      assert.equal(claims.filter((c) => c.state === 'pending').length, 29);
    });

    test('parallel reservations from 3 instances grant exactly the quota', async (t) => {
      const { iam, root, location } = await fresh(t);
      const instances = [
        iam,
        ...(await Promise.all([1, 2].map(async () => (await open(t, location)).iam))),
      ];
      const team = await iam.createProject(root, { name: 'team', quota: { sandboxes: 25 } });
      // Half the reservations land in children: the team's quota counts its whole subtree,
      // and c1's own, tighter quota holds too.
      const c1 = await iam.createProject(root, {
        name: 'c1',
        parentId: team.id,
        quota: { sandboxes: 10 },
      });
      const c2 = await iam.createProject(root, { name: 'c2', parentId: team.id });
      const targets = [team.id, c1.id, c2.id];
      const results = await Promise.allSettled(
        Array.from({ length: 60 }, (_, i) =>
          instances[i % 3]!.reserve(
            targets[i % 3]!,
            { memoryMb: 1, cpuCores: 0.5 },
            randomId('rsv'),
          ),
        ),
      );
      const ok = results.filter((r) => r.status === 'fulfilled').length;
      const refused = results.filter(
        (r) => r.status === 'rejected' && isDsecError(r.reason, 'quota_exceeded'),
      ).length;
      assert.equal(
        ok,
        25,
        JSON.stringify(results.filter((r) => r.status === 'rejected').slice(0, 2)),
      );
      assert.equal(refused, 35);
      assert.deepEqual(await instances[1]!.usage(team.id), {
        sandboxes: 25,
        memoryMb: 25,
        cpuCores: 12.5,
        imageBytes: 0,
        volumeBytes: 0,
      });
      assert.ok((await iam.usage(c1.id)).sandboxes <= 10);
    });

    test('state survives reopen', async (t) => {
      const location = await fixture.fresh();
      const first = await open(t, location);
      const boot = await first.iam.bootstrap();
      const root = await first.iam.authenticate(boot.key);
      const p = await first.iam.createProject(root, { name: 'team', quota: { memoryMb: 1024 } });
      const k = await first.iam.createKey(root, { projectId: p.id, role: 'member', name: 'ci' });
      await first.iam.reserve(p.id, { memoryMb: 512, cpuCores: 1 }, 'sb-x');
      await first.edges.register(edge('edge-1'));
      await first.close();
      await assert.rejects(first.iam.usage(p.id), (e) => isDsecError(e, 'unavailable'));
      const second = await open(t, location);
      assert.equal((await second.iam.bootstrap()).created, false);
      assert.equal((await second.iam.authenticate(k.key)).projectId, p.id);
      assert.deepEqual((await second.iam.getProject(root, p.id)).quota, { memoryMb: 1024 });
      assert.equal((await second.iam.usage(p.id)).memoryMb, 512);
      assert.equal((await second.edges.get('edge-1'))?.url, 'http://127.0.0.1:7001');
      const audit = JSON.stringify(await second.iam.listAudit({ limit: 1000 }));
      assert.ok(!audit.includes(boot.key!) && !audit.includes(k.key), 'a raw key in the audit log');
    });

    test('edge registry: register (upsert), get, list, probes, remove', async (t) => {
      let now = 5_000_000;
      const { db, location } = await fresh(t, { now: () => now });
      const other = await open(t, location);
      const registered = await db.edges.register(
        edge('edge-b', {
          labels: { pool: 'burst', gpu: 'none' },
          backends: ['container', 'container'],
        }),
      );
      assert.deepEqual(registered, {
        edgeId: 'edge-b',
        url: 'http://127.0.0.1:7001',
        secret: SECRET,
        labels: { gpu: 'none', pool: 'burst' },
        backends: ['container'],
        healthy: false,
        lastProbeAt: undefined,
        lastError: undefined,
        status: undefined,
        registeredAt: new Date(now).toISOString(),
        cordoned: false,
        tlsPins: undefined,
      });
      await db.edges.register(edge('edge-a'));
      assert.deepEqual(
        (await other.edges.list()).map((e) => e.edgeId),
        ['edge-a', 'edge-b'],
      );
      const status = { edgeId: 'edge-b', sandboxesByProject: { p: 2 }, used: { memoryMb: 1.5 } };
      assert.equal(
        await other.edges.recordProbe('edge-b', { healthy: true, at: now, status }),
        true,
      );
      let b = await db.edges.get('edge-b');
      assert.equal(b?.healthy, true);
      assert.equal(b?.lastProbeAt, now);
      assert.deepEqual(b?.status, status);
      // A failed probe keeps the last status and records why.
      assert.equal(
        await db.edges.recordProbe('edge-b', {
          healthy: false,
          at: now + 10,
          error: 'ECONNREFUSED',
        }),
        true,
      );
      b = await db.edges.get('edge-b');
      assert.equal(b?.healthy, false);
      assert.equal(b?.lastError, 'ECONNREFUSED');
      assert.deepEqual(b?.status, status);
      // An older probe arriving late changes nothing.
      assert.equal(await db.edges.recordProbe('edge-b', { healthy: true, at: now + 5 }), false);
      assert.equal((await db.edges.get('edge-b'))?.healthy, false);
      assert.equal(await db.edges.recordProbe('edge-b', { healthy: true, at: now + 20 }), true);
      b = await db.edges.get('edge-b');
      assert.equal(b?.healthy, true);
      assert.equal(b?.lastError, undefined);
      // Re-registering at the same URL keeps the health; the first registration time stays.
      now += 60_000;
      const again = await db.edges.register(edge('edge-b', { secret: 't'.repeat(43) }));
      assert.equal(again.healthy, true);
      assert.equal(again.secret, 't'.repeat(43));
      assert.deepEqual(again.labels, {});
      assert.equal(again.registeredAt, registered.registeredAt);
      // At a new URL nobody has probed yet, it is not healthy.
      const moved = await db.edges.register(edge('edge-b', { url: 'https://10.0.0.2:7001' }));
      assert.equal(moved.healthy, false);
      assert.equal(moved.lastProbeAt, undefined);
      assert.equal(moved.status, undefined);
      // A cordon is seen by every reader and outlives re-registration (an edge restarting).
      assert.equal(await db.edges.setCordoned('edge-b', true), true);
      assert.equal((await other.edges.get('edge-b'))?.cordoned, true);
      assert.equal((await db.edges.register(edge('edge-b'))).cordoned, true);
      assert.equal(await db.edges.setCordoned('edge-b', false), true);
      assert.equal((await other.edges.get('edge-b'))?.cordoned, false);
      assert.equal(await db.edges.setCordoned('edge-nope', true), false);
      // TLS pins (issue 24 point 7) are kept, sorted and deduplicated, replaced by a
      // re-registration, and dropped by one without them.
      const pinA = 'A1:'.repeat(31) + 'A1';
      const pinB = '0B:'.repeat(31) + '0B';
      const pinned = await db.edges.register(
        edge('edge-b', { url: 'https://10.0.0.2:7001', tlsPins: [pinB, pinA, pinB] }),
      );
      assert.deepEqual(pinned.tlsPins, [pinB, pinA].sort());
      assert.deepEqual((await other.edges.get('edge-b'))?.tlsPins, [pinA, pinB].sort());
      assert.deepEqual(
        (await db.edges.register(edge('edge-b', { url: 'https://10.0.0.2:7001', tlsPins: [pinA] })))
          .tlsPins,
        [pinA],
      );
      assert.equal((await db.edges.register(edge('edge-b'))).tlsPins, undefined);
      assert.equal(await db.edges.remove('edge-b'), true);
      assert.equal(await db.edges.remove('edge-b'), false);
      assert.equal(await other.edges.get('edge-b'), undefined);
      assert.equal(await db.edges.recordProbe('edge-b', { healthy: true, at: now }), false);
      assert.equal(await db.edges.get('edge-b'), undefined, 'a probe must not re-create an edge');
      const audit = await db.iam.listAudit();
      assert.ok(audit.some((e) => e.action === 'edge.register' && e.target === 'edge-a'));
      assert.ok(audit.some((e) => e.action === 'edge.remove' && e.target === 'edge-b'));
      assert.ok(audit.some((e) => e.action === 'edge.cordon' && e.target === 'edge-b'));
      assert.ok(audit.some((e) => e.action === 'edge.uncordon' && e.target === 'edge-b'));
      assert.ok(!JSON.stringify(audit).includes(SECRET), 'an edge secret in the audit log');
    });

    test('edge registry refuses malformed registrations, naming the field', async (t) => {
      const { db } = await fresh(t);
      const cases: [Parameters<typeof edge>[1] & { edgeId?: string }, string][] = [
        [{ edgeId: '' }, 'edgeId'],
        [{ edgeId: 'has space' }, 'edgeId'],
        [{ url: 'ftp://x' }, 'url'],
        [{ url: 'not a url' }, 'url'],
        [{ secret: 'short' }, 'secret'],
        [{ labels: { pool: 7 as unknown as string } }, 'labels.pool'],
        [{ backends: [''] }, 'backends'],
        [{ url: 'https://x:1', tlsPins: [] }, 'tlsPins'],
        [{ url: 'https://x:1', tlsPins: ['ab:'.repeat(31) + 'ab'] }, 'tlsPins'],
        [{ url: 'https://x:1', tlsPins: ['AB'.repeat(32)] }, 'tlsPins'],
        [{ url: 'http://x:1', tlsPins: ['AB:'.repeat(31) + 'AB'] }, 'url'],
      ];
      for (const [change, field] of cases) {
        await assert.rejects(
          db.edges.register({ ...edge('edge-x'), ...change }),
          (e) => isDsecError(e, 'invalid_argument') && e.field === field,
          field,
        );
      }
      assert.deepEqual(await db.edges.list(), []);
    });
  });
}

function edge(
  edgeId: string,
  change: Partial<{
    url: string;
    secret: string;
    labels: Record<string, string>;
    backends: string[];
    tlsPins: string[];
  }> = {},
) {
  return {
    edgeId,
    url: 'http://127.0.0.1:7001',
    secret: SECRET,
    labels: {},
    backends: ['container'],
    ...change,
  };
}

function rawDb(location: string): SqlDb {
  return /^postgres(ql)?:\/\//i.test(location) ? new PostgresDb(location) : new SqliteDb(location);
}
