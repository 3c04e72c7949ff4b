import { chmod, mkdtemp, readdir, readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Command } from 'commander';
import { randomId, type SandboxSpec } from '@dsec/core';
import {
  bootBare,
  DEFAULT_MICROVM_ASSETS_DIR,
  ensureMicrovmAssets,
  openContainerEdge,
  probeAccel,
} from '@dsec/edge';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';
import { contextOf } from '../context.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { summarize, type LatencySummary } from './stats.js';

export interface MicrovmBenchOptions {
  /** Measured boots per system. Default 5 (TCG boots take seconds). */
  iterations?: number;
  /** Guest memory of both, MiB. Default 256. */
  memoryMb?: number;
  assetsDir?: string;
  /** Idle microVMs per memory configuration (sharing one base layer). Default 8; 0 skips. */
  memoryVms?: number;
  /** Pause/resume cycles of one idle VM. Default 5; 0 skips. */
  pauseIterations?: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal | undefined;
}

export interface MicrovmBenchReport {
  benchmark: 'microvm';
  /** Which accelerator ran both sides (decided by the edge's boot probe). */
  accel: 'kvm' | 'tcg';
  iterations: number;
  memoryMb: number;
  results: {
    /** `createSandbox` (backend microvm) until its first command (`true`) returned. */
    dsec: LatencySummary;
    /** Bare `qemu-system-x86_64 -M microvm` booting the same kernel and initramfs to a shell that prints a marker. */
    qemu: LatencySummary;
  };
  /**
   * CPU time (all threads) of each side's QEMU at the same points: the
   * sandbox's QEMU cgroup at its first exec's return, the bare QEMU at its
   * marker. Under TCG a boot is CPU-bound, so these vary far less with the
   * host's load than the wall-clock figures (host work outside QEMU, the
   * edge's, is not in them).
   */
  cpu?: { dsec: LatencySummary; qemu: LatencySummary };
  /** dsec p50 ÷ qemu p50; `qemuCpu`: the same of the CPU times. */
  ratios: { qemu: number; qemuCpu?: number };
  target: { ratioQemu: number; met: boolean };
  /**
   * Host memory (the QEMU process's cgroup charge) per idle microVM, `vms`
   * of them at once sharing one base layer, after each ran a 64 MiB
   * allocation that exited (what an agent's command leaves behind).
   */
  memory?: {
    vms: number;
    guestMemoryMb: number;
    /** virtio-blk layers; balloon free-page reporting on / off. */
    blkReportingOnMiB: { mean: number; max: number };
    blkReportingOffMiB: { mean: number; max: number };
    /** virtio-pmem DAX layers: not measured, and why. */
    pmem: string;
  };
  /** Pause (state to a file, QEMU gone) and resume (restore + first exec) of an idle VM. */
  pause?: {
    iterations: number;
    guestMemoryMb: number;
    pause: LatencySummary;
    resumeFirstExec: LatencySummary;
  };
  kernel: string;
  method: string;
  machine: Record<string, unknown>;
}

/**
 * Boot to first exec of a microVM sandbox against the floor: the same
 * kernel and initramfs booted by bare QEMU to a shell that prints a marker
 * on the serial console. The sandbox side adds the EROFS and ext4 drives,
 * module loading, the overlay, the guest agent, the virtio-serial channel
 * and the edge's bookkeeping. Runs alternate between the two systems.
 */
export async function benchMicrovm(options: MicrovmBenchOptions = {}): Promise<MicrovmBenchReport> {
  const iterations = options.iterations ?? 5;
  const memoryMb = options.memoryMb ?? 256;
  const assets = await ensureMicrovmAssets(options.assetsDir ?? DEFAULT_MICROVM_ASSETS_DIR, {
    signal: options.signal,
  });
  const accel = await probeAccel(assets);
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-microvm-'));
  await chmod(work, 0o711);
  const cgroupParent = `dsec-bench-${process.pid}`;
  const store = new DirImageStore(join(work, 'images'));
  const rootfs = join(work, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: rootfs } });
  const edge = await openContainerEdge({
    edgeId: 'bench',
    stateDir: join(work, 'edge'),
    store,
    cgroupParent,
    network: { mode: 'none' },
    microvm: { assetsDir: options.assetsDir, accel },
    fncall: false,
  });
  const openEdge = (name: string, freePageReporting: boolean) =>
    openContainerEdge({
      edgeId: name,
      stateDir: join(work, name),
      store,
      cgroupParent,
      network: { mode: 'none' },
      microvm: { assetsDir: options.assetsDir, accel, freePageReporting },
      fncall: false,
    });
  const spec: SandboxSpec = {
    backend: 'microvm',
    image: 'busybox',
    toolkits: [],
    memoryLimitMb: memoryMb,
    cpuCoresLimit: 1,
    pidsLimit: 256,
    ttlSeconds: 600,
    networkRules: {},
    initUser: 'root',
    env: {},
    labels: {},
  };
  const dsec: number[] = [];
  const qemu: number[] = [];
  const dsecCpu: number[] = [];
  const qemuCpu: number[] = [];
  let pause: MicrovmBenchReport['pause'];
  let memory: MicrovmBenchReport['memory'];
  try {
    for (let i = 0; i < iterations; i++) {
      options.signal?.throwIfAborted();
      const bare = await bootBare(assets, { accel, timeoutMs: 120_000, memoryMb });
      qemu.push(bare.bootMs);
      const id = randomId('sb');
      const t0 = performance.now();
      await edge.createSandbox({ id, projectId: 'bench', spec });
      const r = await edge.runCommand(id, { argv: ['true'] });
      dsec.push(performance.now() - t0);
      const cpuMs = await vmCpuMs(cgroupParent);
      if (bare.cpuMs !== undefined && cpuMs !== undefined) {
        qemuCpu.push(bare.cpuMs);
        dsecCpu.push(cpuMs);
      }
      if (r.exitCode !== 0) throw new Error(`first exec exited ${r.exitCode}`);
      await edge.stopSandbox(id);
      options.onProgress?.(i + 1, iterations);
    }
    const pauseIterations = options.pauseIterations ?? 5;
    if (pauseIterations > 0) {
      const id = randomId('sb');
      await edge.createSandbox({ id, projectId: 'bench', spec });
      await edge.runCommand(id, { argv: ['true'] });
      const pauses: number[] = [];
      const resumes: number[] = [];
      for (let i = 0; i < pauseIterations; i++) {
        options.signal?.throwIfAborted();
        // Idle: the boot's and the last exec's work settled.
        await new Promise((r) => setTimeout(r, 1_000));
        let t0 = performance.now();
        await edge.pauseSandbox(id);
        pauses.push(performance.now() - t0);
        t0 = performance.now();
        const r = await edge.runCommand(id, { argv: ['true'] });
        resumes.push(performance.now() - t0);
        if (r.exitCode !== 0) throw new Error(`exec after resume exited ${r.exitCode}`);
      }
      await edge.stopSandbox(id);
      pause = {
        iterations: pauseIterations,
        guestMemoryMb: memoryMb,
        pause: summarize(pauses),
        resumeFirstExec: summarize(resumes),
      };
    }
    const vms = options.memoryVms ?? 8;
    if (vms > 0) {
      const perVm = async (reporting: boolean) => {
        const e = await openEdge(reporting ? 'mem-on' : 'mem-off', reporting);
        try {
          const ids: string[] = [];
          for (let i = 0; i < vms; i++) {
            options.signal?.throwIfAborted();
            const id = randomId('sb');
            await e.createSandbox({ id, projectId: 'bench', spec });
            await e.runCommand(id, { shell: BURST_64MIB });
            ids.push(id);
          }
          // Free-page reporting batches what was freed for 2 s before it tells the host.
          await new Promise((r) => setTimeout(r, 5_000));
          const mib: number[] = [];
          for (const id of ids) mib.push(((await e.getSandbox(id)).memoryBytes ?? 0) / 2 ** 20);
          for (const id of ids) await e.stopSandbox(id);
          return {
            mean: Math.round((mib.reduce((a, b) => a + b, 0) / mib.length) * 10) / 10,
            max: Math.round(Math.max(...mib) * 10) / 10,
          };
        } finally {
          await e.close();
        }
      };
      memory = {
        vms,
        guestMemoryMb: memoryMb,
        blkReportingOnMiB: await perVm(true),
        blkReportingOffMiB: await perVm(false),
        pmem: PMEM_NOTE,
      };
    }
  } finally {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await rm(work, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
  }
  const d = summarize(dsec);
  const q = summarize(qemu);
  const ratio = Math.round((d.p50Ms / q.p50Ms) * 1000) / 1000;
  const cpu =
    dsecCpu.length > 0 ? { dsec: summarize(dsecCpu), qemu: summarize(qemuCpu) } : undefined;
  return {
    benchmark: 'microvm',
    accel,
    iterations,
    memoryMb,
    results: { dsec: d, qemu: q },
    ...(cpu ? { cpu } : {}),
    ratios: {
      qemu: ratio,
      ...(cpu ? { qemuCpu: Math.round((cpu.dsec.p50Ms / cpu.qemu.p50Ms) * 1000) / 1000 } : {}),
    },
    target: { ratioQemu: 1.3, met: ratio <= 1.3 },
    ...(memory ? { memory } : {}),
    ...(pause ? { pause } : {}),
    kernel: assets.version,
    method:
      `${iterations} alternating boots, 1 vCPU, ${memoryMb} MiB, ${accel}. dsec: createSandbox(backend microvm, busybox image) → ` +
      'first runCommand(true) returned (EROFS layer + ext4 disk as virtio-blk, modules, overlayfs, guest agent over virtio-serial). ' +
      'qemu: bare qemu-system-x86_64 -M microvm, same kernel and initramfs with dsec.bare=1, spawn → marker on the serial console. ' +
      'pause: pauseSandbox of an idle VM (QMP stop, migration to a file, QEMU ends); resumeFirstExec: the next runCommand(true) ' +
      '(QEMU -incoming from the file, cont, agent reconnects, exec). memory: cgroup charge of each QEMU, all VMs alive, ' +
      '5 s after a 64 MiB allocation in each exited.',
    machine: await describeMachine(),
  };
}

/**
 * CPU time of the one microVM running under `parent` (its QEMU's cgroup:
 * cgroup v1's cpuacct, else v2's cpu.stat), in ms.
 */
async function vmCpuMs(parent: string): Promise<number | undefined> {
  for (const [ctrl, file] of [
    ['cpuacct', 'cpuacct.usage'],
    ['cpu,cpuacct', 'cpuacct.usage'],
    ['unified', 'cpu.stat'],
    ['', 'cpu.stat'],
  ] as const) {
    const dir = join('/sys/fs/cgroup', ctrl, parent);
    const vm = (await readdir(dir).catch(() => [] as string[])).find((n) =>
      n.startsWith('dsec-vm-'),
    );
    if (!vm) continue;
    const text = await readFile(join(dir, vm, file), 'utf8').catch(() => undefined);
    if (text === undefined) continue;
    if (file === 'cpuacct.usage') return Number(text) / 1e6;
    const usec = /^usage_usec (\d+)$/m.exec(text)?.[1];
    if (usec !== undefined) return Number(usec) / 1e3;
  }
  return undefined;
}

/** Touches 64 MiB in one process, which then exits (the guest frees the pages). */
const BURST_64MIB = `awk 'BEGIN { s = sprintf("%67108864s", ""); exit 0 }'`;

const PMEM_NOTE =
  'not measured: cannot work with QEMU 7.2 (Debian 12) and the microvm machine. QEMU maps a virtio-pmem region ' +
  'into guest-physical memory only through the memory-device interface (virtio-pmem-pci), whose address space ' +
  '(device memory, -m slots=,maxmem=) and plug handler the pc/q35 machines set up and microvm does not: with ' +
  '-M microvm,pcie=on -device virtio-pmem-pci the device is accepted but never plugged (query-memory-devices: ' +
  'memaddr 0; with memaddr= given, `info mtree` shows no region for it), and the virtio-mmio virtio-pmem device ' +
  'gets no address either. docs/adr/0017-microvm-lifecycle.md.';

export function registerMicrovmBench(bench: Command): void {
  bench
    .command('microvm')
    .description(
      'microVM boot to first exec vs bare QEMU -M microvm booting the same kernel and initramfs',
    )
    .option('--iterations <n>', 'boots per system', '5')
    .option('--memory-mb <n>', 'guest memory', '256')
    .option('--assets-dir <dir>', 'kernel and initramfs cache', DEFAULT_MICROVM_ASSETS_DIR)
    .option('--memory-vms <n>', 'idle VMs per memory configuration (0 skips)', '8')
    .option('--pause-iterations <n>', 'pause/resume cycles (0 skips)', '5')
    .action(
      async (
        opts: {
          iterations: string;
          memoryMb: string;
          assetsDir: string;
          memoryVms: string;
          pauseIterations: string;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const iterations = Number(opts.iterations);
        const progress = createProgress({
          label: 'bench microvm',
          total: iterations,
          enabled: !ctx.json,
        });
        const report = await benchMicrovm({
          iterations,
          memoryMb: Number(opts.memoryMb),
          assetsDir: opts.assetsDir,
          memoryVms: Number(opts.memoryVms),
          pauseIterations: Number(opts.pauseIterations),
          onProgress: (done) => progress.update(done),
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const { dsec, qemu } = report.results;
        ctx.out(`accel ${report.accel}   kernel ${report.kernel}`);
        ctx.out(
          `dsec  boot → first exec  p50 ${dsec.p50Ms.toFixed(0)} ms  (min ${dsec.minMs.toFixed(0)}, max ${dsec.maxMs.toFixed(0)})`,
        );
        ctx.out(
          `qemu  boot → marker      p50 ${qemu.p50Ms.toFixed(0)} ms  (min ${qemu.minMs.toFixed(0)}, max ${qemu.maxMs.toFixed(0)})`,
        );
        ctx.out(
          `ratio ${report.ratios.qemu} (target ≤ ${report.target.ratioQemu}: ${report.target.met ? 'met' : 'not met'})`,
        );
        if (report.cpu)
          ctx.out(
            `QEMU CPU time p50: dsec ${report.cpu.dsec.p50Ms.toFixed(0)} ms, qemu ${report.cpu.qemu.p50Ms.toFixed(0)} ms (ratio ${report.ratios.qemuCpu})`,
          );
        if (report.pause)
          ctx.out(
            `pause p50 ${report.pause.pause.p50Ms.toFixed(0)} ms   resume + first exec p50 ${report.pause.resumeFirstExec.p50Ms.toFixed(0)} ms`,
          );
        if (report.memory)
          ctx.out(
            `memory per idle VM (${report.memory.vms} VMs): reporting on ${report.memory.blkReportingOnMiB.mean} MiB, off ${report.memory.blkReportingOffMiB.mean} MiB`,
          );
      },
    );
}
