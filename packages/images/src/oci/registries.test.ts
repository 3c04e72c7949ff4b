import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import {
  isInsecureRegistry,
  MAX_MIRRORS_PER_REGISTRY,
  pullSources,
  registriesConf,
  registrySettings,
} from './registries.js';

const refused = (fn: () => unknown, field: string): void => {
  assert.throws(fn, (err: unknown) => {
    assert.ok(isDsecError(err, 'invalid_argument'), String(err));
    assert.equal(err.field, field);
    return true;
  });
};

test('config and environment merge: insecure hosts, mirrors in order, the auth file', () => {
  const s = registrySettings(
    {
      insecure: ['Registry.Lab:5000'],
      mirrors: { 'docker.io': ['mirror.lab:5000'] },
    },
    {
      DSEC_INSECURE_REGISTRIES: ' 127.0.0.1:5000 ,registry.lab:5000,,[::1]:5001',
      DSEC_REGISTRY_MIRRORS: 'docker.io=mirror.lab:5000|127.0.0.1:5000/hub,quay.io=127.0.0.1:5002',
      REGISTRY_AUTH_FILE: '/run/auth.json',
    },
  );
  assert.deepEqual(s.insecure, ['registry.lab:5000', '127.0.0.1:5000', '[::1]:5001']);
  assert.deepEqual(s.mirrors, {
    'docker.io': ['mirror.lab:5000', '127.0.0.1:5000/hub'],
    'quay.io': ['127.0.0.1:5002'],
  });
  assert.equal(s.authFile, '/run/auth.json');
  assert.ok(isInsecureRegistry(s, 'REGISTRY.lab:5000'));
  assert.ok(isInsecureRegistry(s, '127.0.0.1:5000/hub'));
  assert.ok(!isInsecureRegistry(s, 'registry.lab'));
  assert.deepEqual(pullSources(s, 'Docker.io'), [
    'mirror.lab:5000',
    '127.0.0.1:5000/hub',
    'docker.io',
  ]);
  assert.deepEqual(pullSources(s, 'ghcr.io'), ['ghcr.io']);
  // The config's auth file wins over the environment's.
  assert.equal(
    registrySettings({ authFile: '/etc/dsec/auth.json' }, s as never).authFile,
    '/etc/dsec/auth.json',
  );
  assert.deepEqual(registrySettings(undefined, {}), { insecure: [], mirrors: {} });
});

test('registriesConf: no search registries, insecure per location, mirrors in order', () => {
  const s = registrySettings(
    {
      insecure: ['127.0.0.1:5000'],
      mirrors: { 'docker.io': ['127.0.0.1:5000/hub', 'mirror.lab'] },
    },
    {},
  );
  assert.equal(
    registriesConf(s),
    [
      'unqualified-search-registries = []',
      '',
      '[[registry]]',
      'location = "127.0.0.1:5000"',
      'insecure = true',
      '',
      '[[registry]]',
      'location = "docker.io"',
      '[[registry.mirror]]',
      'location = "127.0.0.1:5000/hub"',
      'insecure = true',
      '[[registry.mirror]]',
      'location = "mirror.lab"',
      '',
    ].join('\n'),
  );
});

test('malformed entries are refused naming where they came from', () => {
  for (const bad of [
    'host/with/path',
    'a..b',
    '-lead.example',
    'trail-.example',
    'h:0',
    'h:65536',
    'h:port',
    'h:',
    '[::1',
    '[zz]:1',
    'a b',
    'x"\ninsecure = false',
    '',
    'a'.repeat(64),
  ]) {
    refused(() => registrySettings({ insecure: [bad] }, {}), 'registries.insecure');
  }
  refused(
    () => registrySettings(undefined, { DSEC_INSECURE_REGISTRIES: 'ok:1,../x' }),
    'DSEC_INSECURE_REGISTRIES',
  );
  refused(
    () => registrySettings(undefined, { DSEC_REGISTRY_MIRRORS: 'docker.io' }),
    'DSEC_REGISTRY_MIRRORS',
  );
  refused(
    () => registrySettings(undefined, { DSEC_REGISTRY_MIRRORS: '=m:1' }),
    'DSEC_REGISTRY_MIRRORS',
  );
  refused(
    () => registrySettings(undefined, { DSEC_REGISTRY_MIRRORS: 'docker.io=m:1/../x' }),
    'DSEC_REGISTRY_MIRRORS',
  );
  refused(
    () => registrySettings({ mirrors: { 'docker.io': ['docker.io'] } }, {}),
    'registries.mirrors',
  );
  refused(
    () => registrySettings({ mirrors: { 'docker.io': 'm:1' as never } }, {}),
    'registries.mirrors.docker.io',
  );
  refused(() => registrySettings({ insecure: 'h:1' as never }, {}), 'registries.insecure');
  refused(() => registrySettings({ insecure: [5 as never] }, {}), 'registries.insecure');
});

test('attack: long and pathological host strings are refused in linear time and bounded lists', () => {
  // Inputs that make a nested-quantifier pattern backtrack exponentially.
  for (const evil of [
    `${'a'.repeat(250)}!`,
    `${'a-'.repeat(120)}!`,
    `${'a.'.repeat(120)}-`,
    `${'a'.repeat(5000)}`,
  ]) {
    refused(() => registrySettings({ insecure: [evil] }, {}), 'registries.insecure');
  }
  const many = Array.from({ length: 300 }, (_, i) => `h${i}:5000`);
  refused(() => registrySettings({ insecure: many }, {}), 'registries.insecure');
  const mirrors = Array.from({ length: MAX_MIRRORS_PER_REGISTRY + 1 }, (_, i) => `m${i}:5000`);
  refused(() => registrySettings({ mirrors: { 'docker.io': mirrors } }, {}), 'registries.mirrors');
  refused(
    () => registrySettings(undefined, { DSEC_INSECURE_REGISTRIES: 'a:1,'.repeat(20_000) }),
    'env',
  );
  // A prototype key is refused like any other name that is not a host.
  refused(
    () => registrySettings({ mirrors: JSON.parse('{"__proto__": ["m:1"]}') as never }, {}),
    'registries.mirrors',
  );
});
