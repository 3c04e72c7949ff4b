/**
 * Logs and metrics of a real edge (issue 16.3, docs/observability.md): a
 * sandbox created and stopped moves `dsec_edge_sandboxes` and the create
 * phase histogram; a create the edge refuses counts in
 * `dsec_admission_refusals_total` and leaves a warn line with the refusal's
 * fields; `/metrics` needs a key (or the admin listener); and no API key or
 * HMAC secret ever reaches a log line.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { Writable } from 'node:stream';
import { startEdgeServer, startSingleNode, type ClusterConfig } from '@dsec/cluster';
import { isDsecError, randomId, type SandboxSpec } from '@dsec/core';
import { jsonLogger } from '@dsec/edge';
import { RemoteEdge } from '@dsec/edge-http';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';

const root = process.getuid?.() === 0;

function spec(): SandboxSpec {
  return {
    backend: 'container',
    image: 'busybox',
    toolkits: [],
    memoryLimitMb: 128,
    cpuCoresLimit: 1,
    pidsLimit: 128,
    ttlSeconds: 600,
    networkRules: {},
    initUser: 'root',
    env: {},
    labels: {},
  };
}

/** Captures a JSON logger's lines. */
function logCapture() {
  let text = '';
  const stream = new Writable({
    write(chunk: Buffer, _enc, done) {
      text += chunk.toString();
      done();
    },
  });
  return {
    logger: jsonLogger({ name: 'dsec', destination: stream }),
    text: () => text,
    lines: () =>
      text
        .split('\n')
        .filter(Boolean)
        .map((l) => JSON.parse(l) as Record<string, unknown>),
  };
}

/** The value of the first sample line that starts with `prefix` and holds every label in `labels`. */
function sample(text: string, name: string, labels: Record<string, string> = {}): number {
  for (const line of text.split('\n')) {
    if (!line.startsWith(name + '{') && !line.startsWith(name + ' ')) continue;
    if (Object.entries(labels).every(([k, v]) => line.includes(`${k}="${v}"`)))
      return Number(line.slice(line.lastIndexOf(' ') + 1));
  }
  return NaN;
}

async function tempDir(): Promise<{ dir: string; cgroupParent: string; cleanup(): Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-obs-it-'));
  await chmod(dir, 0o711);
  const cgroupParent = `dsec-test-${basename(dir)}`;
  return {
    dir,
    cgroupParent,
    async cleanup() {
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    },
  };
}

test(
  'an edge server: sandbox gauges and create phases move, a refusal is counted and logged as warn, secrets never logged',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, cgroupParent, cleanup } = await tempDir();
    const stateDir = join(dir, 'edge');
    const rootfs = join(dir, 'rootfs');
    await makeBusyboxRootfs(rootfs);
    await buildLayer(new DirImageStore(join(stateDir, 'images')), {
      name: 'busybox',
      kind: 'base',
      from: { dir: rootfs },
    });
    const config: ClusterConfig = {
      edge: {
        id: 'obs-1',
        stateDir,
        host: '127.0.0.1',
        port: 0,
        secretFile: join(dir, 'edge.secret'),
        labels: {},
        cgroupParent,
        cgroupFavorDynmods: false,
        logRequests: true,
        // One sandbox at most: the second create is refused at admission.
        admission: { maxSandboxes: 1 },
        network: { mode: 'none' },
        metricsListen: '127.0.0.1:0',
      },
    };
    const logs = logCapture();
    const server = await startEdgeServer(config, { logger: logs.logger });
    const secret = (await readFile(join(dir, 'edge.secret'), 'utf8')).trim();
    const remote = new RemoteEdge({ edgeId: 'obs-1', url: server.url, secret });
    const scrape = async () => {
      const res = await fetch(server.metricsUrl!);
      assert.equal(res.status, 200);
      return res.text();
    };
    try {
      assert.match(server.metricsUrl ?? '', /^http:\/\/127\.0\.0\.1:\d+\/metrics$/);
      const before = await scrape();
      assert.equal(sample(before, 'dsec_edge_sandboxes', { state: 'running' }), 0);

      const sb = await remote.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() });
      const r = await remote.runCommand(sb.id, { shell: 'echo hi' });
      assert.equal(r.stdout, 'hi\n');
      let text = await scrape();
      assert.equal(sample(text, 'dsec_edge_sandboxes', { state: 'running', edge: 'obs-1' }), 1);
      for (const phase of ['layers', 'chronus', 'network', 'runtime', 'attach', 'total'])
        assert.equal(sample(text, 'dsec_create_phase_seconds_count', { phase }), 1, phase);
      assert.ok(sample(text, 'dsec_create_phase_seconds_sum', { phase: 'total' }) > 0);
      assert.equal(sample(text, 'dsec_command_outcomes_total', { outcome: 'exited' }), 1);
      assert.ok(sample(text, 'dsec_layer_cache_lookups_total', { result: 'miss' }) >= 1);
      assert.ok(sample(text, 'dsec_node_memory_total_bytes') > 0);

      // The edge holds one sandbox at most: the second is refused at admission.
      await assert.rejects(
        remote.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() }),
        (err) => isDsecError(err) && err.code === 'capacity_exhausted',
      );
      text = await scrape();
      assert.equal(sample(text, 'dsec_admission_refusals_total', { resource: 'sandboxes' }), 1);
      const refusal = logs.lines().find((l) => l.msg === 'admission refused');
      assert.ok(refusal, logs.text());
      assert.equal(refusal.level, 40); // warn
      assert.equal(refusal.resource, 'sandboxes');
      assert.equal(typeof refusal.limit, 'number');
      assert.equal(refusal.edgeId, 'obs-1');
      assert.equal(refusal.component, 'edge');

      await remote.stopSandbox(sb.id);
      text = await scrape();
      assert.equal(sample(text, 'dsec_edge_sandboxes', { state: 'running' }), 0);
      assert.equal(sample(text, 'dsec_edge_sandboxes', { state: 'stopped' }), 1);
      const started = logs.lines().find((l) => l.msg === 'sandbox started');
      assert.equal(started?.id, sb.id);
      assert.equal(started?.level, 30); // info
      assert.ok(logs.lines().some((l) => l.msg === 'sandbox stopped' && l.id === sb.id));

      // The edge's main listener serves its metrics to signed requests only.
      const unsigned = await fetch(`${server.url}/edge/v1/metrics`);
      assert.equal(unsigned.status, 401);
      await unsigned.text();
      // A request signed with a wrong secret is refused and logged, without either secret.
      const wrong = new RemoteEdge({ edgeId: 'obs-1', url: server.url, secret: 'a'.repeat(64) });
      await assert.rejects(wrong.status(), (err) => isDsecError(err));
      wrong.close();
      assert.ok(logs.lines().some((l) => l.msg === 'refused' && l.component === 'edge-http'));
      assert.ok(!logs.text().includes(secret), 'the edge secret reached a log line');
      assert.ok(!logs.text().includes('a'.repeat(64)), 'a presented secret reached a log line');
    } finally {
      remote.close();
      await server.close({ stopSandboxes: true });
      await cleanup();
    }
  },
);

test(
  'a single node (`dsec up`): /metrics needs an admin key and shows the edge too; the key is never logged',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, cgroupParent, cleanup } = await tempDir();
    const logs = logCapture();
    const node = await startSingleNode({
      stateDir: join(dir, 'state'),
      port: 0,
      cgroupParent,
      cgroupFavorDynmods: false,
      network: { mode: 'none' },
      logRequests: true,
      logger: logs.logger,
      metricsListen: { host: '127.0.0.1', port: 0 },
    });
    try {
      await makeBusyboxRootfs(join(dir, 'rootfs'));
      await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
      const auth = { authorization: `Bearer ${node.adminKey}`, 'content-type': 'application/json' };
      const created = await fetch(`${node.url}/v1/sandboxes`, {
        method: 'POST',
        headers: auth,
        body: JSON.stringify({ image: 'busybox' }),
      });
      assert.equal(created.status, 201, await created.clone().text());
      const { id } = (await created.json()) as { id: string };

      const anonymous = await fetch(`${node.url}/metrics`);
      assert.equal(anonymous.status, 401);
      await anonymous.text();
      const keyed = await fetch(`${node.url}/metrics`, { headers: auth });
      assert.equal(keyed.status, 200);
      const text = await keyed.text();
      assert.equal(sample(text, 'dsec_edge_sandboxes', { state: 'running' }), 1);
      assert.ok(sample(text, 'dsec_http_requests_total', { route: '/v1/sandboxes' }) >= 1);
      // The admin listener serves the same series without a key.
      const admin = await (await fetch(node.metricsUrl!)).text();
      assert.equal(sample(admin, 'dsec_edge_sandboxes', { state: 'running' }), 1);

      const deleted = await fetch(`${node.url}/v1/sandboxes/${id}`, {
        method: 'DELETE',
        headers: { authorization: auth.authorization },
      });
      assert.equal(deleted.status, 204);
      assert.ok(
        logs.lines().some((l) => l.component === 'apiserver' && l.msg === 'request completed'),
      );
      assert.ok(logs.lines().some((l) => l.component === 'edge' && l.msg === 'sandbox stopped'));
      assert.ok(!logs.text().includes(node.adminKey), 'the admin key reached a log line');
    } finally {
      await node.close({ stopSandboxes: true });
      await cleanup();
    }
  },
);
