import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { joinEdge, loadClusterConfig, type ClusterConfig } from '@dsec/cluster';
import { isDsecError } from '@dsec/core';
import { startPostgres } from '@dsec/iam/testing';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import {
  makeNetns,
  pool,
  removeCgroupParent,
  removeNetns,
  serve,
  type Served,
} from './cluster-harness.js';

/*
 * Issue 10, point 8 (SECURITY E26–E30, G33–G34 across processes): PostgreSQL,
 * two apiservers, a watcher and three edges, each edge in a network namespace
 * this test creates and reached at a test-only address inside it. 300
 * sandboxes are created through both apiservers; then one edge and one
 * apiserver are killed with SIGKILL. Nothing acknowledged may be lost:
 * sandboxes on the surviving edges keep answering, those on the dead edge
 * answer `unavailable` (never "not found"), new creates succeed within
 * seconds, and the dead edge's sandboxes answer again once it restarts.
 */

const SANDBOXES = 300;
const SPEC = {
  image: 'busybox',
  ttlRunningStopSeconds: 900,
  memoryLimitMb: 64,
  cpuCoresLimit: 0.1,
};
const tag = randomBytes(3).toString('hex');
const EDGES = [1, 2, 3].map((i) => ({
  id: `edge-${i}`,
  netns: `dsecft${tag}${i}`,
  veth: `dft${tag}${i}`,
  hostAddr: `10.254.${100 + i}.1`,
  innerAddr: `10.254.${100 + i}.2`,
  cgroupParent: `dsec-ft-${tag}-${i}`,
}));

let dir: string;
let pg: { url: string; stop(): Promise<void> };
let sharedFile: string;
const edgeFiles = new Map<string, string>();
const edges = new Map<string, Served>();
const apiservers: Served[] = [];
let watcher: Served | undefined;
let adminKey: string;
/** Every sandbox a create acknowledged, for the clean-up. */
const created = new Set<string>();

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-cluster-faults-'));
  await chmod(dir, 0o711);
  pg = await startPostgres();
  const images = join(dir, 'images');
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await buildLayer(new DirImageStore(images), {
    name: 'busybox',
    kind: 'base',
    from: { dir: join(dir, 'rootfs') },
  });
  const shared: ClusterConfig = {
    database: pg.url,
    clusterSecretFile: join(dir, 'cluster.secret'),
    imageStore: images,
    apiserver: {
      host: '127.0.0.1',
      port: 0,
      adminKeyFile: join(dir, 'admin.key'),
      watch: false,
      registryRefreshMs: 300,
      logRequests: false,
    },
    watcher: { intervalMs: 300, probeTimeoutMs: 1000, failuresBeforeDown: 2 },
  };
  sharedFile = join(dir, 'cluster.json');
  await writeFile(sharedFile, JSON.stringify(shared));
  for (const e of EDGES) {
    await makeNetns(e.netns, e.veth, e.hostAddr, e.innerAddr);
    const file = join(dir, `${e.id}.json`);
    const config: ClusterConfig = {
      database: pg.url,
      imageStore: images,
      edge: {
        id: e.id,
        stateDir: join(dir, e.id),
        host: e.innerAddr,
        port: 7430,
        secretFile: join(dir, `${e.id}.secret`),
        labels: { rack: `r${e.id.slice(-1)}` },
        cgroupParent: e.cgroupParent,
        network: { mode: 'none' },
        cgroupFavorDynmods: true,
        logRequests: false,
      },
    };
    await writeFile(file, JSON.stringify(config));
    edgeFiles.set(e.id, file);
  }
  // The first apiserver creates the schema and the root project; the second shares them.
  apiservers.push(await serve('apiserver', sharedFile));
  apiservers.push(await serve('apiserver', sharedFile));
  adminKey = (await readFile(join(dir, 'admin.key'), 'utf8')).trim();
  await Promise.all(
    EDGES.map(async (e) => {
      edges.set(e.id, await serve('edge', edgeFiles.get(e.id)!, { netns: e.netns }));
      await joinEdge(await loadClusterConfig(edgeFiles.get(e.id)!));
    }),
  );
  watcher = await serve('watcher', sharedFile);
});

after(async () => {
  // Sandboxes first, through any apiserver still up, then every process.
  const alive = apiservers.find((a) => a.proc.exitCode === null && a.proc.signalCode === null);
  if (alive) {
    const client = new DSecClient({ url: alive.url, apiKey: adminKey });
    for (const sb of await client.listSandboxes().catch(() => [])) created.add(sb.id);
    await pool([...created], 16, (id) => client.sandbox(id).stop());
    client.close();
  }
  for (const s of [...edges.values(), ...apiservers, watcher]) await s?.kill();
  for (const e of EDGES) {
    await removeNetns(e.netns, e.veth);
    await removeCgroupParent(e.cgroupParent);
  }
  await pg?.stop();
  await rm(dir, { recursive: true, force: true });
});

/** Waits until `check` passes (it throws or returns false until then). */
async function eventually(check: () => Promise<boolean>, timeoutMs: number): Promise<number> {
  const start = Date.now();
  let last: unknown;
  while (Date.now() - start < timeoutMs) {
    try {
      if (await check()) return Date.now() - start;
    } catch (err) {
      last = err;
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`not within ${timeoutMs} ms: ${String(last)}`);
}

test('300 sandboxes through two apiservers survive SIGKILL of one edge and one apiserver', async () => {
  const clients = apiservers.map((a) => new DSecClient({ url: a.url, apiKey: adminKey }));
  try {
    // Every edge healthy in the registry before the burst.
    await eventually(async () => {
      const listed = await clients[0]!.listEdges();
      return listed.length === 3 && listed.every((e) => e.healthy);
    }, 15_000);

    const acknowledged = new Map<string, string>();
    const results = await pool(
      Array.from({ length: SANDBOXES }, (_, i) => i),
      24,
      async (i) => {
        const sb = await clients[i % 2]!.runContainer({
          ...SPEC,
          requestId: `ft-${tag}-${i}`,
        });
        acknowledged.set(sb.id, sb.info!.edgeId);
        created.add(sb.id);
        return sb;
      },
    );
    const failed = results.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
    assert.equal(
      failed.length,
      0,
      `creates failed: ${failed
        .map((f) => String(f.reason))
        .slice(0, 3)
        .join('; ')}`,
    );
    const perEdge = new Map<string, number>();
    for (const edgeId of acknowledged.values()) perEdge.set(edgeId, (perEdge.get(edgeId) ?? 0) + 1);
    assert.equal(perEdge.size, 3, `placed on every edge: ${JSON.stringify([...perEdge])}`);

    // The faults: one edge and one apiserver, without warning.
    const victim = 'edge-2';
    await edges.get(victim)!.kill('SIGKILL');
    await apiservers[0]!.kill('SIGKILL');
    const survivor = clients[1]!;

    // New creates succeed within seconds (the dead edge is skipped or retried past).
    const firstOk = await eventually(async () => {
      created.add((await survivor.runContainer(SPEC)).id);
      return true;
    }, 10_000);
    const after = await pool(
      Array.from({ length: 20 }, (_, i) => i),
      8,
      (i) => survivor.runContainer({ ...SPEC, requestId: `ft-${tag}-after-${i}` }),
    );
    for (const r of after) {
      if (r.status === 'fulfilled') created.add(r.value.id);
      assert.equal(r.status, 'fulfilled', String((r as PromiseRejectedResult).reason));
      assert.notEqual(
        (r as PromiseFulfilledResult<{ info: { edgeId: string } }>).value.info.edgeId,
        victim,
      );
    }
    assert.ok(firstOk < 10_000);

    // Nothing acknowledged is lost: surviving edges' sandboxes answer, the dead edge's are unavailable.
    const checks = await pool([...acknowledged], 16, async ([id, edgeId]) => {
      if (edgeId === victim) {
        await assert.rejects(survivor.getSandbox(id), (err: unknown) => {
          assert.ok(isDsecError(err) && err.code === 'unavailable', String(err));
          return true;
        });
        return;
      }
      const sb = await survivor.getSandbox(id);
      assert.equal(sb.info!.state, 'running');
      const r = await sb.runShell('echo ok');
      assert.equal(r.stdout, 'ok\n');
    });
    const bad = checks.filter((r) => r.status === 'rejected');
    assert.equal(bad.length, 0, String(bad[0]?.reason));

    // The dead edge comes back and adopts its sandboxes.
    const e = EDGES.find((x) => x.id === victim)!;
    edges.set(victim, await serve('edge', edgeFiles.get(victim)!, { netns: e.netns }));
    const victims = [...acknowledged].filter(([, edgeId]) => edgeId === victim);
    await eventually(async () => {
      const sb = await survivor.getSandbox(victims[0]![0]);
      return (await sb.runShell('true')).exitCode === 0;
    }, 30_000);
    const adopted = await pool(victims, 16, async ([id]) => {
      const sb = await survivor.getSandbox(id);
      assert.equal((await sb.runShell('echo back')).stdout, 'back\n');
    });
    assert.equal(adopted.filter((r) => r.status === 'rejected').length, 0);

    // Listing reaches every edge again, the restarted one included.
    const listed = new Set((await survivor.listSandboxes()).map((sb) => sb.id));
    const missing = [...acknowledged.keys()].filter((id) => !listed.has(id));
    assert.deepEqual(
      missing.length,
      0,
      `every acknowledged sandbox is listed; missing ${missing.length} (${new Set(missing.map((id) => acknowledged.get(id))).size} edges); edges: ${JSON.stringify((await survivor.listEdges()).map((e) => [e.edgeId, e.healthy]))}`,
    );

    // The idempotency records of the killed apiserver's creates are shared: a retry returns the same sandbox.
    const again = await survivor.runContainer({ ...SPEC, requestId: `ft-${tag}-0` });
    assert.ok(acknowledged.has(again.id));
  } finally {
    for (const c of clients) c.close();
  }
});
