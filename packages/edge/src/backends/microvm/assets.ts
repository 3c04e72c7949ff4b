import { execFile, spawn } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { delimiter, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';

const execFileAsync = promisify(execFile);

/** Where the kernel and initramfs are cached unless an edge says otherwise. */
export const DEFAULT_MICROVM_ASSETS_DIR = '/var/cache/dsec/microvm';
export const QEMU_BINARY = 'qemu-system-x86_64';
/** What the initramfs's /init prints on the serial console when booted with `dsec.bare=1`. */
export const BARE_MARKER = 'DSEC-BARE-READY';

export interface MicrovmAssets {
  kernel: string;
  initramfs: string;
  /** Kernel release and agent source hash (`VERSION`). */
  version: string;
  /**
   * The agent opens virtio-serial ports hot-plugged after boot (`FEATURES`),
   * so a VM boots with its shared port only; an initramfs built before
   * that gets every port at boot.
   */
  hotplugPorts?: boolean;
}

/** The kernel and initramfs in `dir`, if both are there (nothing is built). */
export function findMicrovmAssets(dir = DEFAULT_MICROVM_ASSETS_DIR): MicrovmAssets | undefined {
  const kernel = join(dir, 'vmlinuz');
  const initramfs = join(dir, 'initramfs.cpio');
  if (!existsSync(kernel) || !existsSync(initramfs)) return undefined;
  let version = '';
  try {
    version = readFileSync(join(dir, 'VERSION'), 'utf8').trim();
  } catch {
    // built by an older script: still bootable
  }
  let features: string[] = [];
  try {
    features = readFileSync(join(dir, 'FEATURES'), 'utf8').split(/\s+/);
  } catch {
    // an initramfs from before FEATURES: none of them
  }
  return { kernel, initramfs, version, hotplugPorts: features.includes('hotplug-ports') };
}

/** The QEMU binary on PATH, or undefined. */
export function findQemu(binary = QEMU_BINARY): string | undefined {
  if (binary.includes('/')) return existsSync(binary) ? binary : undefined;
  for (const d of (process.env.PATH ?? '').split(delimiter)) {
    const p = join(d, binary);
    if (d && existsSync(p)) return p;
  }
  return undefined;
}

/**
 * build-assets.sh and the native sources it compiles the agent from: next to
 * this module in the source tree, or from the CLI bundle (packages/cli/dist)
 * in the same repository.
 */
function buildScript(): { script: string; nativeSrc: string } {
  for (const rel of ['./', '../../edge/src/backends/microvm/']) {
    const script = fileURLToPath(new URL(`${rel}build-assets.sh`, import.meta.url));
    // src/backends/microvm → packages/native/src
    if (existsSync(script))
      return { script, nativeSrc: resolve(dirname(script), '../../../../native/src') };
  }
  throw new DsecError('unavailable', 'build-assets.sh is not in this installation of dsec');
}

/**
 * Builds (or refreshes) the microVM assets in `dir` with build-assets.sh:
 * Debian's cloud kernel through `apt-get download` (never installed), and
 * an initramfs with busybox-static, the guest agent compiled from
 * packages/native/src, and the kernel modules it needs. Idempotent; only
 * rebuilds the initramfs when the agent's sources changed.
 */
export async function ensureMicrovmAssets(
  dir = DEFAULT_MICROVM_ASSETS_DIR,
  options: { signal?: AbortSignal } = {},
): Promise<MicrovmAssets> {
  const { script, nativeSrc } = buildScript();
  try {
    await execFileAsync('/bin/sh', [script, dir, nativeSrc], {
      signal: options.signal,
      maxBuffer: 4 * 2 ** 20,
    });
  } catch (err) {
    const stderr = (err as { stderr?: string }).stderr ?? '';
    throw new DsecError(
      'unavailable',
      `cannot build the microVM kernel and initramfs: ${stderr.trim() || String(err)}`,
      {
        cause: err,
      },
    );
  }
  const assets = findMicrovmAssets(dir);
  if (!assets) throw new DsecError('internal', `build-assets.sh left no kernel in ${dir}`);
  return assets;
}

export type Accel = 'kvm' | 'tcg';

/** QEMU arguments of the accelerator (TCG's translation cache kept small: it is host memory per VM). */
export function accelArgs(accel: Accel): string[] {
  return accel === 'kvm'
    ? ['-accel', 'kvm', '-cpu', 'host']
    : ['-accel', 'tcg,tb-size=64', '-cpu', 'max'];
}

/**
 * The kernel command line every microVM boots with. `tsc_early_khz`: the
 * microvm machine has no PIT speaker gate nor HPET, so without a given TSC
 * frequency a TCG guest hangs calibrating its timers (KVM guests get it
 * from CPUID and ignore this).
 */
export function kernelCmdline(extra: string[]): string {
  return ['console=ttyS0', 'quiet', 'panic=-1', 'tsc_early_khz=2000000', ...extra].join(' ');
}

export interface BareBoot {
  /** Spawn to the marker on the serial console. */
  bootMs: number;
  /**
   * CPU time QEMU (all its threads) had used at the marker: under TCG the
   * boot is CPU-bound, so this varies far less with the host's load than
   * `bootMs` does (undefined where /proc could not be read).
   */
  cpuMs?: number | undefined;
  accel: Accel;
}

/**
 * Boots the kernel and initramfs with `dsec.bare=1` (the init prints
 * {@link BARE_MARKER} and powers off) and times spawn → marker: the floor
 * a microVM sandbox's boot is compared with, and the KVM probe.
 */
export async function bootBare(
  assets: MicrovmAssets,
  options: { accel: Accel; timeoutMs: number; memoryMb?: number; qemu?: string },
): Promise<BareBoot> {
  const start = performance.now();
  const child = spawn(
    options.qemu ?? QEMU_BINARY,
    [
      '-M',
      'microvm,x-option-roms=off',
      ...accelArgs(options.accel),
      '-m',
      String(options.memoryMb ?? 128),
      '-smp',
      '1',
      '-nodefaults',
      '-no-user-config',
      '-display',
      'none',
      '-no-reboot',
      '-kernel',
      assets.kernel,
      '-initrd',
      assets.initramfs,
      '-append',
      kernelCmdline(['dsec.bare=1']),
      '-serial',
      'stdio',
    ],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  try {
    return await new Promise<BareBoot>((resolveBoot, reject) => {
      let seen = '';
      const timer = setTimeout(
        () =>
          reject(
            new DsecError('deadline_exceeded', `no boot marker after ${options.timeoutMs} ms`),
          ),
        options.timeoutMs,
      );
      child.stdout.on('data', (chunk: Buffer) => {
        seen = (seen + chunk.toString('latin1')).slice(-4096);
        if (seen.includes(BARE_MARKER)) {
          clearTimeout(timer);
          const bootMs = performance.now() - start;
          resolveBoot({ bootMs, cpuMs: processCpuMs(child.pid), accel: options.accel });
        }
      });
      child.stderr.resume();
      child.on('error', (err) => {
        clearTimeout(timer);
        reject(err);
      });
      child.on('exit', (code, sig) => {
        clearTimeout(timer);
        reject(new DsecError('unavailable', `qemu exited (${code ?? sig}) before the boot marker`));
      });
    });
  } finally {
    child.kill('SIGKILL');
  }
}

/** utime + stime of a process (all threads), from /proc/PID/stat, in ms (USER_HZ is 100 on Linux). */
export function processCpuMs(pid: number | undefined): number | undefined {
  if (pid === undefined) return undefined;
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(fields[11]) + Number(fields[12])) * 10;
  } catch {
    return undefined;
  }
}

const probed = new Map<string, Promise<Accel>>();

/**
 * KVM or TCG, decided by booting the bare initramfs under KVM with a
 * timeout: `/dev/kvm` alone proves nothing (PVM-style nested KVM here
 * accepts the VM and then hangs stock kernels, or fails on MSRs). Once per
 * process and kernel.
 */
export function probeAccel(
  assets: MicrovmAssets,
  options: { timeoutMs?: number } = {},
): Promise<Accel> {
  const key = `${assets.kernel}\0${assets.version}`;
  let p = probed.get(key);
  if (!p) {
    p = existsSync('/dev/kvm')
      ? bootBare(assets, { accel: 'kvm', timeoutMs: options.timeoutMs ?? 10_000 }).then(
          () => 'kvm' as const,
          () => 'tcg' as const,
        )
      : Promise.resolve('tcg' as const);
    probed.set(key, p);
  }
  return p;
}
