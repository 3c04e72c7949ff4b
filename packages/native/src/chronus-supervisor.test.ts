import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { createConnection } from 'node:net';
import {
  chmod,
  copyFile,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  readlink,
  rm,
  stat,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';

import { helperPath } from './binaries.js';
import { ChronusConnection } from './chronus-client.js';
import { ChronusSupervisor, findChronus, isChronus, prepareChronus } from './chronus-supervisor.js';
import {
  BUSYBOX,
  DOCKER_CAPS,
  integrationSkipReason,
  runCollect,
  startDaemon,
  startRuncSandbox,
  waitFor,
} from './test-support.js';
import type { Daemon } from './test-support.js';

const skip = integrationSkipReason() ?? false;

/** `/<id>`: the cgroup path of a test-support sandbox, as /proc/PID/cgroup shows it. */
const cgroupOf = (d: Daemon) => `/${d.sandbox.id}`;

async function echo(socketPath: string, text: string): Promise<string> {
  const conn = await ChronusConnection.connect(socketPath);
  try {
    const r = await runCollect(conn, { argv: ['sh', '-c', `echo ${text}`], shell: true });
    return r.stdout.toString();
  } finally {
    conn.close();
  }
}

/** Inode of the sealed shell memfd a process holds. */
async function shellMemfd(pid: number): Promise<number> {
  for (const fd of await readdir(`/proc/${pid}/fd`)) {
    const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => '');
    if (target.startsWith('/memfd:dsec-shell')) return (await stat(`/proc/${pid}/fd/${fd}`)).ino;
  }
  throw new Error(`no shell memfd in ${pid}`);
}

/** Running: neither gone nor a zombie. */
async function alive(pid: number): Promise<boolean> {
  const text = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
  return text !== '' && !/\) [ZX] /.test(text);
}

describe('chronus supervisor', { skip }, () => {
  let dir: string;
  let supervisor: ChronusSupervisor;
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-native-sup-'));
    supervisor = new ChronusSupervisor({ dir: join(dir, 'chronusd'), shellPath: BUSYBOX });
  });
  after(async () => {
    await supervisor.stop();
    await rm(dir, { recursive: true, force: true });
  });

  test('daemons are forked children that share one sealed shell and show no host path', async () => {
    const a = await startDaemon({ supervisor });
    const b = await startDaemon({ supervisor });
    try {
      const pid = await supervisor.start();
      assert.equal((await stat(supervisor.dir)).mode & 0o777, 0o700);
      assert.equal((await stat(supervisor.socketPath)).mode & 0o777, 0o600);
      const inodes = await Promise.all([pid, a.pid, b.pid].map(shellMemfd));
      assert.equal(new Set(inodes).size, 1, 'one copy of the shell for the whole node');
      for (const d of [a, b]) {
        const cmdline = await readFile(`/proc/${d.pid}/cmdline`, 'utf8');
        assert.equal(cmdline.split('\0')[0], 'dsec-chronus');
        assert.doesNotMatch(cmdline, /\//, 'no path in the command line');
        assert.equal(await echo(d.socketPath, 'hi'), 'hi\n');
      }
      assert.equal(
        (await readFile(`/proc/${pid}/cmdline`, 'utf8')).split('\0')[0],
        'dsec-chronusd',
      );
      // Nothing of the supervisor's (its control socket, its log) or of the edge's lives on in a
      // daemon. Beyond its own fds it holds the idle reaper of the echo: a pidfd and a socket.
      const held = await Promise.all(
        (await readdir(`/proc/${a.pid}/fd`)).map((fd) => readlink(`/proc/${a.pid}/fd/${fd}`)),
      );
      assert.deepEqual(
        held.map((t) => t.replace(/\[\d+\]$/, '').replace(/^\/tmp\/.*/, 'DIR')).sort(),
        [
          '/dev/null',
          '/dev/null',
          '/dev/null',
          '/memfd:dsec-shell (deleted)',
          'DIR',
          'anon_inode:[eventpoll]',
          'anon_inode:[pidfd]',
          'socket:',
          'anon_inode:[pidfd]',
          'socket:',
        ].sort(),
      );
    } finally {
      await a.stop();
      await b.stop();
    }
  });

  test('a command starts with no signal ignored or blocked (its daemon ignores SIGPIPE and SIGCHLD)', async () => {
    const d = await startDaemon({ supervisor });
    const conn = await ChronusConnection.connect(d.socketPath);
    try {
      const r = await runCollect(conn, { argv: ['cat', '/proc/self/status'] });
      const status = r.stdout.toString();
      assert.match(status, /^SigIgn:\s+0+$/m);
      assert.match(status, /^SigBlk:\s+0+$/m);
    } finally {
      conn.close();
      await d.stop();
    }
  });

  test('isChronus and findChronus tell a sandbox daemon from everything else', async () => {
    const a = await startDaemon({ supervisor });
    const b = await startDaemon({ supervisor });
    try {
      assert.equal(await isChronus(a.pid, cgroupOf(a)), true);
      assert.equal(await isChronus(a.pid, cgroupOf(b)), false, "another sandbox's cgroup");
      assert.equal(
        await isChronus(a.sandbox.initPid, cgroupOf(a)),
        false,
        "the sandbox's own init",
      );
      assert.equal(await isChronus(await supervisor.start(), cgroupOf(a)), false, 'the supervisor');
      // A process inside the sandbox that calls itself dsec-chronus is still not one.
      const conn = await ChronusConnection.connect(a.socketPath);
      // GNU head (not a busybox applet, which would look itself up by argv[0]), blocked on stdin.
      const fake = conn.spawn({
        argv: ['sh', '-c', 'exec -a dsec-chronus /usr/bin/head -c 1'],
        shell: true,
        stdin: true,
      });
      await fake.started;
      // STARTED comes when the command is forked; its shell execs the impostor a moment later.
      const impostors: number[] = [];
      for (let tries = 0; impostors.length === 0 && tries < 200; tries++) {
        if (tries > 0) await sleep(10);
        const inside = (await readFile(join(a.sandbox.cgroupDirs[0]!, 'cgroup.procs'), 'utf8'))
          .split('\n')
          .filter(Boolean)
          .map(Number);
        for (const pid of inside) {
          const argv0 = (await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '')).split(
            '\0',
          )[0];
          if (argv0 === 'dsec-chronus' && pid !== a.pid) impostors.push(pid);
        }
      }
      assert.equal(impostors.length, 1, 'the impostor runs in the same cgroup');
      assert.equal(await isChronus(impostors[0]!, cgroupOf(a)), false);
      assert.deepEqual(await findChronus(a.sandbox.cgroupDirs[0]!, cgroupOf(a)), [a.pid]);
      fake.killTree();
      await fake.exited;
      conn.close();
    } finally {
      await a.stop();
      await b.stop();
    }
  });

  test('a second handle adopts the running supervisor', async () => {
    const pid = await supervisor.start();
    const again = new ChronusSupervisor({ dir: supervisor.dir, shellPath: BUSYBOX });
    assert.equal(await again.start(), pid);
    assert.equal(again.adopted, true);
    const d = await startDaemon({ supervisor: again });
    try {
      assert.equal(await echo(d.socketPath, 'adopted'), 'adopted\n');
    } finally {
      await d.stop();
    }
  });

  test("a handle that never started stops the supervisor a crashed edge left (the pid file's)", async () => {
    const pid = await supervisor.start();
    const next = new ChronusSupervisor({ dir: supervisor.dir, shellPath: BUSYBOX });
    await next.stop();
    assert.equal(await alive(pid), false);
  });

  test('a supervisor sealing another shell is replaced, not adopted', async () => {
    const pid = await supervisor.start();
    const shell = join(dir, 'busybox-copy');
    await copyFile(BUSYBOX, shell);
    const other = new ChronusSupervisor({ dir: supervisor.dir, shellPath: shell });
    const fresh = await other.start();
    assert.notEqual(fresh, pid);
    assert.equal(other.adopted, false);
    await waitFor(async () => !(await alive(pid)), 'the replaced supervisor to exit');
    await other.stop();
  });

  test('a supervisor of an older helper binary is replaced on start and stopped on stop', async () => {
    await supervisor.stop();
    // An "upgrade": the running supervisor's executable is another file than helperPath().
    const oldDir = join(dir, 'old-build');
    await mkdir(oldDir);
    await copyFile(helperPath(), join(oldDir, 'dsec-helper'));
    await chmod(join(oldDir, 'dsec-helper'), 0o755);
    const saved = process.env.DSEC_NATIVE_DIR;
    process.env.DSEC_NATIVE_DIR = oldDir;
    let old: number;
    try {
      old = await supervisor.start();
    } finally {
      if (saved === undefined) delete process.env.DSEC_NATIVE_DIR;
      else process.env.DSEC_NATIVE_DIR = saved;
    }
    const upgraded = new ChronusSupervisor({ dir: supervisor.dir, shellPath: BUSYBOX });
    const fresh = await upgraded.start();
    assert.notEqual(fresh, old);
    assert.equal(upgraded.adopted, false);
    await waitFor(async () => !(await alive(old)), 'the old supervisor to be replaced');
    // And a handle stops what it started even after the binary changed under it.
    process.env.DSEC_NATIVE_DIR = oldDir;
    const stale = new ChronusSupervisor({ dir: join(dir, 'stale'), shellPath: BUSYBOX });
    let stalePid: number;
    try {
      stalePid = await stale.start();
    } finally {
      if (saved === undefined) delete process.env.DSEC_NATIVE_DIR;
      else process.env.DSEC_NATIVE_DIR = saved;
    }
    await stale.stop();
    assert.equal(await alive(stalePid), false);
    await upgraded.stop();
  });

  test('a pid file naming a process that is not ours is not adopted, and that process is left alone', async () => {
    await supervisor.stop();
    const stranger = spawn('sleep', ['1000'], { stdio: 'ignore' });
    try {
      await writeFile(join(supervisor.dir, 'chronusd.pid'), `${stranger.pid}\n`);
      const pid = await supervisor.start();
      assert.notEqual(pid, stranger.pid);
      assert.equal(supervisor.adopted, false);
      assert.equal(await alive(stranger.pid!), true);
    } finally {
      stranger.kill('SIGKILL');
    }
  });

  test('daemons outlive a killed supervisor; the next sandbox gets a fresh one', async () => {
    const a = await startDaemon({ supervisor });
    try {
      const first = await supervisor.start();
      process.kill(first, 'SIGKILL');
      await waitFor(async () => !(await alive(first)), 'the supervisor to die');
      assert.equal(await echo(a.socketPath, 'still'), 'still\n');
      assert.equal(await isChronus(a.pid, cgroupOf(a)), true);
      const b = await startDaemon({ supervisor });
      try {
        const second = await supervisor.start();
        assert.notEqual(second, first);
        assert.equal(await echo(b.socketPath, 'fresh'), 'fresh\n');
      } finally {
        await b.stop();
      }
    } finally {
      await a.stop();
    }
  });

  test('stop() ends the supervisor only', async () => {
    const a = await startDaemon({ supervisor });
    try {
      const pid = await supervisor.start();
      await supervisor.stop();
      assert.equal(await alive(pid), false);
      assert.equal(existsSync(supervisor.socketPath), false);
      assert.equal(await echo(a.socketPath, 'alive'), 'alive\n');
    } finally {
      await a.stop();
    }
  });

  test('a failing daemon reports its reason; the supervisor keeps serving', async () => {
    const sandbox = await startRuncSandbox();
    const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
    try {
      const base = {
        supervisor,
        socketPath: join(sockDir, 'chronus.sock'),
        cgroupDirs: sandbox.cgroupDirs,
        capabilities: DOCKER_CAPS,
        noNewPrivs: true,
      };
      await assert.rejects(
        prepareChronus({ ...base, seccompProfile: 'allow read\n' }),
        (e: Error & { code?: string }) =>
          e.code === 'internal' && /first rule must be `default/.test(e.message),
      );
      await assert.rejects(
        prepareChronus({ ...base, seccompProfile: '', cgroupDirs: [join(sockDir, 'nope')] }).then(
          (p) => p.attach(sandbox.initPid),
        ),
        (e: Error & { code?: string }) => e.code === 'internal' && /join cgroup/.test(e.message),
      );
      await assert.rejects(
        prepareChronus({ ...base, seccompProfile: '', capabilities: ['CAP_NOPE'] }).then((p) =>
          p.attach(sandbox.initPid),
        ),
        (e: Error & { code?: string }) =>
          e.code === 'internal' && /unknown capability/.test(e.message),
      );
      const pending = await prepareChronus({ ...base, seccompProfile: '' });
      await pending.attach(sandbox.initPid);
      assert.equal(await echo(base.socketPath, 'ok'), 'ok\n');
    } finally {
      await sandbox.destroy();
      await rm(sockDir, { recursive: true, force: true });
    }
  });

  test('a daemon whose edge goes away before attaching exits by itself', async () => {
    const sandbox = await startRuncSandbox();
    const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
    try {
      await supervisor.start();
      // The control protocol by hand (PROTOCOL.md): u32le length, then NUL-terminated strings.
      const strings = ['prepare', 'sock', join(sockDir, 'chronus.sock'), 'caps', ''];
      for (const d of sandbox.cgroupDirs) strings.push('cgroup', d);
      const body = Buffer.from(strings.map((x) => `${x}\0`).join(''));
      const header = Buffer.alloc(4);
      header.writeUInt32LE(body.length);
      const socket = createConnection(supervisor.socketPath);
      socket.write(Buffer.concat([header, body]));
      let text = '';
      socket.setEncoding('utf8').on('data', (x: string) => (text += x));
      await waitFor(() => /^pid \d+\n/.test(text), 'the pid line');
      const pid = Number(/^pid (\d+)/.exec(text)![1]);
      assert.equal(await alive(pid), true);
      socket.destroy(); // an edge that crashed between prepare and attach
      await waitFor(async () => !(await alive(pid)), 'the orphaned daemon to exit');
    } finally {
      await sandbox.destroy();
      await rm(sockDir, { recursive: true, force: true });
    }
  });

  test('an aborted prepare leaves no daemon behind', async () => {
    const sandbox = await startRuncSandbox();
    const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
    try {
      const pending = await prepareChronus({
        supervisor,
        socketPath: join(sockDir, 'chronus.sock'),
        cgroupDirs: sandbox.cgroupDirs,
        seccompProfile: '',
        capabilities: DOCKER_CAPS,
        noNewPrivs: true,
      });
      pending.abort();
      await waitFor(async () => !(await alive(pending.pid)), 'the aborted daemon to exit');
    } finally {
      await sandbox.destroy();
      await rm(sockDir, { recursive: true, force: true });
    }
  });

  test("with net, the daemon configures the sandbox's interface over rtnetlink before it serves", async () => {
    const sandbox = await startRuncSandbox();
    const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
    // A veth this test makes: its far end in the sandbox's namespace, addresses
    // outside every edge's range (10.213–10.250) and unique to this run.
    const tag = Math.floor(Math.random() * 0xfff);
    const hostEnd = `dsnt${tag.toString(16)}`;
    const net4 = `10.254.${tag >> 4}.${(tag & 15) * 16}`;
    const a4 = net4.replace(/\d+$/, (o) => String(Number(o) + 1));
    const b4 = net4.replace(/\d+$/, (o) => String(Number(o) + 2));
    const a6 = `fd5e:feed:${tag.toString(16)}::1`;
    const b6 = `fd5e:feed:${tag.toString(16)}::2`;
    const socketPath = join(sockDir, 'chronus.sock');
    try {
      const pending = await prepareChronus({
        supervisor,
        socketPath,
        cgroupDirs: sandbox.cgroupDirs,
        seccompProfile: '',
        capabilities: DOCKER_CAPS,
        noNewPrivs: true,
        network: true,
      });
      assert.equal(supervisor.protocolVersion, 2);
      assert.ok(pending.configureNetwork);
      // Checked before anything reaches the daemon.
      await assert.rejects(
        pending.configureNetwork({
          interface: 'eth0',
          addresses: [{ address: b4, prefixLength: 33, gateway: a4 }],
        }),
        { code: 'invalid_argument' },
      );
      const ip = (...args: string[]) => runTool('ip', args);
      await ip(
        'link',
        'add',
        hostEnd,
        'type',
        'veth',
        'peer',
        'name',
        'eth0',
        'netns',
        String(sandbox.initPid),
      );
      await ip('addr', 'add', `${a6}/64`, 'dev', hostEnd, 'nodad');
      await ip('addr', 'add', `${a4}/30`, 'dev', hostEnd);
      await ip('link', 'set', hostEnd, 'up');
      await Promise.all([
        pending.attach(sandbox.initPid),
        pending.configureNetwork({
          interface: 'eth0',
          addresses: [
            { address: b4, prefixLength: 30, gateway: a4 },
            { address: b6, prefixLength: 64, gateway: a6 },
          ],
        }),
      ]);
      const inside = (...args: string[]) =>
        runTool('nsenter', ['-t', String(sandbox.initPid), '-n', 'ip', '-j', ...args]);
      const addrs = JSON.parse(await inside('addr', 'show')) as {
        ifname: string;
        flags: string[];
        addr_info: { local: string; prefixlen: number }[];
      }[];
      const eth0 = addrs.find((l) => l.ifname === 'eth0');
      assert.ok(eth0 && eth0.flags.includes('UP'), JSON.stringify(addrs));
      assert.ok(addrs.find((l) => l.ifname === 'lo')?.flags.includes('UP'));
      const local = eth0.addr_info.map((a) => `${a.local}/${a.prefixlen}`);
      assert.ok(local.includes(`${b4}/30`) && local.includes(`${b6}/64`), local.join(' '));
      for (const family of ['-4', '-6']) {
        const routes = JSON.parse(await inside(family, 'route', 'show', 'default')) as {
          gateway: string;
          dev: string;
        }[];
        assert.deepEqual(
          routes.map((r) => [r.gateway, r.dev]),
          [[family === '-4' ? a4 : a6, 'eth0']],
        );
      }
      // The link works both ways (host end to the sandbox's end, both made here).
      await runTool(BUSYBOX, ['ping', '-c', '1', '-W', '3', b4]);
      await runTool(BUSYBOX, ['ping6', '-c', '1', '-W', '3', b6]);
      // The daemon serves as usual, and cannot change the network any more.
      const conn = await ChronusConnection.connect(socketPath);
      try {
        const r = await runCollect(conn, {
          argv: ['ip', 'link', 'set', 'eth0', 'down'],
          shell: true,
        });
        assert.notEqual(r.exit.exitCode, 0);
        assert.match(r.stderr.toString(), /not permitted/);
      } finally {
        conn.close();
      }
    } finally {
      await runTool('ip', ['link', 'del', hostEnd]).catch(() => undefined);
      await sandbox.destroy();
      await rm(sockDir, { recursive: true, force: true });
    }
  });

  test("a failed network configuration is the daemon's reason, and it exits", async () => {
    const sandbox = await startRuncSandbox();
    const sockDir = await mkdtemp(join(tmpdir(), 'dsec-native-sock-'));
    try {
      const pending = await prepareChronus({
        supervisor,
        socketPath: join(sockDir, 'chronus.sock'),
        cgroupDirs: sandbox.cgroupDirs,
        seccompProfile: '',
        capabilities: DOCKER_CAPS,
        noNewPrivs: true,
        network: true,
      });
      // No such interface in the sandbox: nothing was made for it.
      const [attached, configured] = await Promise.allSettled([
        pending.attach(sandbox.initPid),
        pending.configureNetwork!({
          interface: 'eth0',
          addresses: [{ address: '10.254.255.2', prefixLength: 30, gateway: '10.254.255.1' }],
        }),
      ]);
      for (const r of [attached, configured]) {
        assert.equal(r.status, 'rejected');
        assert.match(String(r.reason), /configure eth0: no such interface/);
      }
      await waitFor(async () => !(await alive(pending.pid)), 'the failed daemon to exit');
    } finally {
      await sandbox.destroy();
      await rm(sockDir, { recursive: true, force: true });
    }
  });
});

/** Runs a host tool; rejects with its stderr. */
function runTool(cmd: string, args: string[]): Promise<string> {
  return new Promise((resolveOut, reject) => {
    const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout.setEncoding('utf8').on('data', (s: string) => (out += s));
    child.stderr.setEncoding('utf8').on('data', (s: string) => (err += s));
    child.on('error', reject);
    child.on('close', (code) =>
      code === 0 ? resolveOut(out) : reject(new Error(`${cmd} ${args.join(' ')}: ${err.trim()}`)),
    );
  });
}
