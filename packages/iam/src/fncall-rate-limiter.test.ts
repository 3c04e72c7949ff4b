import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { DsecError, isDsecError } from '@dsec/core';
import { FnCallRateLimiter } from './fncall-rate-limiter.js';
import { openControlDb } from './control-db.js';
import type { FnCallRateLimit } from './types.js';

/** A limiter over fixed limits and a clock the test moves by hand. */
function setup(table: Record<string, FnCallRateLimit[]>, options: { shares?: number } = {}) {
  const clock = { ms: 1_000_000 };
  let reads = 0;
  const limiter = new FnCallRateLimiter({
    limits: (projectId) => {
      reads++;
      const l = table[projectId];
      return l ? Promise.resolve(l) : Promise.reject(new DsecError('not_found', projectId));
    },
    now: () => clock.ms,
    limitsTtlMs: 5000,
    ...options,
  });
  return { limiter, clock, reads: () => reads };
}

/** How many of `n` acquires in a row (no time passing) are admitted. */
async function admitted(limiter: FnCallRateLimiter, projectId: string, n: number) {
  let ok = 0;
  for (let i = 0; i < n; i++) {
    try {
      await limiter.acquire(projectId);
      ok++;
    } catch (e) {
      if (!isDsecError(e, 'quota_exceeded')) throw e;
    }
  }
  return ok;
}

const lim = (projectId: string, perSecond: number): FnCallRateLimit => ({
  projectId,
  name: projectId,
  perSecond,
});

test('burst is one second worth, then calls are admitted at the rate', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 10)] });
  assert.equal(await admitted(limiter, 'p', 25), 10);
  clock.ms += 100; // one token back at 10/s
  assert.equal(await admitted(limiter, 'p', 5), 1);
  clock.ms += 350; // 3.5 tokens: three calls, half a token left
  assert.equal(await admitted(limiter, 'p', 5), 3);
  clock.ms += 50;
  assert.equal(await admitted(limiter, 'p', 5), 1);
  // However long it stays idle, the bucket holds one second's worth, no more.
  clock.ms += 60_000;
  assert.equal(await admitted(limiter, 'p', 50), 10);
});

test('refusal is quota_exceeded naming the project, the limit and when to retry', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 4)] });
  assert.equal(await admitted(limiter, 'p', 4), 4);
  clock.ms += 100; // 0.4 of a token back: 150 ms to go
  await assert.rejects(
    limiter.acquire('p'),
    (e) =>
      isDsecError(e, 'quota_exceeded') &&
      e.details?.['projectId'] === 'p' &&
      e.details['resource'] === 'fncallsPerSecond' &&
      e.details['limit'] === 4 &&
      e.details['retryAfterMs'] === 150,
  );
  clock.ms += 150;
  await limiter.acquire('p');
});

test('an ancestor limit bounds its whole subtree; a refused call takes no token anywhere', async () => {
  // Two children of team (limit 10), each with a limit of 8 of its own.
  const team = lim('team', 10);
  const { limiter, clock } = setup({
    a: [lim('a', 8), team],
    b: [lim('b', 8), team],
    team: [team],
  });
  assert.equal(await admitted(limiter, 'a', 20), 8); // a's own limit binds first
  assert.equal(await admitted(limiter, 'b', 20), 2); // then the team's remaining 2
  await assert.rejects(
    limiter.acquire('team'),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['projectId'] === 'team',
  );
  // b was refused by the team 18 times: had those taken b's own tokens, b would be empty now.
  clock.ms += 1000;
  assert.equal(await admitted(limiter, 'b', 20), 8);
});

test('a batch takes a token per call; one over the burst waits for a full bucket and leaves debt', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 10)] });
  await limiter.acquire('p', 4);
  await limiter.acquire('p', 6);
  await assert.rejects(
    limiter.acquire('p', 1),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['requested'] === 1,
  );
  clock.ms += 500; // 5 tokens: a batch of 6 must wait 100 ms more
  await assert.rejects(
    limiter.acquire('p', 6),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['retryAfterMs'] === 100,
  );
  clock.ms += 500;
  // 25 calls at 10/s: admitted on a full bucket (10), the debt of 15 paid off 1.5 s later,
  // and the next call's own token back 0.1 s after that.
  await limiter.acquire('p', 25);
  clock.ms += 1599;
  await assert.rejects(
    limiter.acquire('p'),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['retryAfterMs'] === 1,
  );
  clock.ms += 1;
  await limiter.acquire('p');
  await assert.rejects(limiter.acquire('p', 0), (e) => isDsecError(e, 'invalid_argument'));
  await assert.rejects(limiter.acquire('p', 1.5), (e) => isDsecError(e, 'invalid_argument'));
});

test('a quota of 0 refuses every call, without a retry hint', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 0)] });
  for (let i = 0; i < 3; i++) {
    await assert.rejects(
      limiter.acquire('p'),
      (e) => isDsecError(e, 'quota_exceeded') && e.details?.['retryAfterMs'] === undefined,
    );
    clock.ms += 10_000;
  }
});

test('unlimited projects are always admitted; unknown ones fail with the source error', async () => {
  const { limiter } = setup({ free: [] });
  assert.equal(await admitted(limiter, 'free', 10_000), 10_000);
  await assert.rejects(limiter.acquire('nope'), (e) => isDsecError(e, 'not_found'));
});

test('shares split the rate between apiservers; a share below 1/s still admits one call', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 9)], q: [lim('q', 1)] }, { shares: 3 });
  assert.equal(await admitted(limiter, 'p', 20), 3);
  clock.ms += 1000;
  assert.equal(await admitted(limiter, 'p', 20), 3);
  // 1/3 call per second: one now, the next three seconds later.
  assert.equal(await admitted(limiter, 'q', 5), 1);
  clock.ms += 2900;
  assert.equal(await admitted(limiter, 'q', 5), 0);
  clock.ms += 100;
  assert.equal(await admitted(limiter, 'q', 5), 1);
  assert.throws(
    () => new FnCallRateLimiter({ limits: () => Promise.resolve([]), shares: 0 }),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('limits are read once per TTL, and a changed limit takes effect with a full bucket', async () => {
  const table = { p: [lim('p', 2)] };
  const { limiter, clock, reads } = setup(table);
  assert.equal(await admitted(limiter, 'p', 5), 2);
  assert.equal(reads(), 1);
  table.p = [lim('p', 5)];
  clock.ms += 4999; // still the cached limit of 2: its bucket is full again, no more
  assert.equal(await admitted(limiter, 'p', 10), 2);
  assert.equal(reads(), 1);
  clock.ms += 1;
  assert.equal(await admitted(limiter, 'p', 10), 5);
  assert.equal(reads(), 2);
});

test('a clock that steps back refills nothing', async () => {
  const { limiter, clock } = setup({ p: [lim('p', 2)] });
  assert.equal(await admitted(limiter, 'p', 2), 2);
  clock.ms -= 10_000;
  assert.equal(await admitted(limiter, 'p', 2), 0);
});

test('over the control database: the quota set at project creation is what is enforced', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-rate-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const db = await openControlDb(join(dir, 'iam.db'));
  t.after(() => db.close());
  const root = await db.iam.authenticate((await db.iam.bootstrap()).key);
  const team = await db.iam.createProject(root, { name: 'team', quota: { fncallsPerSecond: 3 } });
  const child = await db.iam.createProject(root, { name: 'c', parentId: team.id });
  const clock = { ms: 0 };
  const limiter = new FnCallRateLimiter({
    limits: (id) => db.iam.fncallRateLimits(id),
    now: () => clock.ms,
  });
  assert.equal(await admitted(limiter, child.id, 5), 3);
  await assert.rejects(
    limiter.acquire(team.id),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['projectId'] === team.id,
  );
  assert.equal(await admitted(limiter, root.projectId, 100), 100);
});

test('property: in any window, admitted calls ≤ one second of burst + the rate × its length', async () => {
  await fc.assert(
    fc.asyncProperty(
      fc.integer({ min: 1, max: 50 }),
      fc.array(fc.tuple(fc.integer({ min: 0, max: 400 }), fc.integer({ min: 1, max: 8 })), {
        minLength: 1,
        maxLength: 120,
      }),
      async (rate, steps) => {
        const { limiter, clock } = setup({ p: [lim('p', rate)] });
        const admitted: { atMs: number; n: number }[] = [];
        for (const [gapMs, n] of steps) {
          clock.ms += gapMs;
          try {
            await limiter.acquire('p', n);
            admitted.push({ atMs: clock.ms, n });
          } catch (e) {
            assert.ok(isDsecError(e, 'quota_exceeded'));
          }
        }
        // Debt from a batch over the burst is paid before anything else is admitted, so the
        // bound holds for the calls admitted after the window's first admission.
        for (let i = 0; i < admitted.length; i++) {
          let calls = 0;
          for (let j = i; j < admitted.length; j++) {
            calls += admitted[j]!.n;
            const windowMs = admitted[j]!.atMs - admitted[i]!.atMs;
            const last = admitted[j]!.n;
            assert.ok(
              calls - last <= rate + (rate * windowMs) / 1000 + 1e-9,
              `${calls - last} calls admitted before ${windowMs} ms at ${rate}/s`,
            );
          }
        }
      },
    ),
    { numRuns: 300 },
  );
});

test('property: calls spaced at the rate are never refused', async () => {
  await fc.assert(
    fc.asyncProperty(fc.integer({ min: 1, max: 1000 }), fc.nat(200), async (rate, calls) => {
      const { limiter, clock } = setup({ p: [lim('p', rate)] });
      for (let i = 0; i < calls; i++) {
        await limiter.acquire('p');
        clock.ms += Math.ceil(1000 / rate);
      }
    }),
    { numRuns: 100 },
  );
});
