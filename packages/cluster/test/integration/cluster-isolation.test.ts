import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { joinEdge, loadClusterConfig, type ClusterConfig } from '@dsec/cluster';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { removeCgroupParent, serve, type Served } from './cluster-harness.js';

/*
 * SECURITY (issue 10, point 1): no sandbox can reach an edge's or an
 * apiserver's port. The worst case is served: both listen on every address
 * of the host (0.0.0.0), so the sandbox's own gateway (the host end of its
 * veth, an address the edge created) is one of them. The sandbox, with the
 * default network policy, tries both ports at its gateway; a listener inside
 * the sandbox shows the probe itself connects when something answers.
 */

const tag = randomBytes(3).toString('hex');
const cgroupParent = `dsec-iso-${tag}`;
let dir: string;
let edge: Served | undefined;
let api: Served | undefined;
let client: DSecClient;
let sandbox: Sandbox;
let edgePort: number;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-cluster-iso-'));
  await chmod(dir, 0o711);
  const images = join(dir, 'images');
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await buildLayer(new DirImageStore(images), {
    name: 'busybox',
    kind: 'base',
    from: { dir: join(dir, 'rootfs') },
  });
  edgePort = 20000 + Math.floor(Math.random() * 20000);
  const config: ClusterConfig = {
    database: join(dir, 'control.db'),
    clusterSecretFile: join(dir, 'cluster.secret'),
    imageStore: images,
    apiserver: {
      host: '0.0.0.0',
      port: 0,
      adminKeyFile: join(dir, 'admin.key'),
      watch: true,
      registryRefreshMs: 300,
      logRequests: false,
    },
    watcher: { intervalMs: 300, probeTimeoutMs: 1000, failuresBeforeDown: 1 },
    edge: {
      id: 'iso-1',
      stateDir: join(dir, 'edge'),
      host: '0.0.0.0',
      port: edgePort,
      url: `http://127.0.0.1:${edgePort}`,
      secretFile: join(dir, 'edge.secret'),
      labels: {},
      cgroupParent,
      network: { mode: 'isolated' },
      cgroupFavorDynmods: true,
      logRequests: false,
    },
  };
  const file = join(dir, 'cluster.json');
  await writeFile(file, JSON.stringify(config));
  edge = await serve('edge', file);
  api = await serve('apiserver', file);
  await joinEdge(await loadClusterConfig(file));
  client = new DSecClient({
    url: api.url.replace('0.0.0.0', '127.0.0.1'),
    apiKey: (await readFile(join(dir, 'admin.key'), 'utf8')).trim(),
  });
  // The registry is read every 300 ms: retry until the apiserver knows the edge.
  for (let i = 0; ; i++) {
    try {
      sandbox = await client.runContainer({
        image: 'busybox',
        ttlRunningStopSeconds: 300,
        networkRules: {},
      });
      break;
    } catch (err) {
      if (i > 50) throw err;
      await new Promise((r) => setTimeout(r, 200));
    }
  }
});

after(async () => {
  await sandbox?.stop().catch(() => undefined);
  client?.close();
  await api?.kill();
  await edge?.kill();
  await removeCgroupParent(cgroupParent);
  await rm(dir, { recursive: true, force: true });
});

test('a sandbox reaches neither its edge’s port nor an apiserver’s, even on its own gateway', async () => {
  const apiPort = Number(new URL(api!.url).port);
  const gateway = (await sandbox.runShell("ip route | awk '/default/ {print $3}'")).stdout.trim();
  assert.match(gateway, /^\d+\.\d+\.\d+\.\d+$/, 'the sandbox has a default gateway');
  // Positive control: the same probe connects to a listener inside the sandbox.
  const control = await sandbox.runShell(
    '(nc -l -p 7777 >/dev/null 2>&1 &) ; sleep 0.3; nc -w 2 127.0.0.1 7777 </dev/null && echo OPEN || echo CLOSED',
  );
  assert.equal(control.stdout.trim(), 'OPEN');
  for (const port of [edgePort, apiPort]) {
    const probe = await sandbox.runShell(
      `nc -w 2 ${gateway} ${port} </dev/null && echo OPEN || echo CLOSED`,
      { timeoutMs: 10_000 },
    );
    assert.equal(probe.stdout.trim(), 'CLOSED', `port ${port} at ${gateway}`);
  }
});
