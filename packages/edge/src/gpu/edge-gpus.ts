import { readFile } from 'node:fs/promises';
import { DsecError } from '@dsec/core';
import type { FnCallGpuRequest, FnCallGpuUnitStatus } from '@dsec/core';
import { GpuAllocator, type GpuAllocatorOptions } from './allocator.js';
import {
  checkInventoryNodes,
  discoverGpuInventory,
  nodeGpuHostProbe,
  type GpuDiscoveryOptions,
  type GpuHostProbe,
} from './discover.js';
import type { GpuInventory } from './inventory.js';
import { gpuSpecFragment, type GpuSpecFragment } from './oci-fragment.js';

/**
 * How an edge finds its GPUs (docs/gpu.md, Configuration):
 * - `off` (the default): no GPUs; calls with `gpu` answer `unavailable`.
 * - `auto`: discover them when the host has an NVIDIA driver
 *   (`/proc/driver/nvidia` exists); a host without one runs without GPUs,
 *   and a host with one whose discovery fails refuses to start.
 * - an object: GPUs are required; discovery (or the inventory file) must
 *   succeed or the edge refuses to start.
 */
export type EdgeGpuConfig = 'auto' | 'off' | EdgeGpuSettings;

export interface EdgeGpuSettings {
  /**
   * A `GpuInventory` as JSON (what `host-check inventory` prints) instead of
   * discovery: for tests, and for operators who describe their devices.
   * Its device nodes are still checked against the host's /dev.
   */
  inventoryFile?: string | undefined;
  /** Discovery options (ignored with `inventoryFile`). */
  discovery?: Omit<GpuDiscoveryOptions, 'probe'> | undefined;
  maxSharedWorkersPerUnit?: GpuAllocatorOptions['maxSharedWorkersPerUnit'];
  sharedPlacement?: GpuAllocatorOptions['sharedPlacement'];
  /** Give `/dev/nvidia-modeset` too (display work only). Default false. */
  modeset?: boolean | undefined;
}

export interface OpenEdgeGpusOptions {
  /** What discovery and the node check read of the host (tests pass a fake one). */
  probe?: GpuHostProbe | undefined;
  /** Where `auto` looks for the driver. Default `/proc/driver/nvidia`. */
  driverProcDir?: string | undefined;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/**
 * An edge's GPUs: the inventory found at start and the allocator handing
 * its units to FnCall workers. `assign` gives the OCI fragment the
 * container backend merges into the worker's config; `release` frees the
 * units when the worker's sandbox is gone.
 */
export class EdgeGpus {
  readonly #allocator: GpuAllocator;
  readonly #maxShared: number;

  constructor(
    readonly inventory: GpuInventory,
    readonly settings: Omit<EdgeGpuSettings, 'inventoryFile' | 'discovery'> = {},
  ) {
    this.#allocator = new GpuAllocator(inventory, settings);
    this.#maxShared = settings.maxSharedWorkersPerUnit ?? 4;
  }

  /** Resolves undefined when GPUs are off (or `auto` on a host without a driver). */
  static async open(
    config: EdgeGpuConfig | undefined,
    options: OpenEdgeGpusOptions = {},
  ): Promise<EdgeGpus | undefined> {
    if (config === undefined || config === 'off') return undefined;
    const probe = options.probe ?? nodeGpuHostProbe();
    if (config === 'auto') {
      const dir = options.driverProcDir ?? '/proc/driver/nvidia';
      const hasDriver = await probe.readFile(`${dir}/version`).then(
        () => true,
        () => false,
      );
      if (!hasDriver) {
        options.log?.('no NVIDIA driver: GPUs off', { checked: `${dir}/version` });
        return undefined;
      }
    }
    const settings = config === 'auto' ? {} : config;
    const inventory =
      settings.inventoryFile !== undefined
        ? await readGpuInventoryFile(settings.inventoryFile, probe)
        : await discoverGpuInventory({ ...settings.discovery, probe });
    const gpus = new EdgeGpus(inventory, settings);
    options.log?.('GPUs found', {
      driverVersion: inventory.driverVersion,
      units: gpus.status().map((u) => `${u.model} ${u.uuid}`),
    });
    return gpus;
  }

  /**
   * Gives `workerId` units for `request` and returns what its OCI config
   * needs. Throws as `GpuAllocator.assign` does (`capacity_exhausted` when
   * the units are taken or this node has none such), holding nothing then.
   */
  assign(workerId: string, request: FnCallGpuRequest): GpuSpecFragment {
    const assignment = this.#allocator.assign(workerId, request);
    try {
      return gpuSpecFragment(assignment, this.inventory, { modeset: this.settings.modeset });
    } catch (err) {
      this.#allocator.release(workerId);
      throw err;
    }
  }

  /** Frees what `workerId` holds; false when it held nothing. */
  release(workerId: string): boolean {
    return this.#allocator.release(workerId);
  }

  /** The UUIDs `workerId` holds, in the order CUDA numbers them. */
  heldBy(workerId: string): string[] {
    return this.#allocator.assignmentOf(workerId)?.units.map((u) => u.uuid) ?? [];
  }

  /** Every unit and its use, as `EdgeStatus.gpus` reports it. */
  status(): FnCallGpuUnitStatus[] {
    return this.#allocator.status().map((s) => ({
      kind: s.unit.kind,
      uuid: s.unit.uuid,
      model: s.unit.kind === 'gpu' ? s.unit.name : s.unit.profile,
      mode: s.mode,
      workers: s.workers.length,
      maxSharedWorkers: this.#maxShared,
    }));
  }
}

/**
 * Reads a `GpuInventory` JSON file, checks its shape (a malformed one would
 * hand out the wrong device) and that its device nodes exist on the host.
 * Throws `unavailable` naming what is wrong.
 */
export async function readGpuInventoryFile(
  path: string,
  probe: GpuHostProbe = nodeGpuHostProbe(),
): Promise<GpuInventory> {
  const bad = (what: string): never => {
    throw new DsecError('unavailable', `GPU inventory ${path}: ${what}`);
  };
  let raw: unknown;
  try {
    raw = JSON.parse(await readFile(path, 'utf8'));
  } catch (err) {
    throw new DsecError('unavailable', `GPU inventory ${path}: cannot read it as JSON`, {
      cause: err,
    });
  }
  const inv = raw as GpuInventory;
  const isObj = (v: unknown): v is Record<string, unknown> =>
    typeof v === 'object' && v !== null && !Array.isArray(v);
  const checkNode = (n: unknown, where: string): void => {
    if (
      !isObj(n) ||
      typeof n['path'] !== 'string' ||
      !n['path'].startsWith('/') ||
      !Number.isInteger(n['major']) ||
      !Number.isInteger(n['minor'])
    )
      bad(`${where} must be { path: absolute, major, minor }`);
  };
  if (!isObj(inv) || typeof inv.driverVersion !== 'string') bad('driverVersion must be a string');
  if (!Array.isArray(inv.gpus)) bad('gpus must be an array');
  if (!isObj(inv.control)) bad('control must be an object');
  checkNode(inv.control.ctl, 'control.ctl');
  checkNode(inv.control.uvm, 'control.uvm');
  checkNode(inv.control.uvmTools, 'control.uvmTools');
  if (inv.control.modeset !== undefined) checkNode(inv.control.modeset, 'control.modeset');
  const uuids = new Set<string>();
  const indexes = new Set<number>();
  for (const [i, g] of inv.gpus.entries()) {
    const at = `gpus.${i}`;
    if (!isObj(g)) bad(`${at} must be an object`);
    if (!Number.isInteger(g.index) || indexes.has(g.index)) bad(`${at}.index must be unique`);
    if (typeof g.uuid !== 'string' || !g.uuid.startsWith('GPU-') || uuids.has(g.uuid))
      bad(`${at}.uuid must be a unique GPU-… UUID`);
    if (typeof g.name !== 'string' || typeof g.pciBusId !== 'string')
      bad(`${at} needs name and pciBusId`);
    if (typeof g.memoryMib !== 'number' || typeof g.migEnabled !== 'boolean')
      bad(`${at} needs memoryMib and migEnabled`);
    checkNode(g.node, `${at}.node`);
    if (!Array.isArray(g.migInstances)) bad(`${at}.migInstances must be an array`);
    for (const [j, m] of g.migInstances.entries()) {
      if (!isObj(m) || typeof m.uuid !== 'string' || uuids.has(m.uuid))
        bad(`${at}.migInstances.${j}.uuid must be unique`);
      if (typeof m.profile !== 'string' || !Number.isInteger(m.deviceIndex))
        bad(`${at}.migInstances.${j} needs profile and deviceIndex`);
      if (!Array.isArray(m.capNodes) || m.capNodes.length !== 2)
        bad(`${at}.migInstances.${j}.capNodes must be its GI and CI nodes`);
      m.capNodes.forEach((n, k) => checkNode(n, `${at}.migInstances.${j}.capNodes.${k}`));
      uuids.add(m.uuid);
    }
    uuids.add(g.uuid);
    indexes.add(g.index);
  }
  if (!Array.isArray(inv.driverFiles)) bad('driverFiles must be an array');
  for (const [i, f] of inv.driverFiles.entries()) {
    if (
      !isObj(f) ||
      typeof f.hostPath !== 'string' ||
      !f.hostPath.startsWith('/') ||
      (f.kind !== 'library' && f.kind !== 'binary') ||
      !Array.isArray(f.names) ||
      f.names.some((n) => typeof n !== 'string' || n === '' || n.includes('/'))
    )
      bad(
        `driverFiles.${i} must be { hostPath: absolute, kind: library|binary, names: [file names] }`,
      );
  }
  await checkInventoryNodes(inv, probe);
  return inv;
}
