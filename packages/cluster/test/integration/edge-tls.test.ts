import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { joinEdge, loadClusterConfig, type ClusterConfig } from '@dsec/cluster';
import { isDsecError } from '@dsec/core';
import { makeTestCertificate, type TestCertificate } from '@dsec/edge-http/testing';
import { openControlDb, type ControlDb } from '@dsec/iam';
import { startPostgres } from '@dsec/iam/testing';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { removeCgroupParent, serve, type Served } from './cluster-harness.js';

/*
 * Issue 24, point 7, across processes: PostgreSQL, an apiserver (also the
 * watcher) and an edge whose config has `edge.tls`, with certificates made
 * by Debian's openssl. `dsec edge join` registers the edge's pin; the
 * apiserver then reaches the edge over TLS, pinned, and refuses it as soon
 * as the registry pins another certificate. A join whose pin is not the
 * edge's certificate registers nothing.
 */

const tag = randomBytes(3).toString('hex');
const cgroupParent = `dsec-tls-${tag}`;
let dir: string;
let pg: { url: string; stop(): Promise<void> };
let db: ControlDb;
let edge: Served | undefined;
let api: Served | undefined;
let client: DSecClient;
let sandbox: Sandbox;
let edgeFile: string;
let cert: TestCertificate;
let other: TestCertificate;

/** Retries `fn` until it passes (the registry is read every 300 ms). */
async function eventually<T>(fn: () => Promise<T>, tries = 60): Promise<T> {
  for (let i = 0; ; i++) {
    try {
      return await fn();
    } catch (err) {
      if (i >= tries) throw err;
      await new Promise((r) => setTimeout(r, 250));
    }
  }
}

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-cluster-tls-'));
  await chmod(dir, 0o711);
  pg = await startPostgres();
  db = await openControlDb(pg.url);
  cert = await makeTestCertificate(dir, 'edge-tls-1');
  other = await makeTestCertificate(dir, 'someone-else');
  const images = join(dir, 'images');
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await buildLayer(new DirImageStore(images), {
    name: 'busybox',
    kind: 'base',
    from: { dir: join(dir, 'rootfs') },
  });
  const port = 20000 + Math.floor(Math.random() * 20000);
  // The file an operator writes: paths relative to it, a default https URL.
  const config = {
    database: pg.url,
    clusterSecretFile: 'cluster.secret',
    imageStore: images,
    apiserver: {
      port: 0,
      adminKeyFile: 'admin.key',
      watch: true,
      registryRefreshMs: 300,
    },
    watcher: { intervalMs: 300, probeTimeoutMs: 1000, failuresBeforeDown: 1 },
    edge: {
      id: 'tls-1',
      stateDir: 'edge',
      port,
      secretFile: 'edge.secret',
      cgroupParent,
      network: { mode: 'none' },
      tls: { certFile: 'edge-tls-1.crt', keyFile: 'edge-tls-1.key' },
    },
  };
  edgeFile = join(dir, 'cluster.json');
  await writeFile(edgeFile, JSON.stringify(config));
  edge = await serve('edge', edgeFile);
  assert.match(edge.url, /^https:\/\//);
  api = await serve('apiserver', edgeFile);
  const record = await joinEdge(await loadClusterConfig(edgeFile));
  assert.equal(record.url, `https://127.0.0.1:${port}`);
  assert.deepEqual(record.tlsPins, [cert.sha256]);
  client = new DSecClient({
    url: api.url,
    apiKey: (await readFile(join(dir, 'admin.key'), 'utf8')).trim(),
  });
  sandbox = await eventually(() =>
    client.runContainer({ image: 'busybox', ttlRunningStopSeconds: 300 }),
  );
});

after(async () => {
  await sandbox?.stop().catch(() => undefined);
  client?.close();
  await api?.kill();
  await edge?.kill();
  await db?.close();
  await removeCgroupParent(cgroupParent);
  await pg?.stop();
  await rm(dir, { recursive: true, force: true });
});

test('the apiserver reaches a TLS edge through its pin: commands, output, files', async () => {
  const r = await sandbox.runShell('echo over-tls; echo err >&2; exit 3');
  assert.equal(r.stdout, 'over-tls\n');
  assert.equal(r.stderr, 'err\n');
  assert.equal(r.exitCode, 3);
  const bytes = randomBytes(300_000);
  await sandbox.files.write('/tmp/blob', bytes);
  assert.ok(bytes.equals(await sandbox.files.read('/tmp/blob', { format: 'bytes' })));
  assert.equal((await sandbox.runShell('wc -c < /tmp/blob')).stdout.trim(), '300000');
});

test('a registry pin of another certificate makes the apiserver refuse the edge', async () => {
  const record = (await db.edges.get('tls-1'))!;
  // As if the edge's address were taken over by someone with another certificate.
  await db.edges.register({ ...record, tlsPins: [other.sha256] });
  try {
    await eventually(async () => {
      const err = await sandbox.runShell('echo hi').then(
        () => undefined,
        (e: unknown) => e,
      );
      assert.ok(isDsecError(err, 'unavailable'), `refused: ${String(err)}`);
    });
  } finally {
    await db.edges.register(record);
  }
  // Pinned right again, it answers again.
  const r = await eventually(() => sandbox.runShell('echo back'));
  assert.equal(r.stdout, 'back\n');
});

test('a join whose pin is not the edge certificate registers nothing', async () => {
  const config = await loadClusterConfig(edgeFile);
  const wrong: ClusterConfig = {
    ...config,
    edge: {
      ...config.edge!,
      id: 'tls-1',
      tls: { ...config.edge!.tls!, pinSha256: [other.sha256] },
    },
  };
  const before = await db.edges.get('tls-1');
  await assert.rejects(joinEdge(wrong), (e) => isDsecError(e, 'unavailable'));
  assert.deepEqual((await db.edges.get('tls-1'))?.tlsPins, before?.tlsPins, 'unchanged');
  // A plaintext URL for a TLS edge does not join either.
  const plain: ClusterConfig = {
    ...config,
    edge: { ...config.edge!, tls: undefined, url: edge!.url.replace('https:', 'http:') },
  };
  await assert.rejects(joinEdge(plain), (e) => isDsecError(e, 'unavailable'));
  assert.deepEqual((await db.edges.get('tls-1'))?.tlsPins, before?.tlsPins, 'unchanged');
});
