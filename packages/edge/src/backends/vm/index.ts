import { join } from 'node:path';
import type { ImageStore } from '@dsec/core';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import type { NetworkManager } from '../../network/network-manager.js';
import type { Backend } from '../backend.js';
import { BackendSet } from '../backend-set.js';
import {
  DEFAULT_MICROVM_ASSETS_DIR,
  findMicrovmAssets,
  findQemu,
  type Accel,
} from '../microvm/assets.js';
import { DEFAULT_VM_IMAGE_DIR, findVmImage } from './image.js';
import { VmBackend } from './vm-backend.js';

export {
  DEFAULT_VM_IMAGE_DIR,
  ensureVmImage,
  findVmImage,
  VM_CMDLINE,
  type VmImage,
} from './image.js';
export { VmBackend, type VmBackendOptions } from './vm-backend.js';
export { keyForChar, pngSize, textToEvents, toQmpEvents, type QmpInputEvent } from './keys.js';

export interface VmEdgeOptions {
  /** The disk image, kernel and initramfs (`ensureVmImage`); default /var/cache/dsec/vm. */
  imageDir?: string | undefined;
  /** Skip the probe (production hosts with a known-good KVM). */
  accel?: Accel | undefined;
  qemuBinary?: string | undefined;
  bootTimeoutMs?: number | undefined;
}

/**
 * `backend` plus the full-VM backend when QEMU and the built VM image are on
 * this host (the edge then reports `vm` in its status, and only then).
 */
export function withVm(
  backend: Backend,
  options: {
    stateDir: string;
    store: ImageStore;
    layers: LayerMountCache;
    network?: NetworkManager | undefined;
    cgroups: CgroupDriver;
    cgroupParent: string;
    vm?: VmEdgeOptions | false | undefined;
    microvm?: { assetsDir?: string | undefined } | false | undefined;
    log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
  },
): Backend {
  if (options.vm === false) return backend;
  const qemu = findQemu(options.vm?.qemuBinary);
  const image = findVmImage(options.vm?.imageDir ?? DEFAULT_VM_IMAGE_DIR);
  if (!qemu || !image) return backend;
  const vm = new VmBackend({
    dir: join(options.stateDir, 'fullvms'),
    image,
    probeAssets: findMicrovmAssets(
      (options.microvm && options.microvm.assetsDir) || DEFAULT_MICROVM_ASSETS_DIR,
    ),
    store: options.store,
    layers: options.layers,
    network: options.network,
    cgroups: options.cgroups,
    cgroupParent: options.cgroupParent,
    qemuBinary: qemu,
    accel: options.vm?.accel,
    bootTimeoutMs: options.vm?.bootTimeoutMs,
    log: options.log,
  });
  return new BackendSet([...(backend instanceof BackendSet ? backend.backends : [backend]), vm]);
}
