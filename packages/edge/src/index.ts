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
import { chmod, mkdir, stat } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { DsecError } from '@dsec/core';
import type { ImageStore } from '@dsec/core';
import { initPath, mountErofs, unmount } from '@dsec/native';
import { ContainerBackend } from './backends/container/container-backend.js';
import { detectCgroupDriver } from './cgroups/cgroup-driver.js';
import { Edge, type EdgeCapacity } from './edge.js';
import { LayerMountCache } from './layers/layer-cache.js';
import { blobDaemonBlobs } from './layers/remote-blobs.js';
import { RuncRuntime } from './runtime/oci-runtime.js';
import { EventLog } from './events/event-log.js';
import { openNetwork, type EdgeNetworkOptions } from './network/open-network.js';

export { Edge, type EdgeCapacity, type EdgeOptions } from './edge.js';
export { ContainerBackend } from './backends/container/container-backend.js';
export { buildContainerConfig, SANDBOX_CAPABILITIES } from './backends/container/spec.js';
export type { Backend, StartedSandbox } from './backends/backend.js';
export { detectCgroupDriver, type CgroupDriver } from './cgroups/cgroup-driver.js';
export { RuncRuntime, type OciRuntime } from './runtime/oci-runtime.js';
export { LayerMountCache } from './layers/layer-cache.js';
export { OutputCapture } from './sessions/output-capture.js';
export { mountPoints } from './layers/mountinfo.js';
export { EventLog } from './events/event-log.js';
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

export interface ContainerEdgeOptions {
  edgeId: string;
  stateDir: string;
  store: ImageStore;
  url?: string;
  capacity?: Partial<EdgeCapacity>;
  /** OCI runtime binary (`runc`, or `crun` on pure cgroup v2 hosts). */
  runtimeBinary?: string;
  /** Mounted but unused layers are unmounted beyond this many bytes. */
  layerCacheBytes?: number;
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
  log?: (msg: string, fields?: Record<string, unknown>) => void;
}

/**
 * Default capacity: memory is overcommitted 4× and CPU 8× because agent
 * sandboxes mostly wait on the model (paper 4.3: 90 % use ≤ 5 % of their CPU).
 */
export function defaultCapacity(): EdgeCapacity {
  return {
    memoryMb: Math.floor((totalmem() / 2 ** 20) * 4),
    cpuCores: cpus().length * 8,
    sandboxes: 1000,
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
  await mkdir(options.stateDir, { recursive: true });
  await chmod(options.stateDir, 0o711);
  await assertTraversable(options.stateDir);
  const layers = new LayerMountCache(
    join(options.stateDir, 'layers'),
    options.store,
    { mountErofs, unmount },
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
  const events = new EventLog(join(options.stateDir, 'events.db'));
  const network = await openNetwork(options.stateDir, options.network, events, options.log);
  const backend = new ContainerBackend({
    dir: join(options.stateDir, 'sandboxes'),
    runtime: new RuncRuntime(options.runtimeBinary ?? 'runc', join(options.stateDir, 'runtime')),
    cgroups: detectCgroupDriver(),
    layers,
    initBinary: initPath(),
    shellBinary: options.shellBinary ?? '/bin/busybox',
    cgroupParent: options.cgroupParent ?? 'dsec',
    network,
  });
  return Edge.open({
    edgeId: options.edgeId,
    url: options.url,
    stateDir: options.stateDir,
    store: options.store,
    backend,
    layers,
    capacity: { ...defaultCapacity(), ...options.capacity },
    ttlSweepMs: options.ttlSweepMs,
    log: options.log,
    network,
    events,
  });
}
