import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';
import { isDsecError } from '@dsec/core';
import { bisect, MicroBatcher } from './batcher.js';
import { IpSession, NftSession, runTool, startTool } from './sys.js';

describe('MicroBatcher', () => {
  it('runs the callers of one tick as one batch and later callers as the next', async () => {
    const batches: number[][] = [];
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const b = new MicroBatcher<number, number>(async (items) => {
      batches.push(items);
      if (batches.length === 1) await gate;
      return items.map((i) => ({ status: 'fulfilled', value: i * 10 }));
    });
    const first = [1, 2, 3].map((i) => b.submit(i));
    await new Promise((resolve) => setImmediate(resolve));
    // The first batch is running: these wait and go together.
    const second = [4, 5].map((i) => b.submit(i));
    release();
    assert.deepEqual(await Promise.all([...first, ...second]), [10, 20, 30, 40, 50]);
    assert.deepEqual(batches, [
      [1, 2, 3],
      [4, 5],
    ]);
    await b.idle();
  });

  it('gives each caller its own outcome, and a thrown batch fails all of its callers', async () => {
    const b = new MicroBatcher<number, number>(async (items) => {
      if (items.includes(0)) throw new Error('whole batch');
      return items.map((i) =>
        i < 0
          ? { status: 'rejected', reason: new Error(`bad ${i}`) }
          : { status: 'fulfilled', value: i },
      );
    });
    const [ok, bad] = await Promise.allSettled([b.submit(1), b.submit(-1)]);
    assert.deepEqual(ok, { status: 'fulfilled', value: 1 });
    assert.equal(bad?.status, 'rejected');
    const all = await Promise.allSettled([b.submit(0), b.submit(2)]);
    assert.deepEqual(
      all.map((r) => r.status),
      ['rejected', 'rejected'],
    );
  });
});

describe('bisect', () => {
  it('isolates the items that fail an all-or-nothing run', async () => {
    const runs: string[][] = [];
    const results = await bisect(['a', 'b', 'bad', 'c', 'd'], async (items) => {
      runs.push(items);
      if (items.includes('bad')) throw new Error('bad item in run');
    });
    assert.deepEqual(
      results.map((r) => r.status),
      ['fulfilled', 'fulfilled', 'rejected', 'fulfilled', 'fulfilled'],
    );
    // Every good item was applied in some run that succeeded.
    const applied = runs.filter((r) => !r.includes('bad')).flat();
    assert.deepEqual(applied.sort(), ['a', 'b', 'c', 'd']);
  });
});

const hasIp = spawnSync('ip', ['-V']).status === 0;

describe('IpSession', { skip: hasIp ? false : 'needs iproute2' }, () => {
  it('runs requests through one process and names the ones that fail', async () => {
    const ip = new IpSession();
    try {
      const outcomes = await Promise.allSettled([
        ip.run(['link show dev lo']),
        ip.run(['link show dev lo', 'link show dev dsnosuch0', 'link show dev lo']),
        ip.run(['link show dev lo']),
      ]);
      assert.equal(outcomes[0]?.status, 'fulfilled');
      assert.equal(outcomes[2]?.status, 'fulfilled');
      const failed = outcomes[1];
      assert.ok(failed?.status === 'rejected');
      assert.ok(isDsecError(failed.reason, 'internal'));
      assert.match(failed.reason.message, /dsnosuch0/);
      // After a failure the session starts a fresh process and goes on.
      await ip.run(['link show dev lo']);
    } finally {
      ip.close();
    }
  });
});

describe('startTool', () => {
  it('starts the process at once and takes its input later', async () => {
    const cat = startTool('cat', [], { stdin: true });
    assert.equal(await cat.finish('late input\n'), 'late input\n');
  });

  it('a tool killed before its input fails its finish with internal', async () => {
    const cat = startTool('cat', [], { stdin: true });
    cat.kill();
    await assert.rejects(cat.finish('x'), (e: unknown) => isDsecError(e, 'internal'));
  });
});

const canNft = process.getuid?.() === 0 && spawnSync('nft', ['list', 'tables']).status === 0;

describe('NftSession', { skip: canNft ? false : 'needs root and nftables' }, () => {
  const table = `inet dsec_unit_${process.pid}`;

  it('runs each request as one transaction, returns list output, and names what failed', async () => {
    const nft = new NftSession();
    try {
      await nft.run([`add table ${table}`, `add set ${table} s { type ipv4_addr; }`]);
      // Pipelined requests: each gets its own outcome, in order.
      const [added, failed, listed] = await Promise.allSettled([
        nft.run([`add element ${table} s { 10.0.0.1 }`]),
        // The second command fails in the kernel: the first must not stay either.
        nft.run([`add element ${table} s { 10.0.0.2 }`, `delete element ${table} s { 10.0.0.3 }`]),
        nft.run([`list set ${table} s`]),
      ]);
      assert.equal(added?.status, 'fulfilled');
      assert.ok(failed?.status === 'rejected');
      assert.ok(isDsecError(failed.reason, 'internal'));
      assert.match(failed.reason.message, /10\.0\.0\.3/);
      assert.ok(listed?.status === 'fulfilled');
      assert.deepEqual(elements(listed.value), ['10.0.0.1']);
    } finally {
      await runTool('nft', ['delete', 'table', ...table.split(' ')]).catch(() => undefined);
      nft.close();
    }
  });

  it('replaces its process after maxRequests without losing a request', async () => {
    const nft = new NftSession({ maxRequests: 2 });
    try {
      await nft.run([`add table ${table}`, `add set ${table} s { type ipv4_addr; }`]);
      await Promise.all(
        [1, 2, 3, 4, 5].map((i) => nft.run([`add element ${table} s { 10.0.1.${i} }`])),
      );
      const listed = await nft.run([`list set ${table} s`]);
      assert.deepEqual(
        elements(listed).sort(),
        [1, 2, 3, 4, 5].map((i) => `10.0.1.${i}`),
      );
    } finally {
      await runTool('nft', ['delete', 'table', ...table.split(' ')]).catch(() => undefined);
      nft.close();
    }
  });

  it('refuses a command with a newline (it would be two transactions)', async () => {
    const nft = new NftSession();
    try {
      await assert.rejects(nft.run(['list tables\nlist tables']), (e: unknown) =>
        isDsecError(e, 'internal'),
      );
    } finally {
      nft.close();
    }
  });

  function elements(output: unknown[]): string[] {
    const docs = output as { nftables: { set?: { elem?: string[] } }[] }[];
    return docs.flatMap((d) => d.nftables.flatMap((o) => o.set?.elem ?? []));
  }
});
