import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { gzipSync } from 'node:zlib';
import { isDsecError, type DsecError } from '@dsec/core';
import { DirImageStore, importFromRegistry, registrySettings } from '../../src/index.js';

// A hostile registry on loopback (a few lines of HTTP speaking the
// distribution API as far as skopeo asks), against importFromRegistry: a
// manifest naming absurd sizes or layer counts, a redirect loop, a registry
// that stalls, an image config with thousands of Env entries or a User that
// is a path. Every case must end in a stable error code, with bounded time
// (the import's own deadline) and bytes, and leave nothing in the store.
// Needs skopeo.

const json = (v: unknown): Buffer => Buffer.from(JSON.stringify(v));
const sha = (b: Buffer): string => `sha256:${createHash('sha256').update(b).digest('hex')}`;

/** One tiny valid layer: a tar of one file, gzipped. */
function tinyLayer(): { blob: Buffer; diffId: string } {
  return tarLayer(Buffer.from('hi\n'));
}

/** A gzipped tar of one file `hello` holding `content`. */
function tarLayer(content: Buffer): { blob: Buffer; diffId: string } {
  const header = Buffer.alloc(512);
  header.write('hello', 0);
  header.write('0000644\0', 100);
  header.write('0000000\0', 108);
  header.write('0000000\0', 116);
  header.write(`${content.length.toString(8).padStart(11, '0')}\0`, 124);
  header.write('00000000000\0', 136);
  header.write('0', 156);
  header.write('ustar\0', 257);
  header.write('00', 263);
  header.fill(' ', 148, 156);
  let sum = 0;
  for (const byte of header) sum += byte;
  header.write(`${sum.toString(8).padStart(6, '0')}\0 `, 148);
  const body = Buffer.alloc(Math.ceil(content.length / 512) * 512);
  content.copy(body);
  const tar = Buffer.concat([header, body, Buffer.alloc(1024)]);
  return { blob: gzipSync(tar), diffId: sha(tar) };
}

interface Image {
  manifest: Buffer;
  blobs: Map<string, Buffer>;
}

function image(config: object, layers: { digest: string; size: number; diffId: string }[]): Image {
  const cfg = json({
    architecture: 'amd64',
    os: 'linux',
    config,
    rootfs: { type: 'layers', diff_ids: layers.map((l) => l.diffId) },
  });
  const manifest = json({
    schemaVersion: 2,
    mediaType: 'application/vnd.oci.image.manifest.v1+json',
    config: {
      mediaType: 'application/vnd.oci.image.config.v1+json',
      digest: sha(cfg),
      size: cfg.length,
    },
    layers: layers.map((l) => ({
      mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip',
      digest: l.digest,
      size: l.size,
    })),
  });
  return { manifest, blobs: new Map([[sha(cfg), cfg]]) };
}

let dir: string;
let server: Server;
let host: string;
const images = new Map<string, Image>();
const stalled: ServerResponse[] = [];
let requests = 0;

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-registry-attacks-'));
  const layer = tinyLayer();
  const fake = (i: number) => ({
    digest: sha(Buffer.from(String(i))),
    size: 1024,
    diffId: sha(Buffer.from(`d${i}`)),
  });
  images.set(
    'deep',
    image(
      {},
      Array.from({ length: 300 }, (_, i) => fake(i)),
    ),
  );
  images.set('huge', image({}, [{ ...fake(0), size: 2 ** 50 }]));
  const real = { digest: sha(layer.blob), size: layer.blob.length, diffId: layer.diffId };
  const withLayer = (config: object) => {
    const img = image(config, [real]);
    img.blobs.set(real.digest, layer.blob);
    return img;
  };
  images.set('env-flood', withLayer({ Env: Array.from({ length: 5000 }, (_, i) => `V${i}=x`) }));
  images.set('user-path', withLayer({ User: '../../../etc/shadow' }));
  images.set('workdir-relative', withLayer({ WorkingDir: '../../host' }));
  images.set('ok', withLayer({ Env: ['PATH=/bin'], WorkingDir: '/w' }));
  // A decompression bomb: 64 MiB of zeros in a blob of about 64 kB, its diff ID true.
  const bomb = tarLayer(Buffer.alloc(64 * 1024 * 1024));
  const bombImage = image({}, [
    { digest: sha(bomb.blob), size: bomb.blob.length, diffId: bomb.diffId },
  ]);
  bombImage.blobs.set(sha(bomb.blob), bomb.blob);
  images.set('bomb', bombImage);

  server = createServer((req: IncomingMessage, res: ServerResponse) => {
    requests++;
    const url = req.url ?? '/';
    if (url === '/v2/' || url === '/v2') {
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
      return;
    }
    const m = /^\/v2\/attack\/([a-z-]+)\/(manifests|blobs)\/(.+)$/.exec(url);
    if (!m) {
      res.writeHead(404).end();
      return;
    }
    const [, name, kind, ref] = m as unknown as [string, string, string, string];
    if (name === 'loop') {
      res.writeHead(302, { location: url }).end();
      return;
    }
    if (name === 'slow') {
      // Headers, then nothing: a registry that stalls mid-answer.
      res.writeHead(200, { 'content-type': 'application/vnd.oci.image.manifest.v1+json' });
      res.write('{');
      stalled.push(res);
      return;
    }
    const img = images.get(name);
    if (!img) {
      res.writeHead(404).end();
      return;
    }
    if (kind === 'manifests') {
      res
        .writeHead(200, {
          'content-type': 'application/vnd.oci.image.manifest.v1+json',
          'docker-content-digest': sha(img.manifest),
          'content-length': String(img.manifest.length),
        })
        .end(req.method === 'HEAD' ? undefined : img.manifest);
      return;
    }
    const blob = img.blobs.get(ref);
    if (!blob) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { 'content-length': String(blob.length) }).end(blob);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
});

after(async () => {
  for (const res of stalled) res.destroy();
  server?.closeAllConnections();
  await new Promise((r) => server?.close(r));
  if (dir) await rm(dir, { recursive: true, force: true });
});

async function attempt(
  name: string,
  extra: { timeoutMs?: number; maxUnpackedBytes?: number } = {},
): Promise<DsecError> {
  const store = new DirImageStore(join(dir, `store-${name}`));
  const err = await importFromRegistry(store, {
    source: `docker://${host}/attack/${name}:v1`,
    name: `attack-${name}`,
    kind: 'base',
    // TLS off by the node's settings, as an operator would write it.
    registries: registrySettings({ insecure: [host] }, {}),
    mounter: { mountErofs: () => Promise.reject(new Error('no mounts here')) } as never,
    ...extra,
  }).then(
    () => undefined,
    (e: unknown) => e as DsecError,
  );
  assert.ok(err, `${name}: the import succeeded`);
  // Nothing half-made: no layer record and no scratch left behind.
  assert.deepEqual(await store.listLayers(), [], name);
  const scratch = await readdir(store.tmpDir).catch(() => []);
  assert.deepEqual(scratch, [], `${name}: scratch left in ${store.tmpDir}`);
  return err;
}

test('the happy path of this registry works (so the refusals below are the checks, not the server)', async () => {
  const store = new DirImageStore(join(dir, 'store-ok-run'));
  const r = await importFromRegistry(store, {
    source: `docker://${host}/attack/ok:v1`,
    name: 'ok',
    kind: 'base',
    registries: registrySettings({ insecure: [host] }, {}),
    mounter: { mountErofs: () => Promise.reject(new Error('no mounts here')) } as never,
  });
  assert.deepEqual(r.layer.config, { env: ['PATH=/bin'], workingDir: '/w' });
});

test('attack: a manifest with 300 layers is refused before any blob is fetched', async () => {
  const before = requests;
  const err = await attempt('deep');
  assert.ok(isDsecError(err, 'invalid_argument'), String(err));
  assert.equal(err.details?.['reason'], 'too_many_layers');
  // inspect: ping, manifest, config, and nothing of the 300 layers.
  assert.ok(requests - before < 20, `${requests - before} requests`);
});

test('attack: a manifest naming a petabyte layer is refused before the pull', async () => {
  const err = await attempt('huge');
  assert.ok(isDsecError(err, 'resource_exhausted'), String(err));
  assert.equal(err.details?.['reason'], 'image_too_large');
});

test('attack: a redirect loop ends as an unreachable registry', async () => {
  const err = await attempt('loop');
  assert.ok(isDsecError(err, 'unavailable'), String(err));
  assert.equal(err.details?.['reason'], 'registry_unreachable');
});

test('attack: a registry that stalls mid-answer ends at the import deadline', async () => {
  const err = await attempt('slow', { timeoutMs: 3000 });
  assert.ok(isDsecError(err, 'deadline_exceeded'), String(err));
  assert.equal(err.details?.['reason'], 'registry_timeout');
});

test('attack: hostile image configs are refused naming the field', async () => {
  for (const [name, field] of [
    ['env-flood', 'config.Env'],
    ['user-path', 'config.User'],
    ['workdir-relative', 'config.WorkingDir'],
  ] as const) {
    const err = await attempt(name);
    assert.ok(isDsecError(err, 'invalid_argument'), `${name}: ${String(err)}`);
    assert.equal(err.field, field, name);
    assert.equal(err.details?.['reason'], 'image_config', name);
  }
});

test('attack: a layer that decompresses past the bound is stopped while it unpacks', async () => {
  // Well under the compressed bound (the blob is ~64 kB): only the unpacked count can stop it.
  const err = await attempt('bomb', { maxUnpackedBytes: 8 * 1024 * 1024 });
  assert.ok(isDsecError(err, 'resource_exhausted'), String(err));
  assert.equal(err.details?.['reason'], 'image_unpacks_too_large');
  assert.equal(err.field, 'source');
});
