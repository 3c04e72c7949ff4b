import { test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { isDsecError, randomId } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

async function withEdge(
  fn: (ctx: { edge: Edge; stateDir: string; reopen(): Promise<Edge> }) => Promise<void>,
  options: { ttlSweepMs?: number; capacity?: { sandboxes?: number } } = {},
): Promise<void> {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  const open = () =>
    openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
      ...options,
    });
  let edge = await open();
  try {
    await fn({
      edge,
      stateDir: dir,
      async reopen() {
        await edge.close();
        edge = await open();
        return edge;
      },
    });
  } finally {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await cleanup();
  }
}

test('create → exec → stop releases every mount, cgroup, container, process and directory', async () => {
  await withEdge(async ({ edge, stateDir }) => {
    const before = await hostResources(stateDir);
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
    assert.equal(sb.state, 'running');
    const during = await hostResources(stateDir);
    assert.equal(during.containers.length, before.containers.length + 1);
    assert.ok(during.cgroups.length > before.cgroups.length, 'the sandbox has cgroups');
    // The overlay root lives in the runtime's private mount namespace: the host's
    // mount table does not grow with sandboxes, and the sandbox sees its overlay.
    assert.deepEqual(during.mounts, before.mounts);
    const root = await edge.runCommand(sb.id, { shell: 'grep " / " /proc/self/mountinfo' });
    assert.match(root.stdout, / - overlay overlay /);

    const r = await edge.runCommand(sb.id, { shell: 'echo hello; echo oops >&2; exit 3' });
    assert.equal(r.exitCode, 3);
    assert.equal(r.stdout, 'hello\n');
    assert.equal(r.stderr, 'oops\n');
    assert.equal(r.outcome, 'exited');

    await edge.stopSandbox(sb.id);
    assert.deepEqual(await hostResources(stateDir), before);
    assert.equal((await edge.getSandbox(sb.id)).state, 'stopped');
    await edge.stopSandbox(sb.id); // idempotent
  });
});

test('limits, namespaces and the uid map are applied', async () => {
  await withEdge(async ({ edge }) => {
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec({ memoryLimitMb: 128, cpuCoresLimit: 0.5, pidsLimit: 64 }),
    });
    const r = await edge.runCommand(sb.id, {
      shell:
        'cat /proc/self/uid_map; cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us; readlink /proc/self/ns/net /proc/self/ns/pid /proc/self/ns/user',
    });
    const lines = r.stdout.trim().split('\n');
    assert.match(lines[0]!, /^\s*0\s+1\d{5,}\s+65536$/, 'root maps to a non-identity host range');
    assert.equal(lines[1], String(128 * 2 ** 20));
    assert.equal(lines[2], '64');
    assert.equal(lines[3], '50000');
    const host = await import('node:fs/promises').then((fs) =>
      Promise.all(['net', 'pid', 'user'].map((n) => fs.readlink(`/proc/self/ns/${n}`))),
    );
    for (const [i, ns] of host.entries())
      assert.notEqual(lines[4 + i], ns, 'namespace differs from the host');
  });
});

test('bad input gets its own error code and creates nothing', async () => {
  await withEdge(
    async ({ edge, stateDir }) => {
      const before = await hostResources(stateDir);
      await assert.rejects(
        edge.createSandbox({
          id: randomId('sb'),
          projectId: 'p1',
          spec: spec({ image: 'no-such-image' }),
        }),
        (e) => isDsecError(e, 'image_not_found') && e.field === 'image',
      );
      await assert.rejects(edge.getSandbox('sb-nope'), (e) => isDsecError(e, 'sandbox_not_found'));
      await assert.rejects(edge.runCommand('sb-nope', { argv: ['true'] }), (e) =>
        isDsecError(e, 'sandbox_not_found'),
      );
      const first = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
      await assert.rejects(
        edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() }),
        (e) => isDsecError(e, 'capacity_exhausted'),
      );
      await assert.rejects(
        edge.runCommand(first.id, { argv: ['/no/such/program'] }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === 'argv',
      );
      await edge.stopSandbox(first.id);
      await assert.rejects(edge.runCommand(first.id, { argv: ['true'] }), (e) =>
        isDsecError(e, 'sandbox_not_running'),
      );
      assert.deepEqual(await hostResources(stateDir), before);
    },
    { capacity: { sandboxes: 1 } },
  );
});

test('the TTL stops the sandbox and releases everything', async () => {
  await withEdge(
    async ({ edge, stateDir }) => {
      const before = await hostResources(stateDir);
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p1',
        spec: spec({ ttlSeconds: 1 }),
      });
      for (let i = 0; i < 100 && (await edge.getSandbox(sb.id)).state !== 'stopped'; i++) {
        await new Promise((r) => setTimeout(r, 100));
      }
      const info = await edge.getSandbox(sb.id);
      assert.equal(info.state, 'stopped');
      assert.equal(info.reason, 'ttl expired');
      assert.deepEqual(await hostResources(stateDir), before);
    },
    { ttlSweepMs: 100 },
  );
});

test('a timeout kills the whole process tree and is reported as such', async () => {
  await withEdge(async ({ edge }) => {
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
    const r = await edge.runCommand(sb.id, {
      shell: 'sleep 100 & sleep 100 & sleep 100',
      timeoutMs: 300,
    });
    assert.equal(r.outcome, 'timeout');
    const ps = await edge.runCommand(sb.id, { shell: 'ps -o comm | grep -c sleep || true' });
    assert.equal(ps.stdout.trim(), '0');
  });
});

test('after an edge restart running sandboxes are adopted and usable', async () => {
  await withEdge(async ({ edge, stateDir, reopen }) => {
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
    await edge.runCommand(sb.id, { shell: 'echo kept > /root/state' });
    const during = await hostResources(stateDir);

    const edge2 = await reopen();
    assert.deepEqual(
      (await edge2.listSandboxes({})).map((s) => s.id),
      [sb.id],
    );
    const r = await edge2.runCommand(sb.id, { shell: 'cat /root/state' });
    assert.equal(r.stdout, 'kept\n');

    // A dead command daemon is restarted on reopen.
    const { processes } = await hostResources(stateDir);
    const chronus = processes.find((p) => p.includes('chronus'));
    assert.ok(chronus);
    process.kill(Number(chronus.split(' ')[0]), 'SIGKILL');
    const edge3 = await reopen();
    assert.equal((await edge3.runCommand(sb.id, { shell: 'cat /root/state' })).stdout, 'kept\n');
    assert.equal((await hostResources(stateDir)).containers.length, during.containers.length);
  });
});

test('a workspace and a toolkit with identical content stack without a repeated lower', async () => {
  await withEdge(async ({ edge, stateDir }) => {
    const { buildLayer, DirImageStore } = await import('@dsec/images');
    const { mkdir, writeFile } = await import('node:fs/promises');
    const src = join(stateDir, 'same');
    await mkdir(join(src, 'src'), { recursive: true });
    await writeFile(join(src, 'src', 'main.py'), 'print(1)\n');
    const store = new DirImageStore(join(stateDir, 'images'));
    const ws = await buildLayer(store, { name: 'repo', kind: 'workspace', from: { dir: src } });
    const tk = await buildLayer(store, { name: 'tool', kind: 'toolkit', from: { dir: src } });
    assert.equal(ws.digest, tk.digest);
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec({ workspace: 'repo', toolkits: ['tool'] }),
    });
    assert.equal(
      (await edge.runCommand(sb.id, { argv: ['cat', '/src/main.py'] })).stdout,
      'print(1)\n',
    );
    await edge.stopSandbox(sb.id);
  });
});
