/**
 * The blob daemon over real FUSE (needs root and /dev/fuse): blobs of a
 * DirImageStore read through `<mount>/<hex>`, on-demand chunk fetching, a
 * small cache budget, a split EROFS layer whose data blob lives on the
 * mount, crash recovery with a warm cache, and a clean stop.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, open, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { buildLayer, DirImageStore } from '@dsec/images';
import { mountErofs, unmount } from '@dsec/native';
import { BlobDaemon } from '@dsec/edge';

const skip =
  process.getuid?.() !== 0
    ? 'needs root'
    : !existsSync('/dev/fuse')
      ? 'needs /dev/fuse'
      : !existsSync('/usr/bin/mkfs.erofs')
        ? 'needs mkfs.erofs'
        : false;

const KiB = 1024;
const MiB = 1024 * KiB;
const CHUNK = 256 * KiB;

interface Fixture {
  dir: string;
  store: DirImageStore;
  data: Buffer;
  digest: string;
  mountDir: string;
  cacheDir: string;
  start(options?: { cacheBytes?: number }): Promise<BlobDaemon>;
}

async function mountsUnder(dir: string): Promise<string[]> {
  const info = await readFile('/proc/self/mountinfo', 'utf8');
  return info
    .split('\n')
    .map((l) => l.split(' ')[4] ?? '')
    .filter((p) => p === dir || p.startsWith(`${dir}/`));
}

/** True while `pid` runs (a zombie counts as gone). */
function alive(pid: number): boolean {
  let text = '';
  try {
    text = readFileSync(`/proc/${pid}/stat`, 'utf8');
  } catch {
    return false;
  }
  return !/\) Z /.test(text);
}

/**
 * A temp dir with a store holding one random blob. Everything the test
 * mounts or starts under it is undone afterwards, even when it fails.
 */
async function fixture(
  t: { after: (fn: () => Promise<void>) => void },
  blobBytes = 6 * MiB + 1234,
): Promise<Fixture> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-blobd-'));
  const store = new DirImageStore(join(dir, 'store'));
  const data = randomBytes(blobBytes);
  await writeFile(join(dir, 'blob'), data);
  const { digest } = await store.putBlob(join(dir, 'blob'));
  const mountDir = join(dir, 'mnt');
  const cacheDir = join(dir, 'cache');
  const pids = new Set<number>();
  t.after(async () => {
    for (const m of (await mountsUnder(dir)).reverse())
      await unmount([m], { detach: true }).catch(() => undefined);
    for (const pid of pids)
      if (alive(pid)) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          // already gone
        }
      }
    await rm(dir, { recursive: true, force: true });
  });
  return {
    dir,
    store,
    data,
    digest,
    mountDir,
    cacheDir,
    async start(options = {}) {
      const daemon = await BlobDaemon.start({
        mountDir,
        cacheDir,
        storeLocation: store.location,
        chunkBytes: CHUNK,
        ...options,
      });
      pids.add(daemon.pid);
      return daemon;
    },
  };
}

async function readAt(path: string, offset: number, length: number): Promise<Buffer> {
  const fh = await open(path, 'r');
  try {
    const buf = Buffer.alloc(length);
    const { bytesRead } = await fh.read(buf, 0, length, offset);
    return buf.subarray(0, bytesRead);
  } finally {
    await fh.close();
  }
}

async function waitGone(pid: number): Promise<void> {
  for (let i = 0; i < 200 && alive(pid); i++) await new Promise((r) => setTimeout(r, 20));
}

describe('blob daemon (FUSE)', { skip }, () => {
  test('serves blobs byte-exact and fetches only the touched chunks', async (t) => {
    const f = await fixture(t);
    const daemon = await f.start();
    assert.equal(daemon.adopted, false);
    const path = daemon.pathFor(f.digest);
    assert.equal((await stat(path)).size, f.data.length);
    assert.equal((await stat(path)).mode & 0o7777, 0o444);
    // Mid-chunk offsets, so the kernel's 128 KiB readahead stays in the chunk.
    const ranges: [number, number][] = [
      [1000, 100],
      [3 * CHUNK + 5000, 4096],
      [10 * CHUNK + 77, 20_000],
      [f.data.length - 10, 100],
    ];
    for (const [off, len] of ranges)
      assert.ok(
        (await readAt(path, off, len)).equals(f.data.subarray(off, off + len)),
        `range ${off}+${len}`,
      );
    const s = await daemon.stats();
    assert.equal(s.cache.fetches, 4);
    assert.equal(s.cache.bytesFetched, 3 * CHUNK + (f.data.length % CHUNK));
    assert.equal(s.daemon.knownBlobs, 1);
    assert.equal(s.daemon.ioErrors, 0);

    const entries = await readdir(f.mountDir);
    assert.deepEqual(entries.sort(), ['.stats', f.digest.slice('sha256:'.length)].sort());
    await assert.rejects(stat(daemon.pathFor(`sha256:${'0'.repeat(64)}`)), { code: 'ENOENT' });
    await assert.rejects(stat(join(f.mountDir, 'not-a-digest')), { code: 'ENOENT' });
    await assert.rejects(writeFile(join(f.mountDir, 'x'), 'x'), { code: 'EROFS' });
    assert.throws(() => daemon.pathFor('sha256:xyz'), { code: 'invalid_argument' });

    // The whole blob, sequentially.
    assert.ok((await readFile(path)).equals(f.data));
    await daemon.stop();
    assert.deepEqual(await mountsUnder(f.dir), []);
    assert.equal(alive(daemon.pid), false);
  });

  test('a cache budget smaller than the blob evicts yet reads stay correct', async (t) => {
    const f = await fixture(t);
    const daemon = await f.start({ cacheBytes: 2 * CHUNK });
    assert.ok((await readFile(daemon.pathFor(f.digest))).equals(f.data));
    for (const off of [5 * CHUNK + 3, 100, 20 * CHUNK + 9])
      assert.ok(
        (await readAt(daemon.pathFor(f.digest), off, 1000)).equals(
          f.data.subarray(off, off + 1000),
        ),
      );
    const s = await daemon.stats();
    assert.ok(s.cache.evictions > 0, JSON.stringify(s.cache));
    assert.ok(s.cache.cachedBytes <= 2 * CHUNK);
    assert.ok((await readdir(join(f.cacheDir, 'chunks'))).length <= 2);
    await daemon.stop();
  });

  test('a split EROFS layer mounts with its data blob on the daemon', async (t) => {
    const f = await fixture(t, 1);
    const src = join(f.dir, 'tree');
    await mkdir(join(src, 'sub'), { recursive: true });
    const files: Record<string, Buffer> = {
      'big.bin': randomBytes(3 * MiB + 17),
      'sub/small.txt': Buffer.from('hello from a split layer\n'),
      'sub/mid.bin': randomBytes(300 * KiB),
    };
    for (const [name, content] of Object.entries(files)) await writeFile(join(src, name), content);
    const layer = await buildLayer(f.store, {
      name: 'blobd-test',
      kind: 'toolkit',
      from: { dir: src },
      split: true,
    });
    assert.ok(layer.blobDigest);
    const daemon = await f.start();
    const target = join(f.dir, 'layer');
    await mkdir(target);
    await mountErofs(await f.store.blobPath(layer.digest), target, {
      blobDevice: daemon.pathFor(layer.blobDigest),
    });
    try {
      for (const [name, content] of Object.entries(files))
        assert.ok((await readFile(join(target, name))).equals(content), name);
    } finally {
      await unmount([target]);
    }
    assert.ok((await daemon.stats()).cache.fetches > 0);
    await daemon.stop();
  });

  test('adopts a live daemon, recovers from a killed one with its warm cache', async (t) => {
    const f = await fixture(t);
    const first = await f.start();
    const path = first.pathFor(f.digest);
    const ranges: [number, number][] = [
      [100, 5000],
      [7 * CHUNK + 11, 9000],
    ];
    for (const [off, len] of ranges)
      assert.ok((await readAt(path, off, len)).equals(f.data.subarray(off, off + len)));
    const warm = await first.stats();

    const again = await f.start();
    assert.equal(again.adopted, true);
    assert.equal(again.pid, first.pid);

    process.kill(first.pid, 'SIGKILL');
    await waitGone(first.pid);
    const second = await f.start();
    assert.equal(second.adopted, false);
    assert.notEqual(second.pid, first.pid);
    assert.equal((await mountsUnder(f.mountDir)).length, 1); // the stale mount was detached
    for (const [off, len] of ranges)
      assert.ok((await readAt(path, off, len)).equals(f.data.subarray(off, off + len)));
    const s = await second.stats();
    assert.equal(s.cache.fetches, 0);
    assert.equal(s.cache.cachedChunks, warm.cache.cachedChunks);
    assert.ok(s.cache.hits > 0);

    await second.stop();
    assert.deepEqual(await mountsUnder(f.dir), []);
    assert.equal(alive(second.pid), false);
    assert.equal(existsSync(join(f.cacheDir, 'blobd.pid')), false);
  });
});
