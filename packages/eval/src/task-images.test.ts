import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  DsecError,
  isDsecError,
  LAYER_NAME_PATTERN,
  LAYER_VERSION_PATTERN,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import {
  checkTemplate,
  importTaskImages,
  isImageTemplate,
  parseDockerImageRef,
  resolveTaskImage,
  swebenchImageKey,
  swebenchImageRef,
  taskImageLayerRef,
} from './task-images.js';

const TEMPLATE = 'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.{id}:latest';

const refused = (fn: () => unknown, field: string): void => {
  assert.throws(fn, (err: unknown) => {
    assert.ok(isDsecError(err, 'invalid_argument'), String(err));
    assert.equal(err.field, field, err.message);
    return true;
  });
};

test('instance IDs become image names as SWE-bench writes them', () => {
  assert.equal(swebenchImageKey('astropy__astropy-12907'), 'astropy_1776_astropy-12907');
  assert.equal(swebenchImageKey('Django__Django-11099'), 'django_1776_django-11099');
  assert.equal(swebenchImageKey('psf__requests-1.2'), 'psf_1776_requests-1.2');
  assert.equal(
    swebenchImageRef(TEMPLATE, 'astropy__astropy-12907'),
    'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
  );
  assert.equal(
    swebenchImageRef('docker://registry.lab/{id}/env-{id}:v2', 'sympy__sympy-20590'),
    'docker://registry.lab/sympy_1776_sympy-20590/env-sympy_1776_sympy-20590:v2',
  );
  // No {id}: one image for every instance, still checked.
  assert.equal(
    swebenchImageRef('docker://registry.lab/base:1', 'x__y-1'),
    'docker://registry.lab/base:1',
  );
});

test('layer names are deterministic and valid in the store', () => {
  const ref = swebenchImageRef(TEMPLATE, 'astropy__astropy-12907');
  assert.equal(taskImageLayerRef(ref), 'sweb.eval.x86_64.astropy_1776_astropy-12907:latest');
  assert.equal(taskImageLayerRef(ref), taskImageLayerRef(ref));
  assert.equal(taskImageLayerRef('docker://r.lab/a/b'), 'b:latest');
  const digest = `sha256:${'ab'.repeat(32)}`;
  assert.equal(taskImageLayerRef(`docker://r.lab/a/b@${digest}`), `b:sha256-${'ab'.repeat(16)}`);
  // A last component too long for a layer name still gets a valid, stable one.
  const long = `docker://r.lab/x/${'a'.repeat(200)}:v1`;
  const [name, version] = taskImageLayerRef(long).split(':') as [string, string];
  assert.match(name, LAYER_NAME_PATTERN);
  assert.match(version, LAYER_VERSION_PATTERN);
  assert.match(name, /^img-[0-9a-f]{32}$/);
  assert.equal(taskImageLayerRef(long), `${name}:${version}`);
});

test('attack: instance IDs cannot steer the reference to another path, registry or tag', () => {
  for (const id of [
    '../../etc/passwd',
    'a/../../b',
    'x/y',
    'evil.example:5000/x',
    'a:latest',
    'a@sha256:00',
    '..',
    'a..b',
    '',
    ' a',
    'a\nb',
    'a%2f..',
    'a'.repeat(129),
    '-leading',
    'ü',
  ]) {
    refused(() => swebenchImageRef(TEMPLATE, id), 'instance_id');
  }
  // Within bounds but not a Docker path component after mapping: refused as an image.
  refused(() => swebenchImageRef(TEMPLATE, 'a._b'), 'image');
});

test('attack: templates must be docker:// references with {id} in the repository path only', () => {
  for (const tpl of [
    'docker://{id}/swebench/x:latest',
    'docker://127.0.0.1:{id}/x:latest',
    'docker://127.0.0.1:5000/x:{id}',
    'docker://127.0.0.1:5000/x@{id}',
    'swebench/sweb.eval.x86_64.{id}:latest',
    'oci:/tmp/layout:{id}',
    'docker://127.0.0.1:5000/../{id}',
    'docker://127.0.0.1:5000//{id}',
    'docker://127.0.0.1:5000/a/./{id}',
    `docker://127.0.0.1:5000/${'a'.repeat(600)}/{id}`,
    'docker://127.0.0.1:5000/{id}{id}{id}{id}{id}',
    'docker://127.0.0.1:5000/x y/{id}',
    'docker:///{id}',
  ]) {
    refused(() => checkTemplate(tpl), 'image');
    refused(() => swebenchImageRef(tpl, 'a__b-1'), 'image');
  }
  refused(() => parseDockerImageRef('docker://busybox'), 'image');
  refused(() => parseDockerImageRef('docker://localhost/A'), 'image');
});

test('attack: two instances never share a layer through a template with {id} above the last component', () => {
  // The local layer is named after the repository's last component and tag: with {id} in
  // an upper component, every instance would map to one layer, and each would run (and be
  // graded) in the image the first one imported.
  for (const tpl of [
    'docker://127.0.0.1:5000/{id}/img:latest',
    'docker://127.0.0.1:5000/swebench/{id}/eval',
    'docker://127.0.0.1:5000/{id}/{id}/eval:v1',
  ]) {
    refused(() => checkTemplate(tpl), 'image');
    refused(() => resolveTaskImage(tpl, 'a__b-1'), 'image');
  }
  for (const tpl of [
    'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.{id}:latest',
    'docker://127.0.0.1:5000/{id}/sweb.{id}:v1',
    'docker://127.0.0.1:5000/shared/image:latest',
  ]) {
    const a = resolveTaskImage(tpl, 'a__b-1').layer;
    const b = resolveTaskImage(tpl, 'a__b-2').layer;
    assert.equal(a === b, !isImageTemplate(tpl), tpl);
  }
});

/** A store holding the named layers; counts lookups, refuses everything else. */
function fakeStore(names: string[]): ImageStore & { lookups: string[] } {
  const lookups: string[] = [];
  return {
    lookups,
    async getLayer(ref: string): Promise<LayerInfo> {
      lookups.push(ref);
      if (names.includes(ref)) return { name: ref } as LayerInfo;
      throw new DsecError('image_not_found', `no layer ${ref}`);
    },
  } as unknown as ImageStore & { lookups: string[] };
}

const noMounter = {
  mount: () => Promise.reject(new Error('no mounts in a unit test')),
} as never;

test('importTaskImages: present layers cost one lookup each; bad references fail alone; order kept', async () => {
  const a = swebenchImageRef(TEMPLATE, 'astropy__astropy-12907');
  const b = swebenchImageRef(TEMPLATE, 'django__django-11099');
  const store = fakeStore([taskImageLayerRef(a), taskImageLayerRef(b)]);
  const seen: string[] = [];
  const out = await importTaskImages([b, a, 'docker://busybox', a, 'docker://h.lab/../x'], {
    store,
    mounter: noMounter,
    concurrency: 2,
    onProgress: (p) => seen.push(`${p.state}:${p.done}/${p.total}`),
  });
  assert.deepEqual([...out.keys()], [b, a, 'docker://busybox', 'docker://h.lab/../x']);
  assert.equal(out.get(a), 'sweb.eval.x86_64.astropy_1776_astropy-12907:latest');
  assert.equal(out.get(b), 'sweb.eval.x86_64.django_1776_django-11099:latest');
  for (const bad of ['docker://busybox', 'docker://h.lab/../x']) {
    const e = out.get(bad);
    assert.ok(isDsecError(e, 'invalid_argument'), String(e));
  }
  // Duplicates collapsed: one lookup per distinct layer, nothing imported.
  assert.equal(store.lookups.length, 2);
  assert.equal(seen.filter((s) => s.startsWith('present')).length, 2);
  assert.equal(seen.filter((s) => s.startsWith('importing')).length, 0);
  assert.ok(seen.includes('failed:4/4') || seen.some((s) => s.endsWith('/4')));
});

test('importTaskImages: a registry that is not there fails its images, not the call', async () => {
  // Port 1 on loopback: nothing listens there; the import reaches nothing else.
  const ref = 'docker://127.0.0.1:1/swebench/sweb.eval.x86_64.a_1776_b-1:latest';
  const out = await importTaskImages([ref], {
    store: Object.assign(fakeStore([]), { tmpDir: undefined }),
    mounter: noMounter,
    registries: { insecure: ['127.0.0.1:1'], mirrors: {} },
  });
  const e = out.get(ref);
  assert.ok(isDsecError(e, 'unavailable'), String(e));
  assert.equal(e.details?.['reason'], 'registry_unreachable');
});

test('importTaskImages: options are checked', async () => {
  for (const concurrency of [0, -1, 1.5, 65]) {
    await assert.rejects(
      importTaskImages([], { store: fakeStore([]), mounter: noMounter, concurrency }),
      (err: unknown) => isDsecError(err, 'invalid_argument'),
    );
  }
  const ac = new AbortController();
  ac.abort();
  await assert.rejects(
    importTaskImages([swebenchImageRef(TEMPLATE, 'a__b-1')], {
      store: fakeStore([]),
      mounter: noMounter,
      signal: ac.signal,
    }),
    (err: unknown) => isDsecError(err, 'aborted'),
  );
});

test('resolveTaskImage: registry templates import, local layer templates name a layer', () => {
  assert.deepEqual(resolveTaskImage(TEMPLATE, 'astropy__astropy-12907'), {
    layer: 'sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
    source: 'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
  });
  assert.deepEqual(resolveTaskImage('sweb.eval.x86_64.{id}:latest', 'astropy__astropy-12907'), {
    layer: 'sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
  });
  assert.deepEqual(resolveTaskImage('toolbox', 'a__b-1'), { layer: 'toolbox:latest' });
  refused(() => resolveTaskImage('../{id}', 'a__b-1'), 'image');
  refused(() => resolveTaskImage('env/{id}', 'a__b-1'), 'image');
  refused(() => resolveTaskImage('env-{id}', 'a/b'), 'instance_id');
});
