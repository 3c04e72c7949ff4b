import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  loadClusterConfig,
  startApiserver,
  startLocalCluster,
  startSingleNode,
} from '@dsec/cluster';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import { dsecCommand } from '../self-command.js';
import { describeMachine } from './create.js';
import { interleave, ratio, type LatencySummary } from './stats.js';

export interface ClusterBenchOptions {
  iterations: number;
  warmup: number;
  edges: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface ClusterBenchReport {
  benchmark: 'cluster';
  cycle: string;
  iterations: number;
  topology: { apiservers: number; edges: number; database: string };
  results: { cluster: LatencySummary; single: LatencySummary };
  /** `single`: the cluster's p50 ÷ `dsec up`'s (target ≤ 1.2). */
  ratios: { single: number | null };
  machine: Record<string, unknown>;
}

const SPEC = {
  image: 'busybox',
  ttlRunningStopSeconds: 600,
  memoryLimitMb: 256,
  cpuCoresLimit: 1,
  networkRules: {},
};

/**
 * create → exec `true` → destroy through a cluster on this machine (two
 * apiservers over the shared control database, a watcher and N edge
 * processes, every call crossing the authenticated edge protocol) against the
 * same cycle through a single-process `dsec up`, interleaved. The cluster's
 * cycles alternate between its two apiservers. Both run the default network
 * policy.
 */
export async function benchCluster(options: ClusterBenchOptions): Promise<ClusterBenchReport> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-cluster-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  const clients: DSecClient[] = [];
  try {
    await makeBusyboxRootfs(join(work, 'rootfs'));
    const single = await startSingleNode({
      stateDir: join(work, 'single'),
      port: 0,
      cgroupParent: 'dsec-bench-single',
    });
    cleanups.unshift(async () => {
      await single.close({ stopSandboxes: true });
      await removeCgroup('dsec-bench-single');
    });
    await single.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(work, 'rootfs') } });

    const clusterDir = join(work, 'cluster');
    await buildLayer(new DirImageStore(join(clusterDir, 'images')), {
      name: 'busybox',
      kind: 'base',
      from: { dir: join(work, 'rootfs') },
    });
    const cluster = await startLocalCluster({
      stateDir: clusterDir,
      edges: options.edges,
      port: 0,
      dsecCommand: dsecCommand(),
      cgroupPrefix: 'dsec-bench',
    });
    cleanups.unshift(async () => {
      await cluster.close({ stopSandboxes: true });
      for (const e of cluster.edges()) await removeCgroup(`dsec-bench-${e.id}`);
    });
    const second = await startApiserver(
      await loadClusterConfig(join(clusterDir, 'cluster', 'cluster.json')),
      { port: 0 },
    );
    cleanups.unshift(() => second.close());

    const singleClient = new DSecClient({ url: single.url, apiKey: single.adminKey });
    const clusterClients = [cluster.url, second.url].map(
      (url) => new DSecClient({ url, apiKey: cluster.adminKey }),
    );
    clients.push(singleClient, ...clusterClients);
    const cycle = async (client: DSecClient) => {
      const sb = await client.runContainer(SPEC);
      try {
        await sb.runShell('true');
      } finally {
        await sb.stop();
      }
    };
    const results = await interleave(
      {
        single: () => cycle(singleClient),
        cluster: (round) => cycle(clusterClients[round % 2]!),
      },
      options,
    );
    return {
      benchmark: 'cluster',
      cycle: 'create → exec `true` → destroy',
      iterations: options.iterations,
      topology: { apiservers: 2, edges: options.edges, database: 'sqlite (embedded, shared file)' },
      results: { cluster: results.cluster!, single: results.single! },
      ratios: { single: ratio(results.cluster!, results.single) },
      machine: await describeMachine(),
    };
  } finally {
    for (const c of clients) c.close();
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

async function removeCgroup(parent: string): Promise<void> {
  for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => []))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${parent}`).catch(() => undefined);
}
