import assert from 'node:assert/strict';
import { lstat, mkdir, readdir, readFile, readlink, symlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { isDsecError, type LayerInfo } from '@dsec/core';
import { buildLayer, collapseLayers, DirImageStore } from '@dsec/images';
import { mountErofs, mountRootfs, unmount } from '@dsec/native';
import { tempDir } from '../../src/testing/fixtures.js';
import { makeWhiteout, setOpaque } from '../../src/overlay/marks.js';

const mounter = { mountErofs, unmount };

/** Content, or the markers `WHITEOUT` (a 0:0 char device) and `OPAQUE` (an opaque directory). */
async function writeTree(root: string, files: Record<string, string>): Promise<void> {
  await mkdir(root, { recursive: true });
  for (const [path, content] of Object.entries(files)) {
    const abs = join(root, path);
    if (content === 'OPAQUE') {
      await mkdir(abs, { recursive: true });
      await setOpaque(abs);
      continue;
    }
    await mkdir(join(abs, '..'), { recursive: true });
    if (content === 'WHITEOUT') await makeWhiteout(abs);
    else await writeFile(abs, content);
  }
}

async function tree(root: string): Promise<string[]> {
  const out: string[] = [];
  const walk = async (rel: string): Promise<void> => {
    const entries = (await readdir(join(root, rel), { withFileTypes: true })).sort((x, y) =>
      x.name < y.name ? -1 : 1,
    );
    for (const e of entries) {
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

/** Names, types and contents below `root`, links read as links. */
async function listing(root: string): Promise<string[]> {
  const out: string[] = [];
  const walk = async (rel: string): Promise<void> => {
    for (const name of (await readdir(join(root, rel))).sort()) {
      const r = rel ? `${rel}/${name}` : name;
      const st = await lstat(join(root, r));
      if (st.isDirectory()) {
        out.push(`${r}/ ${st.mode.toString(8)}`);
        await walk(r);
      } else if (st.isSymbolicLink()) out.push(`${r} -> ${await readlink(join(root, r))}`);
      else out.push(`${r} ${st.mode.toString(8)} ${await readFile(join(root, r), 'utf8')}`);
    }
  };
  await walk('');
  return out;
}

void describe('collapseLayers keeps overlay semantics', () => {
  let t: { dir: string; cleanup(): Promise<void> };
  let store: DirImageStore;
  const mounts: string[] = [];
  let n = 0;
  const mountLayer = async (layer: LayerInfo): Promise<string> => {
    const dir = join(t.dir, 'mnt', String(n++));
    await mkdir(dir, { recursive: true });
    const blobDevice = layer.blobDigest ? await store.blobPath(layer.blobDigest) : undefined;
    await mountErofs(await store.blobPath(layer.digest), dir, blobDevice ? { blobDevice } : {});
    mounts.unshift(dir);
    return dir;
  };
  /** The overlayfs view of a stack, bottom first. */
  const view = async (stack: LayerInfo[]): Promise<string[]> => {
    const lowers = [];
    for (const l of [...stack].reverse()) lowers.push(await mountLayer(l));
    if (lowers.length === 1) return await tree(lowers[0]!);
    const d = join(t.dir, 'ovl', String(n++));
    await Promise.all(['root', 'upper', 'work'].map((x) => mkdir(join(d, x), { recursive: true })));
    await mountRootfs({
      target: join(d, 'root'),
      upper: join(d, 'upper'),
      work: join(d, 'work'),
      lowers,
    });
    mounts.unshift(join(d, 'root'));
    return await tree(join(d, 'root'));
  };
  let base: LayerInfo;
  let ws: LayerInfo;
  let tk: LayerInfo;

  before(async () => {
    t = await tempDir('dsec-collapse-');
    store = new DirImageStore(join(t.dir, 'store'));
    await writeTree(join(t.dir, 'b'), {
      'etc/a': 'base a',
      'etc/b': 'base b',
      'opt/dir/x': 'base x',
      'opt/dir/sub/y': 'base y',
      'keep/k': 'base k',
      'lib/old': 'base old',
      'file-then-dir': 'base file',
    });
    await writeTree(join(t.dir, 'w'), {
      'etc/b': 'WHITEOUT', // deletes the base's etc/b
      'opt/dir': 'OPAQUE', // replaces the base's opt/dir
      'opt/dir/w': 'ws w',
      'keep/kw': 'ws kw',
      'ws/only': 'ws only',
      'tk-deletes-this': 'ws file',
      'file-then-dir/inner': 'ws dir',
    });
    await writeTree(join(t.dir, 't'), {
      'etc/a': 'tk a', // overrides
      'lib/old': 'WHITEOUT',
      'tk-deletes-this': 'WHITEOUT',
      'ws/tk': 'tk file', // merges into the workspace's dir
      'keep/kt': 'tk kt',
    });
    base = await buildLayer(store, { name: 'cb', kind: 'base', from: { dir: join(t.dir, 'b') } });
    ws = await buildLayer(store, {
      name: 'cw',
      kind: 'workspace',
      from: { dir: join(t.dir, 'w') },
      split: true,
    });
    tk = await buildLayer(store, { name: 'ct', kind: 'toolkit', from: { dir: join(t.dir, 't') } });
  });
  after(async () => {
    await unmount(mounts, { detach: true }).catch(() => undefined);
    await t.cleanup();
  });

  void test('base + workspace + toolkit collapse to the overlay view, marks dropped', async () => {
    const expected = await view([base, ws, tk]);
    assert.ok(
      !expected.includes('etc/b=base b') && expected.includes('etc/a=tk a'),
      expected.join('\n'),
    );
    const merged = await collapseLayers(store, { refs: ['cb', 'cw', 'ct'], name: 'cbwt', mounter });
    assert.equal(merged.kind, 'base');
    assert.equal(merged.source, 'collapse');
    assert.deepEqual(merged.parents, ['cb:latest', 'cw:latest', 'ct:latest']);
    assert.ok(merged.blobDigest, 'a split input makes a split result');
    const got = await tree(await mountLayer(merged));
    assert.deepEqual(got, expected);
    assert.ok(!got.some((l) => l.includes('(whiteout)')));
  });

  void test('workspace + toolkit collapse keeps the marks that hide the base', async () => {
    const expected = await view([base, ws, tk]);
    const wt = await collapseLayers(store, {
      refs: ['cw', 'ct'],
      name: 'cwt',
      version: 'v1',
      mounter,
    });
    assert.equal(wt.kind, 'toolkit');
    assert.deepEqual(await view([base, wt]), expected);
    // The collapsed layer still says: etc/b is deleted (from below), opt/dir is opaque.
    const own = await tree(await mountLayer(wt));
    assert.ok(own.includes('etc/b (whiteout)'), own.join('\n'));
    assert.ok(own.includes('lib/old (whiteout)'), own.join('\n'));
    assert.ok(!own.includes('tk-deletes-this=ws file'));
  });

  void test('refuses a base above the bottom and a range above the size threshold', async () => {
    await assert.rejects(
      collapseLayers(store, { refs: ['cw', 'cb'], name: 'bad', mounter }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'refs.1',
    );
    await assert.rejects(
      collapseLayers(store, { refs: ['cb', 'cw'], name: 'bad', mounter, maxContentBytes: 10 }),
      (e) => isDsecError(e, 'invalid_argument'),
    );
    await assert.rejects(collapseLayers(store, { refs: ['cb'], name: 'bad', mounter }), (e) =>
      isDsecError(e, 'invalid_argument'),
    );
  });

  void test('layers a sandbox shaped (symlinks to a host directory) collapse without touching the host', async () => {
    const victim = join(t.dir, 'victim');
    await writeTree(victim, { a: 'host a', 'sub/b': 'host b', 'd/in/y': 'host y' });
    const before = await listing(victim);
    // A snapshot's tree: links to the host directory where the layers above put directories.
    const evil = join(t.dir, 'evil');
    await writeTree(evil, { 'd/keep': 'evil keep' });
    await symlink(victim, join(evil, 'root'));
    await symlink(`${'../'.repeat(30)}${victim.slice(1)}`, join(evil, 'rel'));
    await symlink(victim, join(evil, 'd', 'in'));
    await symlink(victim, join(evil, 'kept-link'));
    await buildLayer(store, { name: 'evil', kind: 'workspace', from: { dir: evil } });
    const over = join(t.dir, 'over');
    await writeTree(over, {
      'root/x': 'over x',
      'd/in/y': 'over y',
      rel: 'WHITEOUT',
      'sub/b': 'WHITEOUT',
    });
    await buildLayer(store, { name: 'over', kind: 'toolkit', from: { dir: over } });
    for (const refs of [
      ['evil', 'over'],
      ['cb', 'evil', 'over'],
    ]) {
      const merged = await collapseLayers(store, { refs, name: `evil-${refs.length}`, mounter });
      assert.deepEqual(await listing(victim), before, `the host directory is untouched (${refs})`);
      const mnt = await mountLayer(merged);
      assert.equal(await readlink(join(mnt, 'kept-link')), victim);
      assert.equal(await readFile(join(mnt, 'd', 'in', 'y'), 'utf8'), 'over y');
      assert.equal(await readFile(join(mnt, 'root', 'x'), 'utf8'), 'over x');
      // Under the lower link, the upper's directory: opaque over it, the link gone from view.
      assert.deepEqual(await readdir(join(mnt, 'root')), ['x']);
      assert.deepEqual((await readdir(join(mnt, 'd'))).sort(), ['in', 'keep']);
    }
  });
});
