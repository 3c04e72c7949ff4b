import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { afterEach, beforeEach, test } from 'node:test';
import { DsecError, type ImageStore, type LayerInfo } from '@dsec/core';
import { LayerMountCache, type LayerMounter } from './layer-cache.js';

class FakeMounter implements LayerMounter {
  readonly mounted = new Map<string, { image: string; blobDevice?: string | undefined }>();
  mountCalls = 0;
  failNext = false;
  async mountErofs(image: string, target: string, options: { blobDevice?: string } = {}) {
    this.mountCalls++;
    await sleep(5); // a real mount takes time: concurrent acquires overlap
    if (this.failNext) {
      this.failNext = false;
      throw new DsecError('internal', 'mount failed');
    }
    this.mounted.set(target, { image, blobDevice: options.blobDevice });
  }
  async unmount(targets: string[]) {
    for (const t of targets) this.mounted.delete(t);
  }
}

let dir: string;
let blobs: Map<string, string>;
let store: ImageStore;
let mounter: FakeMounter;

async function blob(content: string): Promise<string> {
  const digest = `sha256:${createHash('sha256').update(content).digest('hex')}`;
  const file = join(dir, 'blobs', digest.slice(7));
  await writeFile(file, content);
  blobs.set(digest, file);
  return digest;
}

async function layer(name: string, sizeBytes: number, split = false): Promise<LayerInfo> {
  return {
    name,
    version: 'v1',
    kind: 'toolkit',
    digest: await blob(`meta of ${name}`),
    ...(split ? { blobDigest: await blob(`data of ${name}`) } : {}),
    sizeBytes,
    contentBytes: sizeBytes,
    fileCount: 1,
    createdAt: new Date(0).toISOString(),
    source: 'dir',
  };
}

beforeEach(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-layer-cache-'));
  await mkdir(join(dir, 'blobs'));
  blobs = new Map();
  mounter = new FakeMounter();
  store = {
    kind: 'fake',
    local: true,
    blobPath: async (d: string) => {
      const f = blobs.get(d);
      if (!f) throw new DsecError('image_not_found', `no blob ${d}`);
      return f;
    },
  } as unknown as ImageStore;
});
afterEach(async () => {
  await rm(dir, { recursive: true, force: true });
});

void test('concurrent acquires of one layer mount it once and share the directory', async () => {
  const cache = new LayerMountCache(join(dir, 'layers'), store, mounter, 1e9);
  const l = await layer('shared', 100);
  const dirs = await Promise.all(Array.from({ length: 16 }, () => cache.acquire(l)));
  assert.equal(mounter.mountCalls, 1);
  assert.equal(new Set(dirs).size, 1);
  assert.deepEqual(cache.stats(), { mounted: 1, inUse: 1, bytes: 100 });
  for (let i = 0; i < 16; i++) cache.release(l.digest);
  assert.equal(cache.stats().inUse, 0);
  await cache.close();
  assert.equal(mounter.mounted.size, 0);
});

void test('unused layers are unmounted least recently used first, only above the budget', async () => {
  const cache = new LayerMountCache(join(dir, 'layers'), store, mounter, 250);
  const [a, b, c, d] = await Promise.all(['a', 'b', 'c', 'd'].map((n) => layer(n, 100)));
  const use = async (l: LayerInfo) => {
    const p = await cache.acquire(l);
    await sleep(3);
    cache.release(l.digest);
    await sleep(3);
    return p;
  };
  const pa = await use(a!);
  await use(b!);
  await use(a!); // a is now more recent than b
  assert.equal(mounter.mounted.size, 2, 'under budget: both stay mounted');
  const pc = await use(c!); // 300 > 250: b (least recent) goes
  assert.deepEqual([...mounter.mounted.keys()].sort(), [pa, pc].sort());
  // A layer in use is never unmounted, whatever the budget says.
  await cache.acquire(d!);
  await cache.trim(0);
  assert.deepEqual([...mounter.mounted.keys()], [join(dir, 'layers', d!.digest.slice(7, 39))]);
  cache.release(d!.digest);
  await cache.close();
  assert.equal(mounter.mounted.size, 0);
});

void test('a split layer mounts a local copy of its metadata with the data blob from the store', async () => {
  const cache = new LayerMountCache(join(dir, 'layers'), store, mounter, 1e9);
  const l = await layer('split', 100, true);
  const target = await cache.acquire(l);
  const m = mounter.mounted.get(target)!;
  assert.ok(m.image.startsWith(join(dir, 'layers')), `metadata is local: ${m.image}`);
  assert.notEqual(m.image, blobs.get(l.digest));
  assert.equal(m.blobDevice, blobs.get(l.blobDigest!), 'data is read from the store in place');
  assert.equal((await stat(m.image)).size, 'meta of split'.length);
  cache.release(l.digest);
  await cache.close();
  assert.deepEqual(
    await readdir(join(dir, 'layers', '.meta')),
    [],
    'local metadata dropped on unmount',
  );
});

void test('a corrupt metadata blob is refused; a failed mount is retried by the next acquire', async () => {
  const cache = new LayerMountCache(join(dir, 'layers'), store, mounter, 1e9);
  const l = await layer('corrupt', 100, true);
  await writeFile(blobs.get(l.digest)!, 'tampered');
  await assert.rejects(cache.acquire(l), (e) => e instanceof DsecError && e.code === 'internal');
  assert.equal(cache.stats().mounted, 0);

  const ok = await layer('flaky', 100);
  mounter.failNext = true;
  await assert.rejects(cache.acquire(ok));
  assert.equal(cache.stats().mounted, 0);
  await cache.acquire(ok);
  assert.equal(cache.stats().inUse, 1);
  cache.release(ok.digest);
  await cache.close();
});

void test('a remote store: data blobs come from the blob server, which stops when no layer reads through it', async () => {
  const remote = { ...store, local: false } as ImageStore;
  const served: string[] = [];
  let stops = 0;
  const blobServer = {
    pathFor: async (digest: string) => {
      served.push(digest);
      return join(dir, 'fuse', digest.slice(7));
    },
    stop: async () => {
      stops++;
    },
  };
  assert.throws(
    () => new LayerMountCache(join(dir, 'layers'), remote, mounter, 1e9),
    (e) => e instanceof DsecError && e.code === 'invalid_argument',
    'a remote store without a blob server is refused',
  );
  const cache = new LayerMountCache(join(dir, 'layers'), remote, mounter, 1e9, blobServer);
  const l = await layer('remote', 100, true);
  const target = await cache.acquire(l);
  assert.equal(mounter.mounted.get(target)!.blobDevice, join(dir, 'fuse', l.blobDigest!.slice(7)));
  assert.deepEqual(served, [l.blobDigest]);
  await cache.close();
  assert.equal(stops, 0, 'a layer in use keeps the blob server');
  cache.release(l.digest);
  await cache.close();
  assert.equal(stops, 1);
  assert.equal(mounter.mounted.size, 0);
});
