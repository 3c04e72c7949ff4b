import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdir, readFile, rename, rm, symlink, writeFile } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { createConnection } from 'node:net';
import { join } from 'node:path';
import fc from 'fast-check';
import { after, before, describe, test } from 'node:test';

import { ChronusConnection } from './chronus-client.js';
import type { ChronusError } from './chronus-client.js';
import { integrationSkipReason, runCollect, startDaemon, waitFor } from './test-support.js';
import type { Daemon } from './test-support.js';

const skip = integrationSkipReason() ?? false;

describe('chronus against a runc sandbox', { skip }, () => {
  let d: Daemon;
  let conn: ChronusConnection;
  before(async () => {
    d = await startDaemon();
    conn = await ChronusConnection.connect(d.socketPath);
  });
  after(async () => {
    conn?.close();
    await d?.stop();
  });

  test('true exits 0 with a pid from the sandbox namespace', async () => {
    const r = await runCollect(conn, { argv: ['true'] });
    assert.equal(r.exit.exitCode, 0);
    assert.equal(r.exit.signal, null);
    assert.ok(r.pid > 1 && r.pid < 10000, `pid ${r.pid}`);
  });

  test('exit code through the sealed shell', async () => {
    const r = await runCollect(conn, { argv: ['sh', '-c', 'exit 7'], shell: true });
    assert.equal(r.exit.exitCode, 7);
  });

  test('death by signal', async () => {
    const r = await runCollect(conn, { argv: ['sh', '-c', 'kill -9 $$'], shell: true });
    assert.equal(r.exit.exitCode, null);
    assert.equal(r.exit.signal, 'SIGKILL');
  });

  test('stdout and stderr stay separate and ordered', async () => {
    const script = 'for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; done';
    const r = await runCollect(conn, { argv: ['sh', '-c', script], shell: true });
    assert.equal(r.stdout.toString(), 'out1\nout2\nout3\nout4\nout5\n');
    assert.equal(r.stderr.toString(), 'err1\nerr2\nerr3\nerr4\nerr5\n');
  });

  test('stdin streams into cat', async () => {
    const input = 'line\n'.repeat(100_000);
    const r = await runCollect(conn, { argv: ['cat'] }, input);
    assert.equal(r.exit.exitCode, 0);
    assert.equal(r.stdout.length, input.length);
    assert.equal(r.stdout.toString(), input);
  });

  test('a missing program is a SPAWN_ERROR (ENOENT), not an exit code', async () => {
    const h = conn.spawn({ argv: ['no-such-program'] });
    await assert.rejects(
      h.started,
      (err: ChronusError) => err.errno === 2 && err.code === 'ENOENT',
    );
    await assert.rejects(h.exited);
  });

  test('a missing cwd and an unknown user are SPAWN_ERRORs', async () => {
    await assert.rejects(
      conn.spawn({ argv: ['true'], cwd: '/nope' }).started,
      (e: ChronusError) => e.errno === 2,
    );
    // A user the sandbox cannot run as is ESRCH: a name it does not have, a uid outside its ids.
    await assert.rejects(
      conn.spawn({ argv: ['true'], user: 'mallory' }).started,
      (e: ChronusError) => e.code === 'ESRCH' && /unknown user/.test(e.message),
    );
    for (const user of ['70000', '9999999999']) {
      await assert.rejects(
        conn.spawn({ argv: ['true'], user }).started,
        (e: ChronusError) => e.code === 'ESRCH',
        user,
      );
    }
  });

  test('user resolution from the sandbox passwd/group, home as cwd, HOME/USER', async () => {
    const r = await runCollect(conn, {
      argv: ['sh', '-c', 'id; pwd; echo $HOME $USER'],
      shell: true,
      user: 'alice',
    });
    const [id, pwd, env] = r.stdout.toString().split('\n');
    assert.match(id ?? '', /^uid=1000\(alice\) gid=1000\(alice\) groups=.*10\(wheel\)/);
    assert.equal(pwd, '/home/alice');
    assert.equal(env, '/home/alice alice');
    const n = await runCollect(conn, { argv: ['id', '-u'], uid: 1234, gid: 1234 });
    assert.equal(n.stdout.toString(), '1234\n');
  });

  test('an image without /etc/passwd runs root as uid 0; other names stay refused', async () => {
    // A FROM scratch image: no /etc/passwd, no /etc/group (the test edits the rootfs from the host).
    const etc = join(d.sandbox.dir, 'rootfs/etc');
    await rename(join(etc, 'passwd'), join(etc, 'passwd.away'));
    await rename(join(etc, 'group'), join(etc, 'group.away'));
    try {
      for (const user of ['root', 'root:root', '0', '0:0']) {
        const r = await runCollect(conn, { argv: ['id'], shell: true, user });
        assert.equal(r.exit.exitCode, 0, user);
        assert.match(r.stdout.toString(), /^uid=0(\(root\))? gid=0/, user);
      }
      const env = await runCollect(conn, {
        argv: ['sh', '-c', 'echo $HOME $USER; pwd'],
        shell: true,
        user: 'root',
      });
      assert.equal(env.stdout.toString(), '/root root\n/\n'); // no /root: cwd falls back to /
      const n = await runCollect(conn, { argv: ['id'], shell: true, user: '1234:4321' });
      assert.match(n.stdout.toString(), /^uid=1234 gid=4321/);
      for (const [user, what] of [
        ['alice', 'unknown user alice'],
        ['root:wheel', 'unknown group in root:wheel'],
        ['1000:staff', 'unknown group in 1000:staff'],
      ] as const) {
        await assert.rejects(
          conn.spawn({ argv: ['true'], user }).started,
          (e: ChronusError) => e.code === 'ESRCH' && e.message.includes(what),
          user,
        );
      }
    } finally {
      await rename(join(etc, 'passwd.away'), join(etc, 'passwd'));
      await rename(join(etc, 'group.away'), join(etc, 'group'));
    }
  });

  test('USER:GROUP takes the group from /etc/group; crafted passwd lines confuse nothing', async () => {
    const g = await runCollect(conn, { argv: ['id'], shell: true, user: 'alice:wheel' });
    assert.match(g.stdout.toString(), /^uid=1000\(alice\) gid=10\(wheel\)/);
    const etc = join(d.sandbox.dir, 'rootfs/etc');
    const saved = await readFile(join(etc, 'passwd'), 'utf8');
    // What a sandbox could write into its own /etc/passwd to fool a sloppy parser: short lines,
    // ids that are not numbers or overflow, a NUL that ends the text early, a CR, a name
    // with a colon's worth of fields folded in, an empty name.
    await writeFile(
      join(etc, 'passwd'),
      [
        'mallory:x:0:0',
        'eve:x:0x0:0::/:/bin/sh',
        'trudy:x:4294967296:0::/:/bin/sh',
        'oscar:x:-1:0::/:/bin/sh',
        ':x:0:0::/:/bin/sh',
        'bob\r:x:0:0::/:/bin/sh',
        'alice:x:1000:1000::/home/alice:/bin/sh',
        'carol:x:2000:2000::/:/bin/sh\0\nzed:x:0:0::/:/bin/sh',
      ].join('\n') + '\n',
    );
    try {
      for (const user of ['mallory', 'eve', 'trudy', 'oscar', 'bob', 'zed']) {
        await assert.rejects(
          conn.spawn({ argv: ['true'], user }).started,
          (e: ChronusError) => e.code === 'ESRCH',
          user,
        );
      }
      const a = await runCollect(conn, { argv: ['id', '-u'], shell: true, user: 'alice' });
      assert.equal(a.stdout.toString(), '1000\n');
      const c = await runCollect(conn, { argv: ['id', '-u'], shell: true, user: 'carol' });
      assert.equal(c.stdout.toString(), '2000\n');
    } finally {
      await writeFile(join(etc, 'passwd'), saved);
    }
  });

  test('a passwd or group that is a FIFO, a device, a directory or a /proc link blocks nothing', async () => {
    // The reaper reads the sandbox's own /etc/passwd and /etc/group before each named user's
    // command: one the sandbox made a FIFO with no writer would hang that read (and the
    // command) for ever, a link to /dev/zero would never end, and a link into /proc/self
    // would hand the reaper's own files (its fds: the platform's shell) to the parser.
    const etc = join(d.sandbox.dir, 'rootfs/etc');
    await rename(join(etc, 'passwd'), join(etc, 'passwd.away'));
    await rename(join(etc, 'group'), join(etc, 'group.away'));
    const make: Record<string, (path: string) => Promise<void>> = {
      fifo: async (path) => {
        execFileSync('mkfifo', [path]);
      },
      zero: (path) => symlink('/dev/zero', path),
      dir: (path) => mkdir(path),
      shell: (path) => symlink('/proc/self/fd/4', path),
      environ: (path) => symlink('/proc/1/environ', path),
    };
    try {
      for (const [kind, makeOne] of Object.entries(make)) {
        await makeOne(join(etc, 'passwd'));
        await makeOne(join(etc, 'group'));
        try {
          await assert.rejects(
            conn.spawn({ argv: ['true'], shell: true, user: 'alice' }).started,
            (e: ChronusError) => e.code === 'ESRCH',
            kind,
          );
          await assert.rejects(
            conn.spawn({ argv: ['true'], shell: true, user: 'root:wheel' }).started,
            (e: ChronusError) => e.code === 'ESRCH',
            kind,
          );
          // Not `id`: it reads /etc/passwd itself, and the sandbox's FIFO is the command's to wait on.
          const ids = ['grep', '-E', '^(Uid|Gid):', '/proc/self/status'];
          const r = await runCollect(conn, { argv: ids, shell: true, user: 'root' });
          assert.match(r.stdout.toString(), /^Uid:\t0\t.*\nGid:\t0\t/, kind);
          const n = await runCollect(conn, { argv: ids, shell: true, user: '1234:4321' });
          assert.match(n.stdout.toString(), /^Uid:\t1234\t.*\nGid:\t4321\t/, kind);
        } finally {
          await rm(join(etc, 'passwd'), { recursive: true, force: true });
          await rm(join(etc, 'group'), { recursive: true, force: true });
        }
      }
    } finally {
      await rename(join(etc, 'passwd.away'), join(etc, 'passwd'));
      await rename(join(etc, 'group.away'), join(etc, 'group'));
    }
  });

  test('a command sees only fds 0, 1, 2', async () => {
    // `; true` keeps sh from exec'ing ls in place (ls's own directory fd would show up).
    const r = await runCollect(conn, { argv: ['sh', '-c', 'ls /proc/$$/fd; true'], shell: true });
    assert.deepEqual(r.stdout.toString().trim().split(/\s+/).sort(), ['0', '1', '2']);
    const p = await runCollect(conn, {
      argv: ['sh', '-c', 'ls /proc/$$/fd; true'],
      shell: true,
      pty: { rows: 24, cols: 80 },
    });
    assert.deepEqual(p.stdout.toString().trim().split(/\s+/).sort(), ['0', '1', '2']);
  });

  test('the daemon is invisible inside the sandbox and sits in its cgroups', async () => {
    const r = await runCollect(conn, { argv: ['ps', '-o', 'pid,args'] });
    assert.doesNotMatch(r.stdout.toString(), /chronus|\.sock|dsec-helper/);
    const status = await readFile(`/proc/${d.pid}/status`, 'utf8');
    assert.match(status, /^NSpid:\t\d+$/m, 'daemon has no pid inside the sandbox namespace');
    for (const dir of d.sandbox.cgroupDirs) {
      const procs = (await readFile(join(dir, 'cgroup.procs'), 'utf8')).split('\n');
      assert.ok(procs.includes(String(d.pid)), `daemon in ${dir}`);
    }
  });

  test('posture: capabilities bounded, no_new_privs', async () => {
    const r = await runCollect(conn, {
      argv: ['grep', '-E', '^(CapBnd|CapEff|NoNewPrivs)', '/proc/self/status'],
    });
    // Docker's default set: 0x00000000a80425fb
    assert.match(r.stdout.toString(), /CapEff:\t00000000a80425fb/);
    assert.match(r.stdout.toString(), /CapBnd:\t00000000a80425fb/);
    assert.match(r.stdout.toString(), /NoNewPrivs:\t1/);
    const alice = await runCollect(conn, {
      argv: ['grep', '^CapEff', '/proc/self/status'],
      user: 'alice',
    });
    assert.equal(alice.stdout.toString(), 'CapEff:\t0000000000000000\n');
  });

  test('KILL_TREE kills every descendant, including setsid and double-forked ones', async () => {
    const h = conn.spawn({
      argv: ['sh', '-c', 'sleep 1001 & sleep 1001 & setsid sleep 1001 & (sleep 1001 &) ; wait'],
      shell: true,
    });
    await h.started;
    const count = async (): Promise<number> => {
      const r = await runCollect(conn, {
        argv: ['sh', '-c', 'ps -o args | grep -c "^sleep 1001"'],
        shell: true,
      });
      return Number(r.stdout.toString().trim());
    };
    await waitFor(async () => (await count()) === 4, 'four sleeps');
    h.killTree();
    const exit = await h.exited;
    assert.equal(exit.signal, 'SIGKILL');
    assert.equal(await count(), 0);
  });

  test('SIGNAL reaches the process group', async () => {
    const h = conn.spawn({ argv: ['sleep', '1000'] });
    await h.started;
    h.signal('SIGTERM');
    assert.equal((await h.exited).signal, 'SIGTERM');
  });

  test('pty: controlling terminal and window size', async () => {
    const h = conn.spawn({
      argv: ['sh', '-c', 'stty size; tty'],
      shell: true,
      pty: { rows: 33, cols: 101 },
    });
    const out: Buffer[] = [];
    h.onStdout((b) => out.push(Buffer.from(b)));
    assert.equal((await h.exited).exitCode, 0);
    assert.match(Buffer.concat(out).toString(), /^33 101\r\n\/dev\/pts\/\d+\r\n$/);
  });

  test('pty: stdin goes to the terminal, STDIN_EOF is ^D', async () => {
    const h = conn.spawn({ argv: ['cat'], stdin: true, pty: { rows: 24, cols: 80 } });
    const out: Buffer[] = [];
    h.onStdout((b) => out.push(Buffer.from(b)));
    await h.started;
    h.write('hello\n');
    h.endStdin();
    assert.equal((await h.exited).exitCode, 0);
    assert.equal(Buffer.concat(out).toString(), 'hello\r\nhello\r\n'); // echo, then cat's output
  });

  test('closing a connection kills its commands, but not detached ones', async () => {
    const other = await ChronusConnection.connect(d.socketPath);
    const attached = other.spawn({ argv: ['sleep', '1002'] });
    const detached = other.spawn({ argv: ['sleep', '1003'], detached: true });
    const pa = (await attached.started).pid;
    const pd = (await detached.started).pid;
    other.close();
    await assert.rejects(attached.exited, (e: ChronusError) => e.code === 'ECONNRESET');
    const alive = async (pid: number): Promise<boolean> =>
      (await runCollect(conn, { argv: ['kill', '-0', String(pid)] })).exit.exitCode === 0;
    await waitFor(async () => !(await alive(pa)), 'attached command to die');
    assert.equal(await alive(pd), true);
    await runCollect(conn, { argv: ['kill', '-9', String(pd)] });
  });

  describe('idle reapers', () => {
    /** The pid (in the sandbox) of the reaper that ran the command: the shell's parent. */
    const reaperOf = async (script = ''): Promise<number> => {
      const r = await runCollect(conn, { argv: ['sh', '-c', `${script}echo $PPID`], shell: true });
      assert.equal(r.exit.exitCode, 0, r.stderr.toString());
      return Number(r.stdout.toString().trim());
    };
    /** Host pids of the daemon's children: its reapers. */
    const reapers = async (): Promise<number[]> =>
      (await readFile(`/proc/${d.pid}/task/${d.pid}/children`, 'utf8'))
        .trim()
        .split(/\s+/)
        .filter(Boolean)
        .map(Number);

    test('a clean command leaves its reaper to run the next one, with fresh stdio', async () => {
      const first = await reaperOf();
      assert.equal(await reaperOf(), first);
      const fds = await runCollect(conn, {
        argv: ['sh', '-c', 'ls /proc/$$/fd; echo $PPID'],
        shell: true,
      });
      assert.deepEqual(
        fds.stdout.toString().trim().split(/\s+/).sort(),
        ['0', '1', '2', String(first)].sort(),
      );
      const input = await runCollect(conn, { argv: ['cat'] }, 'through a reused reaper\n');
      assert.equal(input.stdout.toString(), 'through a reused reaper\n');
      assert.equal(await reaperOf(), first);
    });

    test('a command that leaves a process behind retires its reaper', async () => {
      const first = await reaperOf('sleep 1004 >/dev/null 2>&1 & ');
      const next = await reaperOf();
      assert.notEqual(next, first);
      await runCollect(conn, { argv: ['sh', '-c', 'pkill -f "sleep 1004"; true'], shell: true });
    });

    test('a reaper changed from outside (reniced) is not reused', async () => {
      const first = await reaperOf('renice -n 5 -p $PPID >/dev/null; ');
      assert.notEqual(await reaperOf(), first);
    });

    test('a stopped idle reaper is continued; a killed one is replaced', async () => {
      const first = await reaperOf();
      const [host] = await reapers();
      assert.ok(host, 'one idle reaper');
      process.kill(host, 'SIGSTOP');
      assert.equal(await reaperOf(), first);
      const [again] = await reapers();
      process.kill(again!, 'SIGKILL');
      await waitFor(async () => (await reapers()).length === 0, 'the killed reaper to go');
      assert.notEqual(await reaperOf(), first);
    });

    test('idle reapers exit after five seconds', async () => {
      await reaperOf();
      assert.equal((await reapers()).length, 1);
      await waitFor(async () => (await reapers()).length === 0, 'idle reapers to exit', 10_000);
    });
  });

  test('throughput: 200 MiB of yes arrives complete', async (t) => {
    const size = 200 * 1024 * 1024;
    const h = conn.spawn({
      argv: ['sh', '-c', `/usr/bin/yes | /usr/bin/head -c ${size}`],
      shell: true,
    });
    let bytes = 0;
    h.onStdout((b) => (bytes += b.length));
    const t0 = process.hrtime.bigint();
    assert.equal((await h.exited).exitCode, 0);
    const secs = Number(process.hrtime.bigint() - t0) / 1e9;
    assert.equal(bytes, size);
    t.diagnostic(`yes throughput ${(size / secs / 1e6).toFixed(0)} MB/s`);
  });

  test('round trip of `true` (200 spawns, mean reported)', async (t) => {
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < 200; i++)
      assert.equal((await runCollect(conn, { argv: ['true'] })).exit.exitCode, 0);
    t.diagnostic(
      `spawn round trip of true: ${(Number(process.hrtime.bigint() - t0) / 1e6 / 200).toFixed(2)} ms`,
    );
  });
});

/** One frame as the wire carries it (PROTOCOL.md), with whatever `len` and payload it is given. */
function rawFrame(len: number, type: number, stream: number, payload: Uint8Array): Buffer {
  const head = Buffer.alloc(9);
  head.writeUInt32LE(len >>> 0, 0);
  head.writeUInt8(type, 4);
  head.writeUInt32LE(stream >>> 0, 5);
  return Buffer.concat([head, payload]);
}

/** A SPAWN payload whose counts and strings need not agree (argc, envc, NULs, truncation). */
const spawnPayload = fc
  .record({
    flags: fc.integer({ min: 0, max: 31 }),
    rows: fc.integer({ min: 0, max: 0xffff }),
    argc: fc.oneof(fc.integer({ min: 0, max: 4 }), fc.nat()),
    envc: fc.oneof(fc.integer({ min: 0, max: 4 }), fc.nat()),
    strings: fc.array(fc.stringMatching(/^[a-z]{0,6}$/), { maxLength: 8 }),
    cut: fc.nat(),
  })
  .map(({ flags, rows, argc, envc, strings, cut }) => {
    const head = Buffer.alloc(24);
    head.writeUInt32LE(flags, 0);
    head.writeUInt16LE(rows, 12);
    head.writeUInt16LE(rows, 14);
    head.writeUInt32LE(argc >>> 0, 16);
    head.writeUInt32LE(envc >>> 0, 20);
    // Program names that exist nowhere: a well-formed SPAWN among these fails with ENOENT.
    const body = Buffer.from(strings.map((t) => `no-such-${t}\0`).join(''));
    const whole = Buffer.concat([head, body]);
    return whole.subarray(0, cut % (whole.length + 1));
  });

const anyFrame = fc.oneof(
  spawnPayload.map((p) => rawFrame(p.length + 5, 0x01, 1, p)),
  fc
    .record({
      type: fc.integer({ min: 0, max: 255 }),
      stream: fc.integer({ min: 0, max: 3 }),
      payload: fc.uint8Array({ maxLength: 64 }),
    })
    .map(({ type, stream, payload }) => rawFrame(payload.length + 5, type, stream, payload)),
  // A length field out of bounds (below 5, or past 1 MiB) ends the connection.
  fc
    .oneof(fc.integer({ min: 0, max: 4 }), fc.integer({ min: (1 << 20) + 6, max: 0xffffffff }))
    .map((len) => rawFrame(len, 0x01, 1, new Uint8Array(0))),
  fc.uint8Array({ minLength: 1, maxLength: 32 }).map((b) => Buffer.from(b)),
);

describe('chronus against malformed frames', { skip }, () => {
  test('no sequence of frames takes the daemon down; it serves the next connection', async () => {
    const d = await startDaemon();
    try {
      await fc.assert(
        fc.asyncProperty(fc.array(anyFrame, { minLength: 1, maxLength: 12 }), async (frames) => {
          await new Promise<void>((resolve, reject) => {
            const sock = createConnection(d.socketPath, () => {
              sock.end(Buffer.concat(frames));
            });
            sock.on('data', () => undefined);
            sock.on('error', (err: NodeJS.ErrnoException) =>
              err.code === 'ECONNRESET' || err.code === 'EPIPE' ? resolve() : reject(err),
            );
            sock.on('close', () => resolve());
          });
          const conn = await ChronusConnection.connect(d.socketPath);
          try {
            const r = await runCollect(conn, { argv: ['true'] });
            assert.equal(r.exit.exitCode, 0);
          } finally {
            conn.close();
          }
        }),
        { numRuns: 60 },
      );
    } finally {
      await d.stop();
    }
  });
});

describe('chronus lifetime', { skip }, () => {
  test('the daemon exits (and removes its socket) when the sandbox init dies', async () => {
    const d = await startDaemon();
    const conn = await ChronusConnection.connect(d.socketPath);
    let stopped = false;
    try {
      const h = conn.spawn({ argv: ['sleep', '1000'] });
      await h.started;
      stopped = true;
      await d.stop(); // kills the container's init and waits for the daemon pid to vanish
      // Either the reaper's report of the SIGKILL made it out first, or the connection dropped.
      const outcome = await h.exited.then(
        (e) => e.signal,
        (e: ChronusError) => e.code,
      );
      assert.ok(outcome === 'SIGKILL' || outcome === 'ECONNRESET', String(outcome));
      assert.equal(existsSync(d.socketPath), false);
    } finally {
      conn.close();
      // A failure before the stop under test must not leave the sandbox running.
      if (!stopped) await d.stop();
    }
  });
});
