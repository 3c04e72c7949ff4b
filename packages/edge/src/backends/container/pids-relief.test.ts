import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { nearLimit, PidsRelief } from './pids-relief.js';
import type { ReliefTarget } from './pids-relief.js';

/** A directory standing in for a sandbox's pids cgroup, and a relief whose reclaims are counted. */
async function fixture() {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-pids-relief-'));
  const set = async (current: number, refused: number) => {
    await writeFile(join(dir, 'pids.current'), `${current}\n`);
    await writeFile(join(dir, 'pids.events'), `max ${refused}\n`);
  };
  await set(3, 0);
  const calls: unknown[][] = [];
  let release: () => void = () => undefined;
  const relief = new PidsRelief({
    reclaim: async (...args) => {
      calls.push(args);
      await new Promise<void>((resolve) => (release = resolve));
      return { processes: 700, groups: 1 };
    },
  });
  const target: ReliefTarget = {
    id: 'sb-1',
    cgroupDirs: () => [join(dir, 'no-such'), dir],
    pidsLimit: 1024,
    initPid: 11,
    chronusPid: 12,
  };
  return {
    dir,
    set,
    calls,
    relief,
    target,
    release: () => release(),
    close: async () => {
      relief.close();
      await rm(dir, { recursive: true, force: true });
    },
  };
}

test('nearLimit: within an eighth of the limit, never closer than the reserve', () => {
  assert.equal(nearLimit(1024, 1024), true);
  assert.equal(nearLimit(896, 1024), true);
  assert.equal(nearLimit(895, 1024), false);
  assert.equal(nearLimit(8, 16), true);
  assert.equal(nearLimit(7, 16), false);
  assert.equal(nearLimit(0, 0), true);
});

test('no reclaim without refused forks, nor when the sandbox is well below its limit', async () => {
  const f = await fixture();
  try {
    assert.equal(f.relief.check(f.target), undefined);
    await f.set(1024, 0); // full, but nothing was refused
    assert.equal(f.relief.check(f.target), undefined);
    await f.set(500, 40); // refusals, but far from the limit now
    assert.equal(f.relief.check(f.target), undefined);
    assert.equal(f.calls.length, 0);
  } finally {
    await f.close();
  }
});

test('refused forks near the limit: one reclaim, shared by concurrent calls, then quiet', async () => {
  const f = await fixture();
  try {
    await f.set(1020, 5);
    const a = f.relief.check(f.target);
    const b = f.relief.check(f.target);
    assert.ok(a && b);
    assert.equal(a, b, 'concurrent calls wait for the same reclaim');
    assert.deepEqual(f.calls, [[f.dir, 11, 12, 1024]]);
    f.release();
    assert.deepEqual(await a, { refused: false, reclaimedProcesses: 700, reclaimedGroups: 1 });
    // The same refusals do not start another; new ones near the limit do.
    assert.equal(f.relief.check(f.target), undefined);
    await f.set(1024, 9);
    const c = f.relief.check(f.target);
    assert.ok(c);
    f.release();
    await c;
    assert.equal(f.calls.length, 2);
  } finally {
    await f.close();
  }
});

test('refusals seen while below the limit still count once it is near again', async () => {
  const f = await fixture();
  try {
    await f.set(600, 3);
    assert.equal(f.relief.check(f.target), undefined);
    await f.set(1000, 3);
    const p = f.relief.check(f.target);
    assert.ok(p, 'the refusals were not forgotten');
    f.release();
    await p;
  } finally {
    await f.close();
  }
});

test('a failed reclaim lets the call go ahead; a sandbox without a pids cgroup is never read again', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-pids-relief-'));
  try {
    await writeFile(join(dir, 'pids.current'), '16\n');
    await writeFile(join(dir, 'pids.events'), 'max 1\n');
    const relief = new PidsRelief({
      reclaim: () => Promise.reject(new Error('helper died')),
    });
    const target = {
      id: 'sb-2',
      cgroupDirs: () => [dir],
      pidsLimit: 16,
      initPid: 1,
      chronusPid: 2,
    };
    assert.deepEqual(await relief.check(target), {
      refused: false,
      reclaimedProcesses: 0,
      reclaimedGroups: 0,
    });
    let asked = 0;
    const none = { ...target, id: 'sb-3', cgroupDirs: () => (asked++, [join(dir, 'x')]) };
    assert.equal(relief.check(none), undefined);
    assert.equal(relief.check(none), undefined);
    assert.equal(asked, 1);
    relief.forget('sb-2');
    relief.forget('sb-3');
    relief.close();
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
