/**
 * SECURITY.md B15 (noisy neighbour, outcome H): CPU, memory and IO stress in
 * sandbox A leaves sandbox B's exec latency and the edge's API within bound.
 *
 * A has one core and 256 MB; it runs four busy loops, a memory hog that is
 * OOM-killed inside A's cgroup over and over, and an fsync'ed write loop
 * (one bounded file, deleted each round). B's `true` is timed before and
 * during the stress. The bound is deliberately generous (this is an isolation
 * check, not a benchmark): B's p50 under stress ≤ max(10 × idle p50, 250 ms).
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readdir, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;
const RUNS = 30;
/** Spreads the samples over a few seconds, so they meet every phase of the stress loops. */
const GAP_MS = 100;

function p50(samples: number[]): number {
  const s = [...samples].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

async function timed<T>(fn: () => Promise<T>): Promise<{ ms: number; value: T }> {
  const t0 = performance.now();
  const value = await fn();
  return { ms: performance.now() - t0, value };
}

/** The sandbox cgroup dirs (dsec-*) under a cgroup parent, for one v1 controller. */
async function sandboxCgroups(ctrl: string, parent: string): Promise<string[]> {
  return (await readdir(`/sys/fs/cgroup/${ctrl}/${parent}`).catch(() => [] as string[])).filter(
    (n) => n.startsWith('dsec-'),
  );
}

async function readCg(ctrl: string, parent: string, name: string, file: string): Promise<string> {
  return readFile(`/sys/fs/cgroup/${ctrl}/${parent}/${name}/${file}`, 'utf8');
}

const oomKills = async (parent: string, name: string) =>
  Number(/oom_kill (\d+)/.exec(await readCg('memory', parent, name, 'memory.oom_control'))?.[1]);
const cpuNs = async (parent: string, name: string) =>
  Number((await readCg('cpuacct', parent, name, 'cpuacct.usage')).trim());

test(
  'B15: CPU, memory and IO stress in one sandbox keeps its neighbour and the API within bound',
  { skip: root ? false : 'needs root', timeout: 120_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      const before = await hostResources(dir);
      const a = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'noisy',
        spec: spec({ cpuCoresLimit: 1, memoryLimitMb: 256 }),
      });
      const [cgA] = await sandboxCgroups('memory', cgroupParent);
      assert.ok(cgA, "A's cgroup exists");
      const b = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'quiet',
        spec: spec({ cpuCoresLimit: 1, memoryLimitMb: 256 }),
      });
      const cgB = (await sandboxCgroups('memory', cgroupParent)).find((n) => n !== cgA);
      assert.ok(cgB, "B's cgroup exists");

      const execB = async (): Promise<number> => {
        const { ms, value } = await timed(() => edge.runCommand(b.id, { argv: ['true'] }));
        assert.equal(value.outcome, 'exited');
        assert.equal(value.exitCode, 0);
        return ms;
      };
      const api = async (): Promise<number[]> => [
        (await timed(() => edge.getSandbox(b.id))).ms,
        (await timed(() => edge.listSandboxes({}))).ms,
        (await timed(() => edge.status())).ms,
      ];

      // Idle baseline (a few warm-up calls first: the first exec opens B's channel).
      for (let i = 0; i < 3; i++) await execB();
      const idle: number[] = [];
      const idleApi: number[] = [];
      for (let i = 0; i < RUNS; i++) {
        idle.push(await execB());
        idleApi.push(...(await api()));
        await sleep(GAP_MS);
      }

      // The stress, as background commands in A.
      const cpu0 = await cpuNs(cgroupParent, cgA);
      const oom0 = await oomKills(cgroupParent, cgA);
      const stress = [
        ...Array.from({ length: 4 }, () => 'while :; do :; done'),
        // Reads /dev/zero into memory until the cgroup's OOM killer takes it; again and again.
        'while :; do tail /dev/zero >/dev/null 2>&1; done',
        // One 200 MB file at a time on A's writable layer, flushed, then deleted.
        'n=0; while :; do dd if=/dev/zero of=/root/big bs=1M count=200 conv=fsync >/dev/null 2>&1; rm -f /root/big; n=$((n+1)); echo $n >/root/dd-rounds; done',
      ];
      const started = await Promise.all(
        stress.map((shell) => edge.io.startCommand(a.id, { shell, timeoutMs: 300_000 })),
      );
      await sleep(1000);

      const stressed: number[] = [];
      const stressedApi: number[] = [];
      const t0 = performance.now();
      const cpu1 = await cpuNs(cgroupParent, cgA);
      for (let i = 0; i < RUNS; i++) {
        stressed.push(await execB());
        stressedApi.push(...(await api()));
        await sleep(GAP_MS);
      }
      const cpuShare = ((await cpuNs(cgroupParent, cgA)) - cpu1) / 1e6 / (performance.now() - t0);
      // The memory hog has been killed inside A (poll: the first kill may still be on its way).
      for (let i = 0; i < 100 && (await oomKills(cgroupParent, cgA)) === oom0; i++)
        await sleep(100);
      const oomA = (await oomKills(cgroupParent, cgA)) - oom0;
      // At least one 200 MB write was flushed to disk.
      const ddRounds = async () =>
        Number(
          (await edge.runCommand(a.id, { shell: 'cat /root/dd-rounds 2>/dev/null || echo 0' }))
            .stdout,
        );
      for (let i = 0; i < 100 && (await ddRounds()) === 0; i++) await sleep(200);
      const rounds = await ddRounds();
      const throttled = Number(
        /nr_throttled (\d+)/.exec(await readCg('cpu', cgroupParent, cgA, 'cpu.stat'))?.[1],
      );
      // The loops were still running all along (none died of the OOM kills).
      const running = (await Promise.all(started.map((c) => edge.io.getCommand(a.id, c.commandId))))
        .map((c) => c.state)
        .filter((s) => s === 'running').length;

      const numbers = {
        idleP50Ms: +p50(idle).toFixed(2),
        stressedP50Ms: +p50(stressed).toFixed(2),
        stressedMaxMs: +Math.max(...stressed).toFixed(2),
        idleApiP50Ms: +p50(idleApi).toFixed(3),
        stressedApiP50Ms: +p50(stressedApi).toFixed(3),
        stressedApiMaxMs: +Math.max(...stressedApi).toFixed(3),
        cpuA: +cpuShare.toFixed(2),
        cpuTotalA: +(((await cpuNs(cgroupParent, cgA)) - cpu0) / 1e9).toFixed(2),
        ddRoundsA: rounds,
        oomKillsA: oomA,
        throttledA: throttled,
      };
      console.log('B15', JSON.stringify(numbers));

      // A really was under stress: its loops ran, at about its one-core quota, throttled by
      // it, and its memory hog was OOM-killed there.
      assert.equal(running, stress.length, 'the stress loops kept running');
      assert.ok(cpuShare > 0.3, `A used ${cpuShare} cores`);
      assert.ok(cpuShare < 1.2, `A stayed within its one-core quota (${cpuShare})`);
      assert.ok(throttled > 0, "A's CPU quota throttled it");
      assert.ok(oomA > 0, 'the memory hog was OOM-killed inside A');
      assert.ok(rounds > 0, 'the IO loop flushed at least one file');
      // …and B was not touched: no OOM kill there, its commands all succeeded (execB asserts),
      // within the bound.
      assert.equal(await oomKills(cgroupParent, cgB), 0, 'no OOM kill in B');
      const bound = Math.max(10 * p50(idle), 250);
      assert.ok(
        p50(stressed) <= bound,
        `B's exec p50 under stress ${p50(stressed)} ms > ${bound} ms`,
      );
      const apiBound = Math.max(10 * p50(idleApi), 250);
      assert.ok(
        p50(stressedApi) <= apiBound,
        `API p50 under stress ${p50(stressedApi)} ms > ${apiBound} ms`,
      );
      assert.equal((await edge.getSandbox(a.id)).state, 'running', 'A itself survived its hog');

      // Stop the stress, then both sandboxes: nothing is left behind.
      for (const c of started) await edge.io.killCommand(a.id, c.commandId);
      for (const c of started)
        assert.equal((await edge.io.waitCommand(a.id, c.commandId)).outcome, 'killed');
      await edge.stopSandbox(a.id);
      await edge.stopSandbox(b.id);
      assert.deepEqual(await hostResources(dir), before);
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
      await cleanup();
    }
  },
);
