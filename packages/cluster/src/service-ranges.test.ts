import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { parseClusterConfig } from './config.js';
import { clusterServices, serviceRanges, withServiceRanges } from './service-ranges.js';

test("the cluster's service addresses are protected where the config gives them as IP literals", () => {
  assert.deepEqual(
    serviceRanges({
      urls: [
        'postgres://dsec:secret@10.0.0.5:5432/dsec',
        's3://bucket/prefix?endpoint=http%3A%2F%2F10.0.0.6%3A9000&region=x',
        's3://bucket/p?endpoint=http://[fd00:1::6]:9000',
        'https://[fd00:1::7]:7430',
        // By name: not resolved here (the node's networks or protectedRanges cover those).
        'postgres://dsec@db:5432/dsec',
        'not a url',
        undefined,
      ],
      hosts: ['10.0.0.8', '0.0.0.0', '::', '127.0.0.1', '::1', '0:0::1', 'localhost', undefined],
    }),
    ['10.0.0.5/32', '10.0.0.6/32', 'fd00:1::6/128', 'fd00:1::7/128', '10.0.0.8/32'],
  );
});

test('an edge started from a cluster config protects the database, image store, apiserver and its own listener', () => {
  const config = parseClusterConfig(
    {
      database: 'postgres://dsec@10.20.0.5:5432/dsec',
      imageStore: 's3://images/p?endpoint=http://[fd00:20::6]:9000',
      apiserver: { host: '10.20.0.7' },
      edge: {
        id: 'edge-a1',
        stateDir: '/var/lib/dsec/edge',
        secretFile: '/etc/dsec/edge.secret',
        host: '0.0.0.0',
        url: 'http://10.20.0.8:7430',
        network: { protectedRanges: ['192.168.40.0/24', '10.20.0.7/32'], nat64Prefixes: [] },
      },
    },
    '/etc/dsec',
  );
  const edge = config.edge;
  assert.ok(edge?.url);
  const network = withServiceRanges(edge.network, clusterServices(config, edge, edge.url));
  // The operator's own ranges first, each service once, the wildcard bind left out.
  assert.deepEqual(network.protectedRanges, [
    '192.168.40.0/24',
    '10.20.0.7/32',
    '10.20.0.5/32',
    'fd00:20::6/128',
    '10.20.0.8/32',
  ]);
  assert.deepEqual(network.nat64Prefixes, []);
  // No network section: the services alone.
  assert.deepEqual(withServiceRanges(undefined, { hosts: ['10.1.1.1'] }).protectedRanges, [
    '10.1.1.1/32',
  ]);
});

test('the cluster config checks its protected ranges and NAT64 prefixes as lists, strictly', () => {
  assert.throws(
    () =>
      parseClusterConfig({
        edge: {
          id: 'e',
          stateDir: '/s',
          secretFile: '/k',
          network: { protectedRange: ['10.0.0.0/8'] },
        },
      }),
    (err: unknown) =>
      isDsecError(err) && err.code === 'invalid_argument' && err.field === 'edge.network',
  );
  assert.throws(
    () =>
      parseClusterConfig({
        edge: {
          id: 'e',
          stateDir: '/s',
          secretFile: '/k',
          network: { protectedRanges: '10.0.0.0/8' },
        },
      }),
    (err: unknown) =>
      isDsecError(err) &&
      err.code === 'invalid_argument' &&
      err.field === 'edge.network.protectedRanges',
  );
});
