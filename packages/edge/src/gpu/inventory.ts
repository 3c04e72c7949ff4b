import { DsecError } from '@dsec/core';

/**
 * The GPUs of one host, as a worker's OCI spec needs them (issue 14.5):
 * device nodes with their numbers, MIG instances named by UUID, and the
 * driver's user-space files. Built by `buildGpuInventory` from the text
 * `nvidia-smi` and procfs give (parsers below, pure and tested against
 * fixture text), by `discoverGpuInventory` on a real host.
 *
 * Vocabulary:
 * - a *GPU* is one physical device, `/dev/nvidia<minor>`. Its minor is the
 *   driver's (`/proc/driver/nvidia/gpus/<bus>/information`), which need not
 *   equal nvidia-smi's index (that one is PCI order).
 * - a *MIG instance* is a slice of a GPU in MIG mode (A100, H100, H200): its
 *   own UUID (`MIG-…`), a profile (`1g.10gb`), a GPU instance and compute
 *   instance ID. A process reaches it through the parent's device node plus
 *   two capability nodes under `/dev/nvidia-caps`. A GPU in MIG mode is only
 *   ever handed out as its instances.
 * - *control nodes* every GPU process needs: `/dev/nvidiactl`,
 *   `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`; `/dev/nvidia-modeset`
 *   (display only) is recorded but not given out by default.
 */

/** A character device node on the host. */
export interface DeviceNode {
  path: string;
  major: number;
  minor: number;
}

export interface MigInstance {
  /** `MIG-<uuid>` (R470+), or `MIG-GPU-<uuid>/<gi>/<ci>` from older drivers: what CUDA_VISIBLE_DEVICES takes. */
  uuid: string;
  /** As `nvidia-smi -L` names it: `1g.10gb`, `3g.40gb`, `1c.3g.40gb` (a compute instance of a shared GI). */
  profile: string;
  /** nvidia-smi index of the parent GPU. */
  parentIndex: number;
  /** The MIG device's index within its parent (`Device N` in `nvidia-smi -L`). */
  deviceIndex: number;
  gpuInstanceId: number;
  computeInstanceId: number;
  /** Usable memory, when `nvidia-smi` said. */
  memoryMib?: number | undefined;
  /** `/dev/nvidia-caps/nvidia-cap<N>` granting access to the GPU instance, then the compute instance. */
  capNodes: DeviceNode[];
}

export interface GpuDevice {
  /** nvidia-smi index (PCI order). */
  index: number;
  /** `GPU-<uuid>`. */
  uuid: string;
  /** `NVIDIA H200`, `NVIDIA A100-SXM4-80GB`. */
  name: string;
  memoryMib: number;
  /** As nvidia-smi prints it: `00000000:18:00.0`. */
  pciBusId: string;
  migEnabled: boolean;
  /** `/dev/nvidia<minor>`. */
  node: DeviceNode;
  /** Empty unless `migEnabled`; a MIG GPU with no instances created offers nothing. */
  migInstances: MigInstance[];
}

export interface ControlNodes {
  ctl: DeviceNode;
  uvm: DeviceNode;
  uvmTools: DeviceNode;
  /** Absent when the nvidia-modeset module is not loaded. */
  modeset?: DeviceNode | undefined;
}

/** A user-space driver file a worker gets read-only. */
export interface DriverFile {
  hostPath: string;
  kind: 'library' | 'binary';
  /**
   * Names it is exposed under: its own, then every symlink beside it on the
   * host that resolves to it (`libcuda.so.1` for `libcuda.so.550.90.07`):
   * the sonames programs actually load.
   */
  names: string[];
}

export interface GpuInventory {
  driverVersion: string;
  gpus: GpuDevice[];
  control: ControlNodes;
  driverFiles: DriverFile[];
}

// ---- nvidia-smi --query-gpu ------------------------------------------------------

/** The fields `parseGpuQuery` reads, in this order: pass them to `--query-gpu=`. */
export const GPU_QUERY_FIELDS = [
  'index',
  'uuid',
  'name',
  'memory.total',
  'pci.bus_id',
  'driver_version',
  'mig.mode.current',
] as const;

export interface GpuQueryRow {
  index: number;
  uuid: string;
  name: string;
  memoryMib: number;
  pciBusId: string;
  driverVersion: string;
  /** `Enabled` only; `Disabled` and `[N/A]` (no MIG support) are false. */
  migEnabled: boolean;
}

/**
 * Parses `nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader`
 * (with or without `,nounits`: `143771 MiB` and `143771` both read as MiB).
 * Throws `unavailable` naming the line for anything else: a misread
 * inventory would expose the wrong device.
 */
export function parseGpuQuery(text: string): GpuQueryRow[] {
  const rows: GpuQueryRow[] = [];
  for (const [n, line] of lines(text)) {
    const cols = line.split(',').map((c) => c.trim());
    const [index, uuid, name, memory, bus, driver, mig] = cols;
    const mem = /^(\d+)(?:\s*MiB)?$/.exec(memory ?? '');
    if (
      cols.length !== GPU_QUERY_FIELDS.length ||
      !/^\d+$/.test(index ?? '') ||
      !/^GPU-[0-9a-f-]+$/i.test(uuid ?? '') ||
      !name ||
      !mem ||
      !PCI_BUS_ID.test(bus ?? '') ||
      !driver
    ) {
      throw malformed('nvidia-smi --query-gpu', n, line);
    }
    rows.push({
      index: Number(index),
      uuid: uuid!,
      name,
      memoryMib: Number(mem[1]),
      pciBusId: bus!,
      driverVersion: driver,
      migEnabled: mig === 'Enabled',
    });
  }
  return rows;
}

// ---- nvidia-smi -L ---------------------------------------------------------------

export interface GpuListEntry {
  index: number;
  name: string;
  uuid: string;
  mig: { profile: string; deviceIndex: number; uuid: string }[];
}

/**
 * Parses `nvidia-smi -L`: one `GPU i: NAME (UUID: GPU-…)` line per GPU,
 * followed (MIG mode) by its instances, `  MIG 1g.10gb  Device  0: (UUID: MIG-…)`.
 * Lines of other kinds (a future driver's extras) are skipped; a MIG line
 * before any GPU line is refused.
 */
export function parseGpuList(text: string): GpuListEntry[] {
  const out: GpuListEntry[] = [];
  for (const [n, line] of lines(text)) {
    const gpu = /^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-f-]+)\)$/i.exec(line.trim());
    if (gpu) {
      out.push({ index: Number(gpu[1]), name: gpu[2]!, uuid: gpu[3]!, mig: [] });
      continue;
    }
    const mig = /^MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)$/.exec(line.trim());
    if (mig) {
      const parent = out.at(-1);
      if (!parent) throw malformed('nvidia-smi -L', n, line);
      parent.mig.push({ profile: mig[1]!, deviceIndex: Number(mig[2]), uuid: mig[3]! });
    }
  }
  return out;
}

/** GI and CI of a pre-R470 MIG UUID (`MIG-GPU-<uuid>/<gi>/<ci>`); undefined for the current form. */
export function legacyMigIds(uuid: string): { gi: number; ci: number } | undefined {
  const m = /^MIG-GPU-[0-9a-f-]+\/(\d+)\/(\d+)$/i.exec(uuid);
  return m ? { gi: Number(m[1]), ci: Number(m[2]) } : undefined;
}

// ---- nvidia-smi (the MIG devices table) ------------------------------------------

export interface MigTableRow {
  /** nvidia-smi index of the parent GPU. */
  gpu: number;
  gi: number;
  ci: number;
  /** The MIG device index, as in `nvidia-smi -L`. */
  migDevice: number;
  memoryMib: number;
}

/**
 * Reads the "MIG devices" table of plain `nvidia-smi`: the only text output
 * that ties a MIG device index (hence, through `-L`, its UUID) to its GPU
 * and compute instance IDs, which name its capability nodes. Rows look like
 * `|  0    1   0   0  |   13MiB / 40192MiB  | ...`; the BAR1 line under each
 * and every other table are ignored.
 */
export function parseMigDeviceTable(text: string): MigTableRow[] {
  const out: MigTableRow[] = [];
  let inMig = false;
  for (const [, line] of lines(text)) {
    if (/MIG devices:/.test(line)) inMig = true;
    else if (/Processes:/.test(line)) inMig = false;
    if (!inMig) continue;
    const m = /^\|\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*\|\s*\d+MiB\s*\/\s*(\d+)MiB/.exec(line);
    if (m) {
      out.push({
        gpu: Number(m[1]),
        gi: Number(m[2]),
        ci: Number(m[3]),
        migDevice: Number(m[4]),
        memoryMib: Number(m[5]),
      });
    }
  }
  return out;
}

// ---- procfs ----------------------------------------------------------------------

/** Character-device majors by driver name, from `/proc/devices` (block devices ignored). */
export function parseProcDevices(text: string): Map<string, number> {
  const out = new Map<string, number>();
  let character = false;
  for (const [, line] of lines(text)) {
    if (/^Character devices:/.test(line)) character = true;
    else if (/^Block devices:/.test(line)) character = false;
    else if (character) {
      const m = /^\s*(\d+)\s+(\S+)$/.exec(line);
      if (m && !out.has(m[2]!)) out.set(m[2]!, Number(m[1]));
    }
  }
  return out;
}

/** `Device Minor: N` of `/proc/driver/nvidia/gpus/<bus>/information`. */
export function parseGpuInformation(text: string): number | undefined {
  const m = /^Device Minor:\s*(\d+)\s*$/m.exec(text);
  return m ? Number(m[1]) : undefined;
}

/**
 * `/proc/driver/nvidia-caps/mig-minors`: `gpu<minor>/gi<g>/access N` and
 * `gpu<minor>/gi<g>/ci<c>/access N` lines, keyed by their path.
 */
export function parseMigMinors(text: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const [, line] of lines(text)) {
    const m = /^(\S+)\s+(\d+)$/.exec(line.trim());
    if (m) out.set(m[1]!, Number(m[2]));
  }
  return out;
}

/** The procfs directory of a GPU: nvidia-smi's `00000000:18:00.0` is `0000:18:00.0` there. */
export function procGpuDir(pciBusId: string): string {
  const m = PCI_BUS_ID.exec(pciBusId);
  if (!m) throw new DsecError('invalid_argument', `not a PCI bus id: ${pciBusId}`);
  const domain = m[1]!.slice(-4).padStart(4, '0');
  return `/proc/driver/nvidia/gpus/${domain}:${m[2]}:${m[3]}.${m[4]}`.toLowerCase();
}

/** Lines of `nvidia-container-cli list` output: absolute paths, one a line. */
export function parseContainerCliList(text: string): string[] {
  return [...lines(text)].map(([, l]) => l.trim()).filter((l) => l.startsWith('/'));
}

// ---- assembling ------------------------------------------------------------------

/** The NVIDIA driver's fixed major (NV_MAJOR_DEVICE_NUMBER) when /proc/devices does not name it. */
export const NVIDIA_MAJOR = 195;

export interface GpuInventorySources {
  /** `nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,nounits`. */
  query: string;
  /** `nvidia-smi -L`. */
  list: string;
  /** Plain `nvidia-smi`: needed only when a MIG instance has a current-form UUID. */
  smi?: string | undefined;
  /** `/proc/devices`. */
  procDevices: string;
  /** `information` file of each GPU's procfs directory, by `procGpuDir(pciBusId)`. */
  gpuInformation: Record<string, string>;
  /** `/proc/driver/nvidia-caps/mig-minors`: needed only when there are MIG instances. */
  migMinors?: string | undefined;
  driverFiles: DriverFile[];
}

/**
 * Joins the parsed sources into one inventory, cross-checking them: the same
 * GPUs (UUIDs) in `--query-gpu` and `-L`, a known minor for every GPU, GI/CI
 * and capability minors for every MIG instance. Throws `unavailable` naming
 * what is missing or inconsistent; a guessed device number could hand a
 * worker someone else's GPU, so nothing is guessed.
 */
export function buildGpuInventory(src: GpuInventorySources): GpuInventory {
  const rows = parseGpuQuery(src.query);
  const listed = new Map(parseGpuList(src.list).map((g) => [g.uuid, g]));
  const majors = parseProcDevices(src.procDevices);
  const nvidiaMajor =
    majors.get('nvidia-frontend') ??
    majors.get('nvidia') ??
    majors.get('nvidiactl') ??
    NVIDIA_MAJOR;
  const uvmMajor = majors.get('nvidia-uvm');
  if (uvmMajor === undefined) {
    throw unavailable('/proc/devices has no nvidia-uvm: load it (`nvidia-modprobe -u -c=0`)');
  }
  const needsTable = rows.some(
    (r) => r.migEnabled && listed.get(r.uuid)?.mig.some((m) => !legacyMigIds(m.uuid)),
  );
  const table = needsTable ? parseMigDeviceTable(src.smi ?? '') : [];
  const capMinors = parseMigMinors(src.migMinors ?? '');
  const capsMajor = majors.get('nvidia-caps');

  const gpus = rows.map((r): GpuDevice => {
    const entry = listed.get(r.uuid);
    if (!entry || entry.index !== r.index) {
      throw unavailable(`GPU ${r.uuid} is not listed by nvidia-smi -L as index ${r.index}`);
    }
    const info = src.gpuInformation[procGpuDir(r.pciBusId)];
    const minor = info === undefined ? undefined : parseGpuInformation(info);
    if (minor === undefined) {
      throw unavailable(
        `no device minor for GPU ${r.index} in ${procGpuDir(r.pciBusId)}/information`,
      );
    }
    const migInstances = r.migEnabled
      ? entry.mig.map((m): MigInstance => {
          const ids =
            legacyMigIds(m.uuid) ??
            (() => {
              const row = table.find((t) => t.gpu === r.index && t.migDevice === m.deviceIndex);
              return row && { gi: row.gi, ci: row.ci };
            })();
          if (!ids) {
            throw unavailable(
              `MIG device ${m.deviceIndex} of GPU ${r.index} is missing from nvidia-smi's MIG devices table`,
            );
          }
          if (capsMajor === undefined) throw unavailable('/proc/devices has no nvidia-caps');
          const giKey = `gpu${minor}/gi${ids.gi}/access`;
          const ciKey = `gpu${minor}/gi${ids.gi}/ci${ids.ci}/access`;
          const gi = capMinors.get(giKey);
          const ci = capMinors.get(ciKey);
          if (gi === undefined || ci === undefined) {
            throw unavailable(
              `/proc/driver/nvidia-caps/mig-minors has no ${gi === undefined ? giKey : ciKey}`,
            );
          }
          const mem = table.find((t) => t.gpu === r.index && t.migDevice === m.deviceIndex);
          return {
            uuid: m.uuid,
            profile: m.profile,
            parentIndex: r.index,
            deviceIndex: m.deviceIndex,
            gpuInstanceId: ids.gi,
            computeInstanceId: ids.ci,
            ...(mem ? { memoryMib: mem.memoryMib } : {}),
            capNodes: [
              { path: `/dev/nvidia-caps/nvidia-cap${gi}`, major: capsMajor, minor: gi },
              { path: `/dev/nvidia-caps/nvidia-cap${ci}`, major: capsMajor, minor: ci },
            ],
          };
        })
      : [];
    return {
      index: r.index,
      uuid: r.uuid,
      name: r.name,
      memoryMib: r.memoryMib,
      pciBusId: r.pciBusId,
      migEnabled: r.migEnabled,
      node: { path: `/dev/nvidia${minor}`, major: nvidiaMajor, minor },
      migInstances,
    };
  });
  if (listed.size !== gpus.length) {
    throw unavailable(
      `nvidia-smi -L lists ${listed.size} GPUs but --query-gpu ${gpus.length}: run discovery again`,
    );
  }
  const minors = new Set(gpus.map((g) => g.node.minor));
  if (minors.size !== gpus.length) throw unavailable('two GPUs report the same device minor');
  const versions = new Set(rows.map((r) => r.driverVersion));
  if (versions.size > 1)
    throw unavailable(`GPUs report different drivers: ${[...versions].join(', ')}`);
  return {
    driverVersion: rows[0]?.driverVersion ?? '',
    gpus: gpus.sort((a, b) => a.index - b.index),
    control: {
      ctl: { path: '/dev/nvidiactl', major: nvidiaMajor, minor: 255 },
      uvm: { path: '/dev/nvidia-uvm', major: uvmMajor, minor: 0 },
      uvmTools: { path: '/dev/nvidia-uvm-tools', major: uvmMajor, minor: 1 },
      // The modeset node shares the nvidia major; its module registers its own name.
      ...(majors.has('nvidia-modeset')
        ? { modeset: { path: '/dev/nvidia-modeset', major: nvidiaMajor, minor: 254 } }
        : {}),
    },
    driverFiles: src.driverFiles,
  };
}

/** Every device node the inventory names, for checking them against the host's /dev. */
export function inventoryNodes(inv: GpuInventory): DeviceNode[] {
  const c = inv.control;
  return [
    c.ctl,
    c.uvm,
    c.uvmTools,
    ...(c.modeset ? [c.modeset] : []),
    ...inv.gpus.flatMap((g) => [g.node, ...g.migInstances.flatMap((m) => m.capNodes)]),
  ];
}

const PCI_BUS_ID = /^([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$/i;

function* lines(text: string): Generator<[number, string]> {
  let n = 0;
  for (const line of text.split('\n')) {
    n++;
    if (line.trim() !== '') yield [n, line.replace(/\r$/, '')];
  }
}

function malformed(source: string, n: number, line: string): DsecError {
  return unavailable(`cannot read line ${n} of ${source}: ${JSON.stringify(line.slice(0, 200))}`);
}

function unavailable(message: string): DsecError {
  return new DsecError('unavailable', `GPU discovery: ${message}`);
}
