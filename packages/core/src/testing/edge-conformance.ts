import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Readable } from 'node:stream';
import { isDsecError } from '../errors.js';
import type { EdgeApi } from '../edge-api.js';
import { parseLayerRef } from '../images.js';
import type { CommandInfo, SandboxIoApi } from '../sandbox-io.js';
import type { SandboxSpec } from '../types.js';

export interface EdgeUnderTest {
  /** An edge with room for exactly `capacitySandboxes` default sandboxes. */
  edge: EdgeApi;
  capacitySandboxes: number;
  /** Mints a valid sandbox ID for this edge. */
  mintId: () => string;
  /** A base image the edge can start (with a POSIX shell for the `io` cases). */
  image: string;
  /** Run the `io` cases (commands, sessions, files). Default: whether `edge.io` is set. */
  io?: boolean;
  /** Run the `listEvents` case. Default: whether `edge.listEvents` is set. */
  events?: boolean;
  /**
   * Run the pause/resume/timeout cases. Default: whether `edge.pauseSandbox`,
   * `resumeSandbox` and `setSandboxTimeout` are all set.
   */
  lifecycle?: boolean;
  /** Run the snapshot cases. Default: whether `edge.snapshotSandbox` is set. */
  snapshots?: boolean;
  /**
   * Run the FnCall cases (issue 14) with this runtime and a program in it
   * that copies stdin to stdout. Default: not run (a FnCall edge needs its
   * runtime images prepared).
   */
  fncall?: { language: string; echoCode: string } | undefined;
  cleanup?: () => Promise<void>;
}

export const conformanceSpec = (image: string): SandboxSpec => ({
  backend: 'container',
  image,
  toolkits: [],
  memoryLimitMb: 64,
  cpuCoresLimit: 0.1,
  pidsLimit: 64,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
});

/** Long enough for a real edge's container start; a hung stream fails instead of hanging. */
const CASE_TIMEOUT_MS = 120_000;

/**
 * The `EdgeApi` contract as tests; every implementation (the real edge, its
 * network client, the fake) runs it:
 * `edgeApiConformance('FakeEdge', async () => ({ ... }))`. `make` is
 * called once per case and must return a fresh, empty edge. The `io` cases
 * run where the implementation has an in-sandbox interface; they need a
 * shell with `echo`, `cat`, `sleep` and `head` in the image.
 */
export function edgeApiConformance(name: string, make: () => Promise<EdgeUnderTest>): void {
  const withEdge = (
    title: string,
    fn: (u: EdgeUnderTest) => Promise<void>,
    only: (u: EdgeUnderTest) => boolean = () => true,
  ): void =>
    void test(`${name}: ${title}`, { timeout: CASE_TIMEOUT_MS }, async (t) => {
      const u = await make();
      try {
        if (!only(u)) {
          t.skip(`${name} has no such interface`);
          return;
        }
        await fn(u);
      } finally {
        await u.cleanup?.();
      }
    });
  const hasIo = (u: EdgeUnderTest) => u.io ?? u.edge.io !== undefined;
  const hasEvents = (u: EdgeUnderTest) => u.events ?? u.edge.listEvents !== undefined;
  const hasLifecycle = (u: EdgeUnderTest) =>
    u.lifecycle ??
    (u.edge.pauseSandbox !== undefined &&
      u.edge.resumeSandbox !== undefined &&
      u.edge.setSandboxTimeout !== undefined);
  const hasSnapshots = (u: EdgeUnderTest) => u.snapshots ?? u.edge.snapshotSandbox !== undefined;
  const notRunning = (e: unknown) => isDsecError(e, 'sandbox_not_running');
  const create = async (u: EdgeUnderTest, projectId = 'prj-t') =>
    (await u.edge.createSandbox({ id: u.mintId(), projectId, spec: conformanceSpec(u.image) })).id;
  const nf = (e: unknown) => isDsecError(e, 'sandbox_not_found');

  withEdge('status names the edge', async ({ edge }) => {
    const s = await edge.status();
    assert.equal(s.edgeId, edge.edgeId);
    assert.ok(s.capacity.sandboxes >= 1);
  });

  withEdge('create, get, list, run, stop (twice)', async ({ edge, mintId, image }) => {
    const id = mintId();
    const info = await edge.createSandbox({ id, projectId: 'prj-t', spec: conformanceSpec(image) });
    assert.equal(info.id, id);
    assert.equal(info.edgeId, edge.edgeId);
    assert.equal(Date.parse(info.expiresAt) - Date.parse(info.createdAt), 600_000);
    assert.equal((await edge.getSandbox(id)).state, 'running');
    assert.deepEqual(
      (await edge.listSandboxes({ projectIds: ['prj-t'] })).map((s) => s.id),
      [id],
    );
    assert.deepEqual(await edge.listSandboxes({ projectIds: ['prj-other'] }), []);
    assert.deepEqual(await edge.listSandboxes({ projectIds: [] }), []);
    const chunks: Buffer[] = [];
    const r = await edge.runCommand(
      id,
      { argv: ['echo', 'hi'] },
      { onStdout: (c) => chunks.push(c) },
    );
    assert.equal(r.exitCode, 0);
    assert.match(r.stdout, /hi\n$/);
    assert.equal(Buffer.concat(chunks).toString(), r.stdout);
    await edge.stopSandbox(id);
    await edge.stopSandbox(id);
    assert.equal((await edge.getSandbox(id)).state, 'stopped');
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }), (e) =>
      isDsecError(e, 'sandbox_not_running'),
    );
  });

  withEdge(
    'fncall runs a call to completion and reports its pool',
    async ({ edge, fncall }) => {
      const { language, echoCode } = fncall!;
      const r = await edge.fncall!(
        { language, code: echoCode, stdin: 'conformance 1 2 3\n' },
        { projectId: 'prj-t' },
      );
      assert.equal(r.exitCode, 0);
      assert.equal(r.outcome, 'ok');
      assert.equal(r.stdout, 'conformance 1 2 3\n');
      assert.equal(r.truncated, false);
      assert.ok(r.durationMs >= 0);
      const pools = (await edge.status()).fncall ?? [];
      const pool = pools.find((p) => p.language === language && !p.network);
      assert.ok(pool, `status().fncall has no ${language} pool after a call`);
      assert.ok(pool.max >= pool.idle + pool.busy + pool.starting || pool.max === 0);
    },
    (u) => u.fncall !== undefined && u.edge.fncall !== undefined,
  );

  withEdge('unknown IDs are sandbox_not_found', async ({ edge, mintId }) => {
    const id = mintId();
    await assert.rejects(edge.getSandbox(id), nf);
    await assert.rejects(edge.stopSandbox(id), nf);
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }), nf);
  });

  withEdge('runCommand with projectId checks the project in the same call', async (u) => {
    const { edge } = u;
    const id = await create(u);
    const ok = await edge.runCommand(id, { argv: ['echo', 'mine'] }, { projectId: 'prj-t' });
    assert.equal(ok.exitCode, 0);
    await assert.rejects(
      edge.runCommand(id, { argv: ['echo', 'theirs'] }, { projectId: 'prj-other' }),
      nf,
    );
    if (hasIo(u)) {
      const io = edge.io!;
      await assert.rejects(io.runCommand(id, { argv: ['true'] }, { projectId: 'prj-other' }), nf);
      await assert.rejects(
        io.runInSession(id, 'other', { line: 'true' }, { projectId: 'prj-other' }),
        nf,
      );
      assert.equal(
        (await io.runInSession(id, 'mine', { line: 'echo ok' }, { projectId: 'prj-t' })).stdout,
        'ok\n',
      );
    }
    await edge.stopSandbox(id);
    // Another project's sandbox is not found whatever its state; the owner learns the state.
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }, { projectId: 'prj-other' }), nf);
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }, { projectId: 'prj-t' }), (e) =>
      isDsecError(e, 'sandbox_not_running'),
    );
  });

  withEdge(
    'admission refuses past capacity; stopping frees room',
    async ({ edge, mintId, image, capacitySandboxes }) => {
      const ids: string[] = [];
      for (let i = 0; i < capacitySandboxes; i++) {
        ids.push(
          (
            await edge.createSandbox({
              id: mintId(),
              projectId: 'prj-t',
              spec: conformanceSpec(image),
            })
          ).id,
        );
      }
      await assert.rejects(
        edge.createSandbox({ id: mintId(), projectId: 'prj-t', spec: conformanceSpec(image) }),
        (e) => isDsecError(e, 'capacity_exhausted'),
      );
      await edge.stopSandbox(ids[0]!);
      await edge.createSandbox({ id: mintId(), projectId: 'prj-t', spec: conformanceSpec(image) });
    },
  );

  withEdge('a requestId makes create idempotent', async ({ edge, mintId, image }) => {
    const a = await edge.createSandbox({
      id: mintId(),
      projectId: 'prj-t',
      spec: conformanceSpec(image),
      requestId: 'r1',
    });
    const b = await edge.createSandbox({
      id: mintId(),
      projectId: 'prj-t',
      spec: conformanceSpec(image),
      requestId: 'r1',
    });
    assert.equal(b.id, a.id);
    assert.equal((await edge.listSandboxes({ projectIds: ['prj-t'] })).length, 1);
  });

  // ---- the in-sandbox interface ----

  withEdge(
    'io: output streams while the command runs; stdin streams in; the log keeps it',
    async (u) => {
      const io = u.edge.io!;
      const id = await create(u);
      const started = await io.startCommand(id, {
        shell: 'echo first; cat; echo done',
        stdinOpen: true,
      });
      assert.equal(started.state, 'running');
      assert.equal(started.background, true);
      // Stdin goes in only after "first" came out: output that waited for the
      // end of the command would never arrive, and the case would time out.
      const out: Buffer[] = [];
      let fed: Promise<unknown> | undefined;
      const result = await io.watchCommand(id, started.commandId, {
        onStdout: (chunk) => {
          out.push(chunk);
          if (!fed && Buffer.concat(out).toString().includes('first\n')) {
            fed = (async () => {
              assert.deepEqual(await io.writeStdin(id, started.commandId, Buffer.from('a\n')), {
                bytes: 2,
              });
              const more = Readable.from([Buffer.from('b\n'), Buffer.from('c\n')]);
              assert.deepEqual(await io.writeStdin(id, started.commandId, more, { eof: true }), {
                bytes: 4,
              });
            })();
          }
        },
      });
      await fed;
      assert.equal(result.exitCode, 0);
      assert.equal(result.stdout, 'first\na\nb\nc\ndone\n');
      assert.equal(Buffer.concat(out).toString(), result.stdout);
      const info = await io.getCommand(id, started.commandId);
      assert.equal(info.state, 'finished');
      assert.equal(info.result?.stdout, result.stdout);
      assert.ok((await io.listCommands(id)).some((c) => c.commandId === started.commandId));
      assert.equal((await io.waitCommand(id, started.commandId)).stdout, result.stdout);
      await assert.rejects(io.getCommand(id, 'cmd-nope'), (e) =>
        isDsecError(e, 'command_not_found'),
      );

      const errs: Buffer[] = [];
      const both = await io.runCommand(
        id,
        { shell: 'echo out; echo err >&2; exit 3' },
        { onStderr: (c) => errs.push(c) },
      );
      assert.equal(both.exitCode, 3);
      assert.equal(both.stdout, 'out\n');
      assert.equal(Buffer.concat(errs).toString(), 'err\n');
    },
    hasIo,
  );

  withEdge(
    'io: wait times out, signal and kill end a command; an abort kills its command',
    async (u) => {
      const io = u.edge.io!;
      const id = await create(u);
      const sleeper = await io.startCommand(id, { argv: ['sleep', '30'] });
      await assert.rejects(io.waitCommand(id, sleeper.commandId, { timeoutMs: 50 }), (e) =>
        isDsecError(e, 'deadline_exceeded'),
      );
      await io.signalCommand(id, sleeper.commandId, 'SIGTERM');
      const termed = await io.waitCommand(id, sleeper.commandId);
      assert.equal(termed.outcome, 'signaled');

      const another = await io.startCommand(id, { argv: ['sleep', '31'] });
      await io.killCommand(id, another.commandId);
      assert.equal((await io.waitCommand(id, another.commandId)).outcome, 'killed');

      // A caller that goes away takes its command (without a requestId) with it.
      const ac = new AbortController();
      const running = io.runCommand(
        id,
        { shell: 'echo started; sleep 32' },
        { signal: ac.signal, onStdout: () => ac.abort() },
      );
      await running.then(
        (r) => assert.equal(r.outcome, 'killed'),
        (e: unknown) => assert.ok(isDsecError(e, 'aborted'), String(e)),
      );
      const cut = (await io.listCommands(id)).find((c: CommandInfo) =>
        c.shell?.includes('sleep 32'),
      );
      assert.ok(cut, 'the aborted command is in the log');
      assert.equal((await io.waitCommand(id, cut.commandId)).outcome, 'killed');
    },
    hasIo,
  );

  withEdge(
    'io: a session keeps its shell state; output streams; closing is idempotent',
    async (u) => {
      const io = u.edge.io!;
      const id = await create(u);
      await io.runInSession(id, 's1', { line: 'cd /tmp && export A=1' });
      const chunks: Buffer[] = [];
      const r = await io.runInSession(
        id,
        's1',
        { line: 'echo "$A $(pwd)"' },
        { onStdout: (c) => chunks.push(c) },
      );
      assert.equal(r.stdout, '1 /tmp\n');
      assert.equal(Buffer.concat(chunks).toString(), r.stdout);
      assert.equal(r.session, 's1');
      assert.equal(r.shellRestarted, false);
      assert.equal((await io.runInSession(id, 's2', { line: 'echo "[$A]"' })).stdout, '[]\n');
      const names = (await io.listSessions(id)).map((s) => s.name).sort();
      assert.deepEqual(names, ['s1', 's2']);
      await io.closeSession(id, 's1');
      await io.closeSession(id, 's1');
      assert.deepEqual(
        (await io.listSessions(id)).map((s) => s.name),
        ['s2'],
      );
    },
    hasIo,
  );

  withEdge(
    'io: files stream both ways; stat, list, mkdir, rename, remove',
    async (u) => {
      const io: SandboxIoApi = u.edge.io!;
      const id = await create(u);
      await io.mkdir(id, '/tmp/c/d/e', { parents: true });
      const small = await io.writeFile(id, '/tmp/c/small.txt', Buffer.from('hello\n'), {
        mode: 0o640,
      });
      assert.equal(small.size, 6);
      assert.equal(small.mode & 0o777, 0o640);
      assert.equal(small.type, 'file');
      // Larger than any single buffer on the way, in uneven pieces.
      const big = randomBytes(3 * 1024 * 1024 + 17);
      const pieces = [];
      for (let at = 0; at < big.length; at += 100_003) pieces.push(big.subarray(at, at + 100_003));
      const wrote = await io.writeFile(id, '/tmp/c/big.bin', Readable.from(pieces));
      assert.equal(wrote.size, big.length);
      const read: Buffer[] = [];
      for await (const chunk of await io.readFile(id, '/tmp/c/big.bin')) read.push(chunk as Buffer);
      assert.ok(Buffer.concat(read).equals(big), 'the bytes read are the bytes written');
      const stat = await io.statFile(id, '/tmp/c/small.txt');
      assert.equal(stat.name, 'small.txt');
      assert.equal(stat.size, 6);
      const names = (await io.listDir(id, '/tmp/c')).map((f) => f.name).sort();
      assert.deepEqual(names, ['big.bin', 'd', 'small.txt']);
      await io.rename(id, '/tmp/c/small.txt', '/tmp/c/d/moved.txt');
      await assert.rejects(io.statFile(id, '/tmp/c/small.txt'), (e) => isDsecError(e, 'not_found'));
      await assert.rejects(io.readFile(id, '/tmp/c/d'), (e) => isDsecError(e, 'invalid_argument'));
      await io.remove(id, '/tmp/c', { recursive: true });
      await assert.rejects(io.listDir(id, '/tmp/c'), (e) => isDsecError(e, 'not_found'));
    },
    hasIo,
  );

  withEdge(
    'events: a truncated command leaves an event, paged by afterId',
    async (u) => {
      const { edge } = u;
      const id = await create(u);
      const r = await edge.runCommand(id, { shell: 'head -c 5000 /dev/zero', maxOutputBytes: 100 });
      assert.equal(r.truncated, true);
      const events = await edge.listEvents!(id, {});
      const truncated = events.find((e) => e.kind === 'output_truncated');
      assert.ok(truncated, `an output_truncated event in ${JSON.stringify(events)}`);
      assert.equal(truncated.sandboxId, id);
      const last = events[events.length - 1]!;
      assert.deepEqual(await edge.listEvents!(id, { afterId: last.id }), []);
      await assert.rejects(edge.listEvents!(u.mintId(), {}), nf);
    },
    hasEvents,
  );

  // ---- lifecycle (issue 11) ----

  withEdge(
    'lifecycle: pause and resume are no-ops when repeated; a command resumes a paused sandbox',
    async (u) => {
      const { edge } = u;
      const id = await create(u);
      if (hasIo(u)) await edge.io!.runInSession(id, 's', { line: 'cd /tmp && export A=7' });
      const paused = await edge.pauseSandbox!(id);
      assert.equal(paused.state, 'paused');
      assert.ok(paused.pausedAt !== undefined && paused.pausedExpiresAt !== undefined);
      assert.ok(Date.parse(paused.pausedExpiresAt) > Date.parse(paused.pausedAt));
      const again = await edge.pauseSandbox!(id);
      assert.equal(again.state, 'paused');
      assert.equal(again.pausedAt, paused.pausedAt, 'a second pause changes nothing');
      assert.equal((await edge.getSandbox(id)).state, 'paused');
      assert.deepEqual(
        (await edge.listSandboxes({ projectIds: ['prj-t'] })).map((s) => [s.id, s.state]),
        [[id, 'paused']],
      );
      const resumed = await edge.resumeSandbox!(id);
      assert.equal(resumed.state, 'running');
      assert.equal(resumed.pausedAt, undefined);
      assert.equal((await edge.resumeSandbox!(id)).state, 'running');

      await edge.pauseSandbox!(id);
      const r = await edge.runCommand(id, { argv: ['echo', 'back'] });
      assert.equal(r.exitCode, 0);
      assert.match(r.stdout, /back\n$/);
      assert.equal((await edge.getSandbox(id)).state, 'running');
      if (hasIo(u)) {
        // Shell state survives a pause, and a session call resumes too.
        await edge.pauseSandbox!(id);
        const s = await edge.io!.runInSession(id, 's', { line: 'echo "$A $(pwd)"' });
        assert.equal(s.stdout, '7 /tmp\n');
        assert.equal((await edge.getSandbox(id)).state, 'running');
      }
    },
    hasLifecycle,
  );

  withEdge(
    'lifecycle: setSandboxTimeout moves the deadline later and earlier',
    async (u) => {
      const { edge } = u;
      const id = await create(u);
      // The deadline is "now + ttl" on the edge's clock, which is this host's clock in tests.
      const slackMs = 2000;
      const before = Date.now();
      const later = await edge.setSandboxTimeout!(id, 7200);
      const after = Date.now();
      const at = Date.parse(later.expiresAt);
      assert.ok(at >= before + 7_200_000 - slackMs && at <= after + 7_200_000 + slackMs);
      assert.equal(later.state, 'running');
      assert.equal((await edge.getSandbox(id)).expiresAt, later.expiresAt);
      const sooner = await edge.setSandboxTimeout!(id, 60);
      assert.ok(Date.parse(sooner.expiresAt) < at);
      assert.equal((await edge.getSandbox(id)).state, 'running');
    },
    hasLifecycle,
  );

  withEdge(
    'lifecycle: a stopped sandbox is sandbox_not_running; an unknown one sandbox_not_found',
    async (u) => {
      const { edge } = u;
      const id = await create(u);
      await edge.stopSandbox(id);
      await assert.rejects(edge.pauseSandbox!(id), notRunning);
      await assert.rejects(edge.resumeSandbox!(id), notRunning);
      await assert.rejects(edge.setSandboxTimeout!(id, 60), notRunning);
      const unknown = u.mintId();
      await assert.rejects(edge.pauseSandbox!(unknown), nf);
      await assert.rejects(edge.resumeSandbox!(unknown), nf);
      await assert.rejects(edge.setSandboxTimeout!(unknown, 60), nf);
    },
    hasLifecycle,
  );

  withEdge(
    'snapshots: the image starts a sandbox from the captured state, scrubbed paths gone',
    async (u) => {
      const { edge } = u;
      const id = await create(u);
      if (hasIo(u)) {
        await edge.io!.mkdir(id, '/srv/task', { parents: true });
        await edge.io!.writeFile(id, '/srv/task/keep.txt', Buffer.from('kept\n'));
        await edge.io!.writeFile(id, '/srv/task/answer.txt', Buffer.from('42\n'));
      }
      const name = `conformance-${randomBytes(6).toString('hex')}`;
      const scrub = ['/srv/task/answer.txt'];
      const snap = await edge.snapshotSandbox!(id, { name, scrub });
      assert.equal(parseLayerRef(snap.image)?.name, name);
      assert.equal(snap.layer.name, name);
      assert.deepEqual(snap.scrub, scrub);
      assert.equal(parseLayerRef(snap.parents[0] ?? '')?.name, parseLayerRef(u.image)?.name);
      assert.ok(snap.freezeMs >= 0 && snap.totalMs >= snap.freezeMs, JSON.stringify(snap));
      assert.equal((await edge.getSandbox(id)).state, 'running', 'the source keeps running');

      const child = await edge.createSandbox({
        id: u.mintId(),
        projectId: 'prj-t',
        spec: conformanceSpec(snap.image),
      });
      assert.equal((await edge.getSandbox(child.id)).state, 'running');
      if (hasIo(u)) {
        const read: Buffer[] = [];
        for await (const c of await edge.io!.readFile(child.id, '/srv/task/keep.txt'))
          read.push(c as Buffer);
        assert.equal(Buffer.concat(read).toString(), 'kept\n');
        await assert.rejects(edge.io!.statFile(child.id, '/srv/task/answer.txt'), (e) =>
          isDsecError(e, 'not_found'),
        );
      }
      await edge.stopSandbox(id);
      await assert.rejects(edge.snapshotSandbox!(id, { name: `${name}-after` }), notRunning);
      await assert.rejects(edge.snapshotSandbox!(u.mintId(), { name: `${name}-unknown` }), nf);
    },
    hasSnapshots,
  );
}
