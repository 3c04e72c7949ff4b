import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readdir, readFile, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { CHUNK_TABLE_CHUNK_BYTES, isDsecError, parseChunkTable, type LayerInfo } from '@dsec/core';
import { buildLayer, type BuildProgress } from './build.js';
import { DirImageStore } from './store/dir-store.js';
import { isRoot, makeTree, makeTreeContentBytes, tempDir } from './testing/fixtures.js';
import { runTool } from './util/run-tool.js';

// makeTree: 3 top dirs + etc/50 files + usr/{bin,link} + usr/bin/{big,tool} + empty + hard + home/user + notes
const TREE_ENTRIES = 3 + 50 + 2 + 2 + 1 + 1 + 1 + 1;

async function withStore(fn: (store: DirImageStore, dir: string) => Promise<void>): Promise<void> {
  const t = await tempDir();
  try {
    await fn(new DirImageStore(join(t.dir, 'store')), t.dir);
  } finally {
    await t.cleanup();
  }
}

void test('a layer from a directory is stored and recorded', async () => {
  await withStore(async (store, dir) => {
    const src = join(dir, 'src');
    await makeTree(src);
    const phases: string[] = [];
    const layer = await buildLayer(store, {
      name: 'demo',
      kind: 'base',
      from: { dir: src },
      onProgress: (p: BuildProgress) => phases.push(p.phase),
    });
    assert.equal(layer.name, 'demo');
    assert.equal(layer.version, 'latest');
    assert.equal(layer.source, 'dir');
    assert.equal(layer.blobDigest, undefined);
    assert.equal(layer.fileCount, TREE_ENTRIES);
    assert.equal(layer.contentBytes, makeTreeContentBytes());
    assert.equal(layer.sizeBytes, (await stat(await store.blobPath(layer.digest))).size);
    assert.deepEqual(await store.getLayer('demo'), layer);
    for (const p of ['scan', 'mkfs', 'store', 'done']) assert.ok(phases.includes(p), p);

    // Same content again: the same record comes back; other content under the name conflicts.
    const again = await buildLayer(store, { name: 'demo', kind: 'base', from: { dir: src } });
    assert.deepEqual(again, layer);
    await writeFile(join(src, 'new-file'), 'x');
    await assert.rejects(
      buildLayer(store, { name: 'demo', kind: 'base', from: { dir: src } }),
      (e) => isDsecError(e, 'conflict'),
    );
    assert.deepEqual(await readdir(store.tmpDir), [], 'scratch space is cleaned up');
  });
});

void test(
  'a layer from a .tar.gz has the same digest as from the directory, and keeps owners',
  { skip: !isRoot && 'tar --same-owner needs root' },
  async () => {
    await withStore(async (store, dir) => {
      const src = join(dir, 'src');
      await makeTree(src);
      const tgz = join(dir, 'src.tar.gz');
      await runTool('tar', [
        '--create',
        '--gzip',
        `--file=${tgz}`,
        '--numeric-owner',
        `--directory=${src}`,
        '.',
      ]);
      const fromDir = await buildLayer(store, {
        name: 'from-dir',
        kind: 'toolkit',
        from: { dir: src },
      });
      const fromTar = await buildLayer(store, {
        name: 'from-tar',
        version: 'v1.2',
        kind: 'toolkit',
        from: { tar: tgz },
      });
      assert.equal(fromTar.source, 'tar');
      assert.equal(fromTar.version, 'v1.2');
      assert.equal(fromTar.digest, fromDir.digest);
      assert.equal(fromTar.fileCount, TREE_ENTRIES);
      assert.equal(fromTar.contentBytes, fromDir.contentBytes);

      for (const [ext, flag] of [
        ['tar', '--no-auto-compress'],
        ['tar.xz', '--xz'],
        ['tar.zst', '--zstd'],
      ] as const) {
        const archive = join(dir, `src.${ext}`);
        await runTool('tar', [
          '--create',
          flag,
          `--file=${archive}`,
          '--numeric-owner',
          `--directory=${src}`,
          '.',
        ]);
        const layer = await buildLayer(store, {
          name: 'from-tar',
          version: ext,
          kind: 'toolkit',
          from: { tar: archive },
        });
        assert.equal(layer.digest, fromDir.digest, ext);
      }

      const out = join(dir, 'out');
      await runTool('fsck.erofs', [`--extract=${out}`, await store.blobPath(fromTar.digest)]);
      assert.equal((await stat(join(out, 'home/user/notes'))).uid, 1000);
      assert.deepEqual(await readdir(store.tmpDir), []);
    });
  },
);

void test('a split layer stores metadata and data as two blobs', async () => {
  await withStore(async (store, dir) => {
    const src = join(dir, 'src');
    await makeTree(src);
    const layer = await buildLayer(store, {
      name: 'split',
      kind: 'workspace',
      from: { dir: src },
      split: true,
    });
    assert.ok(layer.blobDigest);
    assert.notEqual(layer.blobDigest, layer.digest);
    const meta = (await stat(await store.blobPath(layer.digest))).size;
    const data = (await stat(await store.blobPath(layer.blobDigest))).size;
    assert.equal(layer.sizeBytes, meta + data);
    // The chunk table holds the sha256 of each 1 MiB chunk of the data blob.
    assert.ok(layer.blobChunksDigest);
    const table = parseChunkTable(await readFile(await store.blobPath(layer.blobChunksDigest)));
    const blob = await readFile(await store.blobPath(layer.blobDigest));
    assert.equal(table.chunkBytes, CHUNK_TABLE_CHUNK_BYTES);
    assert.equal(table.digests.length, Math.ceil(blob.length / CHUNK_TABLE_CHUNK_BYTES));
    table.digests.forEach((d, i) => {
      const chunk = blob.subarray(i * CHUNK_TABLE_CHUNK_BYTES, (i + 1) * CHUNK_TABLE_CHUNK_BYTES);
      assert.deepEqual(d, createHash('sha256').update(chunk).digest(), `chunk ${i}`);
    });
    await store.removeLayer('split');
    assert.equal(await store.hasBlob(layer.digest), false);
    assert.equal(await store.hasBlob(layer.blobDigest), false);
    assert.equal(await store.hasBlob(layer.blobChunksDigest), false);
  });
});

void test('bad names, kinds and sources are invalid_argument with the field', async () => {
  await withStore(async (store, dir) => {
    const src = join(dir, 'src');
    await makeTree(src);
    const cases: [Parameters<typeof buildLayer>[1], string][] = [
      [{ name: 'Bad Name', kind: 'base', from: { dir: src } }, 'name'],
      [{ name: '../escape', kind: 'base', from: { dir: src } }, 'name'],
      [{ name: 'ok', version: 'no/slash', kind: 'base', from: { dir: src } }, 'version'],
      [{ name: 'ok', kind: 'nope' as LayerInfo['kind'], from: { dir: src } }, 'kind'],
      [{ name: 'ok', kind: 'base', from: { dir: join(dir, 'missing') } }, 'from.dir'],
      [{ name: 'ok', kind: 'base', from: { dir: join(src, 'empty') } }, 'from.dir'],
      [{ name: 'ok', kind: 'base', from: { tar: join(dir, 'missing.tar') } }, 'from.tar'],
      [{ name: 'ok', kind: 'base', from: {} as { dir: string } }, 'from'],
    ];
    for (const [options, field] of cases) {
      await assert.rejects(
        buildLayer(store, options),
        (e) => isDsecError(e, 'invalid_argument') && e.field === field,
        `${JSON.stringify(options)} → ${field}`,
      );
    }
    assert.deepEqual(await store.listLayers(), []);
  });
});

void test('a corrupt archive is invalid_argument and leaves no scratch behind', async () => {
  await withStore(async (store, dir) => {
    const bad = join(dir, 'bad.tar.gz');
    await writeFile(bad, Buffer.from([0x1f, 0x8b, 0x08, 0, 1, 2, 3, 4, 5, 6, 7]));
    await assert.rejects(
      buildLayer(store, { name: 'bad', kind: 'base', from: { tar: bad } }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'from.tar',
    );
    assert.deepEqual(await readdir(store.tmpDir), []);
    assert.deepEqual(await store.listLayers(), []);
  });
});

void test('an aborted build says aborted and cleans up', async () => {
  await withStore(async (store, dir) => {
    const src = join(dir, 'src');
    await makeTree(src);
    const ac = new AbortController();
    const build = buildLayer(store, {
      name: 'aborted',
      kind: 'base',
      from: { dir: src },
      signal: ac.signal,
      onProgress: (p) => {
        if (p.phase === 'mkfs') ac.abort();
      },
    });
    await assert.rejects(build, (e) => isDsecError(e, 'aborted'));
    assert.deepEqual(await readdir(store.tmpDir), []);
    assert.deepEqual(await store.listLayers(), []);
  });
});
