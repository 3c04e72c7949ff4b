/**
 * `dsec doctor`: what this host offers DSec, each check with how to fix it.
 * Probes do the real thing (mount an EROFS image, an idmapped overlay over
 * it, a swap file) in a directory of their own and undo it, even on failure.
 */
import { execFile } from 'node:child_process';
import { constants, existsSync } from 'node:fs';
import {
  access,
  chown,
  mkdir,
  mkdtemp,
  open,
  readFile,
  rm,
  stat,
  writeFile,
} from 'node:fs/promises';
import { release, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { helperPath, mountErofs, mountRootfs, unmount } from '@dsec/native';
import { kernelHasFileBackedErofs, kernelVersion, probeErofsMount } from './layers/erofs-mount.js';

const execFileAsync = promisify(execFile);

export interface DoctorCheck {
  name: string;
  ok: boolean;
  /** What was found (versions, which way works). */
  detail: string;
  /** How to fix a failure ('' when ok). */
  fix: string;
  /** A failed required check makes `dsec doctor` exit non-zero; others degrade a feature. */
  required: boolean;
}

export interface DoctorOptions {
  /** The edge's state dir: probes run on its filesystem when it exists (else in the temp dir). */
  stateDir: string;
  /** Where the sandbox shell comes from (default /bin/busybox). */
  shellBinary?: string;
  /** Host paths, replaceable by tests. */
  paths?: Partial<DoctorPaths>;
}

export interface DoctorPaths {
  procFilesystems: string;
  meminfo: string;
  cgroupRoot: string;
  devKvm: string;
  kvmPvmModule: string;
  inotifyInstances: string;
}

const DEFAULT_PATHS: DoctorPaths = {
  procFilesystems: '/proc/filesystems',
  meminfo: '/proc/meminfo',
  cgroupRoot: '/sys/fs/cgroup',
  devKvm: '/dev/kvm',
  kvmPvmModule: '/sys/module/kvm_pvm',
  inotifyInstances: '/proc/sys/fs/inotify/max_user_instances',
};

/** True when some required check failed (`dsec doctor` exits 1). */
export function doctorFailed(checks: DoctorCheck[]): boolean {
  return checks.some((c) => c.required && !c.ok);
}

/** Idmapped probe ownership: any unprivileged uid works; this one is far above edge slots'. */
const PROBE_HOST_ID = 100_000 + 61_000 * 65_536;
const MIN_KERNEL: [number, number] = [5, 15];

/** Runs every check; never throws (a check that crashes reports its error). */
export async function runDoctor(options: DoctorOptions): Promise<DoctorCheck[]> {
  const paths = { ...DEFAULT_PATHS, ...options.paths };
  const checks: DoctorCheck[] = [];
  const add = (c: DoctorCheck) => checks.push(c.ok ? { ...c, fix: '' } : c);
  const isRoot = process.getuid?.() === 0;

  add({
    name: 'root',
    ok: isRoot,
    detail: isRoot ? 'running as root' : `running as uid ${process.getuid?.()}`,
    fix: 'run `sudo dsec doctor`: the edge mounts layers, makes cgroups, namespaces and nftables rules as root',
    required: true,
  });
  add(kernelCheck());
  const helper = await helperCheck();
  add(helper);
  const mkfs = await mkfsErofsVersion();
  add({
    name: 'erofs-utils',
    ok: mkfs.ok,
    detail: mkfs.ok ? mkfs.version : mkfs.error,
    fix: 'apt-get install erofs-utils (mkfs.erofs builds, imports and snapshots layers)',
    required: true,
  });

  const base = existsSync(options.stateDir) ? resolve(options.stateDir) : tmpdir();
  const work = await mkdtemp(join(base, '.dsec-doctor-'));
  try {
    const canProbe = isRoot && helper.ok && mkfs.ok;
    const why = !isRoot ? 'needs root' : !helper.ok ? 'needs dsec-helper' : 'needs mkfs.erofs';
    const mounts = await mountChecks(join(work, 'mounts'), canProbe ? undefined : why, paths).catch(
      (err: unknown): DoctorCheck[] => [
        {
          name: 'erofs-file-backed',
          ok: false,
          detail: `the mount probe failed: ${errorText(err)}`,
          fix: 'see the error; `dsec up --erofs-mount loop|file` forces a way',
          required: true,
        },
      ],
    );
    for (const c of mounts) add(c);
  } finally {
    await rm(work, { recursive: true, force: true });
  }
  add(await cgroupCheck(paths.cgroupRoot));
  add(await inotifyCheck(paths.inotifyInstances));
  add(await nftablesCheck(isRoot));
  add(await runtimeCheck());
  add(await swapCheck(options.stateDir, isRoot, paths.meminfo));
  add(await kvmCheck(paths));
  add(await busyboxCheck(options.shellBinary ?? '/bin/busybox'));
  const deboot = await toolVersion('debootstrap', ['--version']);
  add({
    name: 'debootstrap',
    ok: deboot.ok,
    detail: deboot.ok ? deboot.version : deboot.error,
    fix: 'apt-get install debootstrap (only for `dsec image build --from-debootstrap`)',
    required: false,
  });
  return checks;
}

function kernelCheck(): DoctorCheck {
  const v = kernelVersion();
  const ok = v[0] > MIN_KERNEL[0] || (v[0] === MIN_KERNEL[0] && v[1] >= MIN_KERNEL[1]);
  return {
    name: 'kernel',
    ok,
    detail: `Linux ${release()}${
      kernelHasFileBackedErofs(v)
        ? ''
        : ' (before 6.12: layers mount through loop devices, not file-backed)'
    }`,
    fix: `upgrade to Linux ${MIN_KERNEL.join('.')} or newer (Debian 12's 6.1 works; 6.12+ mounts layers without loop devices)`,
    required: true,
  };
}

async function helperCheck(): Promise<DoctorCheck> {
  const path = helperPath();
  const ok = await access(path, constants.X_OK).then(
    () => true,
    () => false,
  );
  return {
    name: 'dsec-helper',
    ok,
    detail: ok ? path : `${path} is missing or not executable`,
    fix: 'apt-get install build-essential libseccomp-dev libcap-dev && make -C packages/native',
    required: true,
  };
}

/** EROFS both ways, loop devices, overlayfs, idmapped mounts: one probe image, layered checks. */
async function mountChecks(
  dir: string,
  skipReason: string | undefined,
  paths: DoctorPaths,
): Promise<DoctorCheck[]> {
  const fileFix =
    'Linux 6.12+ built with CONFIG_EROFS_FS_BACKED_BY_FILE; until then layers mount through loop devices (automatic; `dsec up --erofs-mount loop` forces it)';
  const loopFix =
    'modprobe loop (CONFIG_BLK_DEV_LOOP); in a container, pass /dev/loop-control and /dev/loop* through';
  const overlayFix = 'modprobe overlay (CONFIG_OVERLAY_FS)';
  const idmapFix =
    'Linux 5.19+ with idmapped mounts for EROFS and overlayfs lowers (mount_setattr MOUNT_ATTR_IDMAP)';
  if (skipReason) {
    const skipped = (name: string, fix: string, required: boolean): DoctorCheck => ({
      name,
      ok: false,
      detail: `not probed: ${skipReason}`,
      fix,
      required,
    });
    return [
      skipped('erofs-file-backed', fileFix, false),
      skipped('loop-devices', loopFix, true),
      await overlayListed(paths.procFilesystems, overlayFix),
      skipped('idmapped-mounts', idmapFix, true),
    ];
  }
  const probe = await probeErofsMount(join(dir, 'erofs'));
  const checks: DoctorCheck[] = [
    {
      name: 'erofs-file-backed',
      ok: probe.file,
      detail: probe.file
        ? 'file-backed EROFS mounts work (no loop device per layer)'
        : `file-backed EROFS mount failed: ${probe.fileError}`,
      fix: fileFix,
      // Loop devices stand in for it.
      required: !probe.loop,
    },
    {
      name: 'loop-devices',
      ok: probe.loop,
      detail: probe.loop
        ? `EROFS through an auto-clearing loop device works${probe.file ? ' (used for disk-quota upper layers)' : ' (layers use it: file-backed mounts fail)'}`
        : `loop-device EROFS mount failed: ${probe.loopError}`,
      fix: loopFix,
      // Layers need it where file-backed mounts fail; disk quotas always do.
      required: !probe.file,
    },
  ];
  if (!probe.file && !probe.loop) {
    const noLayer = 'not probed: no way to mount an EROFS layer';
    checks.push(await overlayListed(paths.procFilesystems, overlayFix), {
      name: 'idmapped-mounts',
      ok: false,
      detail: noLayer,
      fix: idmapFix,
      required: true,
    });
    return checks;
  }
  checks.push(...(await overlayChecks(dir, probe.file ? 'file' : 'loop', overlayFix, idmapFix)));
  return checks;
}

async function overlayListed(procFilesystems: string, fix: string): Promise<DoctorCheck> {
  const listed = (await readFile(procFilesystems, 'utf8').catch(() => '')).includes('\toverlay\n');
  return {
    name: 'overlayfs',
    ok: listed,
    detail: listed
      ? 'overlay is in /proc/filesystems (not probed)'
      : 'overlay is not in /proc/filesystems',
    fix,
    required: true,
  };
}

/**
 * Mounts the probe layer, then a sandbox-style overlay over it (plain, then
 * with the layer idmapped to an unprivileged range) and checks ownership.
 */
async function overlayChecks(
  dir: string,
  way: 'file' | 'loop',
  overlayFix: string,
  idmapFix: string,
): Promise<DoctorCheck[]> {
  const d = (n: string) => join(dir, n);
  const src = d('src');
  const layer = d('layer');
  await mkdir(join(src, 'etc'), { recursive: true });
  await writeFile(join(src, 'etc', 'probe'), 'probe\n');
  for (const n of ['layer', 'root', 'upper', 'work', 'iroot', 'iupper', 'iwork']) await mkdir(d(n));
  await chown(d('iupper'), PROBE_HOST_ID, PROBE_HOST_ID);
  await chown(d('iwork'), PROBE_HOST_ID, PROBE_HOST_ID);
  const mounted: string[] = [];
  try {
    await execFileAsync('mkfs.erofs', ['--quiet', d('image'), src]);
    await mountErofs(d('image'), layer, { loop: way === 'loop' });
    mounted.push(layer);
    let overlay: DoctorCheck;
    try {
      await mountRootfs({ target: d('root'), upper: d('upper'), work: d('work'), lowers: [layer] });
      mounted.push(d('root'));
      await writeFile(d('root/etc/written'), 'x');
      const ok = (await readFile(d('upper/etc/written'), 'utf8')) === 'x';
      overlay = {
        name: 'overlayfs',
        ok,
        detail: ok
          ? 'an overlay over an EROFS layer mounts and copies up'
          : 'copy-up did not reach the upper dir',
        fix: overlayFix,
        required: true,
      };
    } catch (err) {
      overlay = {
        name: 'overlayfs',
        ok: false,
        detail: errorText(err),
        fix: overlayFix,
        required: true,
      };
    }
    let idmap: DoctorCheck;
    try {
      await mountRootfs({
        target: d('iroot'),
        upper: d('iupper'),
        work: d('iwork'),
        lowers: [layer],
        idmap: { hostId: PROBE_HOST_ID, size: 65_536 },
      });
      mounted.push(d('iroot'));
      const owner = (await stat(d('iroot/etc/probe'))).uid;
      const ok = owner === PROBE_HOST_ID;
      idmap = {
        name: 'idmapped-mounts',
        ok,
        detail: ok
          ? 'an idmapped EROFS layer under overlayfs shows the sandbox range'
          : `layer files show uid ${owner}, want ${PROBE_HOST_ID}`,
        fix: idmapFix,
        required: true,
      };
    } catch (err) {
      idmap = {
        name: 'idmapped-mounts',
        ok: false,
        detail: errorText(err),
        fix: idmapFix,
        required: true,
      };
    }
    return [overlay, idmap];
  } finally {
    await unmount(mounted.reverse(), { detach: true }).catch(() => undefined);
  }
}

async function cgroupCheck(root: string): Promise<DoctorCheck> {
  const fix =
    'boot with the memory, cpu and pids controllers enabled (cgroup v2: systemd.unified_cgroup_hierarchy=1; v1: cgroup_enable=memory)';
  const v2Controllers = await readFile(join(root, 'cgroup.controllers'), 'utf8').catch(
    () => undefined,
  );
  if (v2Controllers !== undefined) {
    const have = v2Controllers.trim().split(/\s+/).filter(Boolean);
    const missing = ['memory', 'cpu', 'pids'].filter((c) => !have.includes(c));
    return {
      name: 'cgroups',
      ok: missing.length === 0,
      detail: `v2 (unified): ${have.join(', ')}${missing.length ? `; missing ${missing.join(', ')}` : ''}`,
      fix,
      required: true,
    };
  }
  const v1 = ['memory', 'cpu', 'cpuacct', 'pids', 'cpuset', 'freezer'].filter((c) =>
    existsSync(join(root, c)),
  );
  const hybrid = existsSync(join(root, 'unified')) ? ' hybrid' : '';
  const missing = ['memory', 'cpu', 'pids', 'freezer'].filter((c) => !v1.includes(c));
  return {
    name: 'cgroups',
    ok: v1.length > 0 && missing.length === 0,
    detail:
      v1.length === 0
        ? `no cgroup hierarchy under ${root}`
        : `v1${hybrid}: ${v1.join(', ')}${missing.length ? `; missing ${missing.join(', ')} (freezer: pause)` : ''}`,
    fix,
    required: true,
  };
}

/** Below this, a node of many sandboxes runs short of inotify instances. */
const MIN_INOTIFY_INSTANCES = 1024;

/**
 * Sandboxes' user namespaces are created by the host's root, so every inotify
 * instance made in any sandbox (an agent's file watcher, a FnCall worker's
 * zygote) also counts against root's `fs.inotify.max_user_instances`, 128 by
 * default: a handful of watching sandboxes exhaust it for all of them and for
 * root's own daemons.
 */
async function inotifyCheck(path: string): Promise<DoctorCheck> {
  const text = await readFile(path, 'utf8').catch(() => undefined);
  const max = text === undefined ? Number.NaN : Number.parseInt(text, 10);
  return {
    name: 'inotify',
    ok: max >= MIN_INOTIFY_INSTANCES,
    detail: Number.isNaN(max)
      ? `${path} cannot be read`
      : `fs.inotify.max_user_instances = ${max}, shared by every sandbox and the host's root`,
    fix: `sysctl -w fs.inotify.max_user_instances=8192 (and a file in /etc/sysctl.d to keep it); below ${MIN_INOTIFY_INSTANCES}, file watchers in sandboxes fail once a few hold instances, and FnCall workers past a quarter of it clean up after every call`,
    required: false,
  };
}

async function nftablesCheck(isRoot: boolean): Promise<DoctorCheck> {
  const fix =
    'apt-get install nftables iproute2 util-linux coreutils and modprobe nf_tables; without them sandboxes get loopback only (no egress policy)';
  const version = await toolVersion('nft', ['--version']);
  if (!version.ok)
    return { name: 'nftables', ok: false, detail: version.error, fix, required: false };
  if (!isRoot)
    return {
      name: 'nftables',
      ok: false,
      detail: `${version.version}; not probed: needs root`,
      fix,
      required: false,
    };
  const tables = await toolVersion('nft', ['list', 'tables']);
  const others = await Promise.all(
    [
      ['ip', '-V'],
      ['nsenter', '--version'],
      ['stdbuf', '--version'],
    ].map(async ([cmd, arg]) => ({ cmd, r: await toolVersion(cmd!, [arg!]) })),
  );
  const missing = others.filter((o) => !o.r.ok).map((o) => o.cmd);
  return {
    name: 'nftables',
    ok: tables.ok && missing.length === 0,
    detail: !tables.ok
      ? `${version.version}; nft list tables failed: ${tables.error}`
      : missing.length
        ? `${version.version}; missing ${missing.join(', ')}`
        : `${version.version}; the kernel answers (sandbox networks isolated)`,
    fix,
    required: false,
  };
}

async function runtimeCheck(): Promise<DoctorCheck> {
  const [runc, crun] = await Promise.all([
    toolVersion('runc', ['--version']),
    toolVersion('crun', ['--version']),
  ]);
  const parts = [
    runc.ok ? runc.version : 'runc: not found',
    crun.ok ? `${crun.version} (the default where installed)` : 'crun: not installed',
  ];
  return {
    name: 'runc',
    ok: runc.ok || crun.ok,
    detail: parts.join('; '),
    fix: 'apt-get install runc (or crun: faster starts)',
    required: true,
  };
}

/** SwapTotal from /proc/meminfo, in bytes. */
export function swapTotalBytes(meminfo: string): number {
  const m = /^SwapTotal:\s+(\d+)\s+kB$/m.exec(meminfo);
  return m ? Number(m[1]) * 1024 : 0;
}

/**
 * Pause pushes memory to swap; the edge adds swap files under its state dir
 * (lifecycle/swap-area.ts: fallocate, mkswap, swapon). Probes that with a
 * small file on the state dir's filesystem (some, e.g. btrfs without nocow,
 * tmpfs, overlay, refuse swap files).
 */
async function swapCheck(stateDir: string, isRoot: boolean, meminfo: string): Promise<DoctorCheck> {
  const fix =
    'put the state dir on a filesystem that takes swap files (ext4, xfs), or add host swap; without swap a pause keeps the sandbox in memory';
  const total = swapTotalBytes(await readFile(meminfo, 'utf8').catch(() => ''));
  const have = total > 0 ? `host swap ${Math.round(total / 2 ** 20)} MiB` : 'no host swap';
  if (!isRoot)
    return {
      name: 'swap-for-pause',
      ok: total > 0,
      detail: `${have}; swap files not probed: needs root`,
      fix,
      required: false,
    };
  let dir = resolve(stateDir);
  while (!existsSync(dir)) dir = dirname(dir);
  const file = join(dir, `.dsec-doctor-swap-${process.pid}`);
  let on = false;
  try {
    await (await open(file, 'wx', 0o600)).close();
    await execFileAsync('fallocate', ['-l', String(4 * 2 ** 20), file]);
    await execFileAsync('mkswap', [file]);
    await execFileAsync('swapon', [file]);
    on = true;
    return {
      name: 'swap-for-pause',
      ok: true,
      detail: `${have}; the edge can add swap files in ${dir}`,
      fix,
      required: false,
    };
  } catch (err) {
    return {
      name: 'swap-for-pause',
      ok: total > 0,
      detail: `${have}; swap files in ${dir} fail: ${errorText(err)}`,
      fix,
      required: false,
    };
  } finally {
    if (on) await execFileAsync('swapoff', [file]).catch(() => undefined);
    await rm(file, { force: true });
  }
}

async function kvmCheck(paths: DoctorPaths): Promise<DoctorCheck> {
  const fix =
    'only for microVM sandboxes: enable virtualization (kvm_intel/kvm_amd), or on a cloud VM without nested virtualization load PVM (kvm_pvm)';
  if (!existsSync(paths.devKvm))
    return { name: 'kvm', ok: false, detail: `${paths.devKvm} is missing`, fix, required: false };
  // Stock guest kernels hang on PVM: the microVM backend's boot probe then picks TCG.
  const pvm = existsSync(paths.kvmPvmModule)
    ? ' (PVM: stock guest kernels may hang on it; microVMs boot under TCG when the probe fails)'
    : '';
  try {
    await (await open(paths.devKvm, 'r+')).close();
    return {
      name: 'kvm',
      ok: true,
      detail: `${paths.devKvm} opens read-write${pvm}`,
      fix,
      required: false,
    };
  } catch (err) {
    return {
      name: 'kvm',
      ok: false,
      detail: `${paths.devKvm}${pvm}: ${errorText(err)}`,
      fix,
      required: false,
    };
  }
}

/**
 * The sandbox shell is bind-mounted from the host into images that may have
 * no libc, so it must be a static binary: an ELF without a PT_INTERP header.
 */
export function elfIsStatic(head: Buffer): boolean | undefined {
  if (head.length < 64 || head.readUInt32BE(0) !== 0x7f454c46 || head[4] !== 2 || head[5] !== 1)
    return undefined; // not a little-endian ELF64
  const phoff = Number(head.readBigUInt64LE(32));
  const phentsize = head.readUInt16LE(54);
  const phnum = head.readUInt16LE(56);
  if (phoff + phentsize * phnum > head.length) return undefined;
  for (let i = 0; i < phnum; i++) {
    if (head.readUInt32LE(phoff + i * phentsize) === 3 /* PT_INTERP */) return false;
  }
  return true;
}

async function busyboxCheck(path: string): Promise<DoctorCheck> {
  const fix = 'apt-get install busybox-static (the shell inside sandboxes)';
  let head: Buffer;
  try {
    const fh = await open(path, 'r');
    try {
      head = Buffer.alloc(4096);
      const { bytesRead } = await fh.read(head, 0, head.length, 0);
      head = head.subarray(0, bytesRead);
    } finally {
      await fh.close();
    }
  } catch (err) {
    return {
      name: 'busybox-static',
      ok: false,
      detail: `${path}: ${errorText(err)}`,
      fix,
      required: true,
    };
  }
  const isStatic = elfIsStatic(head);
  return {
    name: 'busybox-static',
    ok: isStatic === true,
    detail:
      isStatic === true
        ? `${path} is statically linked`
        : isStatic === false
          ? `${path} is dynamically linked (images without its libc could not run it)`
          : `${path} is not an x86-64/arm64 ELF binary`,
    fix,
    required: true,
  };
}

/** erofs-utils before 1.6 have no --version: `--help` proves it runs; the probe's mkfs prints the version. */
async function mkfsErofsVersion(): Promise<Awaited<ReturnType<typeof toolVersion>>> {
  const v = await toolVersion('mkfs.erofs', ['--version']);
  if (v.ok) return v;
  const help = await toolVersion('mkfs.erofs', ['--help']);
  return help.ok ? { ok: true, version: 'mkfs.erofs (before 1.6: no --version)' } : v;
}

/** First line of `cmd args` output, or why it could not run (one line). */
async function toolVersion(
  cmd: string,
  args: string[],
): Promise<{ ok: true; version: string } | { ok: false; error: string }> {
  try {
    const { stdout, stderr } = await execFileAsync(cmd, args, { timeout: 10_000 });
    const line = (stdout || stderr).split('\n').find((l) => l.trim()) ?? '';
    return { ok: true, version: line.trim() || cmd };
  } catch (err) {
    const e = err as NodeJS.ErrnoException & { stderr?: string };
    if (e.code === 'ENOENT') return { ok: false, error: `${cmd}: not found` };
    const why = (e.stderr ?? '').split('\n').find((l) => l.trim()) ?? e.message;
    return { ok: false, error: `${cmd} ${args.join(' ')}: ${why.trim()}` };
  }
}

function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}
