import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { readStoredLayers } from './storage.js';

// What readStoredLayers accepts from containers/storage's records, and
// every way they can fail to vouch for an image (the build then exports it).

const hex = (c: string): string => c.repeat(64);
const D1 = `sha256:${hex('1')}`;
const D2 = `sha256:${hex('2')}`;

void describe('readStoredLayers', () => {
  let root: string;

  const write = async (
    layers: unknown,
    images: unknown = [{ id: hex('f'), layer: hex('b') }],
  ): Promise<void> => {
    await mkdir(join(root, 'overlay-layers'), { recursive: true });
    await mkdir(join(root, 'overlay-images'), { recursive: true });
    await writeFile(join(root, 'overlay-layers', 'layers.json'), JSON.stringify(layers));
    await writeFile(join(root, 'overlay-images', 'images.json'), JSON.stringify(images));
  };
  const good = [
    { id: hex('a'), 'diff-digest': D1 },
    { id: hex('b'), parent: hex('a'), 'diff-digest': D2 },
  ];

  before(async () => {
    root = await mkdtemp(join(tmpdir(), 'dsec-storage-'));
    for (const id of ['a', 'b'])
      await mkdir(join(root, 'overlay', hex(id), 'diff'), { recursive: true });
  });
  after(async () => {
    await rm(root, { recursive: true, force: true });
  });

  // A host whose overlay module writes redirects never reads the storage directly.
  const plainOverlay = async (): Promise<boolean> => {
    for (const p of ['redirect_dir', 'metacopy']) {
      const v = await readFile(`/sys/module/overlay/parameters/${p}`, 'utf8').catch(() => 'N');
      if (v.trim() !== 'N') return false;
    }
    return true;
  };

  test('the image layers bottom first, each its diff directory', async (t) => {
    if (!(await plainOverlay())) {
      t.skip('the overlay module writes redirect or metacopy xattrs here');
      return;
    }
    await write(good);
    assert.deepEqual(await readStoredLayers(root, `sha256:${hex('f')}`, [D1, D2]), [
      { diffId: D1, diffDir: join(root, 'overlay', hex('a'), 'diff') },
      { diffId: D2, diffDir: join(root, 'overlay', hex('b'), 'diff') },
    ]);
  });

  test('refused: a digest not the config diff ID at its place, a count that differs', async () => {
    await write(good);
    assert.equal(await readStoredLayers(root, hex('f'), [D2, D1]), undefined);
    assert.equal(await readStoredLayers(root, hex('f'), [D2]), undefined);
    assert.equal(await readStoredLayers(root, hex('f'), [D1, D1, D2]), undefined);
  });

  test('refused: an unknown image or parent, malformed records', async () => {
    await write(good);
    assert.equal(await readStoredLayers(root, hex('e'), [D1, D2]), undefined);
    await write([good[1]]);
    assert.equal(await readStoredLayers(root, hex('f'), [D1, D2]), undefined);
    await write([{ id: '../../etc', 'diff-digest': D1 }], [{ id: hex('f'), layer: '../../etc' }]);
    assert.equal(await readStoredLayers(root, hex('f'), [D1]), undefined);
    await write({ not: 'an array' });
    assert.equal(await readStoredLayers(root, hex('f'), [D1, D2]), undefined);
    await write([{ id: hex('a'), 'diff-digest': 7 }], [{ id: hex('f'), layer: hex('a') }]);
    assert.equal(await readStoredLayers(root, hex('f'), [D1]), undefined);
  });

  test('refused: a diff that is a symlink, a cycle of parents', async () => {
    const id = hex('c');
    await mkdir(join(root, 'overlay', id), { recursive: true });
    await symlink('/etc', join(root, 'overlay', id, 'diff'));
    await write([{ id, 'diff-digest': D1 }], [{ id: hex('f'), layer: id }]);
    assert.equal(await readStoredLayers(root, hex('f'), [D1]), undefined);
    await write([
      { id: hex('a'), parent: hex('b'), 'diff-digest': D1 },
      { id: hex('b'), parent: hex('a'), 'diff-digest': D2 },
    ]);
    assert.equal(await readStoredLayers(root, hex('f'), [D1, D2]), undefined);
  });
});
