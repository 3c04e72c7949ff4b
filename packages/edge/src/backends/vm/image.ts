import { execFile } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';

const execFileAsync = promisify(execFile);

/** Where the VM image is cached unless an edge says otherwise. */
export const DEFAULT_VM_IMAGE_DIR = '/var/cache/dsec/vm';

export interface VmImage {
  /** The raw ext4 root filesystem: every sandbox's read-only backing file. */
  disk: string;
  /** The image's kernel and initramfs, booted directly (the image has no bootloader). */
  kernel: string;
  initrd: string;
  /** The kernel command line. */
  cmdline: string;
  /** Kernel release, build hash and features (`VERSION`). */
  version: string;
}

/**
 * The kernel command line of a full VM: root on the first virtio disk,
 * messages on the serial console (the sandbox's console.log), no
 * predictable interface names (the image's dsec-root configures `eth0`),
 * and no boot splash. The backend appends the sandbox's own words
 * (`dsec.layers=`, `dsec.pids=`, `dsec.net=`, `dsec.dns=`).
 */
export const VM_CMDLINE = [
  'root=/dev/vda',
  'rw',
  'console=ttyS0',
  'quiet',
  'panic=-1',
  'systemd.show_status=0',
  'net.ifnames=0',
].join(' ');

/**
 * What an image must say it does (the last words of `VERSION`): mount the
 * sandbox's own image as its root. An image built before served the VM's
 * Debian as the root and ignored the spec's image and disk limit, so it is
 * not offered until `ensureVmImage` (build-image.sh) rebuilt it.
 */
const REQUIRED_FEATURES = ['spec-root'];

/** The built image in `dir`, if complete and of this backend's kind (nothing is built). */
export function findVmImage(dir = DEFAULT_VM_IMAGE_DIR): VmImage | undefined {
  const disk = join(dir, 'disk.img');
  const kernel = join(dir, 'vmlinuz');
  const initrd = join(dir, 'initrd.img');
  const versionFile = join(dir, 'VERSION');
  if (![disk, kernel, initrd, versionFile].every((f) => existsSync(f))) return undefined;
  const version = readFileSync(versionFile, 'utf8').trim();
  const words = version.split(/\s+/);
  if (!REQUIRED_FEATURES.every((f) => words.slice(2).includes(f))) return undefined;
  return { disk, kernel, initrd, cmdline: VM_CMDLINE, version };
}

function buildScript(): { script: string; nativeSrc: string } {
  for (const rel of ['./', '../../edge/src/backends/vm/']) {
    const script = fileURLToPath(new URL(`${rel}build-image.sh`, import.meta.url));
    if (existsSync(script))
      return { script, nativeSrc: resolve(dirname(script), '../../../../native/src') };
  }
  throw new DsecError('unavailable', 'build-image.sh is not in this installation of dsec');
}

/**
 * Builds (or finds up to date) the VM disk image in `dir` with
 * build-image.sh: debootstrap, Debian's kernel, Xorg, an xterm and the
 * guest agent (minutes, and the Debian mirror; idempotent).
 */
export async function ensureVmImage(
  dir = DEFAULT_VM_IMAGE_DIR,
  options: { signal?: AbortSignal; mirror?: string } = {},
): Promise<VmImage> {
  const { script, nativeSrc } = buildScript();
  try {
    await execFileAsync(
      '/bin/sh',
      [script, dir, nativeSrc, ...(options.mirror ? [options.mirror] : [])],
      { signal: options.signal, maxBuffer: 4 * 2 ** 20, killSignal: 'SIGTERM' },
    );
  } catch (err) {
    const stderr = (err as { stderr?: string }).stderr ?? '';
    throw new DsecError(
      'unavailable',
      `cannot build the VM image: ${stderr.trim() || String(err)}`,
      {
        cause: err,
      },
    );
  }
  const image = findVmImage(dir);
  if (!image) throw new DsecError('internal', `build-image.sh left no image in ${dir}`);
  return image;
}
