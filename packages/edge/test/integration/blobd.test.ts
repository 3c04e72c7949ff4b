/**
 * The blob daemon over real FUSE (needs root and /dev/fuse): blobs of a
 * DirImageStore read through `<mount>/<hex>`, on-demand chunk fetching, a
 * small cache budget, a split EROFS layer whose data blob lives on the
 * mount, crash recovery with a warm cache, a clean stop, and verified names
 * (`<hex>.<chunk table hex>`) that turn a corrupted store blob into EIO.
 */
import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, open, readFile, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { buildLayer, DirImageStore } from '@dsec/images';
import { mountErofs, unmount } from '@dsec/native';
import { CHUNK_TABLE_CHUNK_BYTES, encodeChunkTable } from '@dsec/core';
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
  start(options?: { cacheBytes?: number; chunkBytes?: number }): Promise<BlobDaemon>;
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

/** Puts `data`'s chunk table (sha256 of each `chunkBytes` slice) into the store. */
async function putTable(
  store: DirImageStore,
  dir: string,
  data: Buffer,
  chunkBytes = CHUNK_TABLE_CHUNK_BYTES,
): Promise<string> {
  const digests: Buffer[] = [];
  for (let at = 0; at < data.length; at += chunkBytes)
    digests.push(
      createHash('sha256')
        .update(data.subarray(at, at + chunkBytes))
        .digest(),
    );
  const file = join(dir, `table-${chunkBytes}-${digests.length}-${randomBytes(4).toString('hex')}`);
  await writeFile(file, encodeChunkTable(chunkBytes, digests));
  return (await store.putBlob(file)).digest;
}

/** Overwrites `bytes` at `offset` of the stored blob (mode 0444; root may). */
async function corrupt(store: DirImageStore, digest: string, offset: number, bytes: Buffer) {
  const fh = await open(await store.blobPath(digest), 'r+');
  try {
    await fh.write(bytes, 0, bytes.length, offset);
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
      // CI runs this file once more with loop devices (older kernels' path).
      loop: process.env.DSEC_EROFS_MOUNT === 'loop',
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

  test('a verified name checks every chunk against its chunk table', async (t) => {
    const f = await fixture(t);
    // A table of 1 MiB chunks (what layers were built with before 256 KiB) on a
    // daemon of 256 KiB chunks: reads of that name are cut at the table's size.
    const M = 1 << 20;
    assert.notEqual(CHUNK, M);
    const table = await putTable(f.store, f.dir, f.data, M);
    const daemon = await f.start();
    const hex = f.digest.slice('sha256:'.length);
    const path = daemon.pathFor(f.digest, { chunkTable: table });
    assert.equal(path, join(f.mountDir, `${hex}.${table.slice('sha256:'.length)}`));
    assert.equal((await stat(path)).size, f.data.length);
    assert.equal((await stat(path)).mode & 0o7777, 0o444);
    const good: [number, number][] = [
      [1000, 100],
      [2 * M + 5000, 4096],
      [f.data.length - 10, 100],
    ];
    for (const [off, len] of good)
      assert.ok(
        (await readAt(path, off, len)).equals(f.data.subarray(off, off + len)),
        `range ${off}+${len}`,
      );

    // Chunk 4 changes in the store behind the daemon's back.
    await corrupt(f.store, f.digest, 4 * M + 300_000, Buffer.from('not the bytes you hashed'));
    await assert.rejects(readAt(path, 4 * M + 1000, 100), { code: 'EIO' });
    await assert.rejects(readAt(path, 4 * M + 600_000, 100), { code: 'EIO' });
    for (const [off, len] of [...good, [5 * M + 77, 20_000] as [number, number]])
      assert.ok(
        (await readAt(path, off, len)).equals(f.data.subarray(off, off + len)),
        `range ${off}+${len} after the corruption`,
      );
    const s = await daemon.stats();
    assert.ok(s.cache.corruptChunks >= 1, JSON.stringify(s.cache));
    assert.equal(s.cache.verifiedChunks, 4); // chunks 0, 2, 5 and 6
    assert.ok(s.daemon.ioErrors >= 2);
    assert.ok(
      !(await readdir(join(f.cacheDir, 'chunks'))).some((n) => n.startsWith(`${hex}.${M}.4`)),
    );

    // Tables that do not fit: a missing one, one whose bytes do not match its
    // digest, one whose chunk size no cache can hold.
    await assert.rejects(
      stat(daemon.pathFor(f.digest, { chunkTable: `sha256:${'1'.repeat(64)}` })),
      {
        code: 'ENOENT',
      },
    );
    const other = randomBytes(2 * M + 5);
    await writeFile(join(f.dir, 'other'), other);
    const otherDigest = (await f.store.putBlob(join(f.dir, 'other'))).digest;
    const otherTable = await putTable(f.store, f.dir, other);
    await corrupt(f.store, otherTable, 20, Buffer.from([0xff, 0xfe]));
    await assert.rejects(stat(daemon.pathFor(otherDigest, { chunkTable: otherTable })), {
      code: 'EIO',
    });
    const oddChunks = await putTable(f.store, f.dir, f.data, 100_000);
    await assert.rejects(stat(daemon.pathFor(f.digest, { chunkTable: oddChunks })), {
      code: 'EIO',
    });
    // A table of another blob: its chunk count does not fit.
    await assert.rejects(
      stat(daemon.pathFor(f.digest, { chunkTable: await putTable(f.store, f.dir, other) })),
      {
        code: 'EIO',
      },
    );
    // The bare name still reads, unverified.
    assert.ok(
      (await readAt(daemon.pathFor(f.digest), 1000, 100)).equals(f.data.subarray(1000, 1100)),
    );
    await daemon.stop();
    const log = await readFile(join(f.cacheDir, 'blobd.log'), 'utf8');
    assert.match(log, /chunk 4 of sha256:[0-9a-f]{64} does not match its digest/);
    assert.match(log, /do not match its digest/);
    assert.match(log, /chunk size 100000 is not a power of two/);
    assert.deepEqual(await mountsUnder(f.dir), []);
  });
});
