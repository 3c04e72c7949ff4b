import { execFile } from 'node:child_process';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { randomId, type SandboxSpec } from '@dsec/core';
import type { ContainerBackend } from '@dsec/edge';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { describeMachine } from './create.js';

const execFileAsync = promisify(execFile);

export const BENCH_SPEC: SandboxSpec = {
  backend: 'container',
  image: 'busybox',
  toolkits: [],
  memoryLimitMb: 512,
  cpuCoresLimit: 1,
  pidsLimit: 256,
  ttlSeconds: 3600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

/**
 * An edge in a temp dir (no network, its own cgroup parent) with a busybox
 * base, and a sandbox whose writable layer holds `writableMb` MiB of random
 * data in 1 MiB files. Benches drive the Edge directly: what they measure is
 * the edge's work, not the API's.
 */
export async function startSnapshotBenchNode(writableMb: number): Promise<{
  edge: Edge;
  store: DirImageStore;
  work: string;
  sourceId: string;
  /** The source sandbox's upper directory and freezer state file. */
  upperDir: string;
  freezerState: string | undefined;
  close(): Promise<void>;
}> {
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-snap-'));
  await chmod(work, 0o711);
  const store = new DirImageStore(join(work, 'images'));
  const rootfs = join(work, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: rootfs } });
  const cgroupParent = `dsec-bench-${process.pid}`;
  const edge = await openContainerEdge({
    edgeId: 'bench',
    stateDir: join(work, 'edge'),
    store,
    cgroupParent,
    network: { mode: 'none' },
  });
  const close = async () => {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await rm(work, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
  };
  try {
    const sb = await edge.createSandbox({
      id: randomId('sb'),
      projectId: 'bench',
      spec: BENCH_SPEC,
    });
    const r = await edge.runCommand(sb.id, {
      shell: `mkdir /state && i=0; while [ $i -lt ${writableMb} ]; do dd if=/dev/urandom of=/state/f$i bs=1M count=1 2>/dev/null; i=$((i+1)); done`,
      timeoutMs: 600_000,
    });
    if (r.exitCode !== 0) throw new Error(`filling the writable layer failed: ${r.stderr}`);
    const backend = edge.options.backend as ContainerBackend;
    const p = backend.paths({ id: sb.id });
    const freezerDir = backend.options.cgroups
      .dirs(p.cgroupsPath)
      .find((d) => d.includes('/freezer/'));
    return {
      edge,
      store,
      work,
      sourceId: sb.id,
      upperDir: p.upper,
      freezerState: freezerDir && join(freezerDir, 'freezer.state'),
      close,
    };
  } catch (err) {
    await close();
    throw err;
  }
}

/** Bytes a tree occupies on disk (`du -sb` counts apparent bytes; blocks are what was written). */
export async function diskBytes(path: string): Promise<number> {
  const { stdout } = await execFileAsync('du', ['-s', '--block-size=1', path]);
  return Number(stdout.split('\t')[0]);
}

export interface ForkBenchOptions {
  count: number;
  writableMb: number;
  onProgress?: (done: number) => void;
  signal?: AbortSignal;
}

export interface ForkBenchReport {
  benchmark: 'fork';
  count: number;
  writableMb: number;
  results: {
    dsec: {
      snapshotMs: number;
      freezeMs: number;
      createMs: number;
      /** Snapshot, then `count` sandboxes created from it (all at once). */
      forkMs: number;
      bytesWritten: number;
      layerMounts: number;
    };
    copy: {
      /** `count` copies of the upper directory (`cp -a`), each file fsynced. */
      copyMs: number;
      bytesWritten: number;
    };
  };
  ratios: {
    /** copy ÷ dsec bytes written: above 1 means DSec writes less (target ≥ 10). */
    bytesWritten: number;
    /** copy ÷ dsec time to durable state for `count` forks (snapshot vs copies; target ≥ 5). */
    time: number;
    /** (copies + the same creates) ÷ (snapshot + creates): the whole fork. */
    timeWithCreates: number;
  };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * `dsec bench fork`: fork K sandboxes from one whose writable layer holds
 * `writableMb` MiB. DSec snapshots once (one EROFS layer, written once,
 * fsynced by the store) and creates K sandboxes stacked on it, each with an
 * empty writable layer; the peer copies the upper directory K times, as a
 * copy-based fork must before it can start anything, and fsyncs the copies.
 * Bytes written are counted as disk blocks of what each approach creates.
 */
export async function benchFork(options: ForkBenchOptions): Promise<ForkBenchReport> {
  const node = await startSnapshotBenchNode(options.writableMb);
  try {
    const { edge } = node;
    options.onProgress?.(1);
    const mountsBefore = edge.options.layers.stats().mounted;
    const t0 = performance.now();
    const snap = await edge.snapshotSandbox(node.sourceId, { name: 'fork-bench' });
    const t1 = performance.now();
    const ids = await Promise.all(
      Array.from({ length: options.count }, () =>
        edge
          .createSandbox({
            id: randomId('sb'),
            projectId: 'bench',
            spec: { ...BENCH_SPEC, image: 'fork-bench' },
          })
          .then((s) => s.id),
      ),
    );
    const t2 = performance.now();
    options.onProgress?.(2);
    const backend = edge.options.backend as ContainerBackend;
    let upperBytes = 0;
    for (const id of ids) upperBytes += await diskBytes(backend.paths({ id }).upper);
    const dsecBytes = (await diskBytes(await node.store.blobPath(snap.layer.digest))) + upperBytes;
    const layerMounts = edge.options.layers.stats().mounted - mountsBefore;
    for (const id of ids) await edge.stopSandbox(id);

    // The peer: K copies of the (idle) source's upper directory, made durable.
    const copies = join(node.work, 'copies');
    await execFileAsync('mkdir', ['-p', copies]);
    const c0 = performance.now();
    for (let i = 0; i < options.count; i++) {
      await execFileAsync('cp', ['-a', '--', node.upperDir, join(copies, String(i))]);
    }
    await execFileAsync('sh', ['-c', 'find "$1" -type f -exec sync {} +', 'sh', copies]);
    const copyMs = performance.now() - c0;
    const copyBytes = await diskBytes(copies);
    options.onProgress?.(3);
    const snapshotMs = t1 - t0;
    const createMs = t2 - t1;
    const r = (n: number) => Math.round(n * 10) / 10;
    return {
      benchmark: 'fork',
      count: options.count,
      writableMb: options.writableMb,
      results: {
        dsec: {
          snapshotMs: r(snapshotMs),
          freezeMs: snap.freezeMs,
          createMs: r(createMs),
          forkMs: r(snapshotMs + createMs),
          bytesWritten: dsecBytes,
          layerMounts,
        },
        copy: { copyMs: r(copyMs), bytesWritten: copyBytes },
      },
      ratios: {
        bytesWritten: Math.round((copyBytes / dsecBytes) * 100) / 100,
        time: Math.round((copyMs / snapshotMs) * 100) / 100,
        timeWithCreates: Math.round(((copyMs + createMs) / (snapshotMs + createMs)) * 100) / 100,
      },
      method:
        'one edge driven directly, busybox base, source sandbox writable layer of 1 MiB random files; ' +
        'dsec: snapshotSandbox once (freeze, mkfs.erofs of the upper dir, thaw, store with fsync) then K concurrent creates from it; ' +
        'copy: cp -a of the upper dir K times, every file fsynced; bytes = disk blocks of what each created',
      machine: await describeMachine(),
    };
  } finally {
    await node.close();
  }
}
