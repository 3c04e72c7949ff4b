import assert from 'node:assert/strict';
import { lstat, readFile, readlink, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { buildErofs, erofsArgs, erofsCompression } from './erofs.js';
import { isRoot, makeTree, sha256File, tempDir } from './testing/fixtures.js';
import { runTool } from './util/run-tool.js';

void test('the same tree gives byte-identical images, whatever its mtimes or creation order', async () => {
  const t = await tempDir();
  try {
    await makeTree(join(t.dir, 'a'), { order: 'forward' });
    await makeTree(join(t.dir, 'b'), { order: 'reverse', mtime: new Date('2001-02-03T04:05:06Z') });
    const a1 = await buildErofs({ sourceDir: join(t.dir, 'a'), output: join(t.dir, 'a1.erofs') });
    const a2 = await buildErofs({ sourceDir: join(t.dir, 'a'), output: join(t.dir, 'a2.erofs') });
    const b = await buildErofs({ sourceDir: join(t.dir, 'b'), output: join(t.dir, 'b.erofs') });
    const digest = await sha256File(a1.output);
    assert.equal(await sha256File(a2.output), digest);
    assert.equal(await sha256File(b.output), digest);
    assert.equal(a1.sizeBytes, (await stat(a1.output)).size);

    const plain = await buildErofs({
      sourceDir: join(t.dir, 'a'),
      output: join(t.dir, 'p.erofs'),
      compress: false,
    });
    assert.notEqual(await sha256File(plain.output), digest);
  } finally {
    await t.cleanup();
  }
});

void test('split builds (metadata + data blob) are deterministic too', async () => {
  const t = await tempDir();
  try {
    await makeTree(join(t.dir, 'a'));
    await makeTree(join(t.dir, 'b'), { order: 'reverse', mtime: new Date(0) });
    const digests: string[][] = [];
    for (const src of ['a', 'a', 'b']) {
      const r = await buildErofs({
        sourceDir: join(t.dir, src),
        output: join(t.dir, `${src}${digests.length}.meta`),
        blobDevice: join(t.dir, `${src}${digests.length}.blob`),
      });
      assert.ok(r.blobSizeBytes !== undefined && r.blobSizeBytes > 0);
      digests.push([await sha256File(r.output), await sha256File(r.blobDevice!)]);
    }
    assert.deepEqual(digests[1], digests[0]);
    assert.deepEqual(digests[2], digests[0]);
  } finally {
    await t.cleanup();
  }
});

void test('an image holds the tree with its owners, modes and links (checked with fsck.erofs --extract)', async () => {
  const t = await tempDir();
  try {
    const src = join(t.dir, 'src');
    await makeTree(src);
    const img = join(t.dir, 'img.erofs');
    await buildErofs({ sourceDir: src, output: img });
    const out = join(t.dir, 'out');
    await runTool('fsck.erofs', [`--extract=${out}`, img]);
    assert.equal(
      await readFile(join(out, 'usr/bin/big'), 'utf8'),
      await readFile(join(src, 'usr/bin/big'), 'utf8'),
    );
    assert.equal(await readlink(join(out, 'usr/link')), '../etc/f1');
    assert.equal((await stat(join(out, 'usr/bin/tool'))).mode & 0o777, 0o755);
    assert.equal((await lstat(join(out, 'home/user/notes'))).mode & 0o777, 0o600);
    if (isRoot) {
      // fsck.erofs restores owners only when it runs as root.
      assert.equal((await stat(join(out, 'home/user/notes'))).uid, 1000);
      assert.equal((await stat(join(out, 'etc/f1'))).uid, 0);
    }
  } finally {
    await t.cleanup();
  }
});

void test('the flags that make builds reproducible are always passed', () => {
  const args = erofsArgs({ sourceDir: 's', output: 'o' });
  assert.deepEqual(args, [
    '--quiet',
    '-U00000000-0000-0000-0000-000000000000',
    '-T0',
    '-zlz4hc',
    'o',
    's',
  ]);
  const split = erofsArgs({
    sourceDir: 's',
    output: 'o',
    blobDevice: 'b',
    chunkSizeBytes: 1 << 20,
  });
  assert.deepEqual(split, [
    '--quiet',
    '-U00000000-0000-0000-0000-000000000000',
    '-T0',
    '--chunksize=1048576',
    '--blobdev=b',
    'o',
    's',
  ]);
});

void test('compression: lz4, lz4hc or none; the boolean form still means lz4hc or none', async () => {
  const z = (compress: Parameters<typeof erofsArgs>[0]['compress']) =>
    erofsArgs({
      sourceDir: 's',
      output: 'o',
      ...(compress !== undefined ? { compress } : {}),
    }).filter((a) => a.startsWith('-z'));
  assert.deepEqual(z(undefined), ['-zlz4hc']);
  assert.deepEqual(z(true), ['-zlz4hc']);
  assert.deepEqual(z('lz4hc'), ['-zlz4hc']);
  assert.deepEqual(z('lz4'), ['-zlz4']);
  assert.deepEqual(z(false), []);
  assert.deepEqual(z('none'), []);
  assert.equal(erofsCompression(undefined, 'lz4'), 'lz4');
  assert.throws(
    () => erofsCompression('zstd', 'lz4', 'compress'),
    (e) =>
      isDsecError(e, 'invalid_argument') &&
      e.field === 'compress' &&
      /lz4, lz4hc, none/.test(e.message),
  );

  // Each way reads back the same tree; lz4 packs a compressible tree below none.
  const t = await tempDir();
  try {
    const src = join(t.dir, 'src');
    await makeTree(src);
    const sizes: Record<string, number> = {};
    for (const way of ['lz4', 'lz4hc', 'none'] as const) {
      const img = join(t.dir, `${way}.erofs`);
      sizes[way] = (await buildErofs({ sourceDir: src, output: img, compress: way })).sizeBytes;
      const out = join(t.dir, `out-${way}`);
      await runTool('fsck.erofs', [`--extract=${out}`, img]);
      assert.equal(
        await readFile(join(out, 'usr/bin/big'), 'utf8'),
        await readFile(join(src, 'usr/bin/big'), 'utf8'),
      );
    }
    assert.ok(sizes['lz4']! < sizes['none']!, JSON.stringify(sizes));
  } finally {
    await t.cleanup();
  }
});

void test('bad options are invalid_argument with the field', async () => {
  for (const [opts, field] of [
    [{ chunkSizeBytes: 1000, blobDevice: 'b' }, 'chunkSizeBytes'],
    [{ chunkSizeBytes: 2048, blobDevice: 'b' }, 'chunkSizeBytes'],
    [{ timestampSec: -1 }, 'timestampSec'],
    [{ uuid: 'not-a-uuid' }, 'uuid'],
  ] as const) {
    assert.throws(
      () => erofsArgs({ sourceDir: 's', output: 'o', ...opts }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === field,
    );
  }
  const t = await tempDir();
  try {
    await assert.rejects(
      buildErofs({ sourceDir: join(t.dir, 'missing'), output: join(t.dir, 'x') }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'sourceDir',
    );
  } finally {
    await t.cleanup();
  }
});

void test('an aborted build says aborted', async () => {
  const t = await tempDir();
  try {
    await makeTree(join(t.dir, 'a'));
    const ac = new AbortController();
    ac.abort();
    await assert.rejects(
      buildErofs({ sourceDir: join(t.dir, 'a'), output: join(t.dir, 'x'), signal: ac.signal }),
      (e) => isDsecError(e, 'aborted'),
    );
  } finally {
    await t.cleanup();
  }
});
