import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError, type LayerInfo } from '@dsec/core';
import { imageStoreConformance } from './conformance.js';
import { DirImageStore } from './dir-store.js';

imageStoreConformance('DirImageStore', async () => {
  const root = await mkdtemp(join(tmpdir(), 'dsec-dir-store-'));
  return {
    store: new DirImageStore(root),
    cleanup: () => rm(root, { recursive: true, force: true }),
  };
});

void test('DirImageStore lays blobs and records out as documented, read-only, no temp files left', async () => {
  const root = await mkdtemp(join(tmpdir(), 'dsec-dir-store-'));
  try {
    const store = new DirImageStore(root);
    const src = join(root, 'input');
    await writeFile(src, 'bytes');
    const { digest } = await store.putBlob(src);
    const hex = digest.slice('sha256:'.length);
    const blob = join(root, 'blobs', 'sha256', hex);
    assert.equal(await store.blobPath(digest), blob);
    assert.equal((await stat(blob)).mode & 0o777, 0o444);
    await store.putLayer({
      name: 'demo',
      version: 'latest',
      kind: 'base',
      digest,
      sizeBytes: 5,
      contentBytes: 5,
      fileCount: 1,
      createdAt: new Date(0).toISOString(),
      source: 'dir',
    });
    assert.deepEqual(await readdir(join(root, 'layers', 'demo')), ['latest.json']);
    assert.deepEqual(await readdir(join(root, 'blobs', 'sha256')), [hex]);
    assert.equal(store.tmpDir, join(root, 'tmp'));
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

void test('DirImageStore takes a moved file over on the same filesystem: read-only, source gone', async () => {
  const root = await mkdtemp(join(tmpdir(), 'dsec-dir-store-'));
  try {
    const store = new DirImageStore(root);
    const src = join(root, 'given-up');
    await writeFile(src, 'moved');
    const { digest } = await store.putBlob(src, { move: true });
    const blob = await store.blobPath(digest);
    assert.equal((await stat(blob)).mode & 0o777, 0o444);
    assert.equal(await stat(src).catch(() => undefined), undefined, 'the source is gone');
    assert.deepEqual(await readdir(join(root, 'blobs', 'sha256')), [digest.slice(7)]);
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

void test('DirImageStore: a store written before owners opens unchanged, its records the platform’s', async () => {
  const root = await mkdtemp(join(tmpdir(), 'dsec-dir-store-'));
  try {
    const store = new DirImageStore(root);
    const src = join(root, 'input');
    await writeFile(src, 'old bytes');
    const { digest } = await store.putBlob(src);
    // Exactly what a release before owners wrote: no `project`, under layers/.
    const old = {
      name: 'old-snap',
      version: 'latest',
      kind: 'snapshot',
      digest,
      sizeBytes: 9,
      contentBytes: 9,
      fileCount: 1,
      createdAt: new Date(0).toISOString(),
      source: 'snapshot',
      parents: ['busybox:latest'],
      parentDigests: [digest],
      scrub: [],
    };
    await mkdir(join(root, 'layers', 'old-snap'), { recursive: true });
    await writeFile(join(root, 'layers', 'old-snap', 'latest.json'), JSON.stringify(old));
    const reopened = new DirImageStore(root);
    assert.deepEqual(await reopened.getLayer('old-snap'), old);
    assert.equal((await reopened.listLayers())[0]?.project, undefined);
    await assert.rejects(reopened.getLayer('old-snap', { project: 'prj-a' }));

    // A project's record lives in its own tree; one claiming an owner it does not sit under is corrupt.
    await reopened.putLayer({ ...old, name: 'mine', project: 'prj-a' } as LayerInfo);
    assert.deepEqual(await readdir(join(root, 'projects', 'prj-a', 'layers', 'mine')), [
      'latest.json',
    ]);
    await reopened.removeLayer('mine', { project: 'prj-a' });
    assert.deepEqual(await readdir(join(root, 'projects')), [], 'the empty project tree goes');
    await mkdir(join(root, 'layers', 'forged'), { recursive: true });
    await writeFile(
      join(root, 'layers', 'forged', 'latest.json'),
      JSON.stringify({ ...old, name: 'forged', project: 'prj-a' }),
    );
    await assert.rejects(reopened.getLayer('forged'), (e) => isDsecError(e, 'internal'));
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});
