import { execFile } from 'node:child_process';
import { readdir, readFile, realpath, stat } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { DsecError } from '@dsec/core';
import {
  buildGpuInventory,
  GPU_QUERY_FIELDS,
  inventoryNodes,
  legacyMigIds,
  parseContainerCliList,
  parseGpuList,
  parseGpuQuery,
  procGpuDir,
} from './inventory.js';
import type { DriverFile, GpuInventory } from './inventory.js';

/**
 * What discovery reads of the host. `nodeGpuHostProbe()` is the real one;
 * tests pass one that answers from fixture text (`gpu-fixtures.ts`).
 */
export interface GpuHostProbe {
  /** Runs `file args`; resolves its stdout; rejects when it cannot start or exits non-zero. */
  run(file: string, args: readonly string[], options: { timeoutMs: number }): Promise<string>;
  /** Rejects when the file cannot be read. */
  readFile(path: string): Promise<string>;
  /** Major and minor of the character device at `path`; undefined when absent or not one. */
  charDevice(path: string): Promise<{ major: number; minor: number } | undefined>;
  /** Every symlink directly in `dir`, with the absolute path it finally resolves to. */
  symlinksIn(dir: string): Promise<{ name: string; resolved: string }[]>;
}

export interface GpuDiscoveryOptions {
  probe?: GpuHostProbe | undefined;
  /** Default `nvidia-smi` (found on PATH). */
  nvidiaSmi?: string | undefined;
  /**
   * Lists the driver's files (`list --libraries`, `list --binaries`).
   * Default `nvidia-container-cli`; `false`: do not run it, and give
   * `driverLibraries` instead.
   */
  containerCli?: string | false | undefined;
  /** Absolute host paths of the driver libraries; when given, the container CLI's list is not asked for. */
  driverLibraries?: readonly string[] | undefined;
  /**
   * Driver programs a worker gets: absolute host paths, or names picked from
   * the container CLI's `--binaries` list. Default `['nvidia-smi']`.
   */
  binaries?: readonly string[] | undefined;
  /** Per command. Default 30 000 (nvidia-smi can be slow when persistence mode is off). */
  commandTimeoutMs?: number | undefined;
}

/**
 * Builds this host's `GpuInventory` (inventory.ts) from `nvidia-smi`,
 * procfs and the driver's file list, then checks that every device node it
 * names exists in the host's /dev with the numbers it computed (the runtime
 * bind-mounts these nodes into a worker's user namespace, so they must
 * exist). Throws `unavailable` with what is missing; a host without a usable
 * NVIDIA driver fails at the first `nvidia-smi` call.
 */
export async function discoverGpuInventory(
  options: GpuDiscoveryOptions = {},
): Promise<GpuInventory> {
  const probe = options.probe ?? nodeGpuHostProbe();
  const smi = options.nvidiaSmi ?? 'nvidia-smi';
  const timeoutMs = options.commandTimeoutMs ?? 30_000;
  const run = (file: string, args: string[]) =>
    probe.run(file, args, { timeoutMs }).catch((err: unknown) => {
      throw new DsecError('unavailable', `GPU discovery: ${file} ${args.join(' ')} failed`, {
        cause: err,
      });
    });
  const read = (path: string) =>
    probe.readFile(path).catch((err: unknown) => {
      throw new DsecError('unavailable', `GPU discovery: cannot read ${path}`, { cause: err });
    });

  const query = await run(smi, [
    `--query-gpu=${GPU_QUERY_FIELDS.join(',')}`,
    '--format=csv,noheader,nounits',
  ]);
  const list = await run(smi, ['-L']);
  const rows = parseGpuQuery(query);
  const listed = parseGpuList(list);
  const migRows = rows.filter((r) => r.migEnabled);
  const migUuids = listed
    .filter((g) => migRows.some((r) => r.uuid === g.uuid))
    .flatMap((g) => g.mig.map((m) => m.uuid));
  const gpuInformation: Record<string, string> = {};
  for (const r of rows) {
    const dir = procGpuDir(r.pciBusId);
    gpuInformation[dir] = await read(`${dir}/information`);
  }
  const inventory = buildGpuInventory({
    query,
    list,
    smi: migUuids.some((u) => !legacyMigIds(u)) ? await run(smi, []) : undefined,
    procDevices: await read('/proc/devices'),
    gpuInformation,
    migMinors: migUuids.length > 0 ? await read('/proc/driver/nvidia-caps/mig-minors') : undefined,
    driverFiles: await discoverDriverFiles(probe, options, run),
  });
  // The modeset node is optional (display only, never given by default): absent, it is dropped.
  const modeset = inventory.control.modeset;
  if (modeset && !(await probe.charDevice(modeset.path))) delete inventory.control.modeset;
  await checkInventoryNodes(inventory, probe);
  return inventory;
}

/**
 * Checks that every device node `inventory` names exists on the host as a
 * character device with the numbers it records: the runtime bind-mounts
 * these nodes into a worker's user namespace. Throws `unavailable` naming
 * the first one that does not.
 */
export async function checkInventoryNodes(
  inventory: GpuInventory,
  probe: GpuHostProbe = nodeGpuHostProbe(),
): Promise<void> {
  for (const node of inventoryNodes(inventory)) {
    const found = await probe.charDevice(node.path);
    if (!found) {
      throw new DsecError(
        'unavailable',
        `GPU discovery: ${node.path} does not exist (create the nodes: nvidia-modprobe -u -c=0, ` +
          'nvidia-modprobe -c=<minor>, or nvidia-ctk system create-device-nodes)',
      );
    }
    if (found.major !== node.major || found.minor !== node.minor) {
      throw new DsecError(
        'unavailable',
        `GPU discovery: ${node.path} is ${found.major}:${found.minor}, expected ${node.major}:${node.minor}`,
      );
    }
  }
}

async function discoverDriverFiles(
  probe: GpuHostProbe,
  options: GpuDiscoveryOptions,
  run: (file: string, args: string[]) => Promise<string>,
): Promise<DriverFile[]> {
  const cli = options.containerCli ?? 'nvidia-container-cli';
  const wanted = options.binaries ?? ['nvidia-smi'];
  let libraries = options.driverLibraries;
  if (!libraries) {
    if (cli === false) {
      throw new DsecError(
        'unavailable',
        'GPU discovery: give driverLibraries when the container CLI is turned off',
      );
    }
    libraries = parseContainerCliList(await run(cli, ['list', '--libraries']));
  }
  const needListed = wanted.some((b) => !b.startsWith('/'));
  const listedBinaries =
    needListed && cli !== false
      ? parseContainerCliList(await run(cli, ['list', '--binaries']))
      : [];
  const binaries = wanted.map((b) => {
    if (b.startsWith('/')) return b;
    const hit = listedBinaries.find((p) => basename(p) === b);
    if (!hit) throw new DsecError('unavailable', `GPU discovery: the driver has no program ${b}`);
    return hit;
  });
  if (libraries.length === 0)
    throw new DsecError('unavailable', 'GPU discovery: no driver libraries');
  const symlinks = new Map<string, { name: string; resolved: string }[]>();
  const out: DriverFile[] = [];
  for (const path of libraries) {
    if (!path.startsWith('/')) {
      throw new DsecError('invalid_argument', `driver library ${path} is not an absolute path`, {
        field: 'driverLibraries',
      });
    }
    const dir = dirname(path);
    let links = symlinks.get(dir);
    if (!links) {
      links = await probe.symlinksIn(dir);
      symlinks.set(dir, links);
    }
    const aliases = links
      .filter((l) => l.resolved === path && l.name !== basename(path))
      .map((l) => l.name)
      .sort();
    out.push({ hostPath: path, kind: 'library', names: [basename(path), ...aliases] });
  }
  for (const path of binaries)
    out.push({ hostPath: path, kind: 'binary', names: [basename(path)] });
  return out;
}

/** The real host: child processes, procfs, stat of /dev. */
export function nodeGpuHostProbe(): GpuHostProbe {
  return {
    run: (file, args, { timeoutMs }) =>
      new Promise((resolve, reject) => {
        execFile(
          file,
          [...args],
          { timeout: timeoutMs, maxBuffer: 16 * 1024 * 1024, encoding: 'utf8' },
          (err, stdout, stderr) => {
            if (err) reject(new Error(`${err.message}${stderr ? `: ${stderr.trim()}` : ''}`));
            else resolve(stdout);
          },
        );
      }),
    readFile: (path) => readFile(path, 'utf8'),
    async charDevice(path) {
      const st = await stat(path, { bigint: true }).catch(() => undefined);
      if (!st?.isCharacterDevice()) return undefined;
      // glibc's gnu_dev_major / gnu_dev_minor.
      const dev = st.rdev;
      const major = Number(((dev >> 8n) & 0xfffn) | ((dev >> 32n) & ~0xfffn));
      const minor = Number((dev & 0xffn) | ((dev >> 12n) & ~0xffn));
      return { major, minor };
    },
    async symlinksIn(dir) {
      const entries = await readdir(dir, { withFileTypes: true }).catch(() => []);
      const out: { name: string; resolved: string }[] = [];
      for (const e of entries) {
        if (!e.isSymbolicLink()) continue;
        const resolved = await realpath(join(dir, e.name)).catch(() => undefined);
        if (resolved) out.push({ name: e.name, resolved });
      }
      return out;
    },
  };
}
