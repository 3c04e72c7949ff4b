import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { isDsecError } from '@dsec/core';
import { startS3Server, type S3TestServer } from '../testing/s3-server.js';
import { imageStoreConformance } from './conformance.js';
import { openImageStore } from './open.js';
import { S3ImageStore, type S3ImageStoreOptions } from './s3-store.js';

// s3rver checks no signatures; explicit credentials keep the SDK from looking
// anywhere else (profiles, instance metadata) for them.
const credentials = { accessKeyId: 'S3RVER', secretAccessKey: 'S3RVER' };
process.env.AWS_ACCESS_KEY_ID = credentials.accessKeyId;
process.env.AWS_SECRET_ACCESS_KEY = credentials.secretAccessKey;
process.env.AWS_EC2_METADATA_DISABLED = 'true';
process.env.AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED ??= 'true';

let s3: S3TestServer;
let scratch: string;
let runs = 0;

before(async () => {
  s3 = await startS3Server();
  scratch = await mkdtemp(join(tmpdir(), 'dsec-s3-store-test-'));
});
after(async () => {
  await s3.close();
  await rm(scratch, { recursive: true, force: true });
});

/** A store on the shared server under a prefix of its own, with its own cache. */
async function freshStore(over: Partial<S3ImageStoreOptions> = {}): Promise<{
  store: S3ImageStore;
  cacheDir: string;
  cleanup(): Promise<void>;
}> {
  const cacheDir = await mkdtemp(join(scratch, 'cache-'));
  const store = new S3ImageStore({
    bucket: s3.bucket,
    prefix: `run-${++runs}/`,
    endpoint: s3.endpoint,
    credentials,
    cacheDir,
    ...over,
  });
  return { store, cacheDir, cleanup: () => rm(cacheDir, { recursive: true, force: true }) };
}

async function writeTemp(content: Buffer | string): Promise<string> {
  const path = join(scratch, `in-${randomBytes(6).toString('hex')}`);
  await writeFile(path, content);
  return path;
}

function sha256(content: Buffer | string): string {
  return `sha256:${createHash('sha256').update(content).digest('hex')}`;
}

imageStoreConformance('S3ImageStore (s3rver)', () => freshStore());

void describe('S3ImageStore', () => {
  void test('lays blobs and records out under the prefix as documented', async () => {
    const { store, cleanup } = await freshStore();
    try {
      const { digest } = await store.putBlob(await writeTemp('bytes'));
      await store.putLayer({
        name: 'demo',
        version: 'v1',
        kind: 'base',
        digest,
        sizeBytes: 5,
        contentBytes: 5,
        fileCount: 1,
        createdAt: new Date(0).toISOString(),
        source: 'dir',
      });
      const bucketDir = join(s3.dir, s3.bucket, store.prefix);
      const blobs = await readdir(join(bucketDir, 'blobs', 'sha256'));
      assert.ok(
        blobs.some((f) => f.startsWith(digest.slice('sha256:'.length))),
        String(blobs),
      );
      const records = await readdir(join(bucketDir, 'layers', 'demo'));
      assert.ok(
        records.some((f) => f.startsWith('v1.json')),
        String(records),
      );
      assert.equal(store.kind, 's3');
      assert.equal(store.local, false);
      assert.equal(
        store.location,
        `s3://${s3.bucket}/${store.prefix}?endpoint=${encodeURIComponent(s3.endpoint)}&region=us-east-1`,
      );
    } finally {
      await cleanup();
    }
  });

  void test('a multipart upload round-trips, reporting progress and skipping a re-put', async () => {
    const { store, cleanup } = await freshStore({
      multipartThresholdBytes: 256 * 1024,
      partSizeBytes: 100 * 1024,
      partConcurrency: 3,
    });
    try {
      const content = randomBytes(1024 * 1024 + 17);
      const path = await writeTemp(content);
      const progress: number[] = [];
      const put = await store.putBlob(path, { onProgress: (n) => progress.push(n) });
      assert.equal(put.digest, sha256(content));
      assert.equal(put.sizeBytes, content.length);
      assert.equal(progress.length, 11, 'one report per part');
      assert.deepEqual(
        progress,
        [...progress].sort((a, b) => a - b),
      );
      assert.equal(progress.at(-1), content.length);
      assert.deepEqual(await store.statBlob(put.digest), { sizeBytes: content.length });
      assert.deepEqual(await readFile(await store.blobPath(put.digest)), content);
      assert.deepEqual(
        await store.readBlobRange(put.digest, 102_300, 5000),
        content.subarray(102_300, 107_300),
      );
      const again: number[] = [];
      await store.putBlob(path, { onProgress: (n) => again.push(n) });
      assert.deepEqual(again, [content.length], 'already there: nothing sent');
    } finally {
      await cleanup();
    }
  });

  void test('an aborted multipart upload is aborted and leaves no object', async () => {
    const { store, cleanup } = await freshStore({
      multipartThresholdBytes: 64 * 1024,
      partSizeBytes: 64 * 1024,
      partConcurrency: 1,
    });
    try {
      const content = randomBytes(640 * 1024);
      const ac = new AbortController();
      await assert.rejects(
        store.putBlob(await writeTemp(content), {
          signal: ac.signal,
          onProgress: (n) => {
            if (n >= 128 * 1024) ac.abort();
          },
        }),
        (e) => isDsecError(e, 'aborted'),
      );
      assert.equal(await store.hasBlob(sha256(content)), false);
    } finally {
      await cleanup();
    }
  });

  void test('readBlobRange transfers only the range', async () => {
    const proxy = await countingProxy(s3.endpoint);
    const { store, cleanup } = await freshStore();
    try {
      const content = randomBytes(4 * 1024 * 1024);
      const { digest } = await store.putBlob(await writeTemp(content));
      const viaProxy = new S3ImageStore({
        bucket: s3.bucket,
        prefix: store.prefix,
        endpoint: proxy.endpoint,
        credentials,
      });
      const got = await viaProxy.readBlobRange(digest, 1_000_000, 4096);
      assert.deepEqual(got, content.subarray(1_000_000, 1_004_096));
      assert.ok(proxy.responseBytes() >= 4096, `${proxy.responseBytes()} bytes`);
      assert.ok(
        proxy.responseBytes() < 4096 + 8192,
        `${proxy.responseBytes()} response bytes for a 4 KiB range of a 4 MiB blob`,
      );
    } finally {
      await cleanup();
      await proxy.close();
    }
  });

  void test('blobPath detects a blob corrupted on the server and caches nothing', async () => {
    const { store, cacheDir, cleanup } = await freshStore();
    const client = new S3Client({
      endpoint: s3.endpoint,
      region: 'us-east-1',
      forcePathStyle: true,
      credentials,
      requestChecksumCalculation: 'WHEN_REQUIRED',
      responseChecksumValidation: 'WHEN_REQUIRED',
    });
    try {
      const { digest } = await store.putBlob(await writeTemp('the real bytes'));
      await client.send(
        new PutObjectCommand({
          Bucket: s3.bucket,
          Key: `${store.prefix}blobs/sha256/${digest.slice('sha256:'.length)}`,
          Body: 'the evil bytes',
        }),
      );
      const results = await Promise.allSettled([store.blobPath(digest), store.blobPath(digest)]);
      for (const r of results) {
        assert.equal(r.status, 'rejected');
        assert.ok(isDsecError(r.reason, 'internal'), String(r.reason));
        assert.match(r.reason.message, /corrupt/);
      }
      assert.deepEqual(await readdir(join(cacheDir, 'blobs', 'sha256')), []);
    } finally {
      client.destroy();
      await cleanup();
    }
  });

  void test('concurrent blobPath calls share one download and reuse the cache after', async () => {
    const proxy = await countingProxy(s3.endpoint);
    const { store, cleanup } = await freshStore();
    try {
      const content = randomBytes(512 * 1024);
      const { digest } = await store.putBlob(await writeTemp(content));
      const viaProxy = new S3ImageStore({
        bucket: s3.bucket,
        prefix: store.prefix,
        endpoint: proxy.endpoint,
        credentials,
        cacheDir: join(scratch, `shared-${runs}`),
      });
      const paths = await Promise.all([1, 2, 3, 4].map(() => viaProxy.blobPath(digest)));
      assert.equal(new Set(paths).size, 1);
      assert.deepEqual(await readFile(paths[0]!), content);
      const once = proxy.responseBytes();
      assert.ok(once >= content.length && once < content.length * 2, `${once} bytes`);
      assert.equal(await viaProxy.blobPath(digest), paths[0]);
      assert.equal(proxy.responseBytes(), once, 'served from the cache');
    } finally {
      await cleanup();
      await proxy.close();
    }
  });

  void test('an endpoint nobody listens on is unavailable, quickly, naming it', async () => {
    const endpoint = `http://127.0.0.1:${await freePort()}`;
    const store = new S3ImageStore({
      bucket: 'dsec-test',
      endpoint,
      credentials,
      maxAttempts: 1,
      connectTimeoutMs: 1000,
    });
    const started = Date.now();
    await assert.rejects(
      store.hasBlob(sha256('x')),
      (e) => isDsecError(e, 'unavailable') && e.message.includes(endpoint),
    );
    await assert.rejects(store.listLayers(), (e) => isDsecError(e, 'unavailable'));
    await assert.rejects(store.putBlob(await writeTemp('x')), (e) => isDsecError(e, 'unavailable'));
    assert.ok(Date.now() - started < 5000, `${Date.now() - started} ms`);
  });

  void test('a missing bucket is invalid_argument naming the bucket', async () => {
    const store = new S3ImageStore({
      bucket: 'no-such-bucket',
      endpoint: s3.endpoint,
      credentials,
    });
    await assert.rejects(
      store.listLayers(),
      (e) =>
        isDsecError(e, 'invalid_argument') &&
        e.field === 'bucket' &&
        e.message.includes('no-such-bucket'),
    );
    await assert.rejects(store.getLayer('x'), (e) => isDsecError(e, 'invalid_argument'));
  });

  void test('putLayer serializes per ref across instances of one store', async () => {
    const a = await freshStore();
    const b = new S3ImageStore({
      bucket: s3.bucket,
      prefix: a.store.prefix,
      endpoint: s3.endpoint,
      credentials,
    });
    try {
      const d1 = (await a.store.putBlob(await writeTemp('one'))).digest;
      const d2 = (await a.store.putBlob(await writeTemp('two'))).digest;
      const layer = (digest: string) => ({
        name: 'race',
        version: 'v1',
        kind: 'base' as const,
        digest,
        sizeBytes: 3,
        contentBytes: 3,
        fileCount: 1,
        createdAt: new Date(0).toISOString(),
        source: 'dir',
      });
      const settled = await Promise.allSettled([
        a.store.putLayer(layer(d1)),
        b.putLayer(layer(d2)),
      ]);
      assert.equal(settled.filter((s) => s.status === 'fulfilled').length, 1);
      assert.equal(settled.filter((s) => s.status === 'rejected').length, 1);
    } finally {
      await a.cleanup();
    }
  });

  void test('bad options are invalid_argument naming the option', () => {
    const cases: [Partial<S3ImageStoreOptions>, string][] = [
      [{ bucket: 'A_B' }, 'bucket'],
      [{ bucket: 'ab' }, 'bucket'],
      [{ prefix: '../x' }, 'prefix'],
      [{ prefix: 'a//b' }, 'prefix'],
      [{ prefix: 'a?b' }, 'prefix'],
      [{ endpoint: 'ftp://127.0.0.1' }, 'endpoint'],
      [{ endpoint: 'http://user:pw@127.0.0.1' }, 'endpoint'],
      [{ endpoint: 'not a url' }, 'endpoint'],
      [{ region: 'Mars 1' }, 'region'],
      [{ partSizeBytes: 0 }, 'partSizeBytes'],
      [{ maxAttempts: 1.5 }, 'maxAttempts'],
    ];
    for (const [over, field] of cases) {
      assert.throws(
        () => new S3ImageStore({ bucket: 'dsec-test', ...over }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === field,
        `${JSON.stringify(over)} → ${field}`,
      );
    }
  });
});

void describe('openImageStore s3://', () => {
  void test('parses bucket, prefix, endpoint, region, forcePathStyle and cacheDir', () => {
    const store = openImageStore(
      's3://my-bucket/team/images?endpoint=http://127.0.0.1:9000&region=eu-west-1',
      { cacheDir: '/tmp/dsec-cache' },
    );
    assert.ok(store instanceof S3ImageStore);
    assert.equal(store.bucket, 'my-bucket');
    assert.equal(store.prefix, 'team/images/');
    assert.equal(store.endpoint, 'http://127.0.0.1:9000');
    assert.equal(store.region, 'eu-west-1');
    assert.equal(store.forcePathStyle, true);
    assert.equal(store.cacheDir, '/tmp/dsec-cache');
    assert.equal(
      store.location,
      's3://my-bucket/team/images/?endpoint=http%3A%2F%2F127.0.0.1%3A9000&region=eu-west-1',
    );
    assert.equal(openImageStore(store.location).location, store.location);

    const bare = openImageStore('s3://my-bucket');
    assert.ok(bare instanceof S3ImageStore);
    assert.equal(bare.prefix, '');
    assert.equal(bare.endpoint, undefined);
    assert.equal(bare.region, 'us-east-1');
    assert.equal(bare.forcePathStyle, false);
    assert.equal(bare.location, 's3://my-bucket/?region=us-east-1');

    const hosted = openImageStore(
      's3://my-bucket/p/?endpoint=https://s3.example.test&forcePathStyle=false',
    );
    assert.ok(hosted instanceof S3ImageStore);
    assert.equal(hosted.forcePathStyle, false);
    assert.match(hosted.location, /forcePathStyle=false/);
    assert.equal(openImageStore(hosted.location).location, hosted.location);
  });

  void test('malformed s3 URLs are invalid_argument saying what is wrong', () => {
    const cases: [string, string][] = [
      ['s3:bucket', 'store'],
      ['s3://', 'bucket'],
      ['s3://key:secret@bucket/p', 'store'],
      ['s3://bucket:9000/p', 'store'],
      ['s3://bucket/p#frag', 'store'],
      ['s3://bucket/p?endpoint=http://127.0.0.1:9000&color=red', 'store'],
      ['s3://bucket/p?region=a&region=b', 'region'],
      ['s3://bucket/p?forcePathStyle=maybe', 'forcePathStyle'],
      ['s3://bucket/p?endpoint=ftp://x', 'endpoint'],
      ['s3://bucket/%E0%A4%A', 'prefix'],
      ['s3://bucket/../x', 'prefix'],
      ['s3://Bad_Bucket/p', 'bucket'],
    ];
    for (const [location, field] of cases) {
      assert.throws(
        () => openImageStore(location),
        (e) =>
          isDsecError(e, 'invalid_argument') && e.field === field && !e.message.includes('secret'),
        `${location} → ${field}`,
      );
    }
  });
});

/** A loopback HTTP proxy in front of `target` that counts response body bytes. */
async function countingProxy(target: string): Promise<{
  endpoint: string;
  responseBytes(): number;
  close(): Promise<void>;
}> {
  const upstream = new URL(target);
  let bytes = 0;
  const server = http.createServer((req, res) => {
    const out = http.request(
      {
        host: '127.0.0.1',
        port: upstream.port,
        method: req.method,
        path: req.url,
        headers: { ...req.headers, host: upstream.host },
      },
      (up) => {
        res.writeHead(up.statusCode ?? 502, up.headers);
        up.on('data', (chunk: Buffer) => (bytes += chunk.length));
        up.pipe(res);
      },
    );
    out.on('error', () => res.destroy());
    req.pipe(out);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    responseBytes: () => bytes,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}

async function freePort(): Promise<number> {
  const server = http.createServer();
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return port;
}
