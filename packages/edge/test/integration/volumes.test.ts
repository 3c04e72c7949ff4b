/**
 * Volumes (docs/volumes.md) on a real edge: a project's named ext4 store,
 * loop-mounted once host-side and idmapped into each sandbox that names it.
 * Checked here: files keep their owners from one sandbox's id range to the
 * next, a non-root user writes too, the data outlives sandboxes and the edge
 * process; a full volume is ENOSPC inside the sandbox with the host charged
 * at most its size; names are per project; bad names and mount paths are
 * refused; a delete while mounted is `volume_in_use`; symlinks a sandbox
 * planted are never followed on the host; create/delete races leave no loop
 * device, mount or directory behind.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DsecError, randomId } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { unmount } from '@dsec/native';
import { makeStateDir, spec } from './fixture.js';

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

async function mountsUnder(dir: string): Promise<string[]> {
  const text = await readFile('/proc/self/mountinfo', 'utf8');
  return text
    .split('\n')
    .map((l) => l.split(' ')[4] ?? '')
    .filter((p) => p.startsWith(dir));
}

async function rejectsWith(p: Promise<unknown>, code: string, field?: string): Promise<void> {
  await assert.rejects(p, (err: unknown) => {
    assert.ok(err instanceof DsecError, String(err));
    assert.equal(err.code, code, err.message);
    if (field !== undefined) assert.equal(err.field, field);
    return true;
  });
}

const withVolumes = (volumes: SandboxSpec['volumes']) => spec({ volumes });

test(
  'volumes: shared between sandboxes with ids kept, ENOSPC when full, per project, never followed on the host',
  { skip: root ? false : 'needs root', timeout: 240_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateDir = join(dir, 'edge');
    const volumesDir = join(stateDir, 'volumes');
    const canaryDir = await mkdtemp(join(tmpdir(), 'dsec-volume-canary-'));
    const canary = join(canaryDir, 'canary');
    await writeFile(canary, 'host file\n');
    let edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    const volumes = () => {
      assert.ok(edge.volumes, 'a container edge keeps volumes');
      return edge.volumes;
    };
    const sh = async (id: string, line: string, user?: string) =>
      edge.runCommand(id, { shell: line, ...(user ? { user } : {}) });
    const create = (projectId: string, s: SandboxSpec) =>
      edge.createSandbox({ id: randomId('sb'), projectId, spec: s });
    try {
      const made = await volumes().create({ projectId: 'prj-a', name: 'data', sizeMb: 32 });
      assert.equal(made.sizeMb, 32);
      assert.deepEqual(made.mountedBy, []);

      // Sandbox 1 writes as root and as uid 1000, and plants symlinks and a FIFO.
      const a1 = await create('prj-a', withVolumes([{ name: 'data', path: '/data' }]));
      const w = await sh(
        a1.id,
        [
          'echo hello > /data/root-file',
          'ln -s / /data/escape',
          `ln -s ${canary} /data/canary`,
          'mkfifo /data/fifo',
          'stat -c "%u %g %a" /data',
        ].join(' && '),
      );
      assert.equal(w.exitCode, 0, w.stderr);
      assert.equal(
        w.stdout,
        '0 0 1777\n',
        'the volume root is root’s in the sandbox, writable by all',
      );
      const u = await sh(
        a1.id,
        'echo mine > /data/user-file && stat -c %u /data/user-file',
        '1000',
      );
      assert.equal(u.exitCode, 0, u.stderr);
      assert.equal(u.stdout, '1000\n');
      assert.deepEqual((await volumes().get('prj-a', 'data')).mountedBy, [a1.id]);

      // Delete while mounted: refused, with the sandbox named.
      await rejectsWith(volumes().delete('prj-a', 'data'), 'volume_in_use');

      // Sandbox 2 has another host id range; the files keep their owners through the idmap.
      const a2 = await create('prj-a', withVolumes([{ name: 'data', path: '/mnt/v' }]));
      const r = await sh(
        a2.id,
        'cat /mnt/v/root-file /mnt/v/user-file; stat -c "%u %n" /mnt/v/root-file /mnt/v/user-file',
      );
      assert.equal(r.stdout, 'hello\nmine\n0 /mnt/v/root-file\n1000 /mnt/v/user-file\n', r.stderr);
      // The planted links resolve inside sandbox 2 only: its own root, not the host's files.
      const esc = await sh(a2.id, 'cat /mnt/v/canary');
      assert.match(esc.stderr, /No such file or directory/, 'the host file is not reachable');
      assert.doesNotMatch(esc.stdout, /host file/);
      await edge.stopSandbox(a1.id);

      // The host-side mount goes while sandbox 2 holds a clone of it: the next create mounts
      // it again on the same loop device (one superblock, never two ext4 writers on one file).
      const [hostMount, ...others] = await mountsUnder(volumesDir);
      assert.ok(hostMount !== undefined && others.length === 0, 'one host-side mount');
      await unmount([hostMount]);
      const a4 = await create('prj-a', withVolumes([{ name: 'data', path: '/v4' }]));
      assert.deepEqual(await mountsUnder(volumesDir), [hostMount], 'mounted again');
      assert.equal(
        (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir)).length,
        1,
        'on the same loop device',
      );
      await sh(a4.id, 'echo from-4 > /v4/four');
      assert.equal((await sh(a2.id, 'cat /mnt/v/four')).stdout, 'from-4\n');
      await edge.stopSandbox(a4.id);

      // Filling the volume: ENOSPC in the sandbox, the host charged at most the size.
      const dd = await sh(
        a2.id,
        'dd if=/dev/zero of=/mnt/v/fill bs=1M count=64; ls -l /mnt/v/fill',
      );
      assert.match(dd.stderr, /No space left on device/);
      const image = (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir));
      assert.equal(image.length, 1, 'one loop device for the volume, however many sandboxes');
      const st = await stat(image[0]!);
      assert.ok(st.blocks * 512 <= 34 * MiB, `host charged ${st.blocks * 512} bytes`);
      assert.equal((await sh(a2.id, 'rm /mnt/v/fill && echo ok')).stdout, 'ok\n');

      // Names are per project: project B sees no "data" of A's, and its own is another volume.
      await rejectsWith(
        create('prj-b', withVolumes([{ name: 'data', path: '/data' }])),
        'volume_not_found',
        'volumes.0.name',
      );
      await rejectsWith(volumes().get('prj-b', 'data'), 'volume_not_found');
      await rejectsWith(volumes().delete('prj-b', 'data'), 'volume_not_found');
      assert.deepEqual(await volumes().list('prj-b'), []);
      await volumes().create({ projectId: 'prj-b', name: 'data', sizeMb: 16 });
      const b1 = await create('prj-b', withVolumes([{ name: 'data', path: '/data' }]));
      const bl = await sh(b1.id, 'ls -A /data');
      assert.doesNotMatch(bl.stdout, /root-file/, 'B’s "data" is not A’s');
      await edge.stopSandbox(b1.id);

      // Bad names and mount paths.
      for (const name of ['a/b', '..', 'a..b', '', 'x'.repeat(64), 'UPPER', '-x'])
        await rejectsWith(
          volumes().create({ projectId: 'prj-a', name, sizeMb: 16 }),
          'invalid_argument',
          'name',
        );
      await rejectsWith(
        volumes().create({ projectId: 'prj-a', name: 'big', sizeMb: 2 ** 40 }),
        'invalid_argument',
        'sizeMb',
      );
      for (const path of [
        '/proc',
        '/proc/x',
        '/dev',
        '/dev/shm',
        '/sys/fs',
        '/',
        'rel',
        '/a/../etc',
        '/a//b',
        '/a/./b',
        '/a/',
      ])
        await rejectsWith(
          create('prj-a', withVolumes([{ name: 'data', path }])),
          'invalid_argument',
          'volumes.0.path',
        );
      await rejectsWith(
        volumes().create({ projectId: 'prj-a', name: 'data', sizeMb: 16 }),
        'conflict',
      );

      // The data outlives the edge process: a new edge on the same state dir mounts it again.
      await edge.stopSandbox(a2.id);
      await edge.close();
      edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
      assert.deepEqual(
        (await volumes().list('prj-a')).map((v) => v.name),
        ['data'],
      );
      const a3 = await create('prj-a', withVolumes([{ name: 'data', path: '/data' }]));
      assert.equal((await sh(a3.id, 'cat /data/root-file')).stdout, 'hello\n');
      await edge.stopSandbox(a3.id);

      // Delete: nothing followed on the host, nothing left.
      await volumes().delete('prj-a', 'data');
      await volumes().delete('prj-b', 'data');
      assert.equal(
        await readFile(canary, 'utf8'),
        'host file\n',
        'the planted link’s target is untouched',
      );
      assert.deepEqual(await readdir(volumesDir), []);
      assert.deepEqual(await mountsUnder(volumesDir), []);
      assert.deepEqual(
        (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir)),
        [],
      );
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
      // A failed test must not leave a volume mounted under what cleanup removes.
      await unmount(await mountsUnder(volumesDir)).catch(() => undefined);
      await cleanup();
      await rm(canaryDir, { recursive: true, force: true });
    }
  },
);

test(
  'volumes: create/delete races leave no loop device, mount or directory behind',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateDir = join(dir, 'edge');
    const volumesDir = join(stateDir, 'volumes');
    const edge = await openContainerEdge({ edgeId: 'node-1', stateDir, store, cgroupParent });
    const v = edge.volumes!;
    try {
      // Five creates of one name at once: one wins, the others are `conflict`.
      const same = await Promise.allSettled(
        Array.from({ length: 5 }, () => v.create({ projectId: 'p', name: 'race', sizeMb: 16 })),
      );
      assert.equal(same.filter((r) => r.status === 'fulfilled').length, 1);
      for (const r of same)
        if (r.status === 'rejected') assert.equal((r.reason as DsecError).code, 'conflict');

      // A sandbox create and a delete at once: never both. The create either mounts a live
      // volume (and the delete is `volume_in_use`) or fails `volume_not_found`.
      for (let round = 0; round < 3; round++) {
        if (round > 0) await v.create({ projectId: 'p', name: 'race', sizeMb: 16 });
        const [sb, del] = await Promise.allSettled([
          edge.createSandbox({
            id: randomId('sb'),
            projectId: 'p',
            spec: withVolumes([{ name: 'race', path: '/race' }]),
          }),
          v.delete('p', 'race'),
        ]);
        if (sb.status === 'fulfilled') {
          assert.equal(del.status, 'rejected');
          assert.equal(del.reason.code, 'volume_in_use');
          assert.equal(
            (await edge.runCommand(sb.value.id, { shell: 'touch /race/x && echo ok' })).stdout,
            'ok\n',
          );
          await edge.stopSandbox(sb.value.id);
          await v.delete('p', 'race');
        } else {
          assert.equal(del.status, 'fulfilled');
          assert.equal((sb.reason as DsecError).code, 'volume_not_found');
        }
      }
      // Many volumes made and removed at once.
      const names = Array.from({ length: 6 }, (_, i) => `v${i}`);
      await Promise.all(names.map((name) => v.create({ projectId: 'p', name, sizeMb: 16 })));
      await Promise.all(names.map((name) => v.delete('p', name)));
      assert.deepEqual(await readdir(volumesDir), []);
      assert.deepEqual(await mountsUnder(volumesDir), []);
      assert.deepEqual(
        (await loopBackingFiles()).filter((f) => f.startsWith(volumesDir)),
        [],
      );
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
      await unmount(await mountsUnder(volumesDir)).catch(() => undefined);
      await cleanup();
    }
  },
);
