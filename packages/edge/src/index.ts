/**
 * @dsec/edge — the per-node agent (paper 3.3): admission control, layer
 * mounts, sandbox lifecycle through a backend, TTLs, and reconciliation after
 * its own restart. The container backend runs sandboxes with an OCI runtime
 * (runc) over overlays of shared EROFS layers.
 *
 * @example
 * ```ts
 * import { openContainerEdge } from '@dsec/edge';
 * const edge = await openContainerEdge({ edgeId: 'node-1', stateDir: '/var/lib/dsec/edge', store });
 * const info = await edge.createSandbox({ id, projectId: 'root', spec });
 * const r = await edge.runCommand(info.id, { shell: 'echo hello' }); // r.stdout === 'hello\n'
 * await edge.stopSandbox(info.id);
 * ```
 */
import { totalmem, cpus } from 'node:os';
import { stat } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { DsecError } from '@dsec/core';
import type { ImageStore } from '@dsec/core';
import { ChronusSupervisor, initPath, mountErofs, unmount } from '@dsec/native';
import { ContainerBackend } from './backends/container/container-backend.js';
import { withMicrovm, type MicrovmEdgeOptions } from './backends/microvm/index.js';
import { withVm, type VmEdgeOptions } from './backends/vm/index.js';
import { detectCgroupDriver, favorDynamicModifications } from './cgroups/cgroup-driver.js';
import { Edge, type EdgeCapacity } from './edge.js';
import type { FnCallPoolsOptions } from './fncall/pools.js';
import type { EdgeGpuConfig } from './gpu/edge-gpus.js';
import type { SnapshotLimits } from './snapshot/snapshotter.js';
import { AdmissionController } from './admission/admission-controller.js';
import {
  ADMISSION_DEFAULTS,
  resolveAdmissionLimits,
  type AdmissionConfig,
  type AdmissionLimits,
} from './admission/admission-policy.js';
import { HostPressure } from './admission/host-pressure.js';
import { LayerMountCache } from './layers/layer-cache.js';
import { blobDaemonBlobs } from './layers/remote-blobs.js';
import {
  erofsMountFromEnv,
  resolveErofsMount,
  type ErofsMountSetting,
} from './layers/erofs-mount.js';
import { defaultRuntimeBinary, RuncRuntime } from './runtime/oci-runtime.js';
import { EventLog } from './events/event-log.js';
import { ensureDir, TRAVERSE_DIR_MODE } from './state/host-state.js';
import { openNetwork, type EdgeNetworkOptions } from './network/open-network.js';
import { SwapArea } from './lifecycle/swap-area.js';
import type { EdgeLogFn } from './observability/log.js';
import { blobStatsFile, type EdgeMetrics } from './observability/metrics.js';

export { Edge, type EdgeCapacity, type EdgeOptions, type EdgeStartOptions } from './edge.js';
export {
  FNCALL_PROJECT,
  FNCALL_RUNTIME_LABEL,
  FNCALL_NETWORK_LABEL,
  FNCALL_GPU_LABEL,
  FnCallPools,
  type FnCallPoolsOptions,
} from './fncall/pools.js';
export { DEFAULT_FNCALL_RUNTIMES, type FnCallRuntime } from './fncall/runtimes.js';
export {
  SANDBOXFUSION_IMAGE_RECIPES,
  SANDBOXFUSION_RUNTIMES,
  SANDBOXFUSION_TOOLKITS,
  type SandboxFusionToolkit,
} from './fncall/sandboxfusion.js';
export {
  FNCALL_IMAGE_RECIPES,
  prepareFnCallImages,
  type PrepareFnCallImagesOptions,
} from './fncall/images.js';
export type { PoolSizing } from './fncall/sizing.js';
export { AdmissionController } from './admission/admission-controller.js';
export {
  ADMISSION_DEFAULTS,
  decide,
  resolveAdmissionLimits,
  type AdmissionConfig,
  type AdmissionLedger,
  type AdmissionLimits,
  type PressureSample,
} from './admission/admission-policy.js';
export { HostPressure, type PressureSource } from './admission/host-pressure.js';
export { ContainerBackend } from './backends/container/container-backend.js';
export { buildContainerConfig, SANDBOX_CAPABILITIES } from './backends/container/spec.js';
export type {
  Backend,
  BackendSandbox,
  PauseResult,
  SandboxChannel,
  SandboxCommand,
  StartedSandbox,
} from './backends/backend.js';
export { BackendSet } from './backends/backend-set.js';
export {
  bootBare,
  DEFAULT_MICROVM_ASSETS_DIR,
  ensureMicrovmAssets,
  findMicrovmAssets,
  findQemu,
  MicrovmBackend,
  probeAccel,
  type Accel,
  type MicrovmAssets,
  type MicrovmEdgeOptions,
} from './backends/microvm/index.js';
export {
  DEFAULT_VM_IMAGE_DIR,
  ensureVmImage,
  findVmImage,
  VmBackend,
  type VmEdgeOptions,
  type VmImage,
} from './backends/vm/index.js';
export { detectCgroupDriver, type CgroupDriver } from './cgroups/cgroup-driver.js';
export { DEFAULT_SNAPSHOT_LIMITS, type SnapshotLimits } from './snapshot/snapshotter.js';
export { defaultRuntimeBinary, RuncRuntime, type OciRuntime } from './runtime/oci-runtime.js';
export { LayerMountCache } from './layers/layer-cache.js';
export { OutputCapture } from './sessions/output-capture.js';
export { mountPoints } from './layers/mountinfo.js';
export {
  GpuAllocator,
  type GpuAllocatorOptions,
  type GpuAssignment,
  type GpuUnit,
  type GpuUnitStatus,
} from './gpu/allocator.js';
export {
  discoverGpuInventory,
  nodeGpuHostProbe,
  type GpuDiscoveryOptions,
  type GpuHostProbe,
} from './gpu/discover.js';
export type {
  DeviceNode,
  DriverFile,
  GpuDevice,
  GpuInventory,
  MigInstance,
} from './gpu/inventory.js';
export { gpuSpecFragment, withGpu, type GpuSpecFragment } from './gpu/oci-fragment.js';
export {
  EdgeGpus,
  readGpuInventoryFile,
  type EdgeGpuConfig,
  type EdgeGpuSettings,
} from './gpu/edge-gpus.js';
export { doctorFailed, runDoctor, type DoctorCheck, type DoctorOptions } from './doctor.js';
export {
  EROFS_MOUNT_ENV,
  EROFS_MOUNT_SETTINGS,
  erofsMountFromEnv,
  kernelHasFileBackedErofs,
  kernelVersion,
  parseErofsMountSetting,
  hostErofsMounter,
  probeErofsMount,
  resolveErofsMount,
  type ErofsMountMode,
  type ErofsMountSetting,
  type ErofsProbe,
} from './layers/erofs-mount.js';
export { EventLog } from './events/event-log.js';
export {
  ensureDir,
  ensurePrivateFile,
  openPrivateDatabase,
  PRIVATE_DIR_MODE,
  PRIVATE_FILE_MODE,
  TRAVERSE_DIR_MODE,
} from './state/host-state.js';
export {
  BlobDaemon,
  type BlobDaemonOptions,
  type BlobDaemonStats,
} from './ondemand/blob-daemon.js';
export {
  ChunkCache,
  type ChunkCacheOptions,
  type ChunkCacheStats,
  type RangeSource,
} from './ondemand/chunk-cache.js';
export {
  BlobFuseServer,
  type BlobFuseServerOptions,
  type BlobFuseCounters,
} from './ondemand/fuse-server.js';
export { type EdgeNetworkOptions } from './network/open-network.js';
export { LinuxNetwork, type NetworkOptions } from './network/linux-network.js';
export { NoNetwork, type NetworkManager, type SandboxNetwork } from './network/network-manager.js';
export { DEFAULT_NETWORK_CATALOGUE } from './network/policy.js';
export { openCgroupPause, type CgroupPause, type MemoryLimits } from './lifecycle/cgroup-pause.js';
export { SwapArea, type SwapAreaOptions } from './lifecycle/swap-area.js';
export { DEFAULT_PAUSED_TTL_MS, MAX_TTL_SECONDS, MIN_TTL_SECONDS } from './lifecycle/lifecycle.js';
export {
  edgeLog,
  jsonLogger,
  REDACTED_FIELDS,
  type EdgeLogFn,
  type JsonLoggerOptions,
  type LevelLogger,
  type LogLevel,
} from './observability/log.js';
export {
  CREATE_PHASES,
  EdgeMetrics,
  type CreatePhase,
  type EdgeMetricsOptions,
  type EdgeMetricsSources,
} from './observability/metrics.js';
export {
  metricsText,
  parseListenAddress,
  serveMetrics,
  type MetricsListener,
  type MetricsListenerOptions,
} from './observability/metrics-listener.js';

export interface ContainerEdgeOptions {
  edgeId: string;
  stateDir: string;
  store: ImageStore;
  url?: string;
  /** Labels placement selects edges by (`pool=burst`, `hardware=h200`). */
  labels?: Record<string, string> | undefined;
  /** Report the image store's layers in `status()` (default: when labelled `pool=burst`). */
  reportLayers?: boolean | undefined;
  /** Admission knobs (docs/adr/0007-admission-by-real-use.md); every one has a default. */
  admission?: AdmissionConfig | undefined;
  /** Absolute caps, the older form: they override the matching `admission` limits. */
  capacity?: Partial<EdgeCapacity> | undefined;
  /** OCI runtime binary: `crun` where installed, else `runc` (`defaultRuntimeBinary`). */
  runtimeBinary?: string;
  /**
   * Remount the cgroup2 hierarchy with `favordynmods` (default true): moving a
   * task between cgroups then skips an RCU grace period (~12-25 ms here) that
   * every create pays otherwise, at a small cost to fork and exit. It is a
   * host-wide kernel setting; false leaves the host as it is.
   */
  cgroupFavorDynmods?: boolean;
  /** Mounted but unused layers are unmounted beyond this many bytes. */
  layerCacheBytes?: number;
  /**
   * How layers are mounted: `file` (file-backed EROFS, Linux 6.12+), `loop`
   * (auto-clearing loop devices, older kernels) or `auto` (probe at start).
   * Default: `DSEC_EROFS_MOUNT` when set, else `auto`.
   */
  erofsMount?: ErofsMountSetting | undefined;
  /**
   * Bytes of the on-demand chunk cache for a remote image store's data blobs
   * (`stateDir/blob-cache`; default 10 GiB).
   */
  blobCacheBytes?: number | undefined;
  shellBinary?: string;
  /** Parent cgroup of all sandboxes of this edge. Default `dsec`. */
  cgroupParent?: string;
  /** Sandbox networking and egress policy (default: isolated where the host supports it). */
  network?: EdgeNetworkOptions;
  ttlSweepMs?: number;
  /** How long a paused sandbox is kept before it is stopped (default 24 h; ADR 0012). */
  pausedTtlMs?: number | undefined;
  /** Pause running sandboxes unused for this long (default: off; ADR 0012). */
  idleTimeoutMs?: number | undefined;
  /**
   * Pauses push sandboxes' memory into swap files the edge adds under
   * `stateDir/swap` as needed, `pauseSwapChunkBytes` at a time (default
   * 1 GiB), up to `pauseSwapMaxBytes` in all (default: half the host's
   * memory, at most 64 GiB). They are switched off and removed when the edge
   * closes with nothing paused. 0 adds none (pauses then use only swap the
   * host already has).
   */
  pauseSwapMaxBytes?: number | undefined;
  pauseSwapChunkBytes?: number | undefined;
  /** Lifecycle log (docs/observability.md), e.g. `edgeLog(jsonLogger({ name: 'dsec-edge' }))`. */
  log?: EdgeLogFn | undefined;
  /** Prometheus metrics of this edge; bound to it here (`metrics.registry` to serve). */
  metrics?: EdgeMetrics | undefined;
  /** FnCall warm pools (docs/adr/0014-fncall.md); `false` turns FnCall off. */
  fncall?: FnCallPoolsOptions | false | undefined;
  /** GPUs for FnCall workers (docs/gpu.md): `off` (default), `auto`, or `{ inventoryFile, … }`. */
  gpus?: EdgeGpuConfig | undefined;
  /** Bounds on one snapshot (files, apparent bytes, memory, time); defaults in `DEFAULT_SNAPSHOT_LIMITS`. */
  snapshot?: SnapshotLimits | undefined;
  /** MicroVM sandboxes (`backend: 'microvm'`): on where QEMU and the built kernel are; `false`: off. */
  microvm?: MicrovmEdgeOptions | false | undefined;
  /** Full-VM sandboxes (`backend: 'vm'`): on where QEMU and the built VM image are; `false`: off. */
  vm?: VmEdgeOptions | false | undefined;
}

/**
 * The admission limits of this host: `config` over the defaults
 * (`ADMISSION_DEFAULTS`), then the absolute `capacity` caps where given.
 */
export function admissionLimits(
  config: AdmissionConfig = {},
  capacity: Partial<EdgeCapacity> = {},
): AdmissionLimits {
  const limits = resolveAdmissionLimits(config, {
    memoryMb: totalmem() / 2 ** 20,
    cores: cpus().length,
  });
  return {
    ...limits,
    ...(capacity.sandboxes !== undefined ? { maxSandboxes: capacity.sandboxes } : {}),
    ...(capacity.memoryMb !== undefined ? { maxRequestedMemoryMb: capacity.memoryMb } : {}),
    ...(capacity.cpuCores !== undefined ? { maxRequestedCpuCores: capacity.cpuCores } : {}),
  };
}

/**
 * Sandboxes' mapped roots (unprivileged host uids) must walk down to their
 * rootfs, so every ancestor of the state dir needs the execute bit for
 * others. Fail early with the fix instead of an opaque runtime error.
 */
async function assertTraversable(dir: string): Promise<void> {
  for (let d = resolve(dir); ; d = dirname(d)) {
    const st = await stat(d).catch(() => undefined);
    if (st && (st.mode & 0o001) === 0) {
      throw new DsecError(
        'invalid_argument',
        `sandboxes cannot reach their root filesystem under ${d}: run \`chmod o+x ${d}\``,
        {
          field: 'stateDir',
        },
      );
    }
    if (d === dirname(d)) return;
  }
}

/** Wires an edge with the container backend, runc and the native mount helpers. */
export async function openContainerEdge(options: ContainerEdgeOptions): Promise<Edge> {
  ensureDir(options.stateDir, TRAVERSE_DIR_MODE);
  await assertTraversable(options.stateDir);
  const erofsMount = await resolveErofsMount(options.erofsMount ?? erofsMountFromEnv() ?? 'auto', {
    probeDir: join(options.stateDir, 'erofs-probe'),
    log: options.log,
  });
  const layers = new LayerMountCache(
    join(options.stateDir, 'layers'),
    options.store,
    {
      mountErofs: (image, target, mountOptions) =>
        mountErofs(image, target, { ...mountOptions, loop: erofsMount === 'loop' }),
      unmount,
    },
    options.layerCacheBytes ?? 8 * 2 ** 30,
    options.store.local
      ? undefined
      : blobDaemonBlobs({
          mountDir: join(options.stateDir, 'blobs'),
          cacheDir: join(options.stateDir, 'blob-cache'),
          storeLocation: options.store.location,
          cacheBytes: options.blobCacheBytes ?? 10 * 2 ** 30,
        }),
  );
  const { metrics } = options;
  const events = new EventLog(join(options.stateDir, 'events.db'), {
    onRecord: metrics && ((kind) => metrics.sandboxEvent(kind)),
    onDrop: metrics && ((kind) => metrics.sandboxEventDropped(kind)),
  });
  const network = await openNetwork(options.stateDir, options.network, events, options.log);
  const cgroups = detectCgroupDriver();
  if (options.cgroupFavorDynmods ?? true) await favorDynamicModifications(options.log);
  const cgroupParent = options.cgroupParent ?? 'dsec';
  const admission = new AdmissionController({
    edgeId: options.edgeId,
    limits: admissionLimits(options.admission, options.capacity),
    sampleIntervalMs: options.admission?.sampleIntervalMs ?? ADMISSION_DEFAULTS.sampleIntervalMs,
    source: new HostPressure({
      stateDir: options.stateDir,
      sandboxMemoryBytes: () => cgroups.memoryWorkingSetBytes(`/${cgroupParent}`),
      sandboxCpuNs: () => cgroups.cpuUsageNs(`/${cgroupParent}`),
    }),
    log: options.log,
  });
  const swap = new SwapArea({
    dir: join(options.stateDir, 'swap'),
    maxBytes: options.pauseSwapMaxBytes ?? Math.min(totalmem() / 2, 64 * 2 ** 30),
    chunkBytes: options.pauseSwapChunkBytes ?? 2 ** 30,
    log: options.log,
  });
  const backend = new ContainerBackend({
    dir: join(options.stateDir, 'sandboxes'),
    runtime: new RuncRuntime(
      options.runtimeBinary ?? defaultRuntimeBinary(),
      join(options.stateDir, 'runtime'),
    ),
    cgroups,
    layers,
    initBinary: initPath(),
    chronus: new ChronusSupervisor({
      dir: join(options.stateDir, 'chronus'),
      shellPath: options.shellBinary ?? '/bin/busybox',
    }),
    cgroupParent,
    network,
    swap,
    metrics,
    log: options.log,
  });
  const edge = await Edge.open({
    edgeId: options.edgeId,
    url: options.url,
    labels: options.labels,
    reportLayers: options.reportLayers,
    stateDir: options.stateDir,
    store: options.store,
    backend: withVm(withMicrovm(backend, { ...options, layers, network, cgroups, cgroupParent }), {
      ...options,
      layers,
      network,
      cgroups,
      cgroupParent,
    }),
    layers,
    admission,
    ttlSweepMs: options.ttlSweepMs,
    log: options.log,
    network,
    events,
    pausedTtlMs: options.pausedTtlMs,
    idleTimeoutMs: options.idleTimeoutMs,
    swap,
    metrics,
    fncall: options.fncall,
    gpus: options.gpus,
    snapshot: options.snapshot,
  });
  metrics?.bind({
    sandboxStates: async () =>
      (await edge.listSandboxes({ includeEnded: true })).map((s) => s.state),
    admission: () => admission.view(),
    layerCache: () => ({ ...layers.stats(), ...layers.counters }),
    fncallPools: () => edge.fncallPools(),
    ...(options.store.local
      ? {}
      : { blobStats: blobStatsFile(join(options.stateDir, 'blobs', '.stats')) }),
  });
  return edge;
}
