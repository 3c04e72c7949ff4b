import { test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { createServer, type AddressInfo } from 'node:net';
import { basename, join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { isDsecError } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { main } from '@dsec/cli/main';

/** A single node on a fresh state dir with the busybox base image, stopped (sandboxes too) afterwards. */
async function withNode(
  fn: (
    node: SingleNode,
    ctx: { stateDir: string; restart(): Promise<SingleNode> },
  ) => Promise<void>,
) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-cluster-it-'));
  await chmod(dir, 0o711);
  const stateDir = join(dir, 'state');
  const edge = { cgroupParent: `dsec-test-${basename(dir)}` };
  let node = await startSingleNode({ stateDir, port: 0, ...edge });
  try {
    await makeBusyboxRootfs(join(dir, 'rootfs'));
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
    await fn(node, {
      stateDir,
      async restart() {
        await node.close();
        node = await startSingleNode({ stateDir, port: 0, ...edge });
        return node;
      },
    });
  } finally {
    await node.close({ stopSandboxes: true });
    await rm(dir, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${edge.cgroupParent}`).catch(() => undefined);
  }
}

function capture() {
  let stdout = '';
  let stderr = '';
  return {
    io: {
      stdout: { write: (s: string) => (stdout += s) },
      stderr: { write: (s: string) => (stderr += s) },
    },
    get stdout() {
      return stdout;
    },
    get stderr() {
      return stderr;
    },
  };
}

test('the paper’s minimal session through the SDK, and sandboxes survive a restart of the node', async () => {
  await withNode(async (node, { stateDir, restart }) => {
    assert.equal((await readFile(join(stateDir, 'admin.key'), 'utf8')).trim(), node.adminKey);
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    const sandbox = await client.runContainer(
      {
        image: 'busybox',
        memoryLimitMb: 512,
        cpuCoresLimit: 1,
        ttlRunningStopSeconds: 300,
        networkRules: {},
        initUser: 'root',
      },
      { timeoutMs: 60_000 },
    );
    const result = await sandbox.runShell('echo hello world');
    assert.equal(result.exitCode, 0);
    assert.equal(result.stdout, 'hello world\n');
    await sandbox.runShell('echo state > /root/kept');
    client.close();

    const node2 = await restart();
    const client2 = new DSecClient({ url: node2.url, apiKey: node2.adminKey });
    await client2.open();
    assert.deepEqual(
      (await client2.listSandboxes()).map((s) => s.id),
      [sandbox.id],
    );
    assert.equal((await client2.sandbox(sandbox.id).runShell('cat /root/kept')).stdout, 'state\n');
    await client2.sandbox(sandbox.id).stop();
    assert.deepEqual(await client2.listSandboxes(), []);
    client2.close();
  });
});

test('bad input over HTTP: field-level 4xx, distinct codes, nothing created', async () => {
  await withNode(async (node) => {
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    await assert.rejects(
      client.runContainer({ image: 'busybox', memoryLimitMb: -1 }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'memoryLimitMb',
    );
    await assert.rejects(client.runContainer({ image: 'nope' }), (e) =>
      isDsecError(e, 'image_not_found'),
    );
    await assert.rejects(
      client.sandbox('sb-AQZub2RlLTGqyGrrNwDZWFohQMgnMWvSrw').runShell('true'),
      (e) => isDsecError(e, 'sandbox_not_found'),
    );
    const res = await fetch(`${node.url}/v1/sandboxes`, {
      method: 'POST',
      headers: { authorization: `Bearer ${node.adminKey}`, 'content-type': 'application/json' },
      body: JSON.stringify({ image: 'busybox', privileged: true }),
    });
    assert.equal(res.status, 400);
    assert.equal(
      ((await res.json()) as { error: { code: string } }).error.code,
      'invalid_argument',
    );
    assert.deepEqual(await client.listSandboxes(), []);
    assert.deepEqual(
      await readdir(join(node.edge.options.stateDir, 'sandboxes')).catch(() => []),
      [],
    );
    client.close();
  });
});

test('the CLI creates, execs, lists and removes sandboxes', async () => {
  await withNode(async (node) => {
    const env = { DSEC_URL: node.url, DSEC_API_KEY: node.adminKey };
    const run = async (...argv: string[]) => {
      const c = capture();
      const code = await main(argv, { ...c.io, env });
      return { code, stdout: c.stdout, stderr: c.stderr };
    };
    const created = await run('sandbox', 'create', '--image', 'busybox', '--json');
    assert.equal(created.code, 0, created.stderr);
    const id = (JSON.parse(created.stdout) as { id: string }).id;
    const exec = await run(
      'sandbox',
      'exec',
      id,
      '--',
      'sh',
      '-c',
      'echo out; echo err >&2; exit 7',
    );
    assert.equal(exec.code, 7);
    assert.equal(exec.stdout, 'out\n');
    assert.equal(exec.stderr, 'err\n');
    const json = await run('sandbox', 'exec', id, '--json', '--', 'echo', 'hi');
    assert.deepEqual(
      (({ exitCode, stdout, stderr }) => ({ exitCode, stdout, stderr }))(
        JSON.parse(json.stdout) as Record<string, unknown>,
      ),
      { exitCode: 0, stdout: 'hi\n', stderr: '' },
    );
    assert.match((await run('sandbox', 'ls')).stdout, new RegExp(id));
    assert.equal((await run('sandbox', 'rm', id)).code, 0);
    assert.doesNotMatch((await run('sandbox', 'ls', '--json')).stdout, new RegExp(id));
    const missing = await run('sandbox', 'create', '--image', 'nope');
    assert.equal(missing.code, 1);
    assert.match(missing.stderr, /image_not_found/);
  });
});

test('a node whose port is taken fails to start and leaves nothing running: the same state dir starts again', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-cluster-it-'));
  await chmod(dir, 0o711);
  const stateDir = join(dir, 'state');
  const edge = { cgroupParent: `dsec-test-${basename(dir)}` };
  const taken = createServer();
  await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
  const port = (taken.address() as AddressInfo).port;
  const timers = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
  const before = timers();
  try {
    await assert.rejects(startSingleNode({ stateDir, port, ...edge }), /EADDRINUSE|in use/i);
    // The watcher's interval, the edge's sweeps and the control database went with the failure.
    assert.ok(timers() <= before, `timers left running: ${timers() - before}`);
    const node = await startSingleNode({ stateDir, port: 0, ...edge });
    await node.close({ stopSandboxes: true });
  } finally {
    taken.close();
    await rm(dir, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${edge.cgroupParent}`).catch(() => undefined);
  }
});
