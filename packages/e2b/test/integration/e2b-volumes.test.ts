import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Sandbox, Volume } from 'e2b';
import { withE2bNode, useE2b } from './e2b-node.js';

/**
 * E2B's volumes with the unmodified `e2b` SDK against a real node
 * (docs/volumes.md, docs/e2b.md): `Volume.create/list/getInfo/destroy` on
 * DSec's volumes, and `volumeMounts` carrying files from one sandbox to the next.
 */
test('E2B SDK: a volume made with Volume.create carries files between sandboxes', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const vol = await Volume.create('e2b-data');
    assert.equal(vol.volumeId, 'e2b-data');
    assert.deepEqual(
      (await Volume.list()).map((v) => v.name),
      ['e2b-data'],
    );
    assert.equal((await Volume.getInfo('e2b-data')).name, 'e2b-data');

    const a = await Sandbox.create('base', { volumeMounts: { '/data': vol } });
    await a.files.write('/data/note', 'kept across sandboxes');
    const ids = await a.commands.run('stat -c %u:%a /data/note');
    // Written as E2B's default user, `user` (uid 1000), who may write the volume's root.
    assert.match(ids.stdout, /^1000:/);
    await a.kill();

    const b = await Sandbox.create('base', { volumeMounts: { '/mnt/shared': 'e2b-data' } });
    assert.equal(await b.files.read('/mnt/shared/note'), 'kept across sandboxes');
    await assert.rejects(Volume.destroy('e2b-data'), /mounted|409/);
    await b.kill();
    assert.equal(await Volume.destroy('e2b-data'), true);
    assert.deepEqual(await Volume.list(), []);
  });
});
