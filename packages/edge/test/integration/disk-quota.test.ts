/**
 * SECURITY.md B13 (disk fill, outcomes E and H): filling the writable layer
 * with bytes or with inodes hits the sandbox's own quota (`diskLimitMb`) with
 * ENOSPC inside the sandbox; the host's disk is charged no more than the
 * quota; the sandbox stays usable; a neighbour without a quota is unaffected;
 * and stopping it leaves no loop device, mount or image behind.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readdir, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;
const MiB = 2 ** 20;

/** Backing files of the host's attached loop devices. */
async function loopBackingFiles(): Promise<string[]> {
  const files: string[] = [];
  for (const dev of await readdir('/sys/block')) {
    if (!dev.startsWith('loop')) continue;
    const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
    if (file.trim()) files.push(file.trim());
  }
  return files;
}

test(
  'B13: filling the writable layer with bytes or inodes hits the sandbox’s own quota',
  { skip: root ? false : 'needs root', timeout: 120_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      const before = await hostResources(dir);
      const quota = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'fill',
        spec: spec({ diskLimitMb: 32 }),
      });
      const other = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'quiet',
        spec: spec(),
      });
      const sh = async (id: string, line: string) => edge.runCommand(id, { shell: line });

      // Only sandboxes' upper images count: with DSEC_EROFS_MOUNT=loop, layers have loop devices too.
      const sandboxes = join(dir, 'edge', 'sandboxes');
      const images = (await loopBackingFiles()).filter((f) => f.startsWith(sandboxes));
      assert.equal(images.length, 1, 'one loop device, backed by the sandbox’s image');

      // Bytes: a 64 MiB write stops at the 32 MiB quota with ENOSPC.
      const dd = await sh(quota.id, 'dd if=/dev/zero of=/fill bs=1M count=64; ls -l /fill');
      assert.match(dd.stderr, /No space left on device/);
      const size = Number(/\s(\d+)\s+\w{3}\s+\d+\s+[\d:]+\s+\/fill/.exec(dd.stdout)?.[1]);
      assert.ok(size > 16 * MiB && size <= 32 * MiB, `the file stopped at the quota: ${size}`);
      const image = await stat(images[0]!);
      assert.ok(
        image.blocks * 512 <= 34 * MiB,
        `the host is charged at most the quota: ${image.blocks * 512} bytes allocated`,
      );
      // The sandbox stays usable, and freeing space makes room again.
      assert.equal((await sh(quota.id, 'echo still here')).stdout, 'still here\n');
      assert.equal((await sh(quota.id, 'rm /fill && echo x > /again && cat /again')).stdout, 'x\n');

      // Inodes: creating empty files stops with ENOSPC long before the bytes run out.
      const files = await sh(
        quota.id,
        'mkdir /many && cd /many && i=0; while touch f$i 2>/tmp/err; do i=$((i+1)); done; echo $i; cat /tmp/err',
      );
      const created = Number(files.stdout.split('\n')[0]);
      assert.ok(created > 100 && created < 4096, `inodes capped: ${created} files`);
      assert.match(files.stdout, /No space left on device/);

      // The neighbour without a quota writes more than the other's quota.
      const big = await sh(other.id, 'dd if=/dev/zero of=/big bs=1M count=48 2>&1; rm /big');
      assert.equal(big.exitCode, 0, big.stdout);

      await edge.stopSandbox(quota.id);
      await edge.stopSandbox(other.id);
      assert.deepEqual(
        (await loopBackingFiles()).filter((f) => f.startsWith(sandboxes)),
        [],
        'the loop device detached with the sandbox',
      );
      assert.deepEqual(await hostResources(dir), before);
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
      await cleanup();
    }
  },
);
