import { join } from 'node:path';
import type { ImageStore } from '@dsec/core';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import type { NetworkManager } from '../../network/network-manager.js';
import type { Backend } from '../backend.js';
import { BackendSet } from '../backend-set.js';
import { DEFAULT_MICROVM_ASSETS_DIR, findMicrovmAssets, findQemu, type Accel } from './assets.js';
import { MicrovmBackend } from './microvm-backend.js';

export {
  bootBare,
  DEFAULT_MICROVM_ASSETS_DIR,
  ensureMicrovmAssets,
  findMicrovmAssets,
  findQemu,
  probeAccel,
  type Accel,
  type MicrovmAssets,
} from './assets.js';
export { MicrovmBackend, type MicrovmBackendOptions } from './microvm-backend.js';

export interface MicrovmEdgeOptions {
  /** Kernel and initramfs (`ensureMicrovmAssets`); default /var/cache/dsec/microvm. */
  assetsDir?: string | undefined;
  /** Skip the probe (production hosts with a known-good KVM). */
  accel?: Accel | undefined;
  qemuBinary?: string | undefined;
  bootTimeoutMs?: number | undefined;
  /** virtio-balloon free-page reporting (default on; `dsec bench microvm` measures off). */
  freePageReporting?: boolean | undefined;
}

/**
 * The edge's backends: the container backend, plus the microVM backend when
 * QEMU and the built kernel and initramfs are on this host (the edge then
 * reports `microvm` in its status, and only then).
 */
export function withMicrovm(
  container: Backend,
  options: {
    stateDir: string;
    store: ImageStore;
    layers: LayerMountCache;
    network?: NetworkManager | undefined;
    cgroups: CgroupDriver;
    cgroupParent: string;
    microvm?: MicrovmEdgeOptions | false | undefined;
    log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
  },
): Backend {
  if (options.microvm === false) return container;
  const qemu = findQemu(options.microvm?.qemuBinary);
  const assets = findMicrovmAssets(options.microvm?.assetsDir ?? DEFAULT_MICROVM_ASSETS_DIR);
  if (!qemu || !assets) return container;
  return new BackendSet([
    container,
    new MicrovmBackend({
      dir: join(options.stateDir, 'vms'),
      assets,
      store: options.store,
      layers: options.layers,
      network: options.network,
      cgroups: options.cgroups,
      cgroupParent: options.cgroupParent,
      qemuBinary: qemu,
      accel: options.microvm?.accel,
      bootTimeoutMs: options.microvm?.bootTimeoutMs,
      freePageReporting: options.microvm?.freePageReporting,
      log: options.log,
    }),
  ]);
}
