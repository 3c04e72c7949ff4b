/**
 * The cost of the network hop on the exec hot path: warm `runCommand`
 * latency through RemoteEdge → serveEdge(Edge) on loopback against the same
 * Edge in-process, one sandbox, sequential calls, rounds alternating so
 * drift of a shared machine hits both alike. Needs root (a real container
 * edge). Prints JSON.
 *
 *   node --conditions=dsec-source --import tsx packages/edge-http/test/measure-hop.ts [calls-per-round] [rounds]
 */
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { randomId } from '@dsec/core';
import type { EdgeApi } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';

const calls = Number(process.argv[2] ?? 300);
const rounds = Number(process.argv[3] ?? 4);

const dir = await mkdtemp(join(tmpdir(), 'dsec-hop-'));
await chmod(dir, 0o711);
const cgroupParent = `dsec-test-${basename(dir)}`;
const store = new DirImageStore(join(dir, 'images'));
await makeBusyboxRootfs(join(dir, 'rootfs'));
await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
const edge = await openContainerEdge({
  edgeId: 'node-hop',
  stateDir: join(dir, 'edge'),
  store,
  cgroupParent,
});
const secret = newEdgeSecret();
const server = await serveEdge({ edge, secret });
const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
try {
  const spec = {
    backend: 'container' as const,
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
  const id = (await edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec })).id;
  const samples: Record<'inProcess' | 'remote', number[]> = { inProcess: [], remote: [] };
  const run = async (e: EdgeApi, into: number[] | undefined) => {
    for (let i = 0; i < calls; i++) {
      const t0 = performance.now();
      const r = await e.runCommand(id, { argv: ['true'] }, { projectId: 'p' });
      const ms = performance.now() - t0;
      if (r.exitCode !== 0) throw new Error(`exec failed: ${JSON.stringify(r)}`);
      into?.push(ms);
    }
  };
  await run(edge, undefined); // warm both paths (chronus connection, sockets, JIT)
  await run(remote, undefined);
  for (let round = 0; round < rounds; round++) {
    await run(edge, samples.inProcess);
    await run(remote, samples.remote);
  }
  const pct = (xs: number[], p: number) => {
    const s = [...xs].sort((a, b) => a - b);
    return Number(s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!.toFixed(3));
  };
  const summary = (xs: number[]) => ({ p50: pct(xs, 50), p90: pct(xs, 90), p99: pct(xs, 99) });
  const inProcess = summary(samples.inProcess);
  const viaHttp = summary(samples.remote);
  console.log(
    JSON.stringify(
      {
        callsPerPath: calls * rounds,
        inProcessMs: inProcess,
        remoteMs: viaHttp,
        hopP50Ms: Number((viaHttp.p50 - inProcess.p50).toFixed(3)),
        ratioP50: Number((viaHttp.p50 / inProcess.p50).toFixed(3)),
      },
      null,
      2,
    ),
  );
} finally {
  remote.close();
  await server.close();
  for (const s of await edge.listSandboxes({})) await edge.stopSandbox(s.id);
  await edge.close();
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
}
