import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, test } from 'node:test';
import {
  isDsecError,
  resolveLayer,
  type ErrorCode,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import { openImageStore } from './open.js';

export interface StoreUnderTest {
  store: ImageStore;
  cleanup(): Promise<void>;
}

/**
 * Registers the node:test suite every ImageStore implementation must pass.
 * Each test gets a fresh, empty store from `makeStore` and cleans it up.
 *
 * @example
 * ```ts
 * imageStoreConformance('DirImageStore', async () => {
 *   const root = await mkdtemp(join(tmpdir(), 'store-'));
 *   return { store: new DirImageStore(root), cleanup: () => rm(root, { recursive: true, force: true }) };
 * });
 * ```
 */
export function imageStoreConformance(
  name: string,
  makeStore: () => Promise<StoreUnderTest>,
): void {
  void describe(`ImageStore conformance: ${name}`, () => {
    let sut: StoreUnderTest;
    let scratch: string;
    let store: ImageStore;
    let n = 0;

    beforeEach(async () => {
      sut = await makeStore();
      store = sut.store;
      scratch = await mkdtemp(join(tmpdir(), 'dsec-conformance-'));
    });
    afterEach(async () => {
      await sut.cleanup();
      await rm(scratch, { recursive: true, force: true });
    });

    const file = async (content: string | Buffer): Promise<string> => {
      const path = join(scratch, `f${n++}`);
      await writeFile(path, content);
      return path;
    };
    const blob = async (content: string): Promise<string> =>
      (await store.putBlob(await file(content))).digest;
    const snapshotOf = (parent: string) => ({
      parents: ['base-img:v1'],
      parentDigests: [parent],
      source: 'snapshot',
    });
    const layer = (over: Partial<LayerInfo> & { digest: string }): LayerInfo => ({
      name: 'base-img',
      version: 'v1',
      kind: 'base',
      sizeBytes: 10,
      contentBytes: 5,
      fileCount: 2,
      createdAt: '2025-01-01T00:00:00.000Z',
      source: 'dir',
      ...over,
    });

    void test('putBlob stores content under its sha256 and reports its size', async () => {
      const content = Buffer.from('hello, layers\n'.repeat(100_000));
      const put = await store.putBlob(await file(content));
      assert.equal(put.digest, `sha256:${createHash('sha256').update(content).digest('hex')}`);
      assert.equal(put.sizeBytes, content.length);
      assert.equal(await store.hasBlob(put.digest), true);
      assert.deepEqual(await readFile(await store.blobPath(put.digest)), content);
    });

    void test('putBlob is idempotent, also when racing itself', async () => {
      const a = await file('same bytes');
      const b = await file('same bytes');
      const results = await Promise.all([store.putBlob(a), store.putBlob(b), store.putBlob(a)]);
      assert.equal(new Set(results.map((r) => r.digest)).size, 1);
      assert.notEqual(await blob('other bytes'), results[0]?.digest);
      assert.equal(await readFile(await store.blobPath(results[0].digest), 'utf8'), 'same bytes');
    });

    void test('putBlob with move stores the same blob; the given-up file may be gone', async () => {
      const content = Buffer.from('moved bytes\n'.repeat(50_000));
      const copied = await store.putBlob(await file(content));
      const src = await file(content);
      const moved = await store.putBlob(src, { move: true });
      assert.deepEqual(moved, copied);
      const fresh = await store.putBlob(await file('only moved'), { move: true });
      assert.deepEqual(await readFile(await store.blobPath(fresh.digest), 'utf8'), 'only moved');
      assert.deepEqual(await readFile(await store.blobPath(moved.digest)), content);
    });

    void test('an empty file is a valid blob', async () => {
      const put = await store.putBlob(await file(''));
      assert.equal(put.sizeBytes, 0);
      assert.equal(put.digest, `sha256:${createHash('sha256').digest('hex')}`);
      assert.equal(await store.hasBlob(put.digest), true);
    });

    void test('putBlob of a missing file is invalid_argument', async () => {
      await rejectsWith(store.putBlob(join(scratch, 'missing')), 'invalid_argument');
    });

    void test('an absent blob is reported, not invented', async () => {
      const absent = `sha256:${'0'.repeat(64)}`;
      assert.equal(await store.hasBlob(absent), false);
      await rejectsWith(store.blobPath(absent), 'image_not_found');
      await store.deleteBlob(absent);
    });

    void test('malformed digests are invalid_argument (no path tricks)', async () => {
      for (const bad of [
        '',
        'sha256:',
        'md5:abc',
        `sha256:${'A'.repeat(64)}`,
        'sha256:../../etc/passwd',
        `sha256:${'0'.repeat(63)}/`,
      ]) {
        await rejectsWith(store.hasBlob(bad), 'invalid_argument', bad);
        await rejectsWith(store.blobPath(bad), 'invalid_argument', bad);
        await rejectsWith(store.deleteBlob(bad), 'invalid_argument', bad);
      }
    });

    void test('a layer record round-trips; a bare name means :latest', async () => {
      const digest = await blob('image');
      const v1 = layer({ digest });
      const latest = layer({ digest, version: 'latest', kind: 'toolkit', source: 'tar' });
      await store.putLayer(v1);
      await store.putLayer(latest);
      assert.deepEqual(await store.getLayer('base-img:v1'), v1);
      assert.deepEqual(await store.getLayer('base-img'), latest);
      assert.deepEqual(await store.getLayer('base-img:latest'), latest);
    });

    void test('a split layer keeps its data blob digest', async () => {
      const split = layer({
        digest: await blob('meta'),
        blobDigest: await blob('data'),
        blobChunksDigest: await blob('chunks'),
      });
      await store.putLayer(split);
      assert.deepEqual(await store.getLayer('base-img:v1'), split);
    });

    void test('putLayer is idempotent for the same digest and conflicts for another', async () => {
      const d1 = await blob('one');
      const d2 = await blob('two');
      await store.putLayer(layer({ digest: d1 }));
      await store.putLayer(layer({ digest: d1, createdAt: '2030-01-01T00:00:00.000Z' }));
      await rejectsWith(store.putLayer(layer({ digest: d2 })), 'conflict');
      assert.equal((await store.getLayer('base-img:v1')).digest, d1);
      assert.equal((await store.listLayers()).length, 1);
    });

    void test('racing putLayer calls for one name: one wins, the rest conflict', async () => {
      const digests = await Promise.all(['a', 'b', 'c', 'd'].map(blob));
      const settled = await Promise.allSettled(
        digests.map((digest) => store.putLayer(layer({ digest }))),
      );
      const won = settled.filter((s) => s.status === 'fulfilled');
      assert.equal(won.length, 1);
      for (const s of settled) {
        if (s.status === 'rejected') assert.ok(isDsecError(s.reason, 'conflict'), String(s.reason));
      }
      const winner = digests[settled.findIndex((s) => s.status === 'fulfilled')];
      assert.equal((await store.getLayer('base-img:v1')).digest, winner);
    });

    void test('putLayer rejects bad records with the field at fault', async () => {
      const digest = await blob('x');
      const cases: [Partial<LayerInfo>, string][] = [
        [{ name: 'Bad_Name' }, 'name'],
        [{ name: '../etc' }, 'name'],
        [{ version: '../v1' }, 'version'],
        [{ version: '' }, 'version'],
        [{ kind: 'weird' as LayerInfo['kind'] }, 'kind'],
        [{ digest: 'sha256:nope' }, 'digest'],
        [{ digest: `sha256:${'1'.repeat(64)}` }, 'digest'],
        [{ blobDigest: `sha256:${'2'.repeat(64)}` }, 'blobDigest'],
        [{ blobDigest: digest, blobChunksDigest: `sha256:${'3'.repeat(64)}` }, 'blobChunksDigest'],
        [{ blobChunksDigest: digest }, 'blobChunksDigest'],
        [{ sizeBytes: -1 }, 'sizeBytes'],
        [{ fileCount: 1.5 }, 'fileCount'],
        [{ createdAt: 'yesterday' }, 'createdAt'],
      ];
      for (const [over, field] of cases) {
        await assert.rejects(
          store.putLayer(layer({ digest, ...over })),
          (e) => isDsecError(e, 'invalid_argument') && e.field === field,
          `${JSON.stringify(over)} → ${field}`,
        );
      }
      assert.deepEqual(await store.listLayers(), []);
    });

    void test('unknown and malformed references are image_not_found naming the ref', async () => {
      await store.putLayer(layer({ digest: await blob('x') }));
      for (const ref of [
        'nope',
        'base-img:v2',
        'Bad Name',
        '../../etc/passwd',
        'base-img:',
        ':v1',
        'a:b:c',
        '',
      ]) {
        await assert.rejects(
          store.getLayer(ref),
          (e) => isDsecError(e, 'image_not_found') && e.message.includes(ref),
          ref,
        );
        await rejectsWith(store.removeLayer(ref), 'image_not_found', ref);
      }
    });

    void test('listLayers returns every record, sorted by name then version', async () => {
      assert.deepEqual(await store.listLayers(), []);
      const digest = await blob('x');
      const refs = ['zeta:1', 'alpha:2', 'alpha:1', 'mid:latest'];
      for (const ref of refs) {
        const [name, version] = ref.split(':') as [string, string];
        await store.putLayer(layer({ digest, name, version }));
      }
      const listed = (await store.listLayers()).map((l) => `${l.name}:${l.version}`);
      assert.deepEqual(listed, ['alpha:1', 'alpha:2', 'mid:latest', 'zeta:1']);
    });

    void test('removeLayer drops the record and only the blobs nothing else uses', async () => {
      const shared = await blob('shared');
      const own = await blob('own');
      const data = await blob('data');
      await store.putLayer(layer({ name: 'a', digest: shared }));
      await store.putLayer(layer({ name: 'b', digest: own, blobDigest: shared }));
      await store.putLayer(layer({ name: 'c', digest: data }));
      await store.putLayer(layer({ name: 'c', version: 'v2', digest: data }));

      await store.removeLayer('b:v1');
      await rejectsWith(store.getLayer('b:v1'), 'image_not_found');
      assert.equal(await store.hasBlob(own), false);
      assert.equal(await store.hasBlob(shared), true);

      await store.removeLayer('a:v1');
      assert.equal(await store.hasBlob(shared), false);

      await store.removeLayer('c:v1');
      assert.equal(await store.hasBlob(data), true);
      await store.removeLayer('c:v2');
      assert.equal(await store.hasBlob(data), false);
      assert.deepEqual(await store.listLayers(), []);
      await rejectsWith(store.removeLayer('c:v2'), 'image_not_found');
    });

    void test('removeLayer of a bare name removes :latest', async () => {
      const digest = await blob('x');
      await store.putLayer(layer({ digest, version: 'latest' }));
      await store.putLayer(layer({ digest, version: 'v1' }));
      await store.removeLayer('base-img');
      assert.deepEqual(
        (await store.listLayers()).map((l) => l.version),
        ['v1'],
      );
      assert.equal(await store.hasBlob(digest), true);
    });

    void test('owners: one name:version per namespace, never clashing across them', async () => {
      const [d1, d2, d3, d4] = await Promise.all(['p', 'a', 'b', 'other'].map(blob));
      const platform = layer({ digest: d1! });
      const mine = layer({ digest: d2!, project: 'prj-a', kind: 'snapshot', ...snapshotOf(d1!) });
      const theirs = layer({ digest: d3!, project: 'prj-b' });
      // Whoever writes first, the others' puts of the same name succeed.
      await store.putLayer(theirs);
      await store.putLayer(mine);
      await store.putLayer(platform);
      assert.deepEqual(await store.getLayer('base-img:v1'), platform);
      assert.deepEqual(await store.getLayer('base-img:v1', { project: 'prj-a' }), mine);
      assert.deepEqual(await store.getLayer('base-img:v1', { project: 'prj-b' }), theirs);
      // Within one namespace a name still conflicts.
      await rejectsWith(store.putLayer({ ...mine, digest: d4! }), 'conflict');
      await store.putLayer({ ...mine, createdAt: '2031-01-01T00:00:00.000Z' });
      assert.deepEqual(
        (await store.listLayers()).map((l) => [l.name, l.project]),
        [
          ['base-img', undefined],
          ['base-img', 'prj-a'],
          ['base-img', 'prj-b'],
        ],
      );
    });

    void test('a record is found only in its own namespace', async () => {
      await store.putLayer(layer({ digest: await blob('x'), name: 'only-a', project: 'prj-a' }));
      await rejectsWith(store.getLayer('only-a:v1'), 'image_not_found', 'platform');
      await rejectsWith(store.getLayer('only-a:v1', { project: 'prj-b' }), 'image_not_found');
      await rejectsWith(store.removeLayer('only-a:v1'), 'image_not_found');
      await rejectsWith(store.removeLayer('only-a:v1', { project: 'prj-b' }), 'image_not_found');
      assert.equal((await store.getLayer('only-a:v1', { project: 'prj-a' })).project, 'prj-a');
      // A project option naming nothing is the platform's namespace.
      await store.putLayer(layer({ digest: await blob('y'), name: 'plat' }));
      assert.equal((await store.getLayer('plat:v1', { project: undefined })).project, undefined);
    });

    void test('listLayers of some projects reads the platform’s and theirs, no other namespace', async () => {
      const digest = await blob('x');
      await store.putLayer(layer({ digest, name: 'plat' }));
      for (const project of ['prj-a', 'prj-b', 'prj-c'])
        await store.putLayer(layer({ digest, name: `of-${project}`, project }));
      const listed = async (projects: string[]) =>
        (await store.listLayers({ projects })).map((l) => `${l.project ?? '-'}/${l.name}`);
      assert.deepEqual(await listed(['prj-a', 'prj-c']), [
        'prj-a/of-prj-a',
        'prj-c/of-prj-c',
        '-/plat',
      ]);
      assert.deepEqual(await listed([]), ['-/plat']);
      // Malformed or repeated names list nothing more (no path or key of the caller's making).
      assert.deepEqual(await listed(['prj-a', 'prj-a', '../prj-b', 'prj-b/..', '']), [
        'prj-a/of-prj-a',
        '-/plat',
      ]);
      assert.equal((await store.listLayers()).length, 4);
    });

    void test('malformed owners: image_not_found to look up, invalid_argument to write', async () => {
      const digest = await blob('x');
      await store.putLayer(layer({ digest }));
      for (const project of ['', '../prj-a', 'prj-a/..', 'a/b', '.', 'prj a', 'x'.repeat(129)]) {
        await rejectsWith(store.getLayer('base-img:v1', { project }), 'image_not_found', project);
        await rejectsWith(
          store.removeLayer('base-img:v1', { project }),
          'image_not_found',
          project,
        );
        await assert.rejects(
          store.putLayer(layer({ digest, project })),
          (e) => isDsecError(e, 'invalid_argument') && e.field === 'project',
          JSON.stringify(project),
        );
      }
      assert.deepEqual((await store.listLayers()).length, 1);
    });

    void test('removing one owner’s record keeps the others’ and the blobs they use', async () => {
      const shared = await blob('shared');
      await store.putLayer(layer({ digest: shared }));
      await store.putLayer(layer({ digest: shared, project: 'prj-a' }));
      await store.removeLayer('base-img:v1', { project: 'prj-a' });
      await rejectsWith(store.getLayer('base-img:v1', { project: 'prj-a' }), 'image_not_found');
      assert.equal((await store.getLayer('base-img:v1')).digest, shared);
      assert.equal(await store.hasBlob(shared), true);
      // A blob only a project's record uses is in use.
      const own = await blob('own');
      await store.putLayer(layer({ digest: own, name: 'mine', project: 'prj-a' }));
      await rejectsWith(store.deleteBlob(own), 'conflict');
      await store.removeLayer('mine:v1', { project: 'prj-a' });
      assert.equal(await store.hasBlob(own), false);
      await store.removeLayer('base-img:v1');
      assert.equal(await store.hasBlob(shared), false);
      assert.deepEqual(await store.listLayers(), []);
    });

    void test('resolveLayer: the platform first, then the view root first, never outside it', async () => {
      const [dp, dr, dc, dx] = await Promise.all(['p', 'r', 'c', 'x'].map(blob));
      await store.putLayer(layer({ name: 'shared', digest: dr!, project: 'prj-root' }));
      await store.putLayer(layer({ name: 'shared', digest: dc!, project: 'prj-child' }));
      await store.putLayer(layer({ name: 'own', digest: dc!, project: 'prj-child' }));
      await store.putLayer(layer({ name: 'foreign', digest: dx!, project: 'prj-other' }));
      const view = ['prj-root', 'prj-child'];
      assert.equal((await resolveLayer(store, 'shared:v1', view)).project, 'prj-root');
      assert.equal((await resolveLayer(store, 'own:v1', view)).project, 'prj-child');
      await assert.rejects(
        resolveLayer(store, 'foreign:v1', view),
        (e) => isDsecError(e, 'image_not_found') && !e.message.includes('prj-'),
      );
      await assert.rejects(resolveLayer(store, 'own:v1', []), (e) =>
        isDsecError(e, 'image_not_found'),
      );
      // A platform layer of the name, built later, wins over every project's.
      await store.putLayer(layer({ name: 'shared', digest: dp! }));
      assert.equal((await resolveLayer(store, 'shared:v1', view)).project, undefined);
      assert.equal((await resolveLayer(store, 'shared:v1', view)).digest, dp);
    });

    void test('deleteBlob removes an unused blob and refuses one a layer uses', async () => {
      const used = await blob('used');
      const unused = await blob('unused');
      await store.putLayer(layer({ digest: used }));
      await rejectsWith(store.deleteBlob(used), 'conflict');
      assert.equal(await store.hasBlob(used), true);
      await store.deleteBlob(unused);
      assert.equal(await store.hasBlob(unused), false);
      await rejectsWith(store.blobPath(unused), 'image_not_found');
    });

    void test('statBlob reports the size; absent is image_not_found, malformed invalid_argument', async () => {
      const { digest } = await store.putBlob(await file('twelve bytes'));
      assert.deepEqual(await store.statBlob(digest), { sizeBytes: 12 });
      const empty = await store.putBlob(await file(''));
      assert.deepEqual(await store.statBlob(empty.digest), { sizeBytes: 0 });
      await rejectsWith(store.statBlob(`sha256:${'0'.repeat(64)}`), 'image_not_found');
      await rejectsWith(store.statBlob('sha256:../../etc/passwd'), 'invalid_argument');
    });

    void test('readBlobRange reads exactly the range, short at the end, empty past it', async () => {
      const content = Buffer.from(Array.from({ length: 300_000 }, (_, i) => (i * 7) % 251));
      const { digest } = await store.putBlob(await file(content));
      const size = content.length;
      assert.deepEqual(await store.readBlobRange(digest, 0, 10), content.subarray(0, 10));
      assert.deepEqual(
        await store.readBlobRange(digest, 123_457, 65_536),
        content.subarray(123_457, 123_457 + 65_536),
      );
      assert.deepEqual(await store.readBlobRange(digest, size - 5, 100), content.subarray(-5));
      assert.deepEqual(await store.readBlobRange(digest, 0, size + 10), content);
      assert.equal((await store.readBlobRange(digest, size, 10)).length, 0);
      assert.equal((await store.readBlobRange(digest, size + 1000, 10)).length, 0);
      assert.equal((await store.readBlobRange(digest, 100, 0)).length, 0);
      const empty = await store.putBlob(await file(''));
      assert.equal((await store.readBlobRange(empty.digest, 0, 10)).length, 0);
    });

    void test('readBlobRange rejects bad ranges naming the field, and absent blobs', async () => {
      const digest = await blob('0123456789');
      const cases: [number, number, string][] = [
        [-1, 1, 'offset'],
        [1.5, 1, 'offset'],
        [Number.NaN, 1, 'offset'],
        [0, -1, 'length'],
        [0, 2.5, 'length'],
        [0, Number.POSITIVE_INFINITY, 'length'],
      ];
      for (const [offset, length, field] of cases) {
        await assert.rejects(
          store.readBlobRange(digest, offset, length),
          (e) => isDsecError(e, 'invalid_argument') && e.field === field,
          `${offset}, ${length} → ${field}`,
        );
      }
      const absent = `sha256:${'0'.repeat(64)}`;
      await rejectsWith(store.readBlobRange(absent, 0, 10), 'image_not_found');
      await rejectsWith(store.readBlobRange(absent, 0, 0), 'image_not_found');
      await rejectsWith(store.readBlobRange('md5:abc', 0, 10), 'invalid_argument');
    });

    void test('local and location: a secret-free location that reopens the same store', async () => {
      assert.equal(typeof store.local, 'boolean');
      assert.equal(typeof store.location, 'string');
      assert.notEqual(store.location, '');
      assert.doesNotMatch(store.location, /:\/\/[^/?#]*@/, 'no user:password@ in the location');
      assert.doesNotMatch(store.location, /secret|password|token|accesskey|credential/i);
      const { digest } = await store.putBlob(await file('reopen me'));
      let reopened: ImageStore;
      try {
        reopened = openImageStore(store.location, { cacheDir: join(scratch, 'cache') });
      } catch (err) {
        // A store openImageStore does not know (an in-memory fake) need not reopen.
        if (isDsecError(err, 'invalid_argument') && err.field === 'store') return;
        throw err;
      }
      assert.equal(reopened.kind, store.kind);
      assert.equal(reopened.local, store.local);
      assert.equal(reopened.location, store.location);
      assert.equal(await reopened.hasBlob(digest), true);
      assert.equal(await readFile(await reopened.blobPath(digest), 'utf8'), 'reopen me');
    });

    void test('an aborted putBlob stores nothing and says aborted', async () => {
      const ac = new AbortController();
      ac.abort();
      await rejectsWith(store.putBlob(await file('x'), { signal: ac.signal }), 'aborted');
    });
  });
}

async function rejectsWith(p: Promise<unknown>, code: ErrorCode, what = ''): Promise<void> {
  await assert.rejects(p, (e) => isDsecError(e, code), `${what} should be ${code}`);
}
