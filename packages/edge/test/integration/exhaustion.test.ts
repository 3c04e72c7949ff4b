/**
 * SECURITY.md B11–B13 and issue 9 item 5: resource exhaustion inside a
 * sandbox never costs the platform its control. After a fork bomb, a memory
 * hog or a disk fill, the next exec, session call and file call succeed;
 * an exec that cannot get a process is `resource_exhausted` naming the pids
 * limit; a file write on a full disk is `resource_exhausted` naming the disk;
 * and the edge records `pids_limit` / `oom_killed` events.
 *
 * Each follow-up call gets a generous deadline (this checks that calls work,
 * not how fast: a loaded 2-core host must not make it flaky).
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';
import { isDsecError, randomId } from '@dsec/core';
import type { DsecError } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const run = promisify(execFile);
const root = process.getuid?.() === 0;
const CALL_DEADLINE_MS = 20_000;

async function within<T>(what: string, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new Error(`${what}: no answer in ${CALL_DEADLINE_MS} ms`)),
      CALL_DEADLINE_MS,
    );
  });
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

async function readAll(stream: NodeJS.ReadableStream): Promise<string> {
  const parts: Buffer[] = [];
  for await (const chunk of stream) parts.push(chunk as Buffer);
  return Buffer.concat(parts).toString('utf8');
}

/** The host directory of a sandbox's v1 pids cgroup. */
function pidsCgroup(cgroupParent: string, sandboxId: string): string {
  const name = 'dsec-' + createHash('sha256').update(sandboxId).digest('hex').slice(0, 20);
  return `/sys/fs/cgroup/pids/${cgroupParent}/${name}`;
}

async function pidsState(dir: string): Promise<{ current: number; refused: number }> {
  const current = Number((await readFile(join(dir, 'pids.current'), 'utf8')).trim());
  const events = await readFile(join(dir, 'pids.events'), 'utf8');
  return { current, refused: Number(/max (\d+)/.exec(events)?.[1] ?? 0) };
}

/**
 * The platform's three entry points, each of which must succeed: an exec, a
 * call in a shell session, and file calls (write unless the disk is full,
 * then read back what is there).
 */
async function entryPointsWork(edge: Edge, id: string, tag: string, writable = true) {
  const exec = await within(`${tag}: exec`, edge.runCommand(id, { shell: `echo exec-${tag}` }));
  assert.equal(exec.exitCode, 0, `${tag}: exec ${JSON.stringify(exec)}`);
  assert.equal(exec.stdout, `exec-${tag}\n`);

  const call = await within(
    `${tag}: session call`,
    edge.io.runInSession(id, `s-${tag}`, { line: `echo session-${tag}` }),
  );
  assert.equal(call.exitCode, 0, `${tag}: session ${JSON.stringify(call)}`);
  assert.equal(call.stdout, `session-${tag}\n`);

  if (writable) {
    await within(
      `${tag}: file write`,
      edge.io.writeFile(id, `/tmp/file-${tag}`, Buffer.from(`file-${tag}`)),
    );
  }
  const path = writable ? `/tmp/file-${tag}` : '/etc/passwd';
  const info = await within(`${tag}: file stat`, edge.io.statFile(id, path));
  assert.equal(info.type, 'file');
  const text = await within(`${tag}: file read`, edge.io.readFile(id, path).then(readAll));
  if (writable) assert.equal(text, `file-${tag}`);
  else assert.match(text, /root:/);
}

async function withEdge(
  fn: (edge: Edge, cgroupParent: string, dir: string) => Promise<void>,
  stateFsMb?: number,
): Promise<void> {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  // A disk fill without a quota fills the filesystem of the edge's state dir: give it a
  // small tmpfs of its own, so only that fills (never the host's disk).
  const stateFs = join(dir, 'statefs');
  if (stateFsMb !== undefined) {
    await mkdir(stateFs);
    await run('mount', [
      '-t',
      'tmpfs',
      '-o',
      `size=${stateFsMb}m,mode=0711`,
      'dsec-test-fill',
      stateFs,
    ]);
  }
  const stateDir = stateFsMb !== undefined ? join(stateFs, 'edge') : join(dir, 'edge');
  let edge: Edge | undefined;
  try {
    edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    const before = await hostResources(dir);
    await fn(edge, cgroupParent, dir);
    for (const sb of await edge.listSandboxes({})) await edge.stopSandbox(sb.id);
    assert.deepEqual(await hostResources(dir), before, 'nothing is left behind');
  } finally {
    if (edge) {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
    }
    if (stateFsMb !== undefined)
      await run('umount', [stateFs]).catch(() => run('umount', ['-l', stateFs]));
    await cleanup();
  }
}

const opts = { skip: root ? false : 'needs root', timeout: 180_000 };

test('B11: after a fork bomb the next exec, session call and file call work', opts, () =>
  withEdge(async (edge, cgroupParent) => {
    const pidsLimit = 96;
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'bomb',
      spec: spec({ pidsLimit, cpuCoresLimit: 0.5 }),
    });
    const cg = pidsCgroup(cgroupParent, sb.id);
    // A long-lived background process that a command legitimately leaves behind.
    const server = await edge.runCommand(sb.id, {
      shell: 'sleep 3600 </dev/null >/dev/null 2>&1 & echo $!',
    });
    assert.equal(server.exitCode, 0);
    const serverPid = server.stdout.trim();

    // The bomb's command returns at once; its processes live on and fill pids.max. Its own
    // shell may already meet the full pids cgroup (exit 2, "can't fork").
    const bomb = await edge.runCommand(sb.id, { shell: 'f(){ f | f & }; f', timeoutMs: 5000 });
    assert.ok(bomb.outcome === 'exited' && [0, 2].includes(bomb.exitCode), JSON.stringify(bomb));
    const deadline = Date.now() + 30_000;
    let state = await pidsState(cg);
    while (state.refused === 0 && Date.now() < deadline) {
      await sleep(50);
      state = await pidsState(cg);
    }
    assert.ok(state.refused > 0, `the bomb reached pids.max: ${JSON.stringify(state)}`);

    // The guarantee: the platform's entry points work right after the bomb.
    await entryPointsWork(edge, sb.id, 'bomb');
    // A bomb whose shells all died of failed forks may have emptied the cgroup by itself
    // before the first call; when a call did have to reclaim, the event says so and the
    // bomb (the largest group) went first, so the background process stays.
    const events = await edge.listEvents(sb.id);
    const limit = events.find((e) => e.kind === 'pids_limit');
    if (limit) {
      assert.equal(limit.details.max, pidsLimit);
      assert.ok(Number(limit.details.reclaimedProcesses) > 0, JSON.stringify(limit));
      const ps = await edge.runCommand(sb.id, { shell: 'ps -o pid,args' });
      assert.match(
        ps.stdout,
        new RegExp(`^\\s*${serverPid}\\s+sleep 3600`, 'm'),
        `${ps.stdout}\n${JSON.stringify(events)}`,
      );
    }
    // Without exhaustion nothing is reclaimed: the background process outlives more calls.
    for (let i = 0; i < 3; i++) await edge.runCommand(sb.id, { shell: 'true' });
    const again = await edge.runCommand(sb.id, { shell: `kill -0 ${serverPid} && echo alive` });
    assert.equal(again.stdout, 'alive\n');
  }),
);

test(
  'B11: an exec that cannot get a process is resource_exhausted naming the pids limit',
  opts,
  () =>
    withEdge(async (edge, cgroupParent) => {
      const pidsLimit = 32;
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'held',
        spec: spec({ pidsLimit }),
      });
      // Processes the platform must never kill hold every pid: host processes put into the
      // sandbox's pids cgroup (they are not in its pid namespace, so nothing there can be reclaimed).
      const cg = pidsCgroup(cgroupParent, sb.id);
      const holders: ChildProcess[] = [];
      try {
        for (let i = 0; (await pidsState(cg)).current < pidsLimit && i < pidsLimit; i++) {
          const p = spawn('sleep', ['600'], { stdio: 'ignore' });
          holders.push(p);
          await writeFile(join(cg, 'cgroup.procs'), `${p.pid}\n`).catch(() => undefined);
        }
        assert.equal((await pidsState(cg)).current, pidsLimit);
        const refused = await edge.runCommand(sb.id, { shell: 'echo hi' }).then(
          (r) => assert.fail(`ran: ${JSON.stringify(r)}`),
          (e: unknown) => e as DsecError,
        );
        assert.ok(isDsecError(refused, 'resource_exhausted'), String(refused));
        assert.deepEqual(refused.details, { limit: 'pids', max: pidsLimit });
        assert.match(refused.message, /pids limit \(32 processes\)/);
        assert.equal(refused.status, 429);
        const file = await edge.io.statFile(sb.id, '/etc/passwd').then(
          () => assert.fail('stat ran'),
          (e: unknown) => e as DsecError,
        );
        assert.ok(isDsecError(file, 'resource_exhausted'), String(file));
        const events = await edge.listEvents(sb.id);
        assert.ok(
          events.some((e) => e.kind === 'pids_limit' && e.details.refused === true),
          JSON.stringify(events),
        );
      } finally {
        for (const p of holders) p.kill('SIGKILL');
      }
      await sleep(100);
      await entryPointsWork(edge, sb.id, 'freed');
    }),
);

test(
  'B11: a bomb inside a live session shell is taken back by chronus for the next exec',
  opts,
  () =>
    withEdge(async (edge, cgroupParent) => {
      const pidsLimit = 128;
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'bomb-in-session',
        spec: spec({ pidsLimit, cpuCoresLimit: 0.5 }),
      });
      const cg = pidsCgroup(cgroupParent, sb.id);
      // The bomb's processes are a running command's tree (the session shell's), not leftovers:
      // the edge's reclaim from the host leaves them, and chronus's own (on its refused fork)
      // stops and kills that tree.
      await edge.io.runInSession(sb.id, 'bomb', { line: 'f(){ f | f & }; f >/dev/null 2>&1' });
      const deadline = Date.now() + 30_000;
      while ((await pidsState(cg)).refused === 0 && Date.now() < deadline) await sleep(20);
      assert.ok((await pidsState(cg)).refused > 0, 'the bomb reached pids.max');
      const exec = await within('exec', edge.runCommand(sb.id, { shell: 'echo after' }));
      assert.equal(exec.stdout, 'after\n', JSON.stringify(exec));
      const events = await edge.listEvents(sb.id);
      assert.ok(
        events.some((e) => e.kind === 'pids_limit' && Number(e.details.reclaimedProcesses) > 0),
        JSON.stringify(events),
      );
      // Nothing stays stopped: every process the reclaim stopped was killed.
      const ps = await edge.runCommand(sb.id, { shell: 'ps -o stat,args | grep -c "^T" || true' });
      assert.equal(ps.stdout.trim(), '0', ps.stdout);
      await entryPointsWork(edge, sb.id, 'bomb-in-session');
    }),
);

test('B12: after a memory hog is OOM-killed the next calls work and it is reported', opts, () =>
  withEdge(async (edge) => {
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'hog',
      spec: spec({ memoryLimitMb: 64 }),
    });
    const hog = await edge.runCommand(sb.id, {
      shell: 'head -c 400m /dev/zero | tail > /dev/null',
      timeoutMs: 60_000,
    });
    assert.equal(hog.outcome, 'oom', JSON.stringify(hog));
    await entryPointsWork(edge, sb.id, 'hog');
    // A hog left running in the background is killed by the OOM killer just the same.
    await edge.runCommand(sb.id, {
      shell: '(head -c 400m /dev/zero | tail >/dev/null) >/dev/null 2>&1 &',
    });
    await sleep(500);
    await entryPointsWork(edge, sb.id, 'hog2');
    const events = await edge.listEvents(sb.id);
    assert.ok(
      events.some((e) => e.kind === 'oom_killed'),
      JSON.stringify(events),
    );
  }),
);

test(
  'B13: a disk fill under a quota keeps calls working; a write is resource_exhausted',
  opts,
  () =>
    withEdge(async (edge) => {
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'fill',
        spec: spec({ diskLimitMb: 32 }),
      });
      const dd = await edge.runCommand(sb.id, {
        shell:
          'dd if=/dev/zero of=/fill bs=1M count=64; i=0; while touch /f$i 2>/dev/null; do i=$((i+1)); done',
        timeoutMs: 60_000,
      });
      assert.match(dd.stderr, /No space left on device/);
      await entryPointsWork(edge, sb.id, 'quota', false);
      const write = await edge.io.writeFile(sb.id, '/tmp/more', Buffer.alloc(1 << 20, 1)).then(
        () => assert.fail('the write went through on a full disk'),
        (e: unknown) => e as DsecError,
      );
      assert.ok(isDsecError(write, 'resource_exhausted'), String(write));
      assert.deepEqual(write.details, { limit: 'disk', maxMb: 32 });
      // Freeing space inside makes writes work again.
      await edge.runCommand(sb.id, { shell: 'rm -f /fill /f*' });
      await entryPointsWork(edge, sb.id, 'quota-freed');
    }),
);

test('B13: a disk fill without a quota (the node’s disk) keeps calls working', opts, () =>
  withEdge(async (edge) => {
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'fill', spec: spec() });
    const dd = await edge.runCommand(sb.id, {
      shell: 'dd if=/dev/zero of=/fill bs=1M count=256',
      timeoutMs: 60_000,
    });
    assert.match(dd.stderr, /No space left on device/, JSON.stringify(dd));
    await entryPointsWork(edge, sb.id, 'node', false);
    const write = await edge.io.writeFile(sb.id, '/tmp/more', Buffer.alloc(1 << 20, 1)).then(
      () => assert.fail('the write went through on a full disk'),
      (e: unknown) => e as DsecError,
    );
    assert.ok(isDsecError(write, 'resource_exhausted'), String(write));
    assert.deepEqual(write.details, { limit: 'disk' });
    await edge.runCommand(sb.id, { shell: 'rm -f /fill' });
    await entryPointsWork(edge, sb.id, 'node-freed');
  }, 96),
);

/** Milliseconds of one call, for the timing lines the scenario below prints. */
async function timed<T>(p: () => Promise<T>): Promise<{ ms: number; value: T }> {
  const t0 = performance.now();
  const value = await p();
  return { ms: Math.round(performance.now() - t0), value };
}

/** A fork bomb left running in the background of a finished command. */
const BOMB = 'f(){ f | f & }; f >/dev/null 2>&1 &';
/** A memory hog in the background, OOM-killed over and over (`tail` keeps what it reads). */
const HOG = '(while :; do head -c 2000m /dev/zero | tail >/dev/null; done) >/dev/null 2>&1 &';

/*
 * Issue 24 item 9: the platform's control right after exhaustion. In a
 * sandbox with the API's default limits, a fork bomb fills pids.max, a memory
 * hog is OOM-killed again and again, or both; the next exec must succeed.
 * How long it took is printed (a measurement for docs/security.md, never a
 * threshold here), with the same exec in an idle sandbox beside it.
 */
test('B11+B12: right after a fork bomb and a memory hog the next exec answers (timed)', opts, () =>
  withEdge(async (edge, cgroupParent) => {
    // CreateSandboxBody's defaults: what a sandbox that asks for nothing gets.
    const limits = { pidsLimit: 1024, memoryLimitMb: 512, cpuCoresLimit: 1 };
    const times: Record<string, number[]> = { idle: [], bomb: [], hog: [], both: [] };
    const rounds = Number(process.env.DSEC_EXHAUSTION_ROUNDS ?? 3);
    for (let round = 0; round < rounds; round++) {
      for (const scenario of ['idle', 'bomb', 'hog', 'both'] as const) {
        const sb = await edge.createSandbox({
          id: randomId('sb'),
          projectId: 'bomb-hog',
          spec: spec(limits),
        });
        const cg = pidsCgroup(cgroupParent, sb.id);
        await edge.runCommand(sb.id, { shell: 'true' }); // a warm reaper, as a live sandbox has
        if (scenario === 'hog' || scenario === 'both') {
          await edge.runCommand(sb.id, { shell: HOG });
          await sleep(500); // long enough for the first OOM kill
        }
        if (scenario === 'bomb' || scenario === 'both') {
          await edge.runCommand(sb.id, { shell: BOMB });
          const deadline = Date.now() + 30_000;
          while ((await pidsState(cg)).refused === 0 && Date.now() < deadline) await sleep(20);
          assert.ok((await pidsState(cg)).refused > 0, `${scenario}: the bomb reached pids.max`);
        }
        const r = await timed(() =>
          within(`${scenario}: exec`, edge.runCommand(sb.id, { shell: `echo ${scenario}` })),
        );
        assert.equal(r.value.exitCode, 0, `${scenario}: ${JSON.stringify(r.value)}`);
        assert.equal(r.value.stdout, `${scenario}\n`);
        times[scenario]!.push(r.ms);
        // The reclaim lowers pids.max while it runs; the sandbox's own limit is back after it.
        assert.equal(
          (await readFile(join(cg, 'pids.max'), 'utf8')).trim(),
          String(limits.pidsLimit),
        );
        // No check of a `pids_limit` event here: a bomb's process count swings, and when the exec
        // comes while it is below the reclaim threshold nothing is taken back (the exec simply
        // gets a process). The B11 tests above check the reclaim and its event.
        await edge.stopSandbox(sb.id);
      }
    }
    console.log(`exhaustion timing, next exec (ms): ${JSON.stringify(times)}`);
  }),
);
