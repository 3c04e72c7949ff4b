import { execFile } from 'node:child_process';
import { chmod, mkdir, mkdtemp, readFile, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { promisify } from 'node:util';
import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import type { ImageStore } from '@dsec/core';
import {
  GoldAgent,
  RepoCache,
  computeReward,
  loadTasks,
  parseTestOutput,
  prepareTasks,
  runEval,
  type EnvironmentBuilder,
  type EvalTask,
  type PreparedTask,
} from '@dsec/eval';
import { hostErofsMounter } from '@dsec/edge';
import { DSecClient } from '@dsec/sdk';
import { environmentBuilder, recipesFile } from '../commands/eval.js';
import { contextOf } from '../context.js';
import { formatBytes } from '../format.js';
import { parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { localStore } from '../stores.js';
import { describeMachine } from './create.js';
import { blockDeviceOf, bytesWrittenSoFar, dropCaches, pool } from './layers.js';

const execFileAsync = promisify(execFile);

export interface EvalBenchOptions {
  tasksFile: string;
  /** Each task runs this many times per system (default 8). */
  copies?: number;
  /** Tasks in flight at once, for both systems (default 16). */
  concurrency?: number;
  /** The image store holding (or receiving) the tasks' layers: the node's own. */
  store: ImageStore;
  /** Builds a missing environment layer from its recipe. */
  buildEnvironment?: EnvironmentBuilder | undefined;
  /** Repository clones (kept between runs). */
  cacheDir: string;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface EvalSystemResult {
  tasksPerMinute: number;
  wallMs: number;
  solved: number;
  /** Runs that produced no reward (harness errors, a failed container). */
  errors: number;
  /** Bytes the runs wrote to disk (every device involved, synced). */
  bytesWritten: number;
  /**
   * CPU per run, in ms: `sandboxes` is what the sandboxes' (containers')
   * cgroups used: the tests, the commands around them, the in-sandbox
   * daemon (DSec's chronus, podman's conmon and cleanup); `platform` is this
   * process and the children it waited for (DSec: driver, apiserver, edge,
   * OCI runtime; podman: the podman CLI). Undefined where a cgroup could not be read.
   */
  cpuMsPerRun: { sandboxes: number | undefined; platform: number };
}

export interface EvalBenchReport {
  benchmark: 'eval';
  tasks: number;
  copies: number;
  runs: number;
  concurrency: number;
  results: {
    dsec: EvalSystemResult;
    podman: EvalSystemResult & { unpackBytes: number; unpackMs: number };
  };
  /**
   * dsec ÷ podman: tasksPerMinute above 1 and bytesWritten below 1 mean DSec
   * is better; `bytesWrittenWithUnpack` counts podman's one-off unpacking too
   * (a node that has not extracted the tasks' images yet).
   */
  ratios: { tasksPerMinute: number; bytesWritten: number; bytesWrittenWithUnpack: number };
  method: string;
  machine: Record<string, unknown>;
}

/**
 * The task set ×`copies` with the gold agent at `concurrency`: DSec (each
 * run a sandbox composed from the image, toolkit and workspace layers,
 * the patch applied through the agent's tools, graded through the command
 * log) against `podman run --rm` per run on the same layers unpacked once
 * per task into a root filesystem (`--rootfs dir:O`, an overlay per run),
 * the patches applied with `patch`, the same tests and the same reward
 * parser: what docker-based SWE harnesses do. Caches are dropped before
 * each phase; bytes are the sectors-written counters of every device
 * holding state (the node's, podman's storage), synced.
 */
export async function benchEval(options: EvalBenchOptions): Promise<EvalBenchReport> {
  const copies = options.copies ?? 8;
  const concurrency = options.concurrency ?? 16;
  const { file, tasks } = await loadTasks(options.tasksFile);
  const runs = tasks.length * copies;
  const total = 2 * runs;
  let done = 0;
  const tick = () => options.onProgress?.(++done, total);

  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-eval-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const repos = new RepoCache(options.cacheDir);
    const { tasks: prepared } = await prepareTasks(tasks, {
      store: options.store,
      repos,
      buildEnvironment: options.buildEnvironment,
      signal: options.signal,
    });
    const byId = new Map(prepared.map((p) => [p.instance_id, p]));
    // Own parent cgroups: their CPU counters hold every sandbox's (container's) use, removed ones too.
    const dsecCgroup = `dsec-bench-eval-${process.pid}`;
    const podmanCgroup = `dsec-bench-eval-podman-${process.pid}`;
    cleanups.push(
      () => removeCgroup(dsecCgroup),
      () => removeCgroup(podmanCgroup),
    );
    const node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      imageStore: options.store.location,
      cgroupParent: dsecCgroup,
      capacity: { sandboxes: concurrency * 2 + 8, cpuCores: concurrency * 2 },
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const podmanRoot = (
      await execFileAsync('podman', ['info', '--format', '{{.Store.GraphRoot}}'])
    ).stdout.trim();
    await mkdir(podmanRoot, { recursive: true });
    // A cgroup path as parent needs podman's cgroupfs manager (systemd wants a slice): else no split.
    const podmanCgroupfs =
      (
        await execFileAsync('podman', ['info', '--format', '{{.Host.CgroupManager}}'])
      ).stdout.trim() === 'cgroupfs';
    const counters = [
      ...new Map(
        (await Promise.all([work, podmanRoot].map((p) => blockDeviceOf(p)))).map((d) => [
          d.statFile,
          d,
        ]),
      ).values(),
    ];
    const written = async () => {
      let sum = 0;
      for (const c of counters) sum += await bytesWrittenSoFar(c.statFile);
      return sum;
    };

    // DSec: every copy a task of its own (own sandbox, own request IDs), the same layers.
    const copiesOf = tasks.flatMap((t) =>
      Array.from({ length: copies }, (_, k): EvalTask => ({
        ...t,
        instance_id: `${t.instance_id}.c${k}`,
      })),
    );
    const preparedCopies = new Map<string, PreparedTask>(
      copiesOf.map((t) => [
        t.instance_id,
        { ...byId.get(t.instance_id.replace(/\.c\d+$/, ''))!, instance_id: t.instance_id },
      ]),
    );
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    cleanups.unshift(async () => client.close());
    await dropCaches();
    const dsecBefore = await written();
    const dsecCpu0 = await cpuSnapshot(dsecCgroup);
    const t0 = performance.now();
    const summary = await runEval({
      client,
      tasks: copiesOf,
      tasksFile: file,
      prepared: preparedCopies,
      agent: new GoldAgent(),
      outPath: join(work, 'dsec.jsonl'),
      concurrency,
      labels: { job: 'bench-eval' },
      original: (task, path) => repos.fileAtBase(task, path),
      signal: options.signal,
      onResult: tick,
    });
    const dsecMs = performance.now() - t0;
    const dsecCpu = cpuPerRun(dsecCpu0, await cpuSnapshot(dsecCgroup), runs);
    const dsecBytes = (await written()) - dsecBefore;

    // podman: each task's layers unpacked once into a root filesystem (the image a harness pulls).
    const unpackBefore = await written();
    const u0 = performance.now();
    const roots = new Map<string, string>();
    for (const t of tasks) {
      const p = byId.get(t.instance_id)!;
      const root = join(work, 'rootfs', t.instance_id.replace(/[^A-Za-z0-9_.-]/g, '_'));
      await unpackLayers(
        options.store,
        [p.image, ...p.toolkits, ...(p.workspace ? [p.workspace] : [])],
        root,
        join(work, 'mnt'),
      );
      roots.set(t.instance_id, root);
      const patches = join(work, 'patches', t.instance_id.replace(/[^A-Za-z0-9_.-]/g, '_'));
      await mkdir(patches, { recursive: true });
      await writeFile(join(patches, 'gold.diff'), t.patch);
      await writeFile(join(patches, 'test.diff'), t.test_patch);
      roots.set(`${t.instance_id}/patches`, patches);
    }
    const unpackMs = performance.now() - u0;
    const unpackBytes = (await written()) - unpackBefore;

    await dropCaches();
    const podmanBefore = await written();
    const podmanCpu0 = await cpuSnapshot(podmanCgroup);
    const p0 = performance.now();
    const podman = await pool(
      Array.from({ length: runs }, (_, i) => tasks[i % tasks.length]!),
      concurrency,
      async (t) => {
        const reward = await podmanRun(
          t,
          roots.get(t.instance_id)!,
          roots.get(`${t.instance_id}/patches`)!,
          podmanCgroupfs ? `/${podmanCgroup}` : undefined,
        );
        tick();
        return reward;
      },
    );
    const podmanMs = performance.now() - p0;
    const podmanCpu = cpuPerRun(podmanCpu0, await cpuSnapshot(podmanCgroup), runs);
    if (!podmanCgroupfs) podmanCpu.sandboxes = undefined;
    const podmanBytes = (await written()) - podmanBefore;

    const perMinute = (n: number, ms: number) => round((n * 60_000) / ms);
    const dsec: EvalSystemResult = {
      tasksPerMinute: perMinute(runs, dsecMs),
      wallMs: Math.round(dsecMs),
      solved: summary.solved,
      errors: summary.errors,
      bytesWritten: dsecBytes,
      cpuMsPerRun: dsecCpu,
    };
    const peer = {
      tasksPerMinute: perMinute(runs, podmanMs),
      wallMs: Math.round(podmanMs),
      solved: podman.filter((r) => r === 1).length,
      errors: podman.filter((r) => r === null).length,
      bytesWritten: podmanBytes,
      cpuMsPerRun: podmanCpu,
      unpackBytes,
      unpackMs: Math.round(unpackMs),
    };
    return {
      benchmark: 'eval',
      tasks: tasks.length,
      copies,
      runs,
      concurrency,
      results: { dsec, podman: peer },
      ratios: {
        tasksPerMinute: round(dsec.tasksPerMinute / peer.tasksPerMinute),
        bytesWritten: round(dsec.bytesWritten / Math.max(1, peer.bytesWritten)),
        bytesWrittenWithUnpack: round(
          dsec.bytesWritten / Math.max(1, peer.bytesWritten + peer.unpackBytes),
          4,
        ),
      },
      method:
        `${tasks.length} tasks × ${copies} with the gold patch, ${concurrency} at a time, per system in turn (caches dropped before each). ` +
        'dsec: `dsec eval run --agent gold` in-process against a single node (sandbox from image+toolkit+workspace layers, patch applied by tool calls with request IDs, test_patch, tests, parse, stop). ' +
        'podman: `podman run --rm --network none --rootfs <dir>:O` per run on the layers unpacked once per task (unpack time and bytes reported apart, not in the run numbers), `patch -p1` of the gold and test patches, the same test command and reward parser. ' +
        'Bytes: sectors written on the devices of the node state and podman storage, synced. ' +
        "CPU per run: each system's sandboxes under a parent cgroup of their own (cpuacct), the platform as this process's CPU plus its reaped children's.",
      machine: await describeMachine(),
    };
  } finally {
    for (const c of cleanups) await c().catch(() => undefined);
  }
}

/** Copies each layer's files, bottom first, into `root` (mounting each EROFS blob read-only). */
async function unpackLayers(
  store: ImageStore,
  refs: string[],
  root: string,
  mnt: string,
): Promise<void> {
  await mkdir(root, { recursive: true });
  await mkdir(mnt, { recursive: true });
  // File-backed where the kernel has it (6.12+), else loop devices.
  const mounter = hostErofsMounter();
  for (const ref of refs) {
    const layer = await store.getLayer(ref);
    const blobDevice = layer.blobDigest ? await store.blobPath(layer.blobDigest) : undefined;
    await mounter.mountErofs(
      await store.blobPath(layer.digest),
      mnt,
      blobDevice ? { blobDevice } : {},
    );
    try {
      await execFileAsync('cp', ['-a', `${mnt}/.`, `${root}/`]);
    } finally {
      await mounter.unmount([mnt], { detach: true });
    }
  }
}

interface CpuSnapshot {
  /** The parent cgroup's CPU counter, ns; undefined where it cannot be read. */
  cgroupNs: number | undefined;
  /** This process's CPU and its reaped children's, ms. */
  processMs: number;
}

/** CPU counters of a parent cgroup (v1 cpuacct, else v2 cpu.stat) and of this process. */
async function cpuSnapshot(cgroup: string): Promise<CpuSnapshot> {
  let cgroupNs: number | undefined;
  for (const file of [
    `/sys/fs/cgroup/cpuacct/${cgroup}/cpuacct.usage`,
    `/sys/fs/cgroup/cpu,cpuacct/${cgroup}/cpuacct.usage`,
  ]) {
    const text = await readFile(file, 'utf8').catch(() => undefined);
    if (text !== undefined) {
      cgroupNs = Number(text.trim());
      break;
    }
  }
  if (cgroupNs === undefined) {
    const stat = await readFile(`/sys/fs/cgroup/${cgroup}/cpu.stat`, 'utf8').catch(() => '');
    const usec = /^usage_usec (\d+)$/m.exec(stat)?.[1];
    // Not created yet (nothing has run under it): nothing used.
    cgroupNs = usec !== undefined ? Number(usec) * 1000 : 0;
  }
  // utime, stime, cutime, cstime: fields 14-17 of /proc/self/stat, in clock ticks (100 Hz on Linux).
  const fields = (await readFile('/proc/self/stat', 'utf8')).split(') ')[1]!.split(' ');
  const ticks = [11, 12, 13, 14].reduce((sum, i) => sum + Number(fields[i]), 0);
  return { cgroupNs, processMs: ticks * 10 };
}

function cpuPerRun(
  before: CpuSnapshot,
  after: CpuSnapshot,
  runs: number,
): EvalSystemResult['cpuMsPerRun'] {
  return {
    sandboxes:
      before.cgroupNs !== undefined && after.cgroupNs !== undefined
        ? round((after.cgroupNs - before.cgroupNs) / 1e6 / runs, 1)
        : undefined,
    platform: round((after.processMs - before.processMs) / runs, 1),
  };
}

/** Removes a parent cgroup the bench made (empty by now) from every v1 hierarchy, or v2. */
async function removeCgroup(name: string): Promise<void> {
  const hierarchies = await readdir('/sys/fs/cgroup').catch(() => [] as string[]);
  for (const h of ['', ...hierarchies.map((d) => `${d}/`)]) {
    // Podman leaves its conmon cgroup inside.
    await rmdir(`/sys/fs/cgroup/${h}${name}/conmon`).catch(() => undefined);
    await rmdir(`/sys/fs/cgroup/${h}${name}`).catch(() => undefined);
  }
}

/** One run in podman: the reward, or null when the container did not run the tests. */
async function podmanRun(
  task: EvalTask,
  root: string,
  patches: string,
  cgroupParent: string | undefined,
): Promise<0 | 1 | null> {
  const script =
    'patch -p1 -i /dsec-patches/gold.diff >/dev/null || exit 97; ' +
    (task.test_patch ? 'patch -p1 -i /dsec-patches/test.diff >/dev/null || exit 98; ' : '') +
    task.test_command;
  try {
    const r = await execFileAsync(
      'podman',
      [
        'run',
        '--rm',
        '--runtime',
        'runc',
        '--network',
        'none',
        // Its containers' (and conmon's) CPU is counted there.
        ...(cgroupParent ? ['--cgroup-parent', cgroupParent] : []),
        // Root here lacks CAP_SYS_RESOURCE: podman's default rlimits (above the hard limits) would fail.
        '--ulimit',
        'nofile=1024:1024',
        '--ulimit',
        'nproc=1024:1024',
        '-v',
        `${patches}:/dsec-patches:ro`,
        '-w',
        task.workdir,
        '--rootfs',
        `${root}:O`,
        '/bin/sh',
        '-c',
        script,
      ],
      { maxBuffer: 64 * 1024 * 1024 },
    ).catch((err: { code?: number; stdout?: string; stderr?: string }) => {
      if (typeof err.code !== 'number' || err.code >= 97) throw err;
      return { stdout: err.stdout ?? '', stderr: err.stderr ?? '', code: err.code };
    });
    const code = 'code' in r ? r.code : 0;
    return computeReward({
      tests: parseTestOutput(`${r.stdout}\n${r.stderr}`),
      failToPass: task.FAIL_TO_PASS,
      passToPass: task.PASS_TO_PASS,
      exitCode: code,
    });
  } catch {
    return null;
  }
}

function round(n: number, digits = 2): number {
  return Math.round(n * 10 ** digits) / 10 ** digits;
}

/** `dsec bench eval`: wired here so that bench.ts only lists it. */
export function registerEvalBench(bench: Command): void {
  bench
    .command('eval')
    .description(
      'the task set ×8 with --agent gold at concurrency 16 vs `podman run --rm` per task on the same layers unpacked into a rootfs: tasks per minute, bytes written',
    )
    .option('--tasks <file>', 'task file', 'examples/swe-tasks/tasks.jsonl')
    .option('--copies <n>', 'runs of each task per system', parseInteger, 8)
    .option('--concurrency <n>', 'runs in flight at once', parseInteger, 16)
    .option(
      '--environments <file>',
      'environment recipes (default environments.json beside the task file)',
    )
    .action(
      async (
        opts: { tasks: string; copies: number; concurrency: number; environments?: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const store = localStore(ctx);
        const { tasks } = await loadTasks(opts.tasks);
        const progress = createProgress({
          label: 'bench eval',
          total: 2 * tasks.length * opts.copies,
          enabled: !ctx.json,
        });
        const report = await benchEval({
          tasksFile: opts.tasks,
          copies: opts.copies,
          concurrency: opts.concurrency,
          store,
          buildEnvironment: await environmentBuilder(
            store,
            recipesFile(opts.tasks, opts),
            join(ctx.options.stateDir, 'cache', 'debs'),
          ),
          cacheDir: join(ctx.options.stateDir, 'eval-cache'),
          onProgress: (done) => progress.update(done),
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const { dsec, podman } = report.results;
        ctx.out(`${report.tasks} tasks × ${report.copies} at concurrency ${report.concurrency}`);
        ctx.out(
          `dsec    ${dsec.tasksPerMinute} tasks/min  solved ${dsec.solved}/${report.runs}  written ${formatBytes(dsec.bytesWritten)}`,
        );
        ctx.out(
          `podman  ${podman.tasksPerMinute} tasks/min  solved ${podman.solved}/${report.runs}  written ${formatBytes(podman.bytesWritten)} (+${formatBytes(podman.unpackBytes)} unpacking)`,
        );
        ctx.out(`ratios (dsec ÷ podman): ${JSON.stringify(report.ratios)}`);
      },
    );
}
