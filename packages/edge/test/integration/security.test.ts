/**
 * Hardening checks against real sandboxes (SECURITY.md A1–A8, A10, B11, B12,
 * D22–D25). The sandboxes have no network egress (policy default), and the
 * probe program (fixtures/probe.c) runs only inside them: it refuses to run
 * outside a user-namespaced sandbox.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { spawnSync } from 'node:child_process';
import { readFile, readlink, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { after, afterEach, before, describe, it } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { helperPath, initPath } from '@dsec/native';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { SANDBOX_CAPABILITIES } from '../../src/backends/container/spec.js';
import { buildTestLayers, hasGcc, workDir } from './network-helpers.js';

const root = process.getuid?.() === 0;
const skip = !root || !hasGcc() ? 'needs root and gcc' : false;

const CAP_BITS: Record<string, number> = {
  CAP_CHOWN: 0,
  CAP_DAC_OVERRIDE: 1,
  CAP_DAC_READ_SEARCH: 2,
  CAP_FOWNER: 3,
  CAP_FSETID: 4,
  CAP_KILL: 5,
  CAP_SETGID: 6,
  CAP_SETUID: 7,
  CAP_SETPCAP: 8,
  CAP_LINUX_IMMUTABLE: 9,
  CAP_NET_BIND_SERVICE: 10,
  CAP_NET_BROADCAST: 11,
  CAP_NET_ADMIN: 12,
  CAP_NET_RAW: 13,
  CAP_IPC_LOCK: 14,
  CAP_IPC_OWNER: 15,
  CAP_SYS_MODULE: 16,
  CAP_SYS_RAWIO: 17,
  CAP_SYS_CHROOT: 18,
  CAP_SYS_PTRACE: 19,
  CAP_SYS_PACCT: 20,
  CAP_SYS_ADMIN: 21,
  CAP_SYS_BOOT: 22,
  CAP_SYS_NICE: 23,
  CAP_SYS_RESOURCE: 24,
  CAP_SYS_TIME: 25,
  CAP_SYS_TTY_CONFIG: 26,
  CAP_MKNOD: 27,
  CAP_LEASE: 28,
  CAP_AUDIT_WRITE: 29,
  CAP_AUDIT_CONTROL: 30,
  CAP_SETFCAP: 31,
};

function runtimePaths(): string[] {
  return ['runc', 'crun']
    .map((name) =>
      spawnSync('sh', ['-c', `command -v ${name}`], { encoding: 'utf8' }).stdout.trim(),
    )
    .filter(Boolean);
}

async function sha256(path: string): Promise<string> {
  return createHash('sha256')
    .update(await readFile(path))
    .digest('hex');
}

describe('sandbox hardening', { skip, timeout: 600_000 }, () => {
  let work = '';
  let node: SingleNode;
  let client: DSecClient;
  const sandboxes: Sandbox[] = [];

  before(async () => {
    work = await workDir('dsec-sec-it-');
    // No uplink and a resolver that is never reached: these sandboxes have no egress at all.
    node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      network: { mode: 'auto', upstream: ['127.0.0.1:9'], uplinks: [] },
    });
    await buildTestLayers(node, work);
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
  });

  after(async () => {
    try {
      for (const sb of sandboxes) await sb.stop().catch(() => undefined);
      client?.close();
      await node?.close({ stopSandboxes: true });
    } finally {
      if (work) await rm(work, { recursive: true, force: true });
    }
  });

  // Stop each test's sandboxes when it ends (the edge's CPU capacity is finite).
  afterEach(async () => {
    for (const sb of sandboxes.splice(0)) await sb.stop().catch(() => undefined);
  });

  async function create(opts: Partial<Parameters<DSecClient['runContainer']>[0]> = {}) {
    const sb = await client.runContainer({ image: 'busybox', toolkits: ['probe'], ...opts });
    sandboxes.push(sb);
    return sb;
  }
  async function sh(sb: Sandbox, line: string, timeoutMs = 60_000): Promise<string> {
    return (
      await sb.runShell(
        `{ ${line}
} 2>&1`,
        { timeoutMs },
      )
    ).stdout;
  }

  it('A1: init and commands hold no descriptor that leads to the host', async () => {
    const sb = await create();
    const out = await sh(
      sb,
      'for p in 1 $$; do for f in /proc/$p/fd/*; do echo "$p $(readlink $f)"; done; done',
    );
    const targets = out
      .trim()
      .split('\n')
      .map((l) => l.split(' ').slice(1).join(' '));
    assert.ok(targets.length > 0);
    for (const t of targets) {
      assert.match(
        t,
        /^(pipe:\[\d+\]|socket:\[\d+\]|anon_inode:.*|\/dev\/null|\/dev\/pts\/\d+|\/proc\/\d+\/fd)$/,
        out,
      );
    }
    assert.doesNotMatch(out, new RegExp(work.replaceAll('/', '\\/')));
  });

  it('A2: runtime and platform binaries stay byte-identical whatever the sandbox writes', async () => {
    const files = [...runtimePaths(), helperPath(), initPath(), '/bin/busybox'];
    const before = await Promise.all(files.map(sha256));
    const sb = await create();
    await sh(
      sb,
      [
        'echo pwned > /proc/1/exe',
        'echo pwned > /proc/self/exe',
        'cp /bin/busybox /dev/.dsec-init',
        'echo pwned >> /dev/.dsec-init',
        'for p in /proc/[0-9]*; do echo pwned > $p/exe; done',
        'echo pwned > /bin/busybox',
        'true',
      ].join('; '),
    );
    await sh(sb, 'ls /');
    assert.deepEqual(await Promise.all(files.map(sha256)), before);
  });

  it('A3: kernel-internal procfs/sysfs files are masked and the host survives a full read', async () => {
    const sb = await create();
    for (const f of [
      '/proc/kpagecgroup',
      '/proc/kpageflags',
      '/proc/kpagecount',
      '/proc/kcore',
      '/proc/keys',
    ]) {
      const out = await sh(sb, `head -c 64 ${f} | wc -c`);
      assert.equal(out.trim().split('\n').at(-1), '0', `${f}: ${out}`);
    }
    assert.equal((await sh(sb, 'ls -A /sys/firmware | wc -l')).trim(), '0');
    const writes = await sh(
      sb,
      'echo "|/tmp/x" > /proc/sys/kernel/core_pattern && echo WROTE1; echo h > /proc/sysrq-trigger && echo WROTE2; true',
    );
    assert.doesNotMatch(writes, /WROTE/);
    assert.notEqual((await readFile('/proc/sys/kernel/core_pattern', 'utf8')).trim(), '|/tmp/x');
    const r = await sb.runShell('timeout 60 grep -r x /proc /sys >/dev/null 2>&1; echo done', {
      timeoutMs: 120_000,
      maxOutputBytes: 4096,
    });
    assert.match(r.stdout, /done/);
    assert.equal((await sb.exec(['true'])).exitCode, 0);
    assert.equal((await node.edge.status()).healthy, true);
  });

  it('A4: capabilities, no-new-privs, seccomp, id map and namespaces are as designed', async () => {
    const sb = await create();
    const status = await sh(sb, 'cat /proc/self/status');
    const capEff = BigInt(`0x${/CapEff:\s*([0-9a-f]+)/.exec(status)?.[1] ?? '0'}`);
    const want = SANDBOX_CAPABILITIES.reduce((m, c) => m | (1n << BigInt(CAP_BITS[c] ?? 63)), 0n);
    assert.equal(capEff, want);
    assert.match(status, /NoNewPrivs:\s*1/);
    assert.match(status, /Seccomp:\s*2/);
    // The runtime loads the filter into init too (crun from the precompiled BPF annotation).
    const init = await sh(sb, 'cat /proc/1/status');
    assert.match(init, /Seccomp:\s*2/);
    assert.match(init, /NoNewPrivs:\s*1/);
    const uidMap = (await sh(sb, 'cat /proc/self/uid_map')).trim().split(/\s+/).map(Number);
    assert.equal(uidMap[0], 0);
    assert.ok((uidMap[1] ?? 0) >= 100_000, `uid_map ${uidMap.join(' ')}`);
    const inside = await sh(
      sb,
      'for n in cgroup ipc mnt net pid user uts; do readlink /proc/self/ns/$n; done',
    );
    for (const [i, n] of ['cgroup', 'ipc', 'mnt', 'net', 'pid', 'user', 'uts'].entries()) {
      const host = await readlink(`/proc/self/ns/${n}`);
      assert.notEqual(inside.trim().split('\n')[i], host, n);
    }
  });

  it('A5: dangerous syscalls fail with EPERM or ENOSYS', async () => {
    const sb = await create();
    const out = await sh(sb, 'probe syscalls');
    const results = Object.fromEntries(
      out
        .trim()
        .split('\n')
        .map((l) => l.split(' ') as [string, string]),
    );
    for (const name of [
      'io_uring_setup',
      'bpf',
      'perf_event_open',
      'userfaultfd',
      'keyctl',
      'add_key',
      'kexec_load',
      'init_module',
      'finit_module',
      'open_by_handle_at',
      'mount',
      'umount2',
      'pivot_root',
      'unshare_user',
      'unshare_net',
      'setns',
      'swapon',
      'reboot',
      'acct',
      'syslog',
      'fsopen',
      'open_tree',
      'clock_settime',
      'iopl',
      'clone_newuser',
      'clone_newns',
    ]) {
      assert.match(results[name] ?? 'missing', /^(EPERM|ENOSYS)$/, `${name}: ${out}`);
    }
    assert.equal(results.clone_plain, 'ALLOWED');
    // ptrace stays allowed inside (debuggers): nothing outside the sandbox's pid
    // namespace can even be named, and its processes are in their own uid range.
  });

  it('A6: terminal and file-clone ioctls cannot inject input or touch protected files', async () => {
    const sb = await create();
    const out = await sh(sb, 'probe ioctls /bin/busybox');
    assert.doesNotMatch(out, /^TIOCSTI\S* ALLOWED/m, out);
    assert.doesNotMatch(out, /^TIOCLINUX\S* ALLOWED/m, out);
    // FICLONE onto /bin/busybox can only touch the sandbox's own copy-up; the layer is EROFS.
    assert.equal(await sha256('/bin/busybox'), await sha256('/bin/busybox'));
  });

  it('A7: a v1 cgroup cannot be mounted and release_agent cannot be written', async () => {
    const sb = await create();
    const out = await sh(
      sb,
      'mkdir -p /tmp/cg && mount -t cgroup -o memory cgroup /tmp/cg && echo MOUNTED; ' +
        'for f in /sys/fs/cgroup/*/release_agent /sys/fs/cgroup/release_agent; do [ -e $f ] && echo /x > $f && echo WROTE $f; done; true',
    );
    assert.doesNotMatch(out, /MOUNTED|WROTE/);
  });

  it('A8/D22: no platform socket, path or abstract name is visible inside', async () => {
    const sb = await create();
    const unix = await sh(sb, 'cat /proc/net/unix');
    // Unnamed socket pairs of the command's own stdio may exist; nothing with a path or an abstract name.
    for (const line of unix.trim().split('\n').slice(1))
      assert.equal(line.trim().split(/\s+/).length, 7, unix);
    const found = await sh(
      sb,
      'find / -xdev \\( -name "*.sock" -o -name "chronus*" -o -name "edge.db" \\) 2>/dev/null; ls -a /dev',
    );
    assert.doesNotMatch(found, /\.sock|chronus|edge\.db/);
    assert.doesNotMatch(await sh(sb, 'ps -o pid,args'), /chronus|dsec-helper|runc|crun/);
  });

  it('A10: sandbox A cannot see, signal or read sandbox B', async () => {
    const a = await create();
    const b = await create();
    await b.runShell('echo secret-b > /root/secret; sleep 600 >/dev/null 2>&1 &');
    const psA = await sh(a, 'ps -o pid,args');
    assert.doesNotMatch(psA, /sleep 600/);
    const look = await sh(a, 'cat /root/secret; find / -xdev -name secret 2>/dev/null; echo end');
    assert.doesNotMatch(look, /secret-b|\/root\/secret\n/);
    assert.match(look, /No such file/);
    // B's processes are not addressable from A (kill every pid A can name).
    // That includes this command's own reaper in A, so the call may end without a result.
    await sh(a, 'kill -9 -1; true').catch(() => undefined);
    assert.match(await sh(b, 'ps -o args'), /sleep 600/);
  });

  it('B11: a fork bomb stops at pids.max, others still spawn, the sandbox stays killable', async () => {
    const sb = await create({ pidsLimit: 64 });
    const other = await create();
    const out = await sh(
      sb,
      'i=0; while [ $i -lt 200 ]; do sleep 300 & i=$((i+1)); done; echo spawned',
      60_000,
    );
    assert.match(out, /can't fork|Resource temporarily unavailable|spawned/);
    const name = 'dsec-' + createHash('sha256').update(sb.id).digest('hex').slice(0, 20);
    const current = await readFile(`/sys/fs/cgroup/pids/dsec/${name}/pids.current`, 'utf8').catch(
      () => readFile(`/sys/fs/cgroup/dsec/${name}/pids.current`, 'utf8'),
    );
    assert.ok(Number(current) <= 64, `processes ${current}`);
    assert.equal((await other.exec(['true'])).exitCode, 0);
    await sb.stop();
    assert.equal((await sb.refresh()).state, 'stopped');
  });

  it('B12: memory over the limit OOM-kills only that command, reported as oom', async () => {
    const sb = await create({ memoryLimitMb: 64 });
    const other = await create();
    const r = await sb.runShell('head -c 400m /dev/zero | tail > /dev/null', { timeoutMs: 60_000 });
    assert.equal(r.outcome, 'oom', JSON.stringify(r));
    assert.equal((await sb.exec(['true'])).exitCode, 0);
    assert.equal((await other.exec(['true'])).exitCode, 0);
    const events = await sb.events();
    assert.ok(
      events.some((e) => e.kind === 'oom_killed'),
      JSON.stringify(events),
    );
  });

  it('D23: nothing the platform keeps for a sandbox is readable inside', async () => {
    const sb = await create();
    await sb.runShell('echo marker-d23');
    const out = await sh(
      sb,
      'grep -rl marker-d23 / --exclude-dir=proc --exclude-dir=sys 2>/dev/null; echo end',
    );
    assert.equal(out.trim(), 'end');
  });

  it('D24: an overwritten /bin/sh does not change what the platform shell runs', async () => {
    const sb = await create();
    await sh(
      sb,
      'rm -f /bin/sh; printf "#!/bin/busybox sh\\necho HACKED\\n" > /bin/sh; chmod +x /bin/sh; echo "echo HACKED" > /etc/profile',
    );
    const r = await sb.runShell('echo clean');
    assert.equal(r.stdout, 'clean\n');
  });

  it('D25: flooding stdout is capped and does not hold up other API calls', async () => {
    const sb = await create();
    const flood = sb.runShell('yes | head -c 200000000', {
      maxOutputBytes: 1 << 20,
      timeoutMs: 120_000,
    });
    const info = await sb.refresh({ timeoutMs: 10_000 });
    assert.equal(info.state, 'running');
    const r = await flood;
    assert.equal(r.truncated, true);
    assert.ok(r.stdout.length <= 2 * (1 << 20) + 1024);
    assert.equal(r.exitCode, 0);
    const events = await sb.events();
    assert.ok(
      events.some((e) => e.kind === 'output_truncated'),
      JSON.stringify(events),
    );
  });
});
