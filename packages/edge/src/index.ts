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
import { join } from 'node:path';
import type { ImageStore } from '@dsec/core';
import { initPath, mountErofs, unmount } from '@dsec/native';
import { ContainerBackend } from './backends/container/container-backend.js';
import { detectCgroupDriver } from './cgroups/cgroup-driver.js';
import { Edge, type EdgeCapacity } from './edge.js';
import { LayerMountCache } from './layers/layer-cache.js';
import { RuncRuntime } from './runtime/oci-runtime.js';

export { Edge, type EdgeCapacity, type EdgeOptions } from './edge.js';
export { ContainerBackend } from './backends/container/container-backend.js';
export { buildContainerConfig, SANDBOX_CAPABILITIES } from './backends/container/spec.js';
export type { Backend, StartedSandbox } from './backends/backend.js';
export { detectCgroupDriver, type CgroupDriver } from './cgroups/cgroup-driver.js';
export { RuncRuntime, type OciRuntime } from './runtime/oci-runtime.js';
export { LayerMountCache } from './layers/layer-cache.js';
export { OutputCapture } from './sessions/output-capture.js';
export { mountPoints } from './layers/mountinfo.js';

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
  shellBinary?: string;
  /** Parent cgroup of all sandboxes of this edge. Default `dsec`. */
  cgroupParent?: string;
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

/** Wires an edge with the container backend, runc and the native mount helpers. */
export async function openContainerEdge(options: ContainerEdgeOptions): Promise<Edge> {
  const layers = new LayerMountCache(
    join(options.stateDir, 'layers'),
    options.store,
    { mountErofs, unmount },
    options.layerCacheBytes ?? 8 * 2 ** 30,
  );
  const backend = new ContainerBackend({
    dir: join(options.stateDir, 'sandboxes'),
    runtime: new RuncRuntime(options.runtimeBinary ?? 'runc', join(options.stateDir, 'runtime')),
    cgroups: detectCgroupDriver(),
    layers,
    initBinary: initPath(),
    shellBinary: options.shellBinary ?? '/bin/busybox',
    cgroupParent: options.cgroupParent ?? 'dsec',
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
  });
}
