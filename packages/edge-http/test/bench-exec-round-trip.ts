/**
 * The exec round trip through `RemoteEdge` → `serveEdge`, for measuring what
 * the edge protocol itself costs (docs/edge-protocol.md "Cost"). Not a test:
 * it prints numbers and asserts nothing.
 *
 *   node --conditions=dsec-source --import tsx packages/edge-http/test/bench-exec-round-trip.ts \
 *     [--edge fake|real] [--rounds 3000] [--concurrency 32] [--tls] [--impl DIR]
 *
 * `--impl DIR` loads `serveEdge`/`RemoteEdge` from DIR/index.ts instead: another
 * version's `src`, unpacked inside the repository so its imports resolve
 * (`mkdir .base && git archive 12887b5 packages/edge-http/src | tar -x -C .base`, then
 * `--impl .base/packages/edge-http/src`; remove `.base` after), for before/after runs.
 * `fake` serves a FakeEdge (the protocol alone); `real` (root) a container
 * edge with one busybox sandbox, so a round trip includes a real `echo`.
 * `--tls` serves over TLS with a pinned certificate made by Debian's openssl.
 */
import { execFileSync } from 'node:child_process';
import { chmod, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { SandboxIdCodec } from '@dsec/core';
import type { EdgeApi, SandboxSpec } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import * as current from '@dsec/edge-http';

const { values } = parseArgs({
  options: {
    edge: { type: 'string', default: 'fake' },
    rounds: { type: 'string', default: '3000' },
    concurrency: { type: 'string', default: '32' },
    tls: { type: 'boolean', default: false },
    impl: { type: 'string' },
  },
});
const { newEdgeSecret, RemoteEdge, serveEdge } = (
  values.impl ? await import(resolve(values.impl, 'index.ts')) : current
) as typeof current;
const ROUNDS = Number(values.rounds);
const CONCURRENCY = Number(values.concurrency);

const spec = (image: string): SandboxSpec => ({
  backend: 'container',
  image,
  toolkits: [],
  memoryLimitMb: 256,
  cpuCoresLimit: 1,
  pidsLimit: 256,
  ttlSeconds: 3600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
});

async function openEdge(): Promise<{ edge: EdgeApi; image: string; close(): Promise<void> }> {
  if (values.edge === 'fake') {
    return { edge: new FakeEdge({ edgeId: 'bench' }), image: 'base', close: async () => {} };
  }
  const { openContainerEdge } = await import('@dsec/edge');
  const { buildLayer, DirImageStore, makeBusyboxRootfs } = await import('@dsec/images');
  const dir = await mkdtemp(join(tmpdir(), 'dsec-bench-rtt-'));
  await chmod(dir, 0o711);
  const cgroupParent = `dsec-bench-${basename(dir)}`;
  const store = new DirImageStore(join(dir, 'images'));
  await makeBusyboxRootfs(join(dir, 'rootfs'));
  await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
  const edge = await openContainerEdge({
    edgeId: 'bench',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
    capacity: { sandboxes: 4 },
  });
  return {
    edge,
    image: 'busybox',
    async close() {
      for (const s of await edge.listSandboxes({})) await edge.stopSandbox(s.id).catch(() => {});
      await edge.close();
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    },
  };
}

/** A self-signed certificate for 127.0.0.1 from Debian's openssl, in a temp dir. */
async function makeCert(): Promise<{ cert: string; key: string; dir: string }> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-bench-tls-'));
  execFileSync(
    'openssl',
    [
      'req',
      '-x509',
      '-newkey',
      'ec',
      '-pkeyopt',
      'ec_paramgen_curve:P-256',
      '-nodes',
      '-days',
      '1',
      '-subj',
      '/CN=dsec-bench-edge',
      '-addext',
      'subjectAltName=IP:127.0.0.1',
      '-keyout',
      join(dir, 'key.pem'),
      '-out',
      join(dir, 'cert.pem'),
    ],
    { stdio: 'ignore' },
  );
  return {
    cert: await readFile(join(dir, 'cert.pem'), 'utf8'),
    key: await readFile(join(dir, 'key.pem'), 'utf8'),
    dir,
  };
}

function quantiles(ms: number[]) {
  const s = [...ms].sort((a, b) => a - b);
  const q = (p: number) => s[Math.min(s.length - 1, Math.floor(p * s.length))]!;
  const mean = s.reduce((a, b) => a + b, 0) / s.length;
  return {
    p50: +q(0.5).toFixed(3),
    p90: +q(0.9).toFixed(3),
    p99: +q(0.99).toFixed(3),
    mean: +mean.toFixed(3),
  };
}

async function main(): Promise<void> {
  const opened = await openEdge();
  const secret = newEdgeSecret();
  const tls = values.tls ? await makeCert() : undefined;
  const serveOptions: Record<string, unknown> = { edge: opened.edge, secret };
  const remoteOptions: Record<string, unknown> = { edgeId: opened.edge.edgeId, secret };
  if (tls) {
    const { X509Certificate } = await import('node:crypto');
    serveOptions.tls = { cert: tls.cert, key: tls.key };
    remoteOptions.tls = { pinSha256: [new X509Certificate(tls.cert).fingerprint256] };
  }
  const server = await serveEdge(serveOptions as unknown as Parameters<typeof serveEdge>[0]);
  const remote = new RemoteEdge({
    ...remoteOptions,
    url: server.url,
  } as unknown as ConstructorParameters<typeof RemoteEdge>[0]);
  const ids = new SandboxIdCodec('edge-rtt-bench-secret');
  try {
    const sb = await remote.createSandbox({
      id: ids.mint(opened.edge.edgeId),
      projectId: 'prj-bench',
      spec: spec(opened.image),
    });
    const run = () =>
      remote.runCommand(sb.id, { argv: ['echo', 'hi'] }, { projectId: 'prj-bench' });
    const direct = () =>
      opened.edge.runCommand(sb.id, { argv: ['echo', 'hi'] }, { projectId: 'prj-bench' });
    for (let i = 0; i < Math.min(200, ROUNDS); i++) await run();
    // Wall time per call, and this process's CPU time per call: client and server
    // both run here, so the CPU figure is the whole protocol's cost, and it is far
    // less disturbed by other work on the machine than the wall time.
    const time = async (fn: () => Promise<unknown>) => {
      const ms: number[] = [];
      const cpu0 = process.cpuUsage();
      for (let i = 0; i < ROUNDS; i++) {
        const t0 = process.hrtime.bigint();
        await fn();
        ms.push(Number(process.hrtime.bigint() - t0) / 1e6);
      }
      const cpu = process.cpuUsage(cpu0);
      return { ...quantiles(ms), cpuUsPerCall: Math.round((cpu.user + cpu.system) / ROUNDS) };
    };
    const inProcess = await time(direct);
    const remoteRtt = await time(run);
    const t0 = process.hrtime.bigint();
    let next = 0;
    await Promise.all(
      Array.from({ length: CONCURRENCY }, async () => {
        while (next++ < ROUNDS) await run();
      }),
    );
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    console.log(
      JSON.stringify({
        edge: values.edge,
        impl: values.impl ?? 'current',
        tls: Boolean(tls),
        rounds: ROUNDS,
        inProcessMs: inProcess,
        remoteMs: remoteRtt,
        concurrency: CONCURRENCY,
        remotePerSecond: Math.round(ROUNDS / seconds),
      }),
    );
  } finally {
    remote.close();
    await server.close();
    await opened.close();
    if (tls) await rm(tls.dir, { recursive: true, force: true });
  }
}

await main();
