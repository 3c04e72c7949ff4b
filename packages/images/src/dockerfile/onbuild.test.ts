import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { buildPullHosts, registrySettings } from '../oci/registries.js';
import { assertPullHost, baseImageRefs, copyFromImageRefs } from './onbuild.js';
import { parseDockerfile } from './parse.js';
import { rewriteStoreBases } from './build.js';

test('base images: global ARGs expanded (a --build-arg over the default), stages and scratch skipped', () => {
  const parsed = parseDockerfile(
    [
      'ARG BASE=debian:bookworm',
      'ARG TAG',
      'FROM ${BASE} AS build',
      'FROM build',
      'FROM scratch',
      'FROM registry.test/x:${TAG:-v1}',
      'FROM $BASE',
    ].join('\n'),
  );
  assert.deepEqual(baseImageRefs(parsed, {}), ['debian:bookworm', 'registry.test/x:v1']);
  assert.deepEqual(baseImageRefs(parsed, { BASE: 'evil.test/e', TAG: 'v2' }), [
    'evil.test/e',
    'registry.test/x:v2',
  ]);
});

test('a FROM whose variable cannot be resolved is refused: its image could not be checked', () => {
  assert.throws(
    () => baseImageRefs(parseDockerfile('FROM ${NOWHERE}\n'), {}),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'from_variable',
  );
});

test('an image named by a transport (host files, not a registry) is refused in FROM and COPY --from', () => {
  for (const text of [
    'FROM oci:/var/lib/x:img\n',
    'FROM docker-archive:/etc/shadow\n',
    'ARG B=containers-storage:[overlay@/var/lib/containers/storage]img\nFROM $B\n',
    'FROM dir:/root\n',
    'FROM docker://registry.test/x\n',
    'FROM debian:bookworm\nCOPY --from=oci-archive:/tmp/a.tar /x /y\n',
    'FROM debian:bookworm\nCOPY --chown=1 --from="oci:/srv/l:i" /x /y\n',
  ]) {
    assert.throws(
      () => baseImageRefs(parseDockerfile(text), {}),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'image_transport',
      text,
    );
  }
  // Docker Hub's `docker` image and a registry with a port are registry images.
  assert.deepEqual(
    baseImageRefs(parseDockerfile('FROM docker:24-dind\nFROM localhost:5000/a:b\n'), {}),
    ['docker:24-dind', 'localhost:5000/a:b'],
  );
});

test('COPY --from images (not stages) are listed to be pulled ahead; a variable there is refused', () => {
  const parsed = parseDockerfile(
    [
      'FROM debian:bookworm AS Build',
      'COPY --from=busybox:1.36 /bin/busybox /bin/',
      'FROM scratch',
      'COPY --from=build /a /a',
      'COPY --from=0 /b /b',
      'ADD --chown=1 --from=registry.test/tools:v1 /c /c',
      'COPY --from=busybox:1.36 /d /d',
    ].join('\n'),
  );
  assert.deepEqual(copyFromImageRefs(parsed), ['busybox:1.36', 'registry.test/tools:v1']);
  assert.throws(
    () => copyFromImageRefs(parseDockerfile('FROM debian\nARG X\nCOPY --from=$X /a /a\n')),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'from_variable',
  );
});

test('attack: an API build pulls FROM only the registries the node allows; the node, its network and look-alike hosts are refused', () => {
  const allowed = buildPullHosts(
    registrySettings({ insecure: ['127.0.0.1:5000'], buildFrom: ['ghcr.io'] }, {}),
  )!;
  for (const ok of [
    'debian:bookworm',
    'library/python:3.11',
    'docker.io/library/debian',
    'index.docker.io/x/y',
    '127.0.0.1:5000/tasks/a:1',
    'GHCR.io/owner/img:1',
  ]) {
    assert.doesNotThrow(() => assertPullHost(ok, allowed), ok);
  }
  for (const bad of [
    '127.0.0.1:2379/x', // the node's own services on another port
    '127.0.0.1/x',
    'localhost:5000/x', // the same port under another name is another host
    'localhost/x',
    '10.0.0.5/x',
    '169.254.169.254/latest',
    '[::1]:5000/x',
    'docker.io.evil.test/x',
    'ghcr.io:444/x',
    'ghcr.io.evil.test/x',
  ]) {
    assert.throws(
      () => assertPullHost(bad, allowed),
      (e: unknown) =>
        isDsecError(e, 'permission_denied') && e.details?.['reason'] === 'from_registry',
      bad,
    );
  }
  // `*` is any host; no list at all (the operator's own CLI builds) too.
  assert.equal(buildPullHosts(registrySettings({ buildFrom: ['*'] }, {})), undefined);
  assert.doesNotThrow(() => assertPullHost('10.0.0.5/x', undefined));
  assert.deepEqual(
    buildPullHosts(registrySettings({}, { DSEC_BUILD_REGISTRIES: 'quay.io, Registry.Test:8443' })),
    ['docker.io', 'quay.io', 'registry.test:8443'],
  );
  assert.throws(
    () => registrySettings({ buildFrom: ['not a host/x'] }, {}),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === 'registries.buildFrom',
  );
});

test("DSec's own names in buildah's shared storage cannot be named by a Dockerfile (FROM or COPY --from)", () => {
  for (const text of [
    'FROM localhost/dsec-store-base-0123456789abcdef-0',
    'FROM LOCALHOST/dsec-build-0123456789abcdef',
    'FROM busybox\nCOPY --from=localhost/dsec-build-0123456789abcdef-base-0 / /x',
  ]) {
    assert.throws(
      () => {
        const parsed = parseDockerfile(text);
        baseImageRefs(parsed, {});
        copyFromImageRefs(parsed);
      },
      (e: unknown) => isDsecError(e) && e.details?.['reason'] === 'reserved_image_name',
      text,
    );
  }
});

test('store bases: each stage FROM the name is rewritten to its local copy, nothing else; a split FROM is refused', () => {
  const text = [
    'FROM e2bdev/base',
    'RUN echo e2bdev/base',
    'FROM --platform=linux/amd64 e2bdev/base AS two',
    'FROM e2bdev/base-other',
    'FROM two',
  ].join('\n');
  const local = new Map([['e2bdev/base', 'localhost/dsec-store-base-x-0']]);
  assert.equal(
    rewriteStoreBases(text, parseDockerfile(text), local),
    [
      'FROM localhost/dsec-store-base-x-0',
      'RUN echo e2bdev/base',
      'FROM --platform=linux/amd64 localhost/dsec-store-base-x-0 AS two',
      'FROM e2bdev/base-other',
      'FROM two',
    ].join('\n'),
  );
  assert.equal(rewriteStoreBases(text, parseDockerfile(text), new Map()), text);
  const split = 'FROM \\\n e2bdev/base\nRUN true';
  assert.throws(
    () => rewriteStoreBases(split, parseDockerfile(split), local),
    (e: unknown) => isDsecError(e) && e.details?.['reason'] === 'store_base',
  );
});
