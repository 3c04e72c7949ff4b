import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import Database from 'better-sqlite3';
import { isDsecError, randomId } from '@dsec/core';
import { openContainerEdge, type ContainerEdgeOptions, type Edge } from '@dsec/edge';
import type { DirImageStore } from '@dsec/images';
import { makeStateDir, spec } from './fixture.js';

/**
 * Pause and resume of container sandboxes (issue 11, docs/adr/0012-pause-and-resume.md):
 * the freezer, memory pushed to the edge's own swap files, transparent resume,
 * TTLs, adoption after a restart and kill -9 in the middle of both.
 */

type Extra = Partial<Pick<ContainerEdgeOptions, 'pausedTtlMs' | 'idleTimeoutMs' | 'ttlSweepMs'>>;

interface Ctx {
  edge: Edge;
  dir: string;
  store: DirImageStore;
  cgroupParent: string;
  logs: { msg: string; fields?: Record<string, unknown> }[];
  /** Closes the edge (its sandboxes keep running, as when its process ends). */
  close(): Promise<void>;
  /** Closes the edge if open and opens a new one on the same state dir. */
  reopen(extra?: Extra): Promise<Edge>;
}

/** Small swap files: enough for these tests' sandboxes, cheap on a shared disk. */
const SWAP = { pauseSwapChunkBytes: 512 * 2 ** 20, pauseSwapMaxBytes: 2 ** 30 };

function edgeOptions(
  c: Pick<Ctx, 'dir' | 'store' | 'cgroupParent' | 'logs'>,
  extra: Extra,
): ContainerEdgeOptions {
  return {
    edgeId: 'node-1',
    stateDir: join(c.dir, 'edge'),
    store: c.store,
    cgroupParent: c.cgroupParent,
    network: { mode: 'none' },
    log: (msg, fields) => c.logs.push({ msg, ...(fields ? { fields } : {}) }),
    ...SWAP,
    ...extra,
  };
}

async function withEdge(fn: (ctx: Ctx) => Promise<void>, extra: Extra = {}): Promise<void> {
  const state = await makeStateDir();
  const base = { dir: state.dir, store: state.store, cgroupParent: state.cgroupParent, logs: [] };
  let open = true;
  const ctx: Ctx = {
    ...base,
    edge: await openContainerEdge(edgeOptions(base, extra)),
    async close() {
      if (open) await ctx.edge.close();
      open = false;
    },
    async reopen(more: Extra = {}) {
      await ctx.close();
      ctx.edge = await openContainerEdge(edgeOptions(base, { ...extra, ...more }));
      open = true;
      return ctx.edge;
    },
  };
  try {
    await fn(ctx);
  } finally {
    // Whatever failed above, leave nothing behind: sandboxes, swap, state.
    if (!open) await ctx.reopen().catch(() => undefined);
    for (const sb of await ctx.edge.listSandboxes({}).catch(() => []))
      await ctx.edge.stopSandbox(sb.id).catch(() => undefined);
    await ctx.edge.close().catch(() => undefined);
    const left = swapFilesUnder(state.dir);
    for (const file of left) spawnSync('swapoff', [file]);
    await state.cleanup();
    assert.deepEqual(left, [], 'the swap files went with the last pause');
  }
}

function hostSwapFreeBytes(): number {
  const meminfo = readFileSync('/proc/meminfo', 'utf8');
  return Number(/^SwapFree:\s+(\d+) kB$/m.exec(meminfo)?.[1] ?? 0) * 1024;
}

/** Active swap areas under `dir` (from /proc/swaps). */
function swapFilesUnder(dir: string): string[] {
  return readFileSync('/proc/swaps', 'utf8')
    .split('\n')
    .slice(1)
    .map((l) => l.split(/\s+/)[0] ?? '')
    .filter((f) => f.startsWith(dir));
}

/** The sandbox's v1 cgroup directory of `controller` (one sandbox per cgroup parent here, or by id). */
function cgroupDir(ctx: Pick<Ctx, 'cgroupParent'>, controller: string, index = 0): string {
  const parent = `/sys/fs/cgroup/${controller}/${ctx.cgroupParent}`;
  const names = readdirSync(parent)
    .filter((n) => n.startsWith('dsec-'))
    .sort();
  return join(parent, names[index]!);
}

function freezerState(ctx: Pick<Ctx, 'cgroupParent'>, index = 0): string {
  return readFileSync(join(cgroupDir(ctx, 'freezer', index), 'freezer.state'), 'utf8').trim();
}

/** The writable layer of the only sandbox of this state dir, seen from the host. */
function upperDir(ctx: Pick<Ctx, 'dir'>): string {
  const sandboxes = join(ctx.dir, 'edge', 'sandboxes');
  const [name] = readdirSync(sandboxes).filter((n) => n.startsWith('dsec-'));
  return join(sandboxes, name!, 'upper');
}

/** Holds `mib` MiB of touched anonymous memory in an awk string, and sleeps. */
const holdMemory = (mib: number) =>
  `awk 'BEGIN { s = sprintf("%${mib * 1048576}s", ""); while (1) system("sleep 1") }'`;

/** A background counter: `/tmp/count` grows while the sandbox runs. */
// Written to a new file and renamed: a reader never sees the truncated file between two writes
// (that made `cat /tmp/count` print nothing now and then on a loaded machine).
const COUNTER =
  'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new && mv -f /tmp/count.new /tmp/count; sleep 0.05; done';

test('pause freezes the sandbox and swaps its memory out; resume keeps processes, sessions and memory', async () => {
  await withEdge(async (ctx) => {
    const { edge } = ctx;
    const id = (
      await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p1',
        spec: spec({ memoryLimitMb: 256 }),
      })
    ).id;
    const hadSwap = hostSwapFreeBytes() > 256 * 2 ** 20;
    const hog = await edge.io.startCommand(id, { shell: holdMemory(96) });
    const counter = await edge.io.startCommand(id, { shell: COUNTER });
    const blob = await edge.runCommand(id, {
      shell: 'head -c 32m /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob',
    });
    assert.equal(blob.exitCode, 0, blob.stderr);
    await edge.io.runInSession(id, 'work', {
      line: 'cd /tmp; export MARK=before-pause; sleep 1000 & echo $! > /tmp/job',
    });
    // The hog's string is touched once awk has built it.
    for (let i = 0; i < 100; i++) {
      if (((await edge.getSandbox(id)).memoryBytes ?? 0) > 96 * 2 ** 20) break;
      await sleep(100);
    }
    const running = await edge.getSandbox(id);
    assert.ok(running.memoryBytes! > 128 * 2 ** 20, `charged ${running.memoryBytes}`);
    assert.equal(
      (await edge.listSandboxes({})).find((s) => s.id === id)?.memoryBytes,
      undefined,
      'lists leave memoryBytes out',
    );

    const paused = await edge.pauseSandbox(id);
    assert.equal(paused.state, 'paused');
    assert.ok(paused.pausedAt && paused.pausedExpiresAt);
    const pausedMs = Date.parse(paused.pausedExpiresAt) - Date.parse(paused.pausedAt);
    assert.equal(pausedMs, 24 * 3_600_000, 'the default paused TTL is a day');
    assert.equal(freezerState(ctx), 'FROZEN');
    const info = await edge.getSandbox(id);
    assert.equal(info.state, 'paused');
    assert.ok(
      info.memoryBytes! < running.memoryBytes! / 20,
      `paused ${info.memoryBytes} vs running ${running.memoryBytes}`,
    );
    assert.equal(
      readFileSync(join(cgroupDir(ctx, 'memory'), 'memory.limit_in_bytes'), 'utf8').trim(),
      String(256 * 2 ** 20),
      'the memory limit is back to the spec while paused',
    );
    assert.ok(
      swapFilesUnder(ctx.dir).length > 0 || hadSwap,
      'the edge added swap of its own (unless the host had enough already)',
    );
    // Nothing runs: the counter (read from the host, in the writable layer) stands still.
    const countFile = join(upperDir(ctx), 'tmp', 'count');
    const frozenAt = readFileSync(countFile, 'utf8');
    await sleep(300);
    assert.equal(readFileSync(countFile, 'utf8'), frozenAt, 'nothing ran while paused');

    const resumed = await edge.resumeSandbox(id);
    assert.equal(resumed.state, 'running');
    assert.equal(resumed.pausedAt, undefined);
    assert.equal(freezerState(ctx), 'THAWED');
    assert.ok(
      Date.parse(resumed.expiresAt) > Date.parse(running.expiresAt),
      'the running TTL did not run down while paused',
    );

    const session = await edge.io.runInSession(id, 'work', {
      line: 'echo "$MARK $(pwd)"; kill -0 $(cat /tmp/job) && echo job-alive',
    });
    assert.equal(session.stdout, 'before-pause /tmp\njob-alive\n');
    const again = await edge.runCommand(id, { shell: 'sha256sum /dev/shm/blob' });
    assert.equal(again.stdout, blob.stdout, 'tmpfs contents came back from swap intact');
    const c1 = Number((await edge.runCommand(id, { argv: ['cat', '/tmp/count'] })).stdout);
    await sleep(300);
    const c2 = Number((await edge.runCommand(id, { argv: ['cat', '/tmp/count'] })).stdout);
    assert.ok(c2 > c1, `the counter runs again (${c1} → ${c2})`);
    for (const cmd of [hog, counter])
      assert.equal((await edge.io.getCommand(id, cmd.commandId)).state, 'running');
  });
});

test('a paused sandbox resumes by itself on its next exec, session, file or port call; concurrent calls share one resume', async () => {
  await withEdge(async (ctx) => {
    const { edge } = ctx;
    const id = (await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() })).id;
    await edge.io.writeFile(id, '/tmp/note', Buffer.from('kept\n'));
    const resumes = () => ctx.logs.filter((l) => l.msg === 'sandbox resumed').length;

    await edge.pauseSandbox(id);
    const r = await edge.runCommand(id, { argv: ['echo', 'back'] });
    assert.equal(r.stdout, 'back\n');
    assert.equal((await edge.getSandbox(id)).state, 'running');
    assert.equal(resumes(), 1);

    // Everything at once on a paused sandbox: one resume serves them all.
    await edge.pauseSandbox(id);
    assert.equal(freezerState(ctx), 'FROZEN');
    const read = async () => {
      const chunks: Buffer[] = [];
      for await (const c of await edge.io.readFile(id, '/tmp/note')) chunks.push(c as Buffer);
      return Buffer.concat(chunks).toString();
    };
    const [exec, session, file, stat] = await Promise.all([
      edge.runCommand(id, { shell: 'echo $((6 * 7))' }),
      edge.io.runInSession(id, 's', { line: 'echo session' }),
      read(),
      edge.io.statFile(id, '/tmp/note'),
    ]);
    assert.equal(exec.stdout, '42\n');
    assert.equal(session.stdout, 'session\n');
    assert.equal(file, 'kept\n');
    assert.equal(stat.size, 5);
    assert.equal(resumes(), 2, 'concurrent calls shared one resume');
    assert.equal(freezerState(ctx), 'THAWED');

    // A port call resumes too (nothing listens: the sandbox answers, it is not frozen).
    await edge.pauseSandbox(id);
    await edge.io.connectPort(id, 9).then(
      (s) => s.destroy(),
      () => undefined,
    );
    assert.equal((await edge.getSandbox(id)).state, 'running');
    assert.equal(resumes(), 3);
  });
});

test('pause and resume are no-ops when repeated; stopped and unknown sandboxes are refused', async () => {
  await withEdge(async (ctx) => {
    const { edge } = ctx;
    const id = (await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() })).id;
    assert.equal((await edge.resumeSandbox(id)).state, 'running', 'resuming a running one');
    const first = await edge.pauseSandbox(id);
    const second = await edge.pauseSandbox(id);
    assert.equal(second.state, 'paused');
    assert.equal(second.pausedAt, first.pausedAt, 'a second pause changes nothing');
    assert.equal(
      ctx.logs.filter((l) => l.msg === 'sandbox paused').length,
      1,
      'the second pause did not freeze again',
    );
    // Concurrent pause and resume: both finish, in order, and the sandbox works.
    const [, resumed] = await Promise.all([edge.pauseSandbox(id), edge.resumeSandbox(id)]);
    assert.equal(resumed.state, 'running');
    assert.equal(freezerState(ctx), 'THAWED');

    await edge.pauseSandbox(id);
    await edge.stopSandbox(id); // a paused sandbox stops: its frozen processes are killed
    assert.equal((await edge.getSandbox(id)).state, 'stopped');
    const notRunning = (e: unknown) => isDsecError(e, 'sandbox_not_running');
    await assert.rejects(edge.pauseSandbox(id), notRunning);
    await assert.rejects(edge.resumeSandbox(id), notRunning);
    await assert.rejects(edge.setSandboxTimeout(id, 60), notRunning);
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }), notRunning);
    const notFound = (e: unknown) => isDsecError(e, 'sandbox_not_found');
    await assert.rejects(edge.pauseSandbox('sb-nope'), notFound);
    await assert.rejects(edge.resumeSandbox('sb-nope'), notFound);
    await assert.rejects(edge.setSandboxTimeout('sb-nope', 60), notFound);
  });
});

test('paused TTL: a paused sandbox is stopped after it; the running TTL does not run down while paused', async () => {
  await withEdge(
    async (ctx) => {
      const { edge } = ctx;
      const kept = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p1',
        spec: spec({ ttlSeconds: 2 }),
      });
      const left = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
      await edge.pauseSandbox(kept.id);
      const paused = await edge.pauseSandbox(left.id);
      assert.equal(
        Date.parse(paused.pausedExpiresAt!) - Date.parse(paused.pausedAt!),
        3000,
        'pausedTtlMs',
      );
      // Past its 2 s running TTL while paused: still there.
      await sleep(2500);
      assert.equal((await edge.getSandbox(kept.id)).state, 'paused');
      const resumedAt = Date.now();
      const resumed = await edge.resumeSandbox(kept.id);
      assert.ok(
        Date.parse(resumed.expiresAt) >= resumedAt,
        'the deadline moved by the time spent paused',
      );
      // Left paused beyond 3 s: stopped by the paused TTL.
      await waitFor(async () => (await edge.getSandbox(left.id)).state === 'stopped', 5000);
      assert.equal((await edge.getSandbox(left.id)).reason, 'paused ttl expired');
      // The resumed one has what was left of its 2 s, then the running TTL stops it.
      await waitFor(async () => (await edge.getSandbox(kept.id)).state === 'stopped', 5000);
      assert.equal((await edge.getSandbox(kept.id)).reason, 'ttl expired');
    },
    { pausedTtlMs: 3000, ttlSweepMs: 100 },
  );
});

test('setSandboxTimeout moves the deadline either way, is bounded, and holds across an edge restart', async () => {
  await withEdge(
    async (ctx) => {
      const id = (
        await ctx.edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() })
      ).id;
      const bad = (e: unknown) => isDsecError(e, 'invalid_argument');
      for (const ttl of [0, 0.5, 7 * 24 * 3600 + 1, Number.NaN, Number.POSITIVE_INFINITY])
        await assert.rejects(ctx.edge.setSandboxTimeout(id, ttl), bad, String(ttl));
      const before = Date.now();
      const week = await ctx.edge.setSandboxTimeout(id, 7 * 24 * 3600);
      assert.ok(Date.parse(week.expiresAt) >= before + 7 * 24 * 3_600_000);
      // Paused: the TTL counts from the resume; read now, it is now + ttl.
      await ctx.edge.pauseSandbox(id);
      const t0 = Date.now();
      const pausedSet = await ctx.edge.setSandboxTimeout(id, 600);
      const at = Date.parse(pausedSet.expiresAt);
      assert.ok(at >= t0 + 600_000 - 50 && at <= Date.now() + 600_000 + 50, pausedSet.expiresAt);
      await ctx.edge.resumeSandbox(id);
      // Shortened, then the edge restarts: the new deadline is what it enforces.
      await ctx.edge.setSandboxTimeout(id, 2);
      const edge = await ctx.reopen();
      assert.equal((await edge.getSandbox(id)).state, 'running');
      await waitFor(async () => (await edge.getSandbox(id)).state === 'stopped', 5000);
      assert.equal((await edge.getSandbox(id)).reason, 'ttl expired');
    },
    { ttlSweepMs: 100 },
  );
});

test('idleTimeoutMs pauses (not stops) a sandbox nobody uses; a command in progress keeps it running', async () => {
  await withEdge(
    async (ctx) => {
      const { edge } = ctx;
      const idle = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
      const busy = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
      const long = edge.runCommand(busy.id, { shell: 'sleep 3; echo done' });
      await waitFor(async () => (await edge.getSandbox(idle.id)).state === 'paused', 5000);
      assert.equal((await edge.getSandbox(busy.id)).state, 'running', 'its command still runs');
      assert.equal((await long).stdout, 'done\n');
      assert.ok(
        ctx.logs.some((l) => l.msg === 'sandbox paused' && l.fields?.reason === 'idle'),
        'logged as an idle pause',
      );
      // Used again: resumed, and paused again once idle.
      assert.equal((await edge.runCommand(idle.id, { argv: ['true'] })).exitCode, 0);
      assert.equal((await edge.getSandbox(idle.id)).state, 'running');
      await waitFor(async () => (await edge.getSandbox(busy.id)).state === 'paused', 5000);
    },
    { idleTimeoutMs: 1000, ttlSweepMs: 100 },
  );
});

test('an edge restarted with paused sandboxes adopts them paused, their memory still in its swap', async () => {
  await withEdge(async (ctx) => {
    const id = (await ctx.edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() }))
      .id;
    // Detached: a command the edge runs ends with the edge's connection to the sandbox.
    await ctx.edge.runCommand(id, {
      shell: `setsid sh -c '${COUNTER}' </dev/null >/dev/null 2>&1 &`,
    });
    const paused = await ctx.edge.pauseSandbox(id);
    const made = swapFilesUnder(ctx.dir);
    const edge = await ctx.reopen();
    assert.deepEqual(swapFilesUnder(ctx.dir), made, 'swap files stay while a sandbox is paused');
    const adopted = await edge.getSandbox(id);
    assert.equal(adopted.state, 'paused');
    assert.equal(adopted.pausedAt, paused.pausedAt);
    assert.equal(freezerState(ctx), 'FROZEN');
    const r = await edge.runCommand(id, { shell: 'cat /tmp/count; sleep 0.3; cat /tmp/count' });
    const [a, b] = r.stdout.trim().split('\n').map(Number);
    assert.ok(b! > a!, `the counter runs again after the adopted resume (${a} → ${b})`);
    assert.equal((await edge.getSandbox(id)).state, 'running');
  });
});

/** Polls `cond` every 50 ms for up to `ms`. */
async function waitFor(cond: () => Promise<boolean>, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`not within ${ms} ms`);
    await sleep(50);
  }
}

/** The sandbox's cgroup directory of `controller` (the container backend's naming). */
function cgroupOf(ctx: Pick<Ctx, 'cgroupParent'>, id: string, controller: string): string {
  const name = 'dsec-' + createHash('sha256').update(id).digest('hex').slice(0, 20);
  return `/sys/fs/cgroup/${controller}/${ctx.cgroupParent}/${name}`;
}

/** Runs pause-crash-child.ts and kill -9s it `killAfterMs` after it opened the edge. */
async function crashDuring(
  ctx: Ctx,
  action: 'pause' | 'resume',
  killAfterMs: number,
): Promise<void> {
  const child = spawn(
    process.execPath,
    [
      '--conditions=dsec-source',
      '--import',
      'tsx',
      new URL('./pause-crash-child.ts', import.meta.url).pathname,
      ctx.dir,
      ctx.cgroupParent,
      action,
    ],
    { stdio: ['ignore', 'pipe', 'inherit'] },
  );
  let out = '';
  child.stdout.setEncoding('utf8').on('data', (s: string) => (out += s));
  const exited = new Promise((resolve) => child.once('exit', resolve));
  for (let i = 0; i < 400 && !out.includes('ready\n'); i++) await sleep(25);
  assert.ok(out.includes('ready\n'), 'the child opened the edge');
  await sleep(killAfterMs);
  child.kill('SIGKILL');
  await exited;
}

test('kill -9 of the edge during pause or resume leaves every sandbox paused or running, never lost', async () => {
  await withEdge(async (ctx) => {
    const ids: string[] = [];
    const blobs: string[] = [];
    for (let i = 0; i < 2; i++) {
      const id = (
        await ctx.edge.createSandbox({
          id: randomId('sb'),
          projectId: 'p1',
          spec: spec({ memoryLimitMb: 256 }),
        })
      ).id;
      ids.push(id);
      // Detached, so they outlive the edges that come and go here.
      await ctx.edge.runCommand(id, {
        shell: `setsid sh -c '${COUNTER}' </dev/null >/dev/null 2>&1 & setsid ${holdMemory(128)} </dev/null >/dev/null 2>&1 & echo $! > /tmp/hog`,
      });
      const blob = await ctx.edge.runCommand(id, {
        shell: 'head -c 16m /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob',
      });
      blobs.push(blob.stdout);
    }
    await waitFor(async () => {
      const charged = await Promise.all(ids.map((id) => ctx.edge.getSandbox(id)));
      return charged.every((s) => s.memoryBytes! > 128 * 2 ** 20);
    }, 20_000);
    await ctx.close();

    let caught = 0;
    const rounds: ['pause' | 'resume', number][] = [
      ['pause', 100],
      ['resume', 0],
      ['pause', 400],
      ['resume', 20],
      ['pause', 20],
      ['resume', 200],
    ];
    for (const [action, killAfterMs] of rounds) {
      await crashDuring(ctx, action, killAfterMs);
      const db = new Database(join(ctx.dir, 'edge', 'edge.db'), { readonly: true });
      caught += (
        db.prepare('SELECT count(*) AS n FROM sandboxes WHERE intent IS NOT NULL').get() as {
          n: number;
        }
      ).n;
      db.close();
      // The next edge finishes what was begun: each sandbox is paused or running, as it says.
      const edge = await ctx.reopen();
      for (const id of ids) {
        const info = await edge.getSandbox(id);
        const frozen = readFileSync(join(cgroupOf(ctx, id, 'freezer'), 'freezer.state'), 'utf8');
        assert.ok(
          (info.state === 'paused' && frozen.trim() === 'FROZEN') ||
            (info.state === 'running' && frozen.trim() === 'THAWED'),
          `${action} killed after ${killAfterMs} ms: ${info.state}, freezer ${frozen.trim()}`,
        );
        assert.equal(
          readFileSync(join(cgroupOf(ctx, id, 'memory'), 'memory.limit_in_bytes'), 'utf8').trim(),
          String(256 * 2 ** 20),
        );
      }
      await ctx.close();
    }
    assert.ok(caught > 0, 'at least one kill landed in the middle of a transition');

    const edge = await ctx.reopen();
    for (const [i, id] of ids.entries()) {
      const r = await edge.runCommand(id, {
        shell: 'kill -0 $(cat /tmp/hog) && cat /tmp/count && sleep 0.3 && cat /tmp/count',
      });
      const [a, b] = r.stdout.trim().split('\n').map(Number);
      assert.ok(
        r.exitCode === 0 && b! > a!,
        `${id}: the hog lives and the counter runs (${JSON.stringify({ stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode, outcome: r.outcome })})`,
      );
      const blob = await edge.runCommand(id, { shell: 'sha256sum /dev/shm/blob' });
      assert.equal(blob.stdout, blobs[i], 'memory contents survived');
    }
  });
});
