import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { mkdir, mkdtemp, open, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import {
  baseReleaseFrom,
  baseReleaseOfTree,
  chooseDebianSuite,
  parseOsRelease,
  readFileInRoot,
  suitesFromAptSources,
} from './debs-suite.js';

// Recorded from the images' /usr/lib/os-release (debian:11, debian:12, debian:trixie in 2026, ubuntu:22.04).
const BULLSEYE = `PRETTY_NAME="Debian GNU/Linux 11 (bullseye)"
NAME="Debian GNU/Linux"
VERSION_ID="11"
VERSION="11 (bullseye)"
VERSION_CODENAME=bullseye
ID=debian
HOME_URL="https://www.debian.org/"
`;
const BOOKWORM = `PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
`;
const TESTING = `PRETTY_NAME="Debian GNU/Linux trixie/sid"
NAME="Debian GNU/Linux"
ID=debian
`;
const UBUNTU = `PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
`;

void test('parseOsRelease reads quoted and bare values and skips the rest', () => {
  const o = parseOsRelease(`${BULLSEYE}# a comment\nnot a line\nX='single'\nY="a \\"q\\""\n`);
  assert.equal(o['VERSION_CODENAME'], 'bullseye');
  assert.equal(o['VERSION_ID'], '11');
  assert.equal(o['PRETTY_NAME'], 'Debian GNU/Linux 11 (bullseye)');
  assert.equal(o['X'], 'single');
  assert.equal(o['Y'], 'a "q"');
});

void test('a base is the suite its os-release names, by codename, release number or testing name', () => {
  assert.deepEqual(baseReleaseFrom(BULLSEYE, []), {
    id: 'debian',
    suite: 'bullseye',
    from: 'os-release',
  });
  assert.equal(baseReleaseFrom(BOOKWORM, []).suite, 'bookworm');
  assert.equal(baseReleaseFrom('ID=debian\nVERSION_ID="10"\n', []).suite, 'buster');
  assert.equal(baseReleaseFrom(TESTING, []).suite, 'trixie');
  // Not Debian: its codename is not a Debian suite.
  assert.deepEqual(baseReleaseFrom(UBUNTU, []), { id: 'ubuntu' });
  // No codename anywhere in os-release: the apt sources decide when they name one release.
  const list =
    'deb http://deb.debian.org/debian bullseye main\n' +
    'deb http://security.debian.org/debian-security bullseye-security main\n' +
    'deb http://deb.debian.org/debian bullseye-updates main\n';
  assert.deepEqual(baseReleaseFrom('ID=debian\n', [{ text: list, deb822: false }]), {
    id: 'debian',
    suite: 'bullseye',
    from: 'apt-sources',
  });
  const sources =
    'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n';
  assert.equal(baseReleaseFrom(undefined, [{ text: sources, deb822: true }]).suite, 'bookworm');
  // Sources naming two releases say nothing for sure.
  const mixed = 'deb http://x/debian bullseye main\ndeb http://x/debian bookworm main\n';
  assert.equal(baseReleaseFrom(undefined, [{ text: mixed, deb822: false }]).suite, undefined);
  assert.deepEqual(
    suitesFromAptSources('deb http://x/debian-security buster/updates main\n', false),
    ['buster'],
  );
  // A hostile os-release cannot smuggle a suite that is not a plain name.
  assert.equal(baseReleaseFrom('ID=debian\nVERSION_CODENAME="../../x y"\n', []).suite, undefined);
});

void test('chooseDebianSuite: the base decides; a recipe that contradicts it is invalid_argument', () => {
  const bullseye = baseReleaseFrom(BULLSEYE, []);
  assert.equal(chooseDebianSuite(undefined, bullseye), 'bullseye');
  assert.equal(chooseDebianSuite('bullseye', bullseye), 'bullseye');
  assert.equal(chooseDebianSuite('bullseye-backports', bullseye), 'bullseye-backports');
  assert.throws(
    () => chooseDebianSuite('bookworm', bullseye, 'py.suite'),
    (e: unknown) =>
      isDsecError(e, 'invalid_argument') &&
      e.field === 'py.suite' &&
      (e.details as { reason?: string }).reason === 'suite_mismatch' &&
      /bullseye/.test(e.message),
  );
  // A base that says nothing: bookworm, DSec's default; a named suite is taken as is.
  assert.equal(chooseDebianSuite(undefined, {}), 'bookworm');
  assert.equal(chooseDebianSuite(undefined, undefined), 'bookworm');
  assert.equal(chooseDebianSuite('trixie', {}), 'trixie');
  // Not Debian: name the suite, or be told to.
  assert.throws(
    () => chooseDebianSuite(undefined, { id: 'ubuntu' }),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === 'suite',
  );
  assert.equal(chooseDebianSuite('bookworm', { id: 'ubuntu' }), 'bookworm');
});

void test('readFileInRoot resolves links inside the tree only, whatever they point at', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-suite-'));
  try {
    const root = join(dir, 'root');
    await mkdir(join(root, 'etc'), { recursive: true });
    await mkdir(join(root, 'usr/lib'), { recursive: true });
    await writeFile(join(root, 'usr/lib/os-release'), BULLSEYE);
    await writeFile(join(dir, 'outside'), 'SECRET=1\n');
    // Debian's own relative link.
    await symlink('../usr/lib/os-release', join(root, 'etc/os-release'));
    assert.equal(await readFileInRoot(root, 'etc/os-release'), BULLSEYE);
    // An absolute link means the image's /usr/lib, never the host's (a bookworm file here).
    await symlink('/usr/lib/os-release', join(root, 'etc/abs'));
    assert.equal(await readFileInRoot(root, 'etc/abs'), BULLSEYE);
    // `..` stops at the tree's root: ../../outside is /outside of the image, which does not exist.
    await symlink('../../../../outside', join(root, 'etc/up'));
    assert.equal(await readFileInRoot(root, 'etc/up'), undefined);
    assert.equal(await readFileInRoot(root, '../outside'), undefined);
    // A link through a directory link, and one that is the host's /etc outright.
    await symlink('/usr', join(root, 'u'));
    assert.equal(await readFileInRoot(root, 'u/lib/os-release'), BULLSEYE);
    await symlink('/etc', join(root, 'hostetc'));
    assert.equal(await readFileInRoot(root, 'hostetc/os-release'), BULLSEYE); // the image's /etc
    assert.equal(await readFileInRoot(root, 'hostetc/passwd'), undefined); // not the host's
    // Loops end; a directory, a FIFO or an oversized file is no file.
    await symlink('loop2', join(root, 'loop1'));
    await symlink('loop1', join(root, 'loop2'));
    assert.equal(await readFileInRoot(root, 'loop1'), undefined);
    assert.equal(await readFileInRoot(root, 'etc'), undefined);
    execFileSync('mkfifo', [join(root, 'etc/fifo')]);
    assert.equal(await readFileInRoot(root, 'etc/fifo'), undefined);
    assert.equal(await readFileInRoot(root, 'usr/lib/os-release', 10), undefined);
    // A file used as a directory.
    assert.equal(await readFileInRoot(root, 'usr/lib/os-release/x'), undefined);
    assert.deepEqual(await baseReleaseOfTree(root), {
      id: 'debian',
      suite: 'bullseye',
      from: 'os-release',
    });
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

/**
 * Starts a watcher of IN_OPEN on `paths` (inotify through python3's ctypes)
 * and resolves, once it is watching, with a function that returns the index
 * of the first path opened. Events queue in order, so opening a sentinel
 * after the call under test tells, without any timing, whether that call
 * opened one of the others first.
 */
async function watchOpens(
  paths: string[],
): Promise<{ first: () => Promise<number>; stop: () => void }> {
  const script = [
    'import ctypes, os, struct, sys',
    'libc = ctypes.CDLL(None, use_errno=True)',
    'fd = libc.inotify_init()',
    'wds = [libc.inotify_add_watch(fd, p.encode(), 0x20) for p in sys.argv[1:]]',
    'assert all(w >= 0 for w in wds), ctypes.get_errno()',
    'print("ready", flush=True)',
    'wd = struct.unpack("iIII", os.read(fd, 4096)[:16])[0]',
    'print(wds.index(wd), flush=True)',
  ].join('\n');
  const child = spawn('/usr/bin/python3', ['-c', script, ...paths], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const lines: string[] = [];
  let wake: (() => void) | undefined;
  let text = '';
  child.stdout.setEncoding('utf8').on('data', (d: string) => {
    text += d;
    const parts = text.split('\n');
    text = parts.pop()!;
    lines.push(...parts);
    wake?.();
  });
  const line = async (): Promise<string> => {
    while (lines.length === 0) await new Promise<void>((r) => (wake = r));
    return lines.shift()!;
  };
  assert.equal(await line(), 'ready');
  return { first: async () => Number(await line()), stop: () => child.kill() };
}

void test('readFileInRoot never opens a device node or FIFO of the tree on the host', async () => {
  // fsck.erofs --extract makes a base's device nodes as real nodes on the host's disk (root
  // extracts them with mknod): opening one is opening the host's device (a disk, a tty, a
  // watchdog that reboots on an unexpected close), whatever the fstat afterwards says.
  const dir = await mkdtemp(join(tmpdir(), 'dsec-suite-'));
  try {
    const root = join(dir, 'root');
    await mkdir(join(root, 'etc'), { recursive: true });
    const sentinel = join(dir, 'sentinel');
    await writeFile(sentinel, '');
    const nodes = [join(root, 'etc/os-release')];
    execFileSync('mkfifo', [nodes[0]!]);
    if (process.getuid?.() === 0) {
      await mkdir(join(root, 'var/lib/dpkg'), { recursive: true });
      nodes.push(join(root, 'var/lib/dpkg/status'));
      execFileSync('mknod', [nodes[1]!, 'c', '1', '3']); // /dev/null's numbers: harmless to open
    }
    for (const [i, node] of nodes.entries()) {
      const watch = await watchOpens([node, sentinel]);
      try {
        // Reached directly and through a link.
        await symlink(`/${node.slice(root.length + 1)}`, join(root, `link${i}`));
        assert.equal(await readFileInRoot(root, node.slice(root.length + 1)), undefined);
        assert.equal(await readFileInRoot(root, `link${i}`), undefined);
        await (await open(sentinel, 'r')).close();
        assert.equal(await watch.first(), 1, `${node} was opened`);
      } finally {
        watch.stop();
      }
    }
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
