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
