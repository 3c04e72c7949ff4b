import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { makeTestCertificate } from '@dsec/edge-http/testing';
import {
  apiBoundsOptions,
  fncallOptions,
  loadClusterConfig,
  parseClusterConfig,
} from './config.js';
import { edgeTlsPins } from './roles.js';

const invalid = (field: string) => (err: unknown) =>
  isDsecError(err) && err.code === 'invalid_argument' && err.field === field;

test('a config gets its defaults and absolute paths relative to its own directory', () => {
  const config = parseClusterConfig(
    {
      database: 'control.db',
      clusterSecretFile: 'secrets/cluster',
      imageStore: 'dir:/srv/images',
      apiserver: {},
      edge: { id: 'edge-a1', stateDir: 'edge', secretFile: 'edge.secret' },
    },
    '/etc/dsec',
  );
  assert.equal(config.database, '/etc/dsec/control.db');
  assert.equal(config.clusterSecretFile, '/etc/dsec/secrets/cluster');
  assert.equal(config.imageStore, 'dir:/srv/images');
  assert.deepEqual(config.apiserver, {
    host: '127.0.0.1',
    port: 7420,
    watch: false,
    registryRefreshMs: 1000,
    logRequests: false,
  });
  assert.equal(config.edge?.stateDir, '/etc/dsec/edge');
  assert.equal(config.edge?.port, 7430);
  assert.deepEqual(config.edge?.labels, {});
  // A URL is not a path.
  const pg = parseClusterConfig({ database: 'postgres://dsec@db:5432/dsec' }, '/etc/dsec');
  assert.equal(pg.database, 'postgres://dsec@db:5432/dsec');
});

test('GPU settings pass through with the inventory file made absolute', () => {
  const edge = { id: 'e1', stateDir: '/s', secretFile: '/k' };
  const config = parseClusterConfig(
    {
      edge: { ...edge, gpus: { inventoryFile: 'gpus.json', sharedPlacement: 'pack' } },
      up: { gpus: 'auto' },
    },
    '/etc/dsec',
  );
  assert.deepEqual(config.edge?.gpus, {
    inventoryFile: '/etc/dsec/gpus.json',
    sharedPlacement: 'pack',
  });
  assert.equal(config.up?.gpus, 'auto');
  assert.throws(() => parseClusterConfig({ edge: { ...edge, gpus: 'on' } }), invalid('edge.gpus'));
});

test('snapshot bounds pass through; unknown fields are refused', () => {
  const edge = { id: 'e1', stateDir: '/s', secretFile: '/k' };
  const snapshot = { maxFiles: 1000, maxMb: 512, memoryMb: 256, timeoutSeconds: 60 };
  assert.deepEqual(parseClusterConfig({ edge: { ...edge, snapshot } }).edge?.snapshot, snapshot);
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, snapshot: { maxBytes: 1 } } }),
    invalid('edge.snapshot'),
  );
});

test('FnCall settings pass through for edges and dsec up; enabled: false runs no calls', () => {
  const sh = {
    name: 'sh',
    image: 'fncall-base',
    mode: 'exec' as const,
    command: ['sh', '{entry}'],
    entry: 'main.sh',
    defaultMemoryMb: 128,
    maxMemoryMb: 256,
    oomMessages: ['out of memory'],
  };
  const fncall = { runtimes: [sh], warm: { python: 2 }, sizing: { max: 8 }, nprocPerCall: 64 };
  const config = parseClusterConfig({
    edge: { id: 'e1', stateDir: '/s', secretFile: '/k', fncall },
    up: { fncall },
  });
  assert.deepEqual(config.edge?.fncall, fncall);
  assert.deepEqual(config.up?.fncall, fncall);
  assert.deepEqual(fncallOptions(config.up?.fncall), fncall);
  assert.equal(
    fncallOptions(parseClusterConfig({ up: { fncall: { enabled: false } } }).up?.fncall),
    false,
  );
  assert.equal(fncallOptions(undefined), undefined);
  assert.throws(
    () => parseClusterConfig({ up: { fncall: { runtimes: [{ ...sh, mode: 'jit' }] } } }),
    invalid('up.fncall.runtimes.0.mode'),
  );
  assert.throws(
    () => parseClusterConfig({ up: { fncall: { sizing: { maximum: 8 } } } }),
    invalid('up.fncall.sizing'),
  );
});

test('bad configs name the field and what is wrong', () => {
  assert.throws(() => parseClusterConfig({ edge: { id: 'Edge_1' } }), invalid('edge.id'));
  assert.throws(
    () => parseClusterConfig({ apiserver: { port: '7420' } }),
    (err: unknown) => invalid('apiserver.port')(err) && /apiserver\.port/.test(String(err)),
  );
  assert.throws(() => parseClusterConfig({ databse: 'x' }), invalid(''));
  assert.throws(
    () =>
      parseClusterConfig({
        edge: { id: 'e1', stateDir: '/s', secretFile: '/k', labels: { 'Bad Key': 'x' } },
      }),
    invalid('edge.labels.Bad Key'),
  );
  assert.throws(
    () =>
      parseClusterConfig({
        edge: { id: 'e1', stateDir: '/s', secretFile: '/k', admission: { maxSandboxes: -1 } },
      }),
    invalid('edge.admission.maxSandboxes'),
  );
  assert.throws(
    () => parseClusterConfig({ apiserver: { fncallQuotaShares: 0 } }),
    invalid('apiserver.fncallQuotaShares'),
  );
});

test('loading names the file, and says when it is not JSON or missing', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-config-'));
  try {
    const file = join(dir, 'cluster.json');
    await writeFile(file, '{ "database": ');
    await assert.rejects(
      loadClusterConfig(file),
      (err: unknown) => invalid('config')(err) && String(err).includes(file),
    );
    await assert.rejects(loadClusterConfig(join(dir, 'missing.json')), invalid('config'));
    await writeFile(file, JSON.stringify({ watcher: { intervalMs: 5 } }));
    await assert.rejects(
      loadClusterConfig(file),
      (err: unknown) => invalid('watcher.intervalMs')(err) && String(err).includes(file),
    );
    await writeFile(file, JSON.stringify({ database: 'db.sqlite' }));
    assert.equal((await loadClusterConfig(file)).database, join(dir, 'db.sqlite'));
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('edge.tls: paths made absolute, pins in canonical form, an https URL required', () => {
  const edge = { id: 'e1', stateDir: '/s', secretFile: '/k' };
  const hex = 'ab'.repeat(32);
  const config = parseClusterConfig(
    {
      edge: {
        ...edge,
        url: 'https://10.0.0.7:7430',
        tls: {
          certFile: 'tls/edge.crt',
          keyFile: 'tls/edge.key',
          pinSha256: [hex, `sha256 Fingerprint=${'CD:'.repeat(31)}CD`],
          pinCertFiles: ['tls/next.crt'],
        },
      },
    },
    '/etc/dsec',
  );
  assert.deepEqual(config.edge?.tls, {
    certFile: '/etc/dsec/tls/edge.crt',
    keyFile: '/etc/dsec/tls/edge.key',
    pinSha256: [`${'AB:'.repeat(31)}AB`, `${'CD:'.repeat(31)}CD`],
    pinCertFiles: ['/etc/dsec/tls/next.crt'],
  });
  const tls = { certFile: '/c', keyFile: '/k' };
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, url: 'http://10.0.0.7:7430', tls } }),
    invalid('edge.url'),
  );
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, tls: { ...tls, pinSha256: ['ab:cd'] } } }),
    invalid('edge.tls.pinSha256.0'),
  );
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, tls: { ...tls, pinSha256: [] } } }),
    invalid('edge.tls.pinSha256'),
  );
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, tls: { certFile: '/c' } } }),
    invalid('edge.tls.keyFile'),
  );
  assert.throws(
    () => parseClusterConfig({ edge: { ...edge, tls: { ...tls, pins: [hex] } } }),
    invalid('edge.tls'),
  );
});

test('edge join pins pinSha256 and pinCertFiles, else the edge certificate itself', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-config-tls-'));
  try {
    const a = await makeTestCertificate(dir, 'a');
    const b = await makeTestCertificate(dir, 'b');
    const tls = { certFile: a.certFile, keyFile: a.keyFile };
    assert.deepEqual(await edgeTlsPins(tls), [a.sha256]);
    assert.deepEqual(await edgeTlsPins({ ...tls, pinCertFiles: [b.certFile] }), [b.sha256]);
    assert.deepEqual(await edgeTlsPins({ ...tls, pinSha256: [b.sha256] }), [b.sha256]);
    assert.deepEqual(
      (
        await edgeTlsPins({ ...tls, pinSha256: [b.sha256], pinCertFiles: [a.certFile, b.certFile] })
      ).sort(),
      [a.sha256, b.sha256].sort(),
    );
    // Pins given, the certificate need not be at hand where the join runs.
    assert.deepEqual(
      await edgeTlsPins({
        certFile: join(dir, 'absent.crt'),
        keyFile: '/k',
        pinSha256: [a.sha256],
      }),
      [a.sha256],
    );
    await assert.rejects(
      edgeTlsPins({ certFile: join(dir, 'absent.crt'), keyFile: '/k' }),
      invalid('edge.tls.certFile'),
    );
    await assert.rejects(
      edgeTlsPins({ ...tls, pinCertFiles: [a.keyFile] }),
      invalid('edge.tls.pinCertFiles.0'),
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('apiserver bounds: allowed hosts, limits and audit retention, for buildApiServer and IAM', () => {
  const config = parseClusterConfig({
    apiserver: {
      allowedHosts: ['api.example.com', '*.tenants.example.com', '*'],
      limits: { maxConnections: 500, maxStreamsPerKey: 8, authFailureBurst: 3 },
      auditRetentionDays: 7,
    },
  });
  assert.deepEqual(apiBoundsOptions(config.apiserver, 'sandbox.example.com'), {
    api: {
      allowedHosts: [
        'api.example.com',
        '*.tenants.example.com',
        '*',
        'sandbox.example.com',
        '*.sandbox.example.com',
      ],
      maxConnections: 500,
      limits: { maxStreamsPerKey: 8 },
    },
    iam: { authFailureBurst: 3, auditRetentionMs: 7 * 86_400_000 },
  });
  assert.deepEqual(apiBoundsOptions(undefined), { api: { allowedHosts: [], limits: {} }, iam: {} });
  for (const bad of [
    'api.example.com:7420',
    'http://api.example.com',
    '*example.com',
    'a..b',
    '',
  ]) {
    assert.throws(
      () => parseClusterConfig({ apiserver: { allowedHosts: [bad] } }),
      invalid('apiserver.allowedHosts.0'),
      bad,
    );
  }
  assert.throws(
    () => parseClusterConfig({ apiserver: { limits: { maxStreamsPerKey: 0 } } }),
    invalid('apiserver.limits.maxStreamsPerKey'),
  );
  assert.throws(
    () => parseClusterConfig({ apiserver: { limits: { perKey: 1 } } }),
    invalid('apiserver.limits'),
  );
});

test('e2b.imageAliases map an image name to a layer or a registry image, never a transport or DSec name', () => {
  const base = { database: 'c.db', apiserver: {} };
  const imageAliases = {
    'e2bdev/base': 'layer:e2b-base:1',
    'python:3': 'mirror.local:5000/library/python:3',
  };
  const config = parseClusterConfig({ ...base, e2b: { imageAliases } }, '/etc/dsec');
  assert.deepEqual(config.e2b?.imageAliases, imageAliases);
  for (const bad of [
    { 'e2bdev/base': 'oci:/var/lib/secret' },
    { 'e2bdev/base': 'localhost/dsec-store-base-x' },
    { 'e2bdev/base': 'layer:Bad Name' },
    { 'oci:/x': 'busybox' },
    { 'e2bdev/base': '' },
  ]) {
    assert.throws(
      () => parseClusterConfig({ ...base, e2b: { imageAliases: bad } }, '/etc/dsec'),
      (err: unknown) => isDsecError(err) && err.code === 'invalid_argument',
      JSON.stringify(bad),
    );
  }
});

test('e2b.templates take a template string or a partial create body with the user to run as', () => {
  const base = { database: 'c.db', apiserver: {} };
  const config = parseClusterConfig(
    {
      ...base,
      e2b: {
        templates: {
          base: 'busybox',
          py: { image: 'python', user: 'root', memoryLimitMb: 2048 },
          ub: { image: 'ubuntu', initUser: 'ubuntu' },
        },
      },
    },
    '/etc/dsec',
  );
  assert.deepEqual(config.e2b?.templates, {
    base: 'busybox',
    py: { image: 'python', user: 'root', memoryLimitMb: 2048 },
    ub: { image: 'ubuntu', initUser: 'ubuntu' },
  });
  for (const bad of [
    { t: { user: 'root' } },
    { t: { image: 'x', user: 'Bad User' } },
    { t: { image: 'x', memoryLimitMb: 1 } },
    { t: { image: 'x', nope: true } },
    { t: { image: 'x', user: 'a', initUser: 'b' } },
    { t: '' },
  ]) {
    assert.throws(
      () => parseClusterConfig({ ...base, e2b: { templates: bad } }, '/etc/dsec'),
      (err: unknown) => isDsecError(err) && err.code === 'invalid_argument',
      JSON.stringify(bad),
    );
  }
});
