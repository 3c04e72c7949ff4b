import { createHash } from 'node:crypto';
import { chmodSync, chownSync, mkdirSync, writeFileSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import {
  ChronusConnection,
  compileSeccompBpf,
  findChronus,
  isChronus,
  prepareChronus,
  removeTree,
  rootfsCommandPrefix,
  startChronus,
  unmount,
} from '@dsec/native';
import type { ChronusSupervisor, PendingChronus } from '@dsec/native';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import { mountPoints } from '../../layers/mountinfo.js';
import type { OciRuntime } from '../../runtime/oci-runtime.js';
import type { Backend, BackendSandbox, PauseResult, StartedSandbox } from '../backend.js';
import { applyGpuDeviceModes } from '../../gpu/device-modes.js';
import { withGpu } from '../../gpu/oci-fragment.js';
import { phaseClock, type CreatePhase, type EdgeMetrics } from '../../observability/metrics.js';
import {
  openCgroupPause,
  type CgroupPause,
  type MemoryLimits,
} from '../../lifecycle/cgroup-pause.js';
import type { SwapArea } from '../../lifecycle/swap-area.js';
import type { NetworkManager, SandboxNetwork } from '../../network/network-manager.js';
import { makeScratchDisk } from '../scratch-disk.js';
import { seccompLines } from './seccomp.js';
import { buildContainerConfig, SANDBOX_CAPABILITIES } from './spec.js';
import { applyQos } from './qos.js';
import { PidsRelief } from './pids-relief.js';
import type { EdgeLogFn } from '../../observability/log.js';

/** Each sandbox gets its own 65536-id range of host uids/gids, starting here. */
const ID_BASE = 100_000;
const ID_COUNT = 65_536;
const RUNTIME_START_TIMEOUT_MS = 30_000;

export interface ContainerBackendOptions {
  /** Per-sandbox directories live under here (local disk: writes stay local). */
  dir: string;
  runtime: OciRuntime;
  cgroups: CgroupDriver;
  layers: LayerMountCache;
  /** Host path of the static dsec-init binary bind-mounted as the sandbox's PID 1. */
  initBinary: string;
  /**
   * The node's chronus supervisor: it forks every sandbox's command daemon
   * (and seals the platform's shell once for all of them).
   */
  chronus: ChronusSupervisor;
  /** Cgroup under which every sandbox's cgroup is created (`/<parent>/<name>`). */
  cgroupParent: string;
  /** Per-sandbox network namespace and egress policy; absent: loopback only. */
  network?: NetworkManager | undefined;
  /** Where a pause pushes memory (ADR 0012); absent: only swap the host already has. */
  swap?: SwapArea | undefined;
  /** Freezer and memory reclaim of the sandboxes' cgroups (default: the host's, by `cgroups.version`). */
  cgroupPause?: CgroupPause | undefined;
  /** Times the create phases (`dsec_create_phase_seconds`). */
  metrics?: EdgeMetrics | undefined;
  /** Logs (re)starts of the chronus supervisor. */
  log?: EdgeLogFn | undefined;
}

/**
 * Container sandboxes: an overlay of shared, idmapped EROFS layers plus a
 * private upper directory, run by an OCI runtime in fresh user, mount, pid,
 * ipc, uts, network and cgroup namespaces, with a chronus daemon that enters
 * those namespaces from outside to run commands (invisible inside: it is not
 * in the sandbox's pid namespace, and its socket is not in its mount
 * namespace).
 */
export class ContainerBackend implements Backend {
  readonly kind = 'container' as const;
  readonly #connections = new Map<string, Promise<ChronusConnection>>();
  readonly #oomKillsSeen = new Map<string, number>();
  readonly #relief = new PidsRelief();
  #seccompBpf: string | undefined;
  readonly #pause: CgroupPause;
  /** The chronus supervisor pid last seen, to log when it is (re)started. */
  #supervisorPid: number | undefined;

  constructor(readonly options: ContainerBackendOptions) {
    this.#pause = options.cgroupPause ?? openCgroupPause(options.cgroups.version);
    // Every mapped root passes through here to its own directory; nobody lists it.
    mkdirSync(options.dir, { recursive: true, mode: 0o711 });
    chmodSync(options.dir, 0o711);
  }

  /**
   * crun loads a precompiled filter from an annotation instead of compiling
   * the OCI profile (the same table, seccomp.ts) on every start: ≈ 7 ms of a
   * create. Compiled once per backend.
   */
  #withPrecompiledSeccomp(config: Record<string, unknown>): Record<string, unknown> {
    if (this.options.runtime.name !== 'crun') return config;
    this.#seccompBpf ??= compileSeccompBpf(seccompLines()).toString('base64');
    return {
      ...config,
      annotations: {
        ...(config.annotations as Record<string, string> | undefined),
        'run.oci.seccomp_bpf_data': this.#seccompBpf,
      },
    };
  }

  /**
   * Closes the edge's connections to the command daemons and stops the
   * chronus supervisor (it only forks daemons for new sandboxes; the next
   * edge starts one, or adopts this one if this edge crashed). The sandboxes
   * and their daemons keep running.
   */
  async close(): Promise<void> {
    const connections = [...this.#connections.values()];
    this.#connections.clear();
    for (const c of await Promise.allSettled(connections))
      if (c.status === 'fulfilled') c.value.close();
    this.#relief.close();
    await this.options.chronus.stop();
    // The node's parent goes with its last sandbox; running ones keep it (and are adopted).
    this.options.cgroups.removeIfEmpty(`/${this.options.cgroupParent}`);
  }

  async start(rec: BackendSandbox, signal?: AbortSignal): Promise<StartedSandbox> {
    const p = this.paths(rec);
    const hostId = ID_BASE + rec.slot * ID_COUNT;
    // Small metadata syscalls run synchronously: microseconds each, where
    // thread-pool round trips would add milliseconds to every create.
    // Private to the sandbox's mapped root (its init must walk down to the
    // rootfs) and to the platform: no other host user can enter it.
    mkdirSync(p.dir, { recursive: true, mode: 0o700 });
    chmodSync(p.dir, 0o700);
    chownSync(p.dir, hostId, hostId);
    // With a disk quota the writable layer lives on its own ext4 image, which
    // the mount helper mounts (and makes upper and work in) inside the
    // runtime's private mount namespace; otherwise on the node's disk.
    const quota = rec.spec.diskLimitMb;
    const upper =
      quota === undefined
        ? { upper: p.upper, work: p.work }
        : { upper: p.quotaUpper, work: p.quotaWork };
    if (quota === undefined) {
      for (const d of [p.upper, p.work, p.rootfs]) mkdirSync(d, { recursive: true });
      for (const d of [p.upper, p.work]) chownSync(d, hostId, hostId);
    } else {
      for (const d of [p.upperMount, p.rootfs]) mkdirSync(d, { recursive: true });
    }

    // Top layer first. Every layer is acquired (stop releases each), but two
    // layers with identical content share one mount and must appear once:
    // overlayfs refuses a repeated lower directory.
    const lowers: string[] = [];
    const timed = <T>(phase: CreatePhase, work: Promise<T>) =>
      this.options.metrics ? this.options.metrics.timePhase(phase, work) : work;
    const phaseDone = phaseClock(this.options.metrics);
    for (const layer of [...rec.layers].reverse()) {
      const dir = await this.options.layers.acquire(layer);
      if (!lowers.includes(dir)) lowers.push(dir);
    }
    phaseDone('layers');
    // The command daemon's host-side setup (it joins the pre-created cgroups,
    // the slowest step on cgroup v1) runs while the network is set up and the
    // runtime starts; the daemon then waits for the runtime to report the
    // sandbox's init.
    const [prepared, networked, imaged] = await Promise.allSettled([
      timed(
        'chronus',
        this.options.cgroups.create(p.cgroupsPath).then(() =>
          prepareChronus({
            ...this.#chronusOptions(p),
            // The daemon configures the sandbox's end of its veth (ADR 0005).
            network: this.options.network?.mode === 'isolated',
          }),
        ),
      ),
      timed('network', Promise.resolve(this.options.network?.setup(rec))),
      quota !== undefined ? makeScratchDisk(p.upperImage, quota, { exclusive: true }) : undefined,
    ]);
    // stop() undoes whatever of these succeeded; only the waiting daemon is ours to end.
    const failed = [prepared, networked, imaged].find((r) => r.status === 'rejected');
    if (failed) {
      if (prepared.status === 'fulfilled') prepared.value.abort();
      throw failed.reason;
    }
    const chronus = (prepared as PromiseFulfilledResult<PendingChronus>).value;
    this.#noteSupervisor();
    const network = (networked as PromiseFulfilledResult<SandboxNetwork | undefined>).value;
    // Volumes: an idmapped clone of each host-side mount is staged in the
    // private namespace (made there, so it goes with it) and bound by the
    // runtime, which resolves the path inside the sandbox's root.
    const volumes = (rec.volumes ?? []).map((v, i) => ({
      source: v.source,
      staging: join(p.dir, `volume${i}`),
      path: v.path,
    }));
    try {
      const base = buildContainerConfig({
        spec: rec.spec,
        hostname: p.name.slice(0, 12),
        rootfs: p.rootfs,
        initBinary: this.options.initBinary,
        cgroupsPath: p.cgroupsPath,
        hostIdBase: hostId,
        idCount: ID_COUNT,
        network,
        volumes: volumes.map((v) => ({ source: v.staging, destination: v.path })),
      });
      // GPUs assigned by the edge (an FnCall worker's): their nodes, cgroup rules, driver files.
      const config = rec.gpu ? withGpu(base, rec.gpu) : base;
      writeFileSync(
        join(p.dir, 'config.json'),
        JSON.stringify(this.#withPrecompiledSeccomp(config)),
      );
      phaseDone(undefined); // the runtime's clock starts here
      const running = await this.options.runtime.run({
        id: p.name,
        bundle: p.dir,
        pidFile: p.pidFile,
        timeoutMs: RUNTIME_START_TIMEOUT_MS,
        signal,
        // The overlay root is mounted in a private mount namespace the runtime
        // is exec'd in: it lives and dies with the sandbox, nothing to unmount.
        prefix: rootfsCommandPrefix({
          target: p.rootfs,
          masks: this.options.runtime.maskPaths,
          ...upper,
          lowers,
          idmap: { hostId, size: ID_COUNT },
          volumes: volumes.map(({ source, staging }) => ({ source, staging })),
          ...(quota !== undefined
            ? { upperImage: { image: p.upperImage, mount: p.upperMount } }
            : {}),
        }),
      });
      phaseDone('runtime');
      // The runtime's umask may have narrowed the GPU nodes' modes (device-modes.ts).
      if (rec.gpu) await applyGpuDeviceModes(running.initPid, rec.gpu.devices);
      await Promise.all([
        chronus.attach(running.initPid),
        this.options.network?.attach(rec, running.initPid, chronus.configureNetwork),
      ]);
      phaseDone('attach');
      await applyQos(running.initPid, chronus.pid, rec.spec.qosClass);
      return { initPid: running.initPid, chronusPid: chronus.pid };
    } catch (err) {
      chronus.abort();
      throw err;
    }
  }

  /** Logs a supervisor this backend has not seen before: the first one, or its replacement after a crash. */
  #noteSupervisor(): void {
    const { pid, adopted } = this.options.chronus;
    if (pid === undefined || pid === this.#supervisorPid) return;
    const restart = this.#supervisorPid !== undefined;
    this.#supervisorPid = pid;
    this.options.log?.(
      restart ? 'chronus supervisor restarted' : 'chronus supervisor started',
      { pid, adopted },
      restart ? 'warn' : 'info',
    );
  }

  /**
   * Releases everything the sandbox took, whatever state it is in: processes,
   * runtime state and cgroups, mounts, directories, layer references. Safe to
   * call twice and on a half-created sandbox.
   */
  async stop(rec: BackendSandbox): Promise<void> {
    const p = this.paths(rec);
    const conn = this.#connections.get(rec.id);
    this.#connections.delete(rec.id);
    this.#oomKillsSeen.delete(rec.id);
    this.#relief.forget(rec.id);
    if (conn) (await conn.catch(() => undefined))?.close();

    // The daemon goes first: it sits in the sandbox's cgroups, and the runtime
    // can only remove them once they are empty. A create interrupted by an edge
    // crash never recorded the pids, so then the daemon is found in the cgroup.
    const chronusPids =
      rec.chronusPid !== undefined
        ? [rec.chronusPid]
        : await findChronus(this.options.cgroups.dirs(p.cgroupsPath)[0] ?? '', p.cgroupsPath);
    for (const pid of chronusPids) if (await isChronus(pid, p.cgroupsPath)) killQuietly(pid);
    // Killing the init ends its pid namespace: the kernel kills everything in it.
    if (rec.initPid !== undefined && (await isProcessOf(rec.initPid, p.cgroupsPath, 'cgroup'))) {
      killQuietly(rec.initPid);
    }
    // Firewall state and the resolver need no running sandbox: release them while
    // the container's processes drain.
    const network = this.options.network?.teardown(rec);
    network?.catch(() => undefined);
    // A paused sandbox's processes are frozen: the SIGKILLs above are only
    // delivered (and the cgroups can only drain) once they run again.
    if (this.#pause.frozen(p.cgroupsPath)) await this.#pause.thaw(p.cgroupsPath);
    if (rec.initPid === undefined) {
      // A create interrupted before the init was recorded: its runtime may still
      // be starting (found by the container name, its last argument).
      for (const pid of await findProcesses(` ${p.name}`))
        if (await isProcessOf(pid, p.name, 'cmdline')) killQuietly(pid);
      if (this.options.runtime.exists(p.name)) await this.options.runtime.forceDelete(p.name);
    }
    // The runtime is long gone (it ran detached): the edge removes the cgroups
    // (killing what is left and waiting for it to drain) and the runtime's state.
    if (this.options.cgroups.exists(p.cgroupsPath))
      await this.options.cgroups.remove(p.cgroupsPath);
    this.options.runtime.forget(p.name);
    await network;
    // Only rootfs mounts made in the host namespace (by older edges) need this.
    if ((await mountPoints()).has(p.rootfs)) await unmount([p.rootfs], { detach: true });
    // The writable layer is the sandbox's tree: removed without following anything in it,
    // at any depth (a plain recursive rm overflows its stack on a few thousand levels).
    await removeTree(p.dir);
    for (const layer of rec.layers) this.options.layers.release(layer.digest);
  }

  /** Whether the sandbox's init is still alive (used after an edge restart). */
  async isRunning(rec: BackendSandbox): Promise<boolean> {
    return (
      rec.initPid !== undefined && isProcessOf(rec.initPid, this.paths(rec).cgroupsPath, 'cgroup')
    );
  }

  /** Makes sure a chronus daemon serves the sandbox (it may have died with a host fault). */
  async ensureChronus(rec: BackendSandbox): Promise<number | undefined> {
    const p = this.paths(rec);
    if (rec.chronusPid !== undefined && (await isChronus(rec.chronusPid, p.cgroupsPath)))
      return undefined;
    if (rec.initPid === undefined)
      throw new DsecError('sandbox_not_running', `sandbox ${rec.id} has no init`);
    const chronus = await startChronus({ ...this.#chronusOptions(p), initPid: rec.initPid });
    return chronus.pid;
  }

  /**
   * A chronus connection for the edge's command, session and file layers: the
   * sandbox's shared one, or with `dedicated` a new one the caller owns and
   * closes (its reads can be paused for back-pressure without stalling others).
   */
  async channel(
    rec: BackendSandbox,
    options: { dedicated?: boolean } = {},
  ): Promise<ChronusConnection> {
    if (options.dedicated) return ChronusConnection.connect(this.paths(rec).socket);
    return this.#connection(rec);
  }

  /** See `PidsRelief`: one pread unless the sandbox is at its pids limit after refused forks. */
  relieve(rec: BackendSandbox) {
    if (rec.initPid === undefined || rec.chronusPid === undefined) return undefined;
    return this.#relief.check({
      id: rec.id,
      cgroupDirs: () => this.options.cgroups.dirs(this.paths(rec).cgroupsPath),
      pidsLimit: rec.spec.pidsLimit,
      initPid: rec.initPid,
      chronusPid: rec.chronusPid,
    });
  }

  /** Whether the OOM killer struck the sandbox since this was last asked. */
  async oomKilled(rec: BackendSandbox): Promise<boolean> {
    const kills = await this.options.cgroups.oomKills(this.paths(rec).cgroupsPath);
    const seen = this.#oomKillsSeen.get(rec.id) ?? 0;
    this.#oomKillsSeen.set(rec.id, kills);
    return kills > seen;
  }

  // ---- pause and resume (docs/adr/0012-pause-and-resume.md) ----

  /**
   * Freezes the sandbox's cgroup (its init, everything under it, and its
   * command daemon, which sits in the same cgroup), then pushes its memory
   * out to swap. The swap space is ensured first, sized by what would go there.
   */
  async pause(rec: BackendSandbox): Promise<PauseResult> {
    const { cgroupsPath } = this.paths(rec);
    await this.options.swap?.ensure(Math.max(0, await this.#pause.swapNeededBytes(cgroupsPath)));
    const start = performance.now();
    await this.#pause.freeze(cgroupsPath);
    const freezeMs = performance.now() - start;
    try {
      const r = await this.#pause.reclaim(cgroupsPath, memoryLimits(rec));
      return {
        freezeMs,
        reclaimMs: r.reclaimMs,
        memoryBeforeBytes: r.beforeBytes,
        memoryAfterBytes: r.afterBytes,
      };
    } catch (err) {
      // Not paused after all: the limits back as they were, the processes running.
      await this.#pause.restoreLimits(cgroupsPath, memoryLimits(rec)).catch(() => undefined);
      await this.#pause.thaw(cgroupsPath).catch(() => undefined);
      throw err;
    }
  }

  async resume(rec: BackendSandbox): Promise<{ chronusPid?: number | undefined }> {
    const { cgroupsPath } = this.paths(rec);
    // What a reclaim opened (v2's swap limit) and a crash kept it from closing.
    await this.#pause.restoreLimits(cgroupsPath, memoryLimits(rec));
    await this.#pause.thaw(cgroupsPath);
    return { chronusPid: await this.ensureChronus(rec) };
  }

  async isFrozen(rec: BackendSandbox): Promise<boolean> {
    return this.#pause.frozen(this.paths(rec).cgroupsPath) === true;
  }

  async memoryBytes(rec: BackendSandbox): Promise<number | undefined> {
    return this.options.cgroups.memoryUsageBytes(this.paths(rec).cgroupsPath);
  }

  /** How every chronus daemon of this backend is started (the sandbox's own restrictions). */
  #chronusOptions(p: ReturnType<ContainerBackend['paths']>) {
    return {
      socketPath: p.socket,
      supervisor: this.options.chronus,
      cgroupDirs: this.options.cgroups.dirs(p.cgroupsPath),
      seccompProfile: seccompLines(),
      capabilities: SANDBOX_CAPABILITIES,
      noNewPrivs: true,
    };
  }

  paths(rec: Pick<BackendSandbox, 'id'>) {
    // A short, stable, filesystem-safe name: runc IDs, cgroup names and unix
    // socket paths (108-byte limit) all derive from it.
    const name = 'dsec-' + createHash('sha256').update(rec.id).digest('hex').slice(0, 20);
    const dir = join(this.options.dir, name);
    return {
      name,
      dir,
      rootfs: join(dir, 'rootfs'),
      upper: join(dir, 'upper'),
      work: join(dir, 'work'),
      // With a disk quota: the image, where it is mounted, and the overlay's dirs in it.
      upperImage: join(dir, 'upper.img'),
      upperMount: join(dir, 'upperfs'),
      quotaUpper: join(dir, 'upperfs', 'upper'),
      quotaWork: join(dir, 'upperfs', 'work'),
      socket: join(dir, 'chronus.sock'),
      pidFile: join(dir, 'init.pid'),
      cgroupsPath: `/${this.options.cgroupParent}/${name}`,
    };
  }

  /** One connection per sandbox, shared by its commands; reopened if it dropped. */
  async #connection(rec: BackendSandbox): Promise<ChronusConnection> {
    const cached = this.#connections.get(rec.id);
    if (cached) {
      const conn = await cached.catch(() => undefined);
      if (conn && !conn.closed) return conn;
      if (this.#connections.get(rec.id) === cached) this.#connections.delete(rec.id);
    }
    const connecting = ChronusConnection.connect(this.paths(rec).socket);
    this.#connections.set(rec.id, connecting);
    connecting.catch(
      () => this.#connections.get(rec.id) === connecting && this.#connections.delete(rec.id),
    );
    return connecting;
  }
}

/** The limits `buildContainerConfig` gives the runtime (spec.ts): no swap while running. */
function memoryLimits(rec: BackendSandbox): MemoryLimits {
  const bytes = rec.spec.memoryLimitMb * 1024 * 1024;
  return { memoryBytes: bytes, memoryAndSwapBytes: bytes };
}

function killQuietly(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // already gone
  }
}

/** PIDs of processes whose command line contains `marker` (rare paths only: it reads all of /proc). */
async function findProcesses(marker: string): Promise<number[]> {
  const found: number[] = [];
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const cmdline = await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '');
    if (cmdline.replaceAll('\0', ' ').includes(marker)) found.push(Number(entry));
  }
  return found;
}

/** Guards against PID reuse: the process must still be the one we started. */
async function isProcessOf(
  pid: number,
  marker: string,
  file: 'cgroup' | 'cmdline',
): Promise<boolean> {
  try {
    const text = await readFile(`/proc/${pid}/${file}`, 'utf8');
    return text.includes(marker);
  } catch {
    return false;
  }
}
