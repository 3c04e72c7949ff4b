import { execFile } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import { readdir, readFile, rmdir } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { LinuxNetwork } from '@dsec/edge';

const execFileAsync = promisify(execFile);

/** What a node left on the host after every sandbox was removed (all zero when clean). */
export interface HostLeftovers {
  /** Mounts at or under the bench's work directory. */
  mounts: number;
  /** Cgroups under the node's cgroup parent, in every hierarchy. */
  cgroups: number;
  /** Host ends of the sandboxes' veth pairs. */
  veths: number;
  /** Elements in the sets and maps of the edge's nftables table. */
  nftElements: number;
  /** Processes whose command line names the work directory or that sit in the node's cgroups. */
  processes: number;
  /** Per-sandbox directories and files left in the edge's state directory. */
  directories: number;
}

export interface LeftoverScope {
  /** The bench's work directory (state dir and everything else below it). */
  workDir: string;
  /** The edge's state directory (`<node state>/edge`). */
  edgeStateDir: string;
  /** The node's cgroup parent (`startSingleNode({ cgroupParent })`), without slashes. */
  cgroupParent: string;
  /** Host-side veth names of every sandbox the bench made. */
  veths: Iterable<string>;
  /** The edge's nftables table (`inet <table>`), if it networks sandboxes. */
  nftTable?: string | undefined;
  /**
   * Mounts under these are not counted: the node's shared layer mounts,
   * which stay (cached) while it runs and go when it closes.
   */
  sharedMountDirs?: string[] | undefined;
}

/** The larger of two counts, key by key (a node counted while running and after it closed). */
export function worstOf(a: HostLeftovers, b: HostLeftovers): HostLeftovers {
  const out = { ...a };
  for (const k of Object.keys(out) as (keyof HostLeftovers)[]) out[k] = Math.max(a[k], b[k]);
  return out;
}

/**
 * What a node's removed sandboxes left: counted while the node still runs
 * (its nftables table exists; its shared layer mounts stay cached, so they
 * are not counted) and again after `close` (everything must be gone); the
 * worse of the two, key by key.
 */
export async function leftoversAcrossClose(
  node: { edge: { options: { network?: unknown } } },
  scope: { workDir: string; edgeStateDir: string; cgroupParent: string; sandboxIds: string[] },
  close: () => Promise<void>,
): Promise<HostLeftovers> {
  const net = node.edge.options.network;
  const counted: LeftoverScope = {
    ...scope,
    veths:
      net instanceof LinuxNetwork
        ? scope.sandboxIds.map((id) => net.names({ id, slot: 0 }).veth)
        : [],
    nftTable: net instanceof LinuxNetwork ? net.table : undefined,
  };
  // A stopped sandbox's veth goes a few tens of milliseconds after its stop returned.
  if (net instanceof LinuxNetwork) await net.drained();
  const running = await countLeftovers({
    ...counted,
    sharedMountDirs: [join(scope.edgeStateDir, 'layers'), join(scope.edgeStateDir, 'blobs')],
  });
  await close();
  return worstOf(running, await countLeftovers(counted));
}

/** Counts what is left of a node's sandboxes on the host (see {@link HostLeftovers}). */
export async function countLeftovers(scope: LeftoverScope): Promise<HostLeftovers> {
  return {
    mounts: await countMounts(scope.workDir, scope.sharedMountDirs ?? []),
    cgroups: await countCgroups(scope.cgroupParent),
    veths: [...scope.veths].filter((v) => existsSync(`/sys/class/net/${v}`)).length,
    nftElements: scope.nftTable ? await countNftElements(scope.nftTable) : 0,
    processes: await countProcesses(scope.workDir, scope.cgroupParent),
    directories: await countStateEntries(scope.edgeStateDir),
  };
}

async function countMounts(dir: string, shared: string[]): Promise<number> {
  const under = (p: string, d: string) => p === d || p.startsWith(d + '/');
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  let n = 0;
  for (const line of text.split('\n')) {
    const point = unescapeMountPath(line.split(' ')[4] ?? '');
    if (point && under(point, dir) && !shared.some((d) => under(point, d))) n++;
  }
  return n;
}

/** The parent's directory in every hierarchy (v1 controllers, v1 named and unified ones, or v2). */
function cgroupParentDirs(parent: string): string[] {
  const root = '/sys/fs/cgroup';
  const hierarchies = readdirSync(root, { withFileTypes: true })
    .filter((e) => e.isDirectory())
    .map((e) => join(root, e.name, parent));
  return [join(root, parent), ...hierarchies].filter((d) => existsSync(d));
}

async function countCgroups(parent: string): Promise<number> {
  let n = 0;
  for (const dir of cgroupParentDirs(parent)) {
    for (const e of await readdir(dir, { withFileTypes: true }).catch(() => [])) {
      if (e.isDirectory()) n++;
    }
  }
  return n;
}

/**
 * Detaches whatever is still mounted under a bench's work directory (a node
 * that failed to release its layers), deepest first, so the directory can go.
 */
export async function detachMountsUnder(dir: string): Promise<void> {
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  const points = text
    .split('\n')
    .map((line) => unescapeMountPath(line.split(' ')[4] ?? ''))
    .filter((p) => p === dir || p.startsWith(dir + '/'))
    .sort((a, b) => b.length - a.length);
  for (const p of points) await execFileAsync('umount', ['-l', p]).catch(() => undefined);
}

function unescapeMountPath(p: string): string {
  return p.replace(/\\(\d{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
}

/**
 * Removes a bench's cgroup parent (`a`, or `a/b` for a peer's own) in every
 * hierarchy, then its ancestors while they are empty (a runtime removes a
 * container's cgroup, never the parent it was put in). rmdir refuses a cgroup
 * that holds tasks or children, so nothing in use goes.
 */
export async function removeCgroupParent(parent: string): Promise<void> {
  for (let p = parent; p !== '.' && p !== '/' && p !== ''; p = dirname(p)) {
    for (const dir of cgroupParentDirs(p)) await rmdir(dir).catch(() => undefined);
  }
}

async function countNftElements(table: string): Promise<number> {
  const out = await execFileAsync('nft', ['-j', 'list', 'table', 'inet', table]).catch(
    () => undefined, // no table: nothing left in it
  );
  if (!out) return 0;
  const parsed = JSON.parse(out.stdout) as {
    nftables: { set?: { name: string; elem?: unknown[] }; map?: { elem?: unknown[] } }[];
  };
  let n = 0;
  for (const obj of parsed.nftables) {
    // The protected ranges are the node's own (filled at start), not a sandbox's leftovers.
    if (obj.set?.name.startsWith('protected')) continue;
    n += (obj.set?.elem ?? obj.map?.elem ?? []).length;
  }
  return n;
}

async function countProcesses(dir: string, cgroupParent: string): Promise<number> {
  let n = 0;
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    const cmdline = await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '');
    const cgroup = await readFile(`/proc/${entry}/cgroup`, 'utf8').catch(() => '');
    if (cmdline.includes(dir) || cgroup.includes(`/${cgroupParent}/`)) n++;
  }
  return n;
}

/** Entries left in the edge's per-sandbox directories (sandboxes, runtime state, resolv.conf files). */
async function countStateEntries(edgeStateDir: string): Promise<number> {
  let n = 0;
  for (const sub of ['sandboxes', 'runtime', join('network', 'resolv')]) {
    n += (await readdir(join(edgeStateDir, sub)).catch(() => [])).length;
  }
  return n;
}
