import { execFile } from 'node:child_process';
import { lstat, mkdir, open, realpath, stat, symlink, writeFile } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { makeBusyboxRootfs } from '@dsec/images';

const execFileAsync = promisify(execFile);

/** The host's Debian packages a Python task needs: the interpreter, its standard library, pytest. */
export const PYTHON_PACKAGES = [
  'python3-minimal',
  'python3.11-minimal',
  'libpython3.11-minimal',
  'libpython3.11-stdlib',
  'python3-pytest',
  'python3-attr',
  'python3-more-itertools',
  'python3-pkg-resources',
  'python3-pluggy',
  'python3-py',
  'python3-iniconfig',
  'python3-packaging',
];

/** Node.js (with npm, as the nodesource package ships it). */
export const NODE_PACKAGES = ['nodejs'];
/** Copied whole: npm updates itself in place, so its files are not the ones dpkg lists. */
const NODE_TREES = ['/usr/lib/node_modules/npm'];

/** What nobody runs in a test sandbox: kept out to keep the layer small. */
const SKIPPED = [
  '/usr/share/doc/',
  '/usr/share/man/',
  '/usr/share/lintian/',
  '/usr/lib/python3.11/test/',
];

/**
 * Writes a root filesystem for test sandboxes that run real Python/pytest
 * and Node/npm tasks without a network: the host's static busybox
 * (`makeBusyboxRootfs`) plus the files of the host's own Debian packages
 * (`dpkg -L`), the bytecode Debian compiled for them, and the shared
 * libraries their programs load (`ldd`). Needs those packages installed on
 * the host (Debian 12: python3-pytest; nodejs for `node`).
 */
export async function makeToolchainRootfs(
  dir: string,
  options: { python?: boolean; node?: boolean; packages?: readonly string[] } = {},
): Promise<{ files: number }> {
  await makeBusyboxRootfs(dir);
  // Merged /usr, as Debian has it: the libraries' paths resolve through these.
  await mkdir(join(dir, 'usr/lib'), { recursive: true });
  await mkdir(join(dir, 'usr/lib64'), { recursive: true });
  await symlink('usr/lib', join(dir, 'lib'));
  await symlink('usr/lib64', join(dir, 'lib64'));
  await mkdir(join(dir, 'usr/local/bin'), { recursive: true });

  const packages = [
    ...(options.python !== false ? PYTHON_PACKAGES : []),
    ...(options.node !== false ? NODE_PACKAGES : []),
    // More of the host's Debian packages (git, bash for SWE-bench-shaped images).
    ...(options.packages ?? []),
  ];
  const listed = new Set<string>();
  for (const pkg of packages) {
    const { stdout } = await execFileAsync('dpkg', ['-L', pkg], { maxBuffer: 64 << 20 });
    for (const line of stdout.split('\n')) {
      const p = line.trim();
      if (!p.startsWith('/') || SKIPPED.some((s) => p.startsWith(s))) continue;
      listed.add(p);
    }
  }
  const files = new Set<string>();
  const elves: string[] = [];
  for (const p of listed) {
    const st = await lstat(p).catch(() => undefined);
    if (!st || st.isDirectory()) continue;
    // A merged-/usr host's `/bin` → `usr/bin` (listed by bash and git): the rootfs has its own.
    if (st.isSymbolicLink() && (await stat(p).catch(() => undefined))?.isDirectory()) continue;
    files.add(p);
    if (st.isFile() && (await isElf(p))) elves.push(p);
    if (p.endsWith('.py')) {
      // Debian's postinst compiled these; without them every run compiles pytest again.
      const cached = join(dirname(p), '__pycache__', `${basename(p, '.py')}.cpython-311.pyc`);
      if (await lstat(cached).catch(() => undefined)) files.add(cached);
    }
  }
  for (const lib of await sharedLibraries(elves)) {
    files.add(await realpath(lib));
    const asNamed = join(await realpath(dirname(lib)), basename(lib));
    files.add(asNamed);
  }
  const list = join(dir, '.files');
  await writeFile(list, [...files].sort().join('\n') + '\n');
  const trees = options.node !== false ? NODE_TREES : [];
  await execFileAsync('sh', [
    '-c',
    'set -e; tar -cf - --no-recursion -P -T "$1" 2>/dev/null | tar -xf - -C "$2" --no-same-owner; rm -f "$1"; ' +
      'shift 2; [ $# -eq 0 ] || tar -cf - -P "$@" 2>/dev/null | tar -xf - -C "$0" --no-same-owner',
    dir,
    list,
    dir,
    ...trees,
  ]);
  return { files: files.size };
}

async function isElf(path: string): Promise<boolean> {
  const fh = await open(path, 'r').catch(() => undefined);
  if (!fh) return false;
  try {
    const head = Buffer.alloc(4);
    const { bytesRead } = await fh.read(head, 0, 4, 0);
    return bytesRead === 4 && head.equals(Buffer.from([0x7f, 0x45, 0x4c, 0x46]));
  } finally {
    await fh.close();
  }
}

/** Every library `ldd` says these programs and modules load, and the dynamic loader. */
async function sharedLibraries(elves: string[]): Promise<Set<string>> {
  const libs = new Set<string>();
  for (let i = 0; i < elves.length; i += 200) {
    const { stdout } = await execFileAsync('ldd', elves.slice(i, i + 200), {
      maxBuffer: 64 << 20,
    }).catch((err: { stdout?: string }) => ({ stdout: err.stdout ?? '' }));
    for (const raw of stdout.split('\n')) {
      // `\tlibz.so.1 => /lib/…/libz.so.1 (0x…)`, `\t/lib64/ld-linux-x86-64.so.2 (0x…)`; `FILE:` heads each program.
      if (!raw.startsWith('\t')) continue;
      const line = raw.trim();
      const arrow = line.indexOf('=> ');
      const path = (arrow >= 0 ? line.slice(arrow + 3) : line).split(' (')[0]!.trim();
      if (path.startsWith('/')) libs.add(path);
    }
  }
  return libs;
}
