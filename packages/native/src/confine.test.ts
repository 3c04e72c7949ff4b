import assert from 'node:assert/strict';
import { execFile, spawn } from 'node:child_process';
import {
  chmod,
  link,
  lstat,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  readlink,
  rm,
  symlink,
  truncate,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { promisify } from 'node:util';
import {
  confinedCommand,
  confinedTreeCommand,
  removeTree,
  runConfined,
  sandboxViewTreeCommand,
} from './index.js';

const execFileAsync = promisify(execFile);
const skip =
  process.getuid?.() !== 0 ? 'needs root (mount namespaces, openat2 on real trees)' : false;

/** A scratch dir with a host "victim" directory next to the trees under test. */
async function scratch(): Promise<{
  dir: string;
  root: string;
  victim: string;
  done(): Promise<void>;
}> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-confine-'));
  const root = join(dir, 'root');
  const victim = join(dir, 'victim');
  await mkdir(root);
  await mkdir(join(victim, 'sub'), { recursive: true });
  await writeFile(join(victim, 'secret'), 'host secret\n');
  await writeFile(join(victim, 'sub', 'file'), 'host file\n');
  return { dir, root, victim, done: () => rm(dir, { recursive: true, force: true }) };
}

async function listing(root: string): Promise<string[]> {
  const out: string[] = [];
  const walk = async (rel: string): Promise<void> => {
    for (const name of (await readdir(join(root, rel))).sort()) {
      const r = rel ? `${rel}/${name}` : name;
      const st = await lstat(join(root, r));
      out.push(`${r} ${st.mode.toString(8)} ${st.nlink}`);
      if (st.isDirectory()) await walk(r);
      else if (st.isFile()) out.push(await readFile(join(root, r), 'utf8'));
    }
  };
  await walk('');
  return out;
}

async function mountCount(): Promise<number> {
  return (await readFile('/proc/self/mountinfo', 'utf8')).split('\n').length;
}

void test(
  'confine: the program sees only its trees; no symlink on them is followed, in any component',
  { skip },
  async () => {
    const s = await scratch();
    try {
      const tree = join(s.dir, 'tree');
      await mkdir(join(tree, 'real'), { recursive: true });
      await writeFile(join(tree, 'real', 'f'), 'mine\n');
      await symlink(s.victim, join(tree, 'abs'));
      await symlink(`${'../'.repeat(20)}${s.victim.slice(1)}`, join(tree, 'rel'));
      await symlink('real', join(tree, 'inside'));
      const mounts = await mountCount();
      const run = (program: string[]) =>
        runConfined(
          confinedCommand(
            { rootDir: s.root, trees: [{ path: tree, name: 't' }], tools: true },
            program,
          ),
        );

      const ok = await run(['cat', '/t/real/f']);
      assert.equal(ok.stdout, 'mine\n');
      for (const through of ['/t/abs/secret', '/t/rel/secret', '/t/inside/f', '/t/abs/sub/file']) {
        const r = await run(['cat', through]);
        assert.notEqual(r.exitCode, 0, through);
        assert.match(r.stderr, /Too many levels of symbolic links/, through);
      }
      // The root holds the trees and the tools, nothing else of the host.
      const names = (await run(['ls', '-A', '/'])).stdout.trim().split('\n');
      assert.ok(names.includes('t') && names.includes('usr'), names.join(' '));
      for (const host of ['etc', 'tmp', 'dev', 'root', 'home', 'sys'])
        assert.ok(!names.includes(host), `no ${host} in the root`);
      // Its /proc is its own pid namespace's: the init and the program, no host process, no sysctl.
      const procs = (await run(['ls', '-A', '/proc'])).stdout.trim().split('\n');
      assert.deepEqual(
        procs.filter((n) => /^\d+$/.test(n)),
        ['1', '2'],
      );
      assert.notEqual((await run(['ls', '/proc/sys'])).exitCode, 0, 'no /proc/sys');
      // A read-only tree takes no write; the root takes none either.
      assert.notEqual((await run(['touch', '/t/new'])).exitCode, 0);
      assert.notEqual((await run(['mkdir', '/x'])).exitCode, 0);
      assert.deepEqual(await readdir(s.root), [], 'the host sees the root dir empty');
      assert.equal(await mountCount(), mounts, 'nothing mounted on the host');
      assert.deepEqual(await listing(s.victim), [
        'secret 100644 1',
        'host secret\n',
        'sub 40755 2',
        'sub/file 100644 1',
        'host file\n',
      ]);
    } finally {
      await s.done();
    }
  },
);

void test(
  'confine: cp -a keeps read-only directory modes; what the program leaves running ends with it',
  { skip },
  async () => {
    const s = await scratch();
    try {
      // Every Debian root has 0555 /proc and /sys: cp makes them writable to fill them, then
      // sets the mode without following a link, which glibc does through /proc/self/fd.
      const src = join(s.dir, 'src');
      const dst = join(s.dir, 'dst');
      await mkdir(join(src, 'proc'), { recursive: true });
      await mkdir(join(src, 'ro', 'inner'), { recursive: true });
      await writeFile(join(src, 'ro', 'inner', 'f'), 'x');
      await chmod(join(src, 'ro'), 0o555);
      await chmod(join(src, 'proc'), 0o555);
      await mkdir(dst);
      const copy = await runConfined(
        confinedCommand(
          {
            rootDir: s.root,
            trees: [
              { path: src, name: 'src' },
              { path: dst, name: 'dst', writable: true },
            ],
            tools: true,
          },
          ['cp', '-a', '--', '/src/.', '/dst/'],
        ),
      );
      assert.equal(copy.exitCode, 0, copy.stderr);
      assert.equal((await lstat(join(dst, 'proc'))).mode & 0o7777, 0o555);
      assert.equal((await lstat(join(dst, 'ro'))).mode & 0o7777, 0o555);
      assert.equal(await readFile(join(dst, 'ro', 'inner', 'f'), 'utf8'), 'x');

      const marker = `dsec-confine-left-${process.pid}`;
      const left = await runConfined(
        confinedCommand({ rootDir: s.root, trees: [], tools: true }, [
          'sh',
          '-c',
          `exec -a ${marker} sleep 300 & exit 3`,
        ]),
      );
      assert.equal(left.exitCode, 3, "the program's status comes back");
      const { stdout } = await execFileAsync('ps', ['-eo', 'args']);
      assert.ok(!stdout.includes(marker), 'nothing it started outlives it');
    } finally {
      await s.done();
    }
  },
);

void test(
  'tree scan counts entries, bytes once per inode and holes, and stops at a cap',
  { skip },
  async () => {
    const s = await scratch();
    try {
      const tree = join(s.dir, 'tree');
      await mkdir(join(tree, 'a', 'b'), { recursive: true });
      await writeFile(join(tree, 'a', 'b', 'f'), 'x'.repeat(1000));
      await link(join(tree, 'a', 'b', 'f'), join(tree, 'hard'));
      await writeFile(join(tree, 'sparse'), '');
      await truncate(join(tree, 'sparse'), 64 * 2 ** 20);
      await symlink(s.victim, join(tree, 'link'));
      const scan = async (...caps: string[]) =>
        runConfined(
          confinedTreeCommand({ rootDir: s.root, trees: [{ path: tree, name: 't' }] }, [
            'scan',
            '/t',
            ...caps,
          ]),
        );
      const all = await scan();
      assert.equal(all.exitCode, 0, all.stderr);
      assert.match(all.stdout, /^files 6$/m); // a, a/b, a/b/f, hard, sparse, link
      assert.match(all.stdout, new RegExp(`^bytes ${64 * 2 ** 20 + 1000}$`, 'm'));
      assert.match(all.stdout, new RegExp(`^holes ${64 * 2 ** 20}$`, 'm'));
      assert.match(all.stdout, /^depth 2$/m);
      for (const [cap, over] of [
        [['--max-files', '3'], 'files'],
        [['--max-bytes', '4096'], 'bytes'],
        [['--max-depth', '1'], 'depth'],
        [['--max-path', '3'], 'path'],
      ] as const) {
        const r = await scan(...cap);
        assert.equal(r.exitCode, 3, `${cap.join(' ')}: ${r.stdout}`);
        assert.match(r.stdout, new RegExp(`^over ${over}$`, 'm'));
      }
    } finally {
      await s.done();
    }
  },
);

void test(
  'tree rm removes any depth without following links, also while the tree changes',
  { skip },
  async () => {
    const s = await scratch();
    try {
      const tree = join(s.dir, 'tree');
      await mkdir(tree);
      // 3000 levels (past PATH_MAX and past the walk's fd depth), links to the victim along the way.
      await execFileAsync('python3', [
        '-c',
        `import os
fd = os.open(${JSON.stringify(tree)}, os.O_RDONLY)
for i in range(3000):
    os.mkdir('d', dir_fd=fd)
    if i % 500 == 0:
        os.symlink(${JSON.stringify(s.victim)}, 'v', dir_fd=fd)
    n = os.open('d', os.O_RDONLY, dir_fd=fd); os.close(fd); fd = n
os.symlink(${JSON.stringify(s.victim)}, 'deepest', dir_fd=fd)`,
      ]);
      // Something keeps swapping a directory for a link to the victim while it goes.
      await mkdir(join(tree, 'swap'));
      const racer = spawn('sh', [
        '-c',
        `while :; do rm -rf "$1/swap" 2>/dev/null; ln -s "$2" "$1/swap" 2>/dev/null; rm -f "$1/swap"; mkdir -p "$1/swap/x" 2>/dev/null; done`,
        'sh',
        tree,
        s.victim,
      ]);
      try {
        await removeTree(tree).catch(() => undefined); // the racer may recreate entries meanwhile
      } finally {
        racer.kill('SIGKILL');
        await new Promise((r) => racer.once('exit', r));
      }
      await removeTree(tree);
      await assert.rejects(lstat(tree));
      assert.deepEqual(await listing(s.victim), [
        'secret 100644 1',
        'host secret\n',
        'sub 40755 2',
        'sub/file 100644 1',
        'host file\n',
      ]);
      await removeTree(tree); // missing is fine
    } finally {
      await s.done();
    }
  },
);

void test(
  'tree shadow and scrub look layers up as overlayfs does and never follow a link',
  { skip },
  async () => {
    const s = await scratch();
    try {
      // Lowers, top first: l0 (a snapshot: root is a link to the victim, etc opaque), l1 (an image).
      const l0 = join(s.dir, 'l0');
      const l1 = join(s.dir, 'l1');
      await mkdir(join(l0, 'etc'), { recursive: true });
      await execFileAsync('setfattr', ['-n', 'trusted.overlay.opaque', '-v', 'y', join(l0, 'etc')]);
      await symlink(s.victim, join(l0, 'root'));
      await execFileAsync('mknod', [join(l0, 'gone'), 'c', '0', '0']);
      await mkdir(join(l1, 'root', '.ssh'), { recursive: true });
      await writeFile(join(l1, 'root', '.ssh', 'id'), 'key\n');
      await mkdir(join(l1, 'etc'), { recursive: true });
      await writeFile(join(l1, 'etc', 'passwd'), 'root\n');
      await writeFile(join(l1, 'gone'), 'deleted above\n');
      await mkdir(join(l1, 'home', 'user'), { recursive: true });
      await writeFile(join(l1, 'home', 'user', '.profile'), 'p\n');
      await chmod(join(l1, 'home', 'user'), 0o750);
      const lowers = [
        { path: l0, name: 'l0' },
        { path: l1, name: 'l1' },
      ];
      const patterns = [
        '--path',
        'root/.ssh/id',
        '--subtree',
        'root/.ssh',
        '--path',
        'etc/passwd',
        '--path',
        'gone',
        '--subtree',
        'home/user',
        '--path',
        'home/user/.profile',
      ];
      const shadow = await runConfined(
        confinedTreeCommand({ rootDir: s.root, trees: lowers }, [
          'shadow',
          '--lower',
          '/l0',
          '--lower',
          '/l1',
          ...patterns,
        ]),
      );
      assert.equal(shadow.exitCode, 0, shadow.stderr);
      // Behind l0's link, under its opaque etc, under its whiteout: hidden. home/user shows through.
      assert.deepEqual(shadow.stdout.trim().split('\n'), ['4', '5']);

      // The copy being scrubbed: a link where a pattern's directory would be, a whiteout in the way.
      const copy = join(s.dir, 'copy');
      await mkdir(copy);
      await symlink(s.victim, join(copy, 'home'));
      const scrub = await runConfined(
        confinedTreeCommand(
          { rootDir: s.root, trees: [{ path: copy, name: 't', writable: true }, ...lowers] },
          [
            'scrub',
            '/t',
            '--host-id',
            '100000',
            '--lower',
            '/l0',
            '--lower',
            '/l1',
            '--path',
            'home/user/.profile',
            '--subtree',
            'home/user',
            '--path',
            'root/.ssh/id',
            '--subtree',
            'nothing',
          ],
        ),
      );
      assert.equal(scrub.exitCode, 0, scrub.stderr);
      assert.equal(await readlink(join(copy, 'home')), s.victim, 'the link stays a link');
      assert.deepEqual(await readdir(copy), ['home']);
      assert.deepEqual(await listing(s.victim), [
        'secret 100644 1',
        'host secret\n',
        'sub 40755 2',
        'sub/file 100644 1',
        'host file\n',
      ]);

      // Without the link in the way, directories are made as the lower shows them, in the sandbox's range.
      await rm(join(copy, 'home'));
      const again = await runConfined(
        confinedTreeCommand(
          { rootDir: s.root, trees: [{ path: copy, name: 't', writable: true }, ...lowers] },
          [
            'scrub',
            '/t',
            '--host-id',
            '100000',
            '--lower',
            '/l0',
            '--lower',
            '/l1',
            '--path',
            'home/user/.profile',
          ],
        ),
      );
      assert.equal(again.exitCode, 0, again.stderr);
      const user = await lstat(join(copy, 'home', 'user'));
      assert.equal(user.mode & 0o7777, 0o750);
      assert.equal(user.uid, 100000 + 0);
      const wh = await lstat(join(copy, 'home', 'user', '.profile'));
      assert.ok(wh.isCharacterDevice() && wh.rdev === 0 && wh.uid === 100000);
    } finally {
      await s.done();
    }
  },
);

void test(
  "chmod-node in a process's own mount namespace: only a device node there, never through a link",
  { skip },
  async () => {
    const s = await scratch();
    await mkdir(join(s.dir, 'ns'));
    // A process in a mount namespace of its own with a tmpfs "/dev"-like directory.
    const holder = spawn('unshare', [
      '--mount',
      '--propagation',
      'private',
      'sh',
      '-c',
      `mount -t tmpfs none "$1" && mknod -m 0600 "$1/node" c 1 3 && ln -s "$2" "$1/link" && echo ready && exec sleep 60`,
      'sh',
      join(s.dir, 'ns'),
      s.victim,
    ]);
    try {
      const ready = await new Promise<string>((resolve) =>
        holder.stdout.once('data', (b: Buffer) => resolve(String(b))),
      );
      assert.equal(ready.trim(), 'ready');
      const pid = holder.pid!;
      const chmodNode = async (path: string) =>
        (
          await runConfined(sandboxViewTreeCommand({ initPid: pid }, ['chmod-node', path, '666']))
        ).stdout.trim();
      assert.equal(await chmodNode(join(s.dir, 'ns', 'node')), 'changed');
      assert.equal(await chmodNode(join(s.dir, 'ns', 'node')), 'same');
      assert.equal(await chmodNode(join(s.dir, 'ns', 'link', 'secret')), 'absent');
      assert.equal(await chmodNode(join(s.dir, 'ns', 'link')), 'absent');
      assert.equal((await lstat(join(s.victim, 'secret'))).mode & 0o777, 0o644);
    } finally {
      holder.kill('SIGKILL');
      await s.done();
    }
  },
);
