import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { Readable } from 'node:stream';
import type { Duplex } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { isDsecError, randomId } from '@dsec/core';
import type { EdgeApi, SandboxSpec } from '@dsec/core';
import { edgeApiConformance } from '@dsec/core/testing';
import { openContainerEdge } from '@dsec/edge';
import type { Edge } from '@dsec/edge';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';
import type { EdgeServer } from '@dsec/edge-http';
import { makeTestCertificate } from '@dsec/edge-http/testing';

/**
 * A real container edge in a temp state dir with a busybox image, served
 * over loopback; with `tls`, over TLS with a certificate from openssl, pinned.
 */
async function servedEdge(capacitySandboxes: number, options: { tls?: boolean } = {}) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-edge-http-it-'));
  await chmod(dir, 0o711);
  const cgroupParent = `dsec-test-${basename(dir)}`;
  const store = new DirImageStore(join(dir, 'images'));
  const rootfs = join(dir, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: rootfs } });
  await rm(rootfs, { recursive: true, force: true });
  const edge = await openContainerEdge({
    edgeId: 'node-remote',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
    capacity: { sandboxes: capacitySandboxes },
  });
  const secret = newEdgeSecret();
  const cert = options.tls ? await makeTestCertificate(dir, 'edge') : undefined;
  const server = await serveEdge({
    edge,
    secret,
    ...(cert ? { tls: { cert: cert.cert, key: cert.key } } : {}),
  });
  const remote = new RemoteEdge({
    edgeId: edge.edgeId,
    url: server.url,
    secret,
    ...(cert ? { tls: { pinSha256: [cert.sha256] } } : {}),
  });
  return {
    edge,
    server,
    remote,
    tls: cert ? { pinSha256: [cert.sha256] } : undefined,
    async cleanup() {
      remote.close();
      await server.close();
      for (const s of await edge.listSandboxes({}))
        await edge.stopSandbox(s.id).catch(() => undefined);
      await edge.close();
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    },
  };
}

for (const tls of [false, true])
  edgeApiConformance(`RemoteEdge → serveEdge(Edge)${tls ? ' over pinned TLS' : ''}`, async () => {
    const s = await servedEdge(2, { tls });
    const served: EdgeApi = s.edge;
    return {
      edge: s.remote,
      capacitySandboxes: 2,
      mintId: () => randomId('sb'),
      image: 'busybox',
      // RemoteEdge always has the lifecycle methods; the served edge decides whether they work.
      lifecycle:
        served.pauseSandbox !== undefined &&
        served.resumeSandbox !== undefined &&
        served.setSandboxTimeout !== undefined,
      snapshots: served.snapshotSandbox !== undefined,
      cleanup: () => s.cleanup(),
    };
  });

const spec: SandboxSpec = {
  backend: 'container',
  image: 'busybox',
  toolkits: [],
  memoryLimitMb: 256,
  cpuCoresLimit: 1,
  pidsLimit: 256,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

// One served edge (over pinned TLS: the plaintext wire has these in the conformance
// suite and the unit tests) and one sandbox for the terminal, port and stdin round trips.
let edge: Edge;
let server: EdgeServer;
let remote: RemoteEdge;
let pins: { pinSha256: string[] } | undefined;
let sb: string;
let cleanup: () => Promise<void>;

before(async () => {
  const s = await servedEdge(4, { tls: true });
  ({ edge, server, remote, tls: pins } = s);
  cleanup = () => s.cleanup();
  sb = (await remote.createSandbox({ id: randomId('sb'), projectId: 'p1', spec })).id;
});

after(async () => {
  await cleanup();
});

test('a terminal round trip: keystrokes in, screen out, resize, exit status', async () => {
  const pty = await remote.io.openPty(sb, { rows: 24, cols: 80 });
  let screen = '';
  pty.onOutput((c) => (screen += c.toString()));
  const waitFor = async (re: RegExp) => {
    for (let i = 0; i < 200 && !re.test(screen); i++) await sleep(25);
    assert.match(screen, re);
  };
  pty.write(Buffer.from('echo $((6*7))\n'));
  await waitFor(/42/);
  pty.resize(40, 120);
  pty.write(Buffer.from('stty size\n'));
  await waitFor(/40 120/);
  pty.write(Buffer.from('exit 5\n'));
  assert.deepEqual(await pty.exited, { exitCode: 5, signal: undefined });
});

test('a port round trip: HTTP to a service in the sandbox; nothing listening is unavailable', async () => {
  const httpd = await remote.io.startCommand(sb, {
    shell:
      'mkdir -p /www && echo hello-over-the-edge > /www/index.html && exec httpd -f -p 127.0.0.1:8082 -h /www',
  });
  try {
    let body = '';
    for (let attempt = 0; attempt < 50 && body === ''; attempt++) {
      body = await get(await remote.io.connectPort(sb, 8082), '/index.html').catch(async () => {
        await sleep(50);
        return '';
      });
    }
    assert.equal(body, 'hello-over-the-edge\n');
    await assert.rejects(
      remote.io.connectPort(sb, 8097).then((s) => get(s, '/')),
      (e) => isDsecError(e, 'unavailable'),
    );
  } finally {
    await remote.io.killCommand(sb, httpd.commandId);
  }
});

test('stdin streams in over the wire: 8 MiB in uneven chunks, then EOF', async () => {
  const total = 8 * 1024 * 1024;
  const started = await remote.io.startCommand(sb, { shell: 'wc -c', stdinOpen: true });
  let sent = 0;
  const source = new Readable({
    read() {
      if (sent >= total) return void this.push(null);
      const n = Math.min(total - sent, 65_537);
      sent += n;
      this.push(Buffer.alloc(n, 0x61));
    },
  });
  assert.deepEqual(await remote.io.writeStdin(sb, started.commandId, source, { eof: true }), {
    bytes: total,
  });
  const r = await remote.io.waitCommand(sb, started.commandId);
  assert.equal(r.stdout.trim(), String(total));
});

test('a client with another secret is refused; the sandbox keeps answering the right one', async () => {
  const stranger = new RemoteEdge({
    edgeId: edge.edgeId,
    url: server.url,
    secret: newEdgeSecret(),
    tls: pins,
  });
  await assert.rejects(
    stranger.getSandbox(sb),
    (e) => isDsecError(e, 'unavailable') && e.details?.reason === 'edge_unauthenticated',
  );
  stranger.close();
  // The sandbox is still there and answering through the right client.
  assert.equal(
    (await remote.runCommand(sb, { argv: ['echo', 'ok'] }, { projectId: 'p1' })).stdout,
    'ok\n',
  );
});

function get(socket: Duplex, path: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({
      path,
      headers: { connection: 'close', host: 'x' },
      createConnection: () => socket,
    });
    req.on('error', reject);
    req.on('response', (res) => {
      let text = '';
      res.on('data', (c: Buffer) => (text += c.toString()));
      res.on('end', () => resolve(text));
      res.on('error', reject);
    });
    req.end();
  });
}
