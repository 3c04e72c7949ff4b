/**
 * Attacks on a node's volumes (docs/volumes.md) beyond volumes.test.ts:
 *
 * - Overcommit: a volume was a sparse image, so a tenant could ask for far
 *   more than the node's disk holds and then write until the disk shared by
 *   every tenant (edge.db, layers, other volumes' images) was full, with
 *   I/O errors in other tenants' volumes. A create now takes its bytes up
 *   front and is `capacity_exhausted` when the disk has no room for them.
 * - A delete that fails half-way (the host-side mount busy) left the
 *   volume listed and unmountable-by-delete: every later delete failed, so
 *   its quota stayed charged until the edge restarted.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { open, readdir, readFile, stat, statfs } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError, randomId, VOLUME_SIZE_MB } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { unmount } from '@dsec/native';
import { makeStateDir, spec } from './fixture.js';
import { volumeKey } from '../../src/volumes/volume-store.js';

const root = process.getuid?.() === 0;
const MiB = 2 ** 20;

async function loopBackingFiles(): Promise<string[]> {
  const files: string[] = [];
  for (const dev of await readdir('/sys/block')) {
    if (!dev.startsWith('loop')) continue;
    const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
    if (file.trim()) files.push(file.trim());
  }
  return files;
}

async function mountsUnder(dir: string): Promise<string[]> {
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  return text
    .split('\n')
    .map((l) => l.split(' ')[4] ?? '')
    .filter((p) => p.startsWith(dir));
}

async function assertNothingLeft(volumesDir: string): Promise<void> {
  assert.deepEqual(await readdir(volumesDir), []);
  assert.deepEqual(await mountsUnder(volumesDir), []);
  assert.deepEqual(
    (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir)),
    [],
  );
}

test(
  'volumes attack: a volume never promises more disk than the node has',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateDir = join(dir, 'edge');
    const volumesDir = join(stateDir, 'volumes');
    const edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    const v = edge.volumes!;
    try {
      // More than the disk has free: refused, and nothing is left of the attempt.
      const fs = await statfs(volumesDir);
      const freeMb = Math.floor((fs.bavail * fs.bsize) / MiB);
      if (freeMb + 1024 <= VOLUME_SIZE_MB.max) {
        await assert.rejects(
          v.create({ projectId: 'p', name: 'huge', sizeMb: freeMb + 1024 }),
          (err: unknown) => {
            assert.ok(err instanceof DsecError, String(err));
            assert.equal(err.code, 'capacity_exhausted', err.message);
            return true;
          },
        );
        await assertNothingLeft(volumesDir);
      }

      // A made volume holds its bytes: writing into it later can never fill the node's disk.
      await v.create({ projectId: 'p', name: 'held', sizeMb: 32 });
      const images = (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir));
      assert.equal(images.length, 1);
      const st = await stat(images[0]!);
      assert.ok(
        st.blocks * 512 >= 32 * MiB,
        `a 32 MiB volume holds ${st.blocks * 512} bytes of the node's disk`,
      );

      await v.delete('p', 'held');
      await assertNothingLeft(volumesDir);
    } finally {
      await edge.close();
      await unmount(await mountsUnder(volumesDir)).catch(() => undefined);
      await cleanup();
    }
  },
);

test(
  'volumes attack: a delete that failed half-way (mount busy) can be retried',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateDir = join(dir, 'edge');
    const volumesDir = join(stateDir, 'volumes');
    const edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    const v = edge.volumes!;
    let holder: ReturnType<typeof spawn> | undefined;
    try {
      await v.create({ projectId: 'p', name: 'held', sizeMb: 16 });
      // A delete while the host-side mount is busy fails, and leaves a volume a later
      // delete removes (not one every delete fails on).
      const [mnt] = await mountsUnder(volumesDir);
      assert.ok(mnt);
      holder = spawn('sleep', ['600'], { cwd: mnt, stdio: 'ignore' });
      await once(holder, 'spawn');
      await assert.rejects(v.delete('p', 'held'));
      assert.equal((await v.get('p', 'held')).name, 'held', 'still there after the failed delete');
      assert.ok(
        (await readdir(join(volumesDir, (await readdir(volumesDir))[0]!))).includes('volume.json'),
        'its record is back: a restart would otherwise remove a volume the control plane lists',
      );
      holder.kill('SIGKILL');
      await once(holder, 'exit');
      holder = undefined;
      await v.delete('p', 'held');
      await assertNothingLeft(volumesDir);
    } finally {
      holder?.kill('SIGKILL');
      await edge.close();
      await unmount(await mountsUnder(volumesDir)).catch(() => undefined);
      await cleanup();
    }
  },
);

test(
  'volumes attack: one volume that no longer mounts does not keep the node from starting',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateDir = join(dir, 'edge');
    const volumesDir = join(stateDir, 'volumes');
    let edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    let closed = false;
    try {
      await edge.volumes!.create({ projectId: 'p', name: 'good', sizeMb: 16 });
      await edge.volumes!.create({ projectId: 'q', name: 'broken', sizeMb: 16 });
      closed = true;
      await edge.close(); // unmounts both: no sandbox uses them
      // The broken volume's superblock is gone (a disk fault, a bad sector).
      const image = join(volumesDir, volumeKey('q', 'broken'), 'volume.ext4');
      const fh = await open(image, 'r+');
      await fh.write(Buffer.alloc(4096), 0, 4096, 0);
      await fh.close();
      edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
      closed = false;
      // The other tenant's volume serves as before.
      const sb = await edge.createSandbox({
        id: randomId('sb'),
        projectId: 'p',
        spec: spec({ volumes: [{ name: 'good', path: '/good' }] }),
      });
      assert.equal(
        (await edge.runCommand(sb.id, { shell: 'touch /good/x && echo ok' })).stdout,
        'ok\n',
      );
      await edge.stopSandbox(sb.id);
      // Its usage is its own, never the node disk's under its empty mount point.
      const broken = await edge.volumes!.get('q', 'broken');
      assert.ok(broken.usedBytes <= 16 * MiB, `usedBytes ${broken.usedBytes} of a 16 MiB volume`);
      // The broken one is refused at mount, and can be deleted.
      await assert.rejects(
        edge.createSandbox({
          id: randomId('sb'),
          projectId: 'q',
          spec: spec({ volumes: [{ name: 'broken', path: '/b' }] }),
        }),
      );
      await edge.volumes!.delete('q', 'broken');
      await edge.volumes!.delete('p', 'good');
      await assertNothingLeft(volumesDir);
    } finally {
      if (!closed) {
        for (const s of await edge.listSandboxes({}))
          await edge.stopSandbox(s.id).catch(() => undefined);
        await edge.close();
      }
      await unmount(await mountsUnder(volumesDir)).catch(() => undefined);
      await cleanup();
    }
  },
);
