import { chmod, copyFile, lchown, mkdir, open, symlink, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { DsecError, throwIfAborted } from '@dsec/core';
import { runTool } from '../util/run-tool.js';
import { prepareEmptyDir } from './prepare-dir.js';

export interface BusyboxRootfsOptions {
  /** The static busybox to install (default `/bin/busybox`). */
  busyboxPath?: string;
  signal?: AbortSignal;
}

export interface BusyboxRootfsResult {
  /** Applet paths linked to `/bin/busybox`, relative to the root (`bin/sh`, `usr/bin/awk`…). */
  applets: string[];
  version: string;
}

const DIRS: [string, number][] = [
  ['bin', 0o755],
  ['sbin', 0o755],
  ['usr', 0o755],
  ['usr/bin', 0o755],
  ['usr/sbin', 0o755],
  ['etc', 0o755],
  ['root', 0o700],
  ['home', 0o755],
  ['home/user', 0o755],
  ['tmp', 0o1777],
  ['var', 0o755],
  ['var/tmp', 0o1777],
  ['proc', 0o555],
  ['sys', 0o555],
  ['dev', 0o755],
  ['run', 0o755],
];

// The unprivileged account sandboxes may run as (`initUser: 'user'`).
const USER_UID = 1000;

/**
 * Writes a minimal root filesystem around the host's static busybox into
 * `dir` (created, or empty): `/bin/busybox`, one absolute symlink per applet
 * at the path busybox names for it, the usual top-level directories and the
 * files programs expect in `/etc` (root, `user` 1000 and `nobody` 65534).
 * Everything is owned by root except `/home/user`, which its user must be
 * able to write. Ownership is only set when running as root.
 */
export async function makeBusyboxRootfs(
  dir: string,
  options: BusyboxRootfsOptions = {},
): Promise<BusyboxRootfsResult> {
  const busybox = options.busyboxPath ?? '/bin/busybox';
  const { signal } = options;
  await assertStatic(busybox);
  const applets = await listApplets(busybox, signal);
  const version = await busyboxVersion(busybox, signal);
  await prepareEmptyDir(dir);
  throwIfAborted(signal);

  const chown = process.getuid?.() === 0 ? lchown : async (): Promise<void> => undefined;
  await chown(dir, 0, 0);
  for (const [d, mode] of DIRS) {
    const path = join(dir, d);
    await mkdir(path, { mode });
    await chmod(path, mode); // mkdir's mode passes through the umask; 1777 must be exact.
    await chown(path, d === 'home/user' ? USER_UID : 0, d === 'home/user' ? USER_UID : 0);
  }

  const target = join(dir, 'bin/busybox');
  await copyFile(busybox, target);
  await chmod(target, 0o755);
  await chown(target, 0, 0);

  const linked: string[] = [];
  for (const applet of applets) {
    if (applet === 'bin/busybox') continue;
    const path = join(dir, applet);
    await mkdir(dirname(path), { recursive: true, mode: 0o755 });
    try {
      await symlink('/bin/busybox', path);
    } catch (err) {
      // Some builds list an applet twice; one link is enough.
      if ((err as NodeJS.ErrnoException).code === 'EEXIST') continue;
      throw err;
    }
    await chown(path, 0, 0);
    linked.push(applet);
  }

  const files: [string, string, number][] = [
    [
      'etc/passwd',
      'root:x:0:0:root:/root:/bin/sh\n' +
        `user:x:${USER_UID}:${USER_UID}:user:/home/user:/bin/sh\n` +
        'nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n',
      0o644,
    ],
    ['etc/group', `root:x:0:\nuser:x:${USER_UID}:\nnogroup:x:65534:\n`, 0o644],
    [
      'etc/shadow',
      'root:*:0:0:99999:7:::\nuser:*:0:0:99999:7:::\nnobody:*:0:0:99999:7:::\n',
      0o640,
    ],
    ['etc/hosts', '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n', 0o644],
    ['etc/hostname', 'sandbox\n', 0o644],
    [
      'etc/os-release',
      'NAME="BusyBox"\nID=busybox\n' +
        `VERSION_ID=${version}\nPRETTY_NAME="BusyBox ${version}"\nHOME_URL="https://busybox.net/"\n`,
      0o644,
    ],
    [
      'etc/profile',
      'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n',
      0o644,
    ],
  ];
  for (const [name, content, mode] of files) {
    const path = join(dir, name);
    await writeFile(path, content, { mode });
    await chmod(path, mode);
    await chown(path, 0, 0);
  }
  return { applets: linked.sort(), version };
}

async function listApplets(busybox: string, signal: AbortSignal | undefined): Promise<string[]> {
  let lines: string[];
  try {
    lines = (await runTool(busybox, ['--list-full'], { signal })).stdout.split('\n');
  } catch (err) {
    // Builds without --list-full: put every applet in /bin.
    if ((err as DsecError).code === 'aborted') throw err;
    lines = (await runTool(busybox, ['--list'], { signal })).stdout
      .split('\n')
      .map((a) => `bin/${a}`);
  }
  const applets = lines.map((l) => l.trim().replace(/^\/+/, '')).filter((l) => l !== '');
  for (const a of applets) {
    // An applet path comes from the binary; keep it inside the rootfs.
    if (a.split('/').some((part) => part === '..' || part === '' || part === '.')) {
      throw new DsecError('internal', `busybox lists a strange applet path: ${a}`);
    }
  }
  return applets;
}

async function busyboxVersion(busybox: string, signal: AbortSignal | undefined): Promise<string> {
  // `busybox` with no arguments prints its banner and exits 0 on Debian's build; some exit 1.
  const out = await runTool(busybox, ['--help'], { signal }).catch((err: unknown) => {
    const msg = err instanceof Error ? err.message : '';
    return { stdout: msg, stderr: '' };
  });
  const m = /BusyBox v([0-9][0-9A-Za-z.+~-]*)/.exec(out.stdout + out.stderr);
  return m?.[1] ?? 'unknown';
}

/**
 * A dynamically linked busybox would not run inside the rootfs, so refuse
 * an ELF with a program interpreter (PT_INTERP).
 */
async function assertStatic(path: string): Promise<void> {
  const fh = await open(path, 'r').catch((err: unknown) => {
    throw new DsecError('invalid_argument', `cannot read ${path}`, {
      field: 'busyboxPath',
      cause: err,
    });
  });
  try {
    const header = Buffer.alloc(64);
    await fh.read(header, 0, 64, 0);
    if (header.readUInt32BE(0) !== 0x7f454c46 || header[4] !== 2 || header[5] !== 1) {
      throw new DsecError('invalid_argument', `${path} is not a 64-bit little-endian ELF`, {
        field: 'busyboxPath',
      });
    }
    const phoff = Number(header.readBigUInt64LE(32));
    const phentsize = header.readUInt16LE(54);
    const phnum = header.readUInt16LE(56);
    const table = Buffer.alloc(phentsize * phnum);
    await fh.read(table, 0, table.length, phoff);
    for (let i = 0; i < phnum; i++) {
      if (table.readUInt32LE(i * phentsize) === 3) {
        throw new DsecError(
          'invalid_argument',
          `${path} is dynamically linked; use a static busybox`,
          {
            field: 'busyboxPath',
          },
        );
      }
    }
  } finally {
    await fh.close();
  }
}
