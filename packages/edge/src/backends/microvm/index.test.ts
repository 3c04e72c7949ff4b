import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import type { ImageStore } from '@dsec/core';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import type { Backend } from '../backend.js';
import { BackendSet } from '../backend-set.js';
import { withMicrovm } from './index.js';

const container = { kind: 'container' } as Backend;

test('an edge offers microvm only with QEMU and a built kernel and initramfs', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-microvm-assets-'));
  try {
    const common = {
      stateDir: join(dir, 'state'),
      store: {} as ImageStore,
      layers: {} as LayerMountCache,
      cgroups: {} as CgroupDriver,
      cgroupParent: 'dsec-test',
    };
    const qemuBinary = join(dir, 'qemu-system-x86_64');
    await writeFile(qemuBinary, '');
    // No assets yet: the container backend alone.
    assert.equal(
      withMicrovm(container, { ...common, microvm: { assetsDir: dir, qemuBinary } }),
      container,
    );
    await writeFile(join(dir, 'vmlinuz'), '');
    await writeFile(join(dir, 'initramfs.cpio'), '');
    const both = withMicrovm(container, { ...common, microvm: { assetsDir: dir, qemuBinary } });
    assert.ok(both instanceof BackendSet);
    assert.deepEqual(both.kinds, ['container', 'microvm']);
    // No QEMU, or switched off: container only.
    const noQemu = { assetsDir: dir, qemuBinary: join(dir, 'absent') };
    assert.equal(withMicrovm(container, { ...common, microvm: noQemu }), container);
    assert.equal(withMicrovm(container, { ...common, microvm: false }), container);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
