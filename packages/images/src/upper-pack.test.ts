import assert from 'node:assert/strict';
import { chown, lstat, mkdir, readdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { shiftErofsIds } from './erofs-ids.js';
import { listOpaqueDirs, makeWhiteout, setOpaque } from './overlay/marks.js';
import { isRoot, tempDir } from './testing/fixtures.js';
import { packUpperDir, parseScrubPatterns, scrubCopy } from './upper-pack.js';
import { runTool } from './util/run-tool.js';
import { treeStats } from './walk.js';

const HOST_ID = 165_536;

void test('scrub patterns: absolute paths, optionally DIR/**; anything else is invalid_argument', () => {
  assert.deepEqual(parseScrubPatterns(['/a/b', '/tmp/build/**', '/**']), [
    { pattern: '/a/b', rel: 'a/b', subtree: false },
    { pattern: '/tmp/build/**', rel: 'tmp/build', subtree: true },
    { pattern: '/**', rel: '', subtree: true },
  ]);
  for (const bad of ['a/b', '/a/../b', '/a//b', '/a/*.txt', '/', '/a/./b', ''])
    assert.throws(
      () => parseScrubPatterns([bad]),
      (err) => isDsecError(err, 'invalid_argument') && err.field === 'scrub.0',
      bad,
    );
});

/** An upper directory as overlayfs leaves it, owned by the sandbox's host ids. */
async function makeUpper(upper: string): Promise<void> {
  await mkdir(join(upper, 'big'), { recursive: true });
  // Enough entries that the directory spans several blocks.
  for (let i = 0; i < 400; i++) await writeFile(join(upper, 'big', `file-${i}`), `${i}\n`);
  await mkdir(join(upper, 'opaque'));
  await setOpaque(join(upper, 'opaque'));
  await writeFile(join(upper, 'opaque', 'only'), 'only\n');
  await makeWhiteout(join(upper, 'deleted'));
  await writeFile(join(upper, 'secret'), 'secret\n');
  await mkdir(join(upper, 'build', 'obj'), { recursive: true });
  await writeFile(join(upper, 'build', 'obj', 'x.o'), 'x\n');
  await writeFile(join(upper, 'user'), 'user\n');
  await writeFile(join(upper, 'stranger'), 'stranger\n');
  const walk = async (dir: string): Promise<void> => {
    await chown(dir, HOST_ID, HOST_ID);
    for (const e of await readdir(dir, { withFileTypes: true })) {
      if (e.isDirectory()) await walk(join(dir, e.name));
      else await chown(join(dir, e.name), HOST_ID, HOST_ID);
    }
  };
  await walk(upper);
  await chown(join(upper, 'user'), HOST_ID + 1000, HOST_ID + 1001);
  await chown(join(upper, 'stranger'), 4242, 4242); // outside the sandbox's range
}

void test(
  'an upper directory packs into a layer with its marks, scrubbed, owners shifted to the sandbox ids',
  {
    skip: !isRoot && 'needs root (whiteouts, trusted xattrs, chown)',
  },
  async () => {
    const { dir, cleanup } = await tempDir();
    try {
      const upper = join(dir, 'upper');
      await makeUpper(upper);
      const image = join(dir, 'layer.erofs');
      await mkdir(join(dir, 'croot'));
      await packUpperDir(
        {
          source: { dir: upper },
          output: image,
          exclude: parseScrubPatterns(['/secret', '/build/**']),
        },
        { rootDir: join(dir, 'croot') },
      );
      const stats = await shiftErofsIds(image, { hostId: HOST_ID, count: 65536 });

      // fsck.erofs checks the superblock checksum we rewrote, and extracts as root.
      const out = join(dir, 'out');
      await runTool('fsck.erofs', [`--extract=${out}`, image]);
      const { neutralized, ...counted } = stats;
      assert.deepEqual(counted, await treeStats(out), 'the walk counts what the image holds');
      assert.deepEqual(neutralized, { devices: 0, setId: 0, capabilities: 0 });
      assert.equal((await readdir(join(out, 'big'))).length, 400);
      const owner = async (p: string) => {
        const st = await lstat(join(out, p));
        return `${st.uid}:${st.gid}`;
      };
      assert.equal(await owner('.'), '0:0');
      assert.equal(await owner('big/file-399'), '0:0');
      assert.equal(await owner('user'), '1000:1001');
      assert.equal(await owner('stranger'), '65534:65534');
      const wh = await lstat(join(out, 'deleted'));
      assert.ok(wh.isCharacterDevice() && wh.rdev === 0, 'the whiteout stays a whiteout');
      // fsck.erofs 1.5 extracts no xattrs: read the opaque mark through a mount.
      const mnt = join(dir, 'mnt');
      await mkdir(mnt);
      await runTool('mount', ['-t', 'erofs', '-o', 'ro', image, mnt]);
      try {
        assert.deepEqual([...(await listOpaqueDirs(mnt))], ['opaque']);
      } finally {
        await runTool('umount', [mnt]);
      }
      await assert.rejects(lstat(join(out, 'secret')));
      assert.deepEqual(await readdir(join(out, 'build')), [], 'DIR/** keeps DIR, empty');
    } finally {
      await cleanup();
    }
  },
);

void test(
  'scrubbing a copy hides what the lower layers show: a whiteout, or an opaque directory',
  {
    skip: !isRoot && 'needs root',
  },
  async () => {
    const { dir, cleanup } = await tempDir();
    try {
      const lower = join(dir, 'lower');
      await mkdir(join(lower, 'ws', 'answers'), { recursive: true });
      await writeFile(join(lower, 'ws', 'answer.txt'), '42\n');
      await writeFile(join(lower, 'ws', 'answers', 'a1'), '1\n');
      await chown(join(lower, 'ws'), 7, 8);
      const copy = join(dir, 'copy');
      await mkdir(join(copy, 'data'), { recursive: true });
      await writeFile(join(copy, 'data', 'residue'), 'r\n');
      await mkdir(join(dir, 'croot'));
      await scrubCopy(
        copy,
        parseScrubPatterns(['/ws/answer.txt', '/ws/answers/**', '/data/residue', '/nowhere']),
        {
          lowerDirs: [lower],
          hostId: HOST_ID,
        },
        { rootDir: join(dir, 'croot') },
      );
      const wh = await lstat(join(copy, 'ws', 'answer.txt'));
      assert.ok(wh.isCharacterDevice() && wh.rdev === 0);
      assert.deepEqual([...(await listOpaqueDirs(copy))].sort(), ['ws/answers']);
      const ws = await lstat(join(copy, 'ws'));
      assert.deepEqual(
        [ws.uid, ws.gid],
        [HOST_ID + 7, HOST_ID + 8],
        'made like the lower directory',
      );
      await assert.rejects(lstat(join(copy, 'data', 'residue')), 'only in the upper: just removed');
      await assert.rejects(lstat(join(copy, 'nowhere')), 'absent everywhere: nothing made');
    } finally {
      await cleanup();
    }
  },
);

/** A POSIX ACL xattr value (linux/posix_acl_xattr.h): version 2, then tag, perm, id per entry. */
function aclValue(entries: [tag: number, perm: number, id: number][]): string {
  const buf = Buffer.alloc(4 + 8 * entries.length);
  buf.writeUInt32LE(2, 0);
  entries.forEach(([tag, perm, id], i) => {
    buf.writeUInt16LE(tag, 4 + 8 * i);
    buf.writeUInt16LE(perm, 6 + 8 * i);
    buf.writeUInt32LE(id >>> 0, 8 + 8 * i);
  });
  return `0x${buf.toString('hex')}`;
}

/** The named users and groups of an ACL xattr, as `u:ID` / `g:ID`. */
async function aclNames(path: string, name: string): Promise<string[]> {
  const { stdout } = await runTool('getfattr', ['--absolute-names', '-e', 'hex', '-n', name, path]);
  const hex = /=0x([0-9a-f]+)/.exec(stdout)?.[1] ?? '';
  const buf = Buffer.from(hex, 'hex');
  const out: string[] = [];
  for (let at = 4; at + 8 <= buf.length; at += 8) {
    const tag = buf.readUInt16LE(at);
    if (tag === 0x02) out.push(`u:${buf.readUInt32LE(at + 4)}`);
    if (tag === 0x08) out.push(`g:${buf.readUInt32LE(at + 4)}`);
  }
  return out;
}

void test(
  "POSIX ACLs in a layer name the sandbox's ids, like the owners (inline and shared xattrs)",
  { skip: !isRoot && 'needs root (chown, system.posix_acl_* xattrs, mount)' },
  async () => {
    // A sandbox's `setfacl -m u:www-data:rwx` lands in its upper with the host id of
    // www-data; a layer must carry www-data's own id, or every sandbox stacking it
    // (its own restart, a fork) sees the entry name an unmapped user.
    const { dir, cleanup } = await tempDir();
    try {
      const upper = join(dir, 'upper');
      await mkdir(join(upper, 'www'), { recursive: true });
      await chown(upper, HOST_ID, HOST_ID);
      await chown(join(upper, 'www'), HOST_ID, HOST_ID);
      const U = 0xffffffff;
      const access = aclValue([
        [0x01, 6, U],
        [0x02, 7, HOST_ID + 33],
        [0x02, 5, 4242], // outside the sandbox's range: unmapped, like an owner
        [0x04, 4, U],
        [0x08, 5, HOST_ID + 33],
        [0x10, 7, U],
        [0x20, 4, U],
      ]);
      // Five files with the same ACL: mkfs.erofs stores a value that many inodes share once.
      for (let i = 0; i < 5; i++) {
        const f = join(upper, 'www', `page-${i}`);
        await writeFile(f, `${i}\n`);
        await chown(f, HOST_ID + 33, HOST_ID + 33);
        await runTool('setfattr', ['-n', 'system.posix_acl_access', '-v', access, f]);
      }
      const lone = join(upper, 'www', 'lone');
      await writeFile(lone, 'x\n');
      await runTool('setfattr', [
        '-n',
        'system.posix_acl_access',
        '-v',
        aclValue([
          [0x01, 6, U],
          [0x02, 6, HOST_ID + 1000],
          [0x04, 4, U],
          [0x10, 6, U],
          [0x20, 4, U],
        ]),
        lone,
      ]);
      await runTool('setfattr', [
        '-n',
        'system.posix_acl_default',
        '-v',
        aclValue([
          [0x01, 7, U],
          [0x04, 5, U],
          [0x08, 7, HOST_ID + 1001],
          [0x10, 7, U],
          [0x20, 5, U],
        ]),
        join(upper, 'www'),
      ]);
      const image = join(dir, 'layer.erofs');
      await mkdir(join(dir, 'croot'));
      await packUpperDir(
        { source: { dir: upper }, output: image },
        { rootDir: join(dir, 'croot') },
      );
      await shiftErofsIds(image, { hostId: HOST_ID, count: 65536, sanitize: true });
      await runTool('fsck.erofs', [image]);
      const mnt = join(dir, 'mnt');
      await mkdir(mnt);
      await runTool('mount', ['-t', 'erofs', '-o', 'ro', image, mnt]);
      try {
        for (let i = 0; i < 5; i++) {
          assert.deepEqual(
            await aclNames(join(mnt, 'www', `page-${i}`), 'system.posix_acl_access'),
            ['u:33', 'u:65534', 'g:33'],
            `page-${i}`,
          );
        }
        assert.deepEqual(await aclNames(join(mnt, 'www', 'lone'), 'system.posix_acl_access'), [
          'u:1000',
        ]);
        assert.deepEqual(await aclNames(join(mnt, 'www'), 'system.posix_acl_default'), ['g:1001']);
      } finally {
        await runTool('umount', [mnt]);
      }
    } finally {
      await cleanup();
    }
  },
);

void test(
  'every opaque mark of a layer tree is listed, however many there are (confined or not)',
  { skip: !isRoot && 'needs root (trusted xattrs, mount namespaces)' },
  async () => {
    // `rm -rf` of a directory a lower layer has, then making it again, leaves an opaque
    // directory in the upper; a package reinstall leaves thousands. Each one listed is
    // ~60 bytes of getfattr output: a listing cut to its last 64 KiB lost the rest, and the
    // layer reused by a registry import merged with the lower files showing through.
    const { dir, cleanup } = await tempDir();
    try {
      const tree = join(dir, 'tree');
      const names = Array.from(
        { length: 2500 },
        (_, i) => `pkg/module-${String(i).padStart(5, '0')}`,
      );
      await mkdir(join(tree, 'pkg'), { recursive: true });
      for (const n of names) await mkdir(join(tree, n));
      // One setfattr for all of them (getfattr's dump format).
      const dump = join(dir, 'marks');
      await writeFile(
        dump,
        names.map((n) => `# file: ${join(tree, n)}\ntrusted.overlay.opaque="y"\n`).join('\n'),
      );
      await runTool('setfattr', [`--restore=${dump}`]);
      assert.equal((await listOpaqueDirs(tree)).size, names.length, 'host-side listing');
      await mkdir(join(dir, 'croot'));
      const confined = await listOpaqueDirs(tree, undefined, join(dir, 'croot'));
      assert.equal(confined.size, names.length, 'confined listing');
      assert.deepEqual([...confined].sort(), names);
    } finally {
      await cleanup();
    }
  },
);
