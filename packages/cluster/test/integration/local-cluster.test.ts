import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { main } from '@dsec/cli/main';
import { startLocalCluster, type LocalCluster } from '@dsec/cluster';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { DSEC, removeCgroupParent } from './cluster-harness.js';

/*
 * `dsec up --edges N` (issue 10, point 6): an apiserver, a watcher and N edge
 * processes on this machine; `dsec cluster status --json` and `dsec sandbox
 * get --json` as a user reads them; an edge process that dies is started
 * again and adopts its sandboxes; closing leaves no process behind.
 */

const prefix = `dsec-lc-${randomBytes(3).toString('hex')}`;
let dir: string;
let stateDir: string;
let cluster: LocalCluster | undefined;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-local-cluster-'));
  await chmod(dir, 0o711);
  stateDir = join(dir, 'state');
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await buildLayer(new DirImageStore(join(stateDir, 'images')), {
    name: 'busybox',
    kind: 'base',
    from: { dir: join(dir, 'rootfs') },
  });
  cluster = await startLocalCluster({
    stateDir,
    edges: 2,
    port: 0,
    dsecCommand: DSEC,
    cgroupPrefix: prefix,
    watcherIntervalMs: 300,
  });
});

after(async () => {
  await cluster?.close({ stopSandboxes: true });
  for (const i of [1, 2]) await removeCgroupParent(`${prefix}-edge-${i}`);
  await rm(dir, { recursive: true, force: true });
});

async function dsec(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = '';
  let stderr = '';
  const code = await main(['--url', cluster!.url, '--state-dir', stateDir, ...args], {
    stdout: { write: (s: string) => (stdout += s) },
    stderr: { write: (s: string) => (stderr += s) },
    env: { DSEC_API_KEY: cluster!.adminKey },
  });
  return { code, stdout, stderr };
}

interface EdgeRow {
  id: string;
  url: string;
  healthy: boolean;
  sandboxes: number;
  pid?: number;
}

async function status(): Promise<EdgeRow[]> {
  const r = await dsec('cluster', 'status', '--json');
  assert.equal(r.code, 0, r.stderr);
  return (JSON.parse(r.stdout) as { edges: EdgeRow[] }).edges;
}

const alive = (pid: number) => {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
};

test('cluster status lists every edge with its process; sandboxes name their edge; a dead edge comes back with its sandboxes', async () => {
  const edges = await status();
  assert.deepEqual(
    edges.map((e) => e.id),
    ['edge-1', 'edge-2'],
  );
  for (const e of edges) {
    assert.equal(e.healthy, true);
    assert.equal(e.sandboxes, 0);
    assert.match(e.url, /^http:\/\/127\.0\.0\.1:\d+$/);
    assert.ok(e.pid !== undefined && alive(e.pid), `edge ${e.id} has a live pid`);
  }

  const created = await dsec('sandbox', 'create', '--image', 'busybox', '--json');
  assert.equal(created.code, 0, created.stderr);
  const id = (JSON.parse(created.stdout) as { id: string }).id;
  const got = await dsec('sandbox', 'get', id, '--json');
  const edgeId = (JSON.parse(got.stdout) as { edgeId: string }).edgeId;
  assert.ok(['edge-1', 'edge-2'].includes(edgeId));

  const victim = edges.find((e) => e.id === edgeId)!;
  process.kill(victim.pid!, 'SIGKILL');
  const deadline = Date.now() + 60_000;
  for (;;) {
    const now = (await status()).find((e) => e.id === edgeId);
    const exec = await dsec('sandbox', 'exec', id, '--', 'echo', 'back');
    if (now?.pid !== undefined && now.pid !== victim.pid && now.healthy && exec.code === 0) {
      assert.equal(exec.stdout, 'back\n');
      assert.equal(now.sandboxes, 1);
      break;
    }
    assert.ok(Date.now() < deadline, `edge ${edgeId} did not come back: ${exec.stderr}`);
    await new Promise((r) => setTimeout(r, 300));
  }

  const pids = [...cluster!.edges().map((e) => e.pid), cluster!.watcherPid()];
  await cluster!.close({ stopSandboxes: true });
  cluster = undefined;
  for (const pid of pids) assert.equal(alive(pid!), false, `process ${pid} ended`);
});
