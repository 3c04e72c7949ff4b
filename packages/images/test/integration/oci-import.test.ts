import assert from 'node:assert/strict';
import { lstat, mkdir, readdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { isDsecError, type LayerInfo } from '@dsec/core';
import { buildLayer, DirImageStore, importOci } from '@dsec/images';
import { mountErofs, mountRootfs, unmount } from '@dsec/native';
import { tempDir } from '../../src/testing/fixtures.js';
import {
  makeDockerArchive,
  makeOciLayout,
  type LayerFiles,
} from '../../src/testing/oci-fixtures.js';
import { runTool } from '../../src/util/run-tool.js';

// Three image layers exercising every OCI rule the import must apply.
const LAYERS: LayerFiles[] = [
  {
    'etc/a': 'a1\n',
    'etc/b': 'b1\n',
    'opt/dir/x': 'x1\n',
    'opt/dir/sub/y': 'y1\n',
    'data/old': 'old\n',
    'data/kept': 'kept\n',
    thing: 'a file first\n',
    'gone-dir/inner': 'inner\n',
  },
  {
    'etc/.wh.a': '', // delete a file
    'etc/.wh.missing': '', // a whiteout for nothing in this image: hides the base's /etc/missing
    'opt/dir/.wh..wh..opq': '', // opaque: lower content of opt/dir disappears
    'opt/dir/z': 'z2\n',
    'data/.wh.old': '',
    'data/new': 'new\n',
    '.wh.gone-dir': '', // delete a whole directory
    newfile: 'n2\n',
  },
  {
    'etc/a': 'a3\n', // re-added after its deletion
    'thing/inner': 'now a directory\n', // a directory replaces a file
  },
];
const CONFIG = {
  Env: ['PATH=/usr/bin:/bin', 'LANG=C.UTF-8'],
  Cmd: ['/bin/sh'],
  WorkingDir: '/work',
  User: '1000',
};

async function tree(root: string): Promise<string[]> {
  const out: string[] = [];
  const walk = async (rel: string): Promise<void> => {
    for (const e of (await readdir(join(root, rel), { withFileTypes: true })).sort((x, y) =>
      x.name < y.name ? -1 : 1,
    )) {
      const r = rel ? `${rel}/${e.name}` : e.name;
      if (e.isDirectory()) {
        out.push(`${r}/`);
        await walk(r);
      } else if (e.isCharacterDevice()) out.push(`${r} (whiteout)`);
      else out.push(`${r}=${(await readFile(join(root, r), 'utf8')).trim()}`);
    }
  };
  await walk('');
  return out;
}

async function opaqueXattr(path: string): Promise<string | undefined> {
  const { stdout } = await runTool('getfattr', [
    '-h',
    '--absolute-names',
    '-d',
    '-m',
    '^trusted\\.overlay\\.',
    path,
  ]);
  return /trusted\.overlay\.opaque="(.*)"/.exec(stdout)?.[1];
}

void describe('OCI import (layout and docker-archive) with overlay whiteouts', () => {
  let t: { dir: string; cleanup(): Promise<void> };
  let store: DirImageStore;
  const mounts: string[] = [];
  const mount = async (layer: LayerInfo, name: string): Promise<string> => {
    const dir = join(t.dir, 'mnt', name);
    await mkdir(dir, { recursive: true });
    const blobDevice = layer.blobDigest ? await store.blobPath(layer.blobDigest) : undefined;
    await mountErofs(await store.blobPath(layer.digest), dir, blobDevice ? { blobDevice } : {});
    mounts.unshift(dir);
    return dir;
  };

  before(async () => {
    t = await tempDir('dsec-oci-');
    store = new DirImageStore(join(t.dir, 'store'));
    await makeOciLayout(join(t.dir, 'layout'), LAYERS, CONFIG);
    await makeDockerArchive(join(t.dir, 'image.tar'), LAYERS, CONFIG);
  });
  after(async () => {
    await unmount(mounts, { detach: true }).catch(() => undefined);
    await t.cleanup();
  });

  const EXPECTED = [
    'data/',
    'data/kept=kept',
    'data/new=new',
    'etc/',
    'etc/a=a3',
    'etc/b=b1',
    'newfile=n2',
    'opt/',
    'opt/dir/',
    'opt/dir/z=z2',
    'thing/',
    'thing/inner=now a directory',
  ];

  void test('as a base: the merged tree has deletions applied and no marks left', async () => {
    const phases = new Set<string>();
    const layer = await importOci(store, {
      path: join(t.dir, 'layout'),
      name: 'oci-base',
      kind: 'base',
      onProgress: (p) => phases.add(p.phase),
    });
    assert.equal(layer.source, 'oci');
    assert.deepEqual(layer.config, {
      env: CONFIG.Env,
      cmd: CONFIG.Cmd,
      workingDir: '/work',
      user: '1000',
    });
    assert.ok(
      phases.has('extract') && phases.has('merge') && phases.has('mkfs'),
      [...phases].join(),
    );
    const dir = await mount(layer, 'base');
    assert.deepEqual(await tree(dir), EXPECTED);
    assert.equal(await opaqueXattr(join(dir, 'opt/dir')), undefined);
  });

  void test('a docker-archive of the same image gives the same layer digest', async () => {
    const fromOci = await store.getLayer('oci-base');
    const fromDocker = await importOci(store, {
      path: join(t.dir, 'image.tar'),
      name: 'docker-base',
      kind: 'base',
    });
    assert.equal(fromDocker.digest, fromOci.digest);
    assert.deepEqual(fromDocker.config, fromOci.config);
    // Importing again is idempotent.
    assert.equal(
      (await importOci(store, { path: join(t.dir, 'layout'), name: 'oci-base', kind: 'base' }))
        .digest,
      fromOci.digest,
    );
  });

  void test('as a toolkit over a base: whiteouts and opaque dirs hide the base through overlayfs', async () => {
    const baseSrc = join(t.dir, 'base-src');
    for (const [p, c] of Object.entries({
      'etc/missing': 'base file the image deleted\n',
      'etc/basekeep': 'base\n',
      'opt/dir/basefile': 'hidden by opaque\n',
      'gone-dir/basefile': 'hidden by whiteout\n',
      'data/basedata': 'base data\n',
    })) {
      await mkdir(join(baseSrc, p, '..'), { recursive: true });
      await writeFile(join(baseSrc, p), c);
    }
    const base = await buildLayer(store, {
      name: 'plain-base',
      kind: 'base',
      from: { dir: baseSrc },
    });
    const tk = await importOci(store, {
      path: join(t.dir, 'layout'),
      name: 'oci-tk',
      kind: 'toolkit',
      split: true,
    });
    assert.ok(tk.blobDigest, 'split import has a data blob');

    const tkDir = await mount(tk, 'tk');
    // The layer itself carries the marks.
    assert.equal(await opaqueXattr(join(tkDir, 'opt/dir')), 'y');
    assert.ok((await lstat(join(tkDir, 'etc/missing'))).isCharacterDevice());
    assert.ok((await lstat(join(tkDir, 'gone-dir'))).isCharacterDevice());

    const baseDir = await mount(base, 'plain-base');
    const root = join(t.dir, 'root');
    await Promise.all(['root', 'upper', 'work'].map((d) => mkdir(join(t.dir, d))));
    await mountRootfs({
      target: root,
      upper: join(t.dir, 'upper'),
      work: join(t.dir, 'work'),
      lowers: [tkDir, baseDir],
    });
    mounts.unshift(root);
    assert.deepEqual(await tree(root), [
      'data/',
      'data/basedata=base data',
      'data/kept=kept',
      'data/new=new',
      'etc/',
      'etc/a=a3',
      'etc/b=b1',
      'etc/basekeep=base',
      'newfile=n2',
      'opt/',
      'opt/dir/',
      'opt/dir/z=z2',
      'thing/',
      'thing/inner=now a directory',
    ]);
  });

  void test('bad input is invalid_argument', async () => {
    const notImage = join(t.dir, 'not-an-image');
    await mkdir(notImage);
    await assert.rejects(importOci(store, { path: notImage, name: 'x', kind: 'base' }), (e) =>
      isDsecError(e, 'invalid_argument'),
    );
    await assert.rejects(
      importOci(store, { path: join(t.dir, 'nope'), name: 'x', kind: 'base' }),
      (e) => isDsecError(e, 'invalid_argument'),
    );
    await assert.rejects(
      importOci(store, {
        path: join(t.dir, 'layout'),
        name: 'x',
        kind: 'base',
        ref: 'no-such-tag',
      }),
      (e) => isDsecError(e, 'invalid_argument'),
    );
  });
});
