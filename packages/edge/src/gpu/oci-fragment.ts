import { DsecError } from '@dsec/core';
import type { GpuAssignment } from './allocator.js';
import type { DeviceNode, GpuInventory } from './inventory.js';
import { procGpuDir } from './inventory.js';

/** Where driver libraries appear in a worker: the directory NVIDIA's CUDA images put on LD_LIBRARY_PATH. */
export const GPU_LIBRARY_DIR = '/usr/local/nvidia/lib64';
/** Where driver programs (`nvidia-smi`) appear: on the sandbox's default PATH. */
export const GPU_BINARY_DIR = '/usr/local/bin';

/** An entry of the OCI config's `linux.devices`. */
export interface OciLinuxDevice {
  path: string;
  type: 'c';
  major: number;
  minor: number;
  fileMode: number;
  uid: number;
  gid: number;
}

/** An entry of `linux.resources.devices` (the device cgroup). */
export interface OciDeviceRule {
  allow: boolean;
  type: 'c';
  major: number;
  minor: number;
  access: string;
}

export interface OciMount {
  destination: string;
  type: 'bind';
  source: string;
  options: string[];
}

/** What a GPU assignment adds to a worker's OCI config (`withGpu` merges it). */
export interface GpuSpecFragment {
  /** Device nodes the runtime creates in the worker's /dev (bind-mounts, in a user namespace). */
  devices: OciLinuxDevice[];
  /** Device-cgroup allow rules for exactly those nodes, after the spec's deny-all. */
  deviceRules: OciDeviceRule[];
  /** Read-only binds of the driver's libraries (under each of their names) and programs. */
  mounts: OciMount[];
  /**
   * `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` (UUIDs, MIG UUIDs
   * for instances, in assignment order) and `LD_LIBRARY_PATH`. Every
   * process that should see the GPUs needs these: commands the edge runs in
   * a sandbox get their own environment, so the caller passes this to each.
   */
  env: Record<string, string>;
  /**
   * procfs directories of the host's other GPUs, to add to `maskedPaths`:
   * what the device cgroup already forbids using is then not shown either
   * (libnvidia-container hides them the same way).
   */
  maskedPaths: string[];
}

export interface GpuSpecOptions {
  /** Give `/dev/nvidia-modeset` too (display work only). Default false. */
  modeset?: boolean | undefined;
}

/**
 * The OCI config pieces that give a worker exactly its assigned GPUs: the
 * control nodes (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`), each unit's
 * device node (for a MIG instance: its parent's node and its two
 * `/dev/nvidia-caps` capability nodes), device-cgroup rules allowing those
 * nodes read-write and nothing else, the driver files read-only, and the
 * environment naming the devices by UUID. Pure: same input, same output.
 *
 * Throws `internal` when the assignment names a unit the inventory does not
 * have (an assignment from another inventory).
 */
export function gpuSpecFragment(
  assignment: GpuAssignment,
  inventory: GpuInventory,
  options: GpuSpecOptions = {},
): GpuSpecFragment {
  const nodes: { node: DeviceNode; fileMode: number }[] = [];
  const add = (node: DeviceNode, fileMode = 0o666) => {
    if (!nodes.some((n) => n.node.path === node.path)) nodes.push({ node, fileMode });
  };
  const c = inventory.control;
  add(c.ctl);
  add(c.uvm);
  add(c.uvmTools);
  if (options.modeset && c.modeset) add(c.modeset);
  const used = new Set<number>();
  for (const unit of assignment.units) {
    const parentIndex = unit.kind === 'gpu' ? unit.index : unit.parentIndex;
    const gpu = inventory.gpus.find((g) => g.index === parentIndex);
    const mig =
      unit.kind === 'mig' ? gpu?.migInstances.find((m) => m.uuid === unit.uuid) : undefined;
    if (!gpu || (unit.kind === 'gpu' ? gpu.uuid !== unit.uuid || gpu.migEnabled : !mig)) {
      throw new DsecError('internal', `GPU ${unit.uuid} is not in this inventory`);
    }
    used.add(gpu.index);
    add(gpu.node);
    // The capability files are read-only on the host (0444); opening them is the grant.
    for (const cap of mig?.capNodes ?? []) add(cap, 0o444);
  }
  const uuids = assignment.units.map((u) => u.uuid).join(',');
  const mounts: OciMount[] = inventory.driverFiles.flatMap((f) =>
    f.names.map((name) => ({
      destination: `${f.kind === 'library' ? GPU_LIBRARY_DIR : GPU_BINARY_DIR}/${name}`,
      type: 'bind' as const,
      source: f.hostPath,
      // Not noexec: libraries are mapped executable and nvidia-smi runs.
      options: ['bind', 'ro', 'nosuid', 'nodev'],
    })),
  );
  return {
    devices: nodes.map(({ node, fileMode }) => ({
      path: node.path,
      type: 'c',
      major: node.major,
      minor: node.minor,
      fileMode,
      uid: 0,
      gid: 0,
    })),
    deviceRules: nodes.map(({ node }) => ({
      allow: true,
      type: 'c',
      major: node.major,
      minor: node.minor,
      access: 'rw',
    })),
    mounts,
    env: {
      CUDA_VISIBLE_DEVICES: uuids,
      NVIDIA_VISIBLE_DEVICES: uuids,
      LD_LIBRARY_PATH: GPU_LIBRARY_DIR,
    },
    maskedPaths: inventory.gpus
      .filter((g) => !used.has(g.index))
      .map((g) => procGpuDir(g.pciBusId)),
  };
}

/**
 * `config` (from `buildContainerConfig`) with `fragment` merged in: devices
 * and mounts appended, allow rules after the deny-all, masked paths added,
 * the environment set on the init process. Returns a new object; `config`
 * is not changed. Throws `internal` when `config` lacks the parts the
 * container spec always has.
 */
export function withGpu(
  config: Record<string, unknown>,
  fragment: GpuSpecFragment,
): Record<string, unknown> {
  const linux = config['linux'] as
    | { resources?: { devices?: unknown[] }; devices?: unknown[]; maskedPaths?: string[] }
    | undefined;
  const process = config['process'] as { env?: string[] } | undefined;
  const mounts = config['mounts'];
  if (!linux?.resources?.devices || !process?.env || !Array.isArray(mounts)) {
    throw new DsecError('internal', 'withGpu: not a container config from buildContainerConfig');
  }
  const keys = new Set(Object.keys(fragment.env));
  return {
    ...config,
    process: {
      ...process,
      env: [
        ...process.env.filter((e) => !keys.has(e.slice(0, e.indexOf('=')))),
        ...Object.entries(fragment.env).map(([k, v]) => `${k}=${v}`),
      ],
    },
    mounts: [...(mounts as unknown[]), ...fragment.mounts],
    linux: {
      ...linux,
      devices: [...(linux.devices ?? []), ...fragment.devices],
      resources: {
        ...linux.resources,
        devices: [...linux.resources.devices, ...fragment.deviceRules],
      },
      maskedPaths: [...(linux.maskedPaths ?? []), ...fragment.maskedPaths],
    },
  };
}
