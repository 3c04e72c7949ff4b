import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { buildLayer, DirImageStore, makeDebianRootfs } from '@dsec/images';

// Slow (minutes) and needs root plus the Debian mirror: opt in with DSEC_TEST_DEBOOTSTRAP=1.
const enabled = process.env['DSEC_TEST_DEBOOTSTRAP'] === '1';

void test(
  'debootstrap makes a bookworm rootfs with python3 that builds into a layer',
  { skip: !enabled && 'set DSEC_TEST_DEBOOTSTRAP=1' },
  async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dsec-debootstrap-'));
    try {
      const root = join(dir, 'root');
      const phases = new Set<string>();
      await makeDebianRootfs(root, { onProgress: (p) => phases.add(p.phase) });
      assert.match(await readFile(join(root, 'etc/os-release'), 'utf8'), /^ID=debian$/m);
      assert.ok((await stat(join(root, 'usr/bin/python3'))).isFile());
      assert.ok(phases.has('cleanup'));
      const store = new DirImageStore(join(dir, 'store'));
      const layer = await buildLayer(store, {
        name: 'debian',
        version: 'bookworm',
        kind: 'base',
        from: { dir: root },
        source: 'debootstrap',
        split: true,
      });
      assert.ok(layer.fileCount > 1000);
      assert.ok(layer.blobDigest);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  },
);
