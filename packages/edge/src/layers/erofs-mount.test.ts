import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';
import {
  erofsMountFromEnv,
  hostErofsMounter,
  kernelHasFileBackedErofs,
  kernelVersion,
  parseErofsMountSetting,
  probeErofsMount,
  resolveErofsMount,
  type ProbeMounter,
} from './erofs-mount.js';
import { mountPoints } from './mountinfo.js';

const execFileAsync = promisify(execFile);
const hasMkfs = existsSync('/usr/bin/mkfs.erofs') || existsSync('/usr/sbin/mkfs.erofs');
const isRoot = process.getuid?.() === 0;

/** Mounts nothing: records calls and fails the ways listed in `failing`. */
function fakeMounter(failing: Array<'file' | 'loop'>): ProbeMounter & { calls: string[] } {
  const calls: string[] = [];
  return {
    calls,
    async mountErofs(_image, target, options) {
      const way = options.loop ? 'loop' : 'file';
      calls.push(`mount ${way}`);
      if (failing.includes(way)) throw new Error(`${way} mount refused`);
      // The probe reads this file back through the "mount".
      await writeFile(join(target, 'probe'), 'dsec erofs probe\n');
    },
    async unmount(targets) {
      calls.push(`unmount ${targets.length}`);
    },
  };
}

void describe('erofs mount mode', () => {
  let dir: string;
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-erofs-mode-'));
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  void test('settings parse strictly; DSEC_EROFS_MOUNT is read when set', () => {
    assert.equal(parseErofsMountSetting('loop'), 'loop');
    assert.throws(
      () => parseErofsMountSetting('block'),
      (err: unknown) => err instanceof DsecError && err.code === 'invalid_argument',
    );
    assert.equal(erofsMountFromEnv({ DSEC_EROFS_MOUNT: 'loop' }), 'loop');
    assert.equal(erofsMountFromEnv({ DSEC_EROFS_MOUNT: '' }), undefined);
    assert.equal(erofsMountFromEnv({}), undefined);
    assert.throws(() => erofsMountFromEnv({ DSEC_EROFS_MOUNT: 'yes' }), /DSEC_EROFS_MOUNT/);
  });

  void test('file-backed EROFS needs Linux 6.12', () => {
    assert.deepEqual(kernelVersion('6.1.0-28-amd64'), [6, 1]);
    assert.equal(kernelHasFileBackedErofs([6, 1]), false);
    assert.equal(kernelHasFileBackedErofs([6, 8]), false);
    assert.equal(kernelHasFileBackedErofs([6, 12]), true);
    assert.equal(kernelHasFileBackedErofs([7, 0]), true);
    assert.equal(kernelHasFileBackedErofs(kernelVersion('garbage')), false);
  });

  void test('a forced setting is used without probing', async () => {
    const mounter = fakeMounter([]);
    const probeDir = join(dir, 'forced');
    assert.equal(await resolveErofsMount('loop', { probeDir, mounter }), 'loop');
    assert.equal(await resolveErofsMount('file', { probeDir, mounter }), 'file');
    assert.deepEqual(mounter.calls, []);
  });

  void test(
    'auto picks file-backed where it works, loop where only that works',
    {
      skip: hasMkfs ? false : 'needs mkfs.erofs',
    },
    async () => {
      const probeDir = join(dir, 'auto');
      const both = fakeMounter([]);
      assert.equal(await resolveErofsMount('auto', { probeDir, mounter: both }), 'file');
      assert.deepEqual(
        both.calls,
        ['unmount 1', 'mount file', 'unmount 1', 'unmount 1'],
        'no loop mount',
      );
      const logs: string[] = [];
      const oldKernel = fakeMounter(['file']);
      assert.equal(
        await resolveErofsMount('auto', {
          probeDir,
          mounter: oldKernel,
          log: (msg) => logs.push(msg),
        }),
        'loop',
      );
      assert.deepEqual(oldKernel.calls, [
        ...['unmount 1', 'mount file', 'unmount 1'],
        ...['unmount 1', 'mount loop', 'unmount 1', 'unmount 1'],
      ]);
      assert.match(logs.join(), /loop devices/);
      await assert.rejects(
        resolveErofsMount('auto', { probeDir, mounter: fakeMounter(['file', 'loop']) }),
        (err: unknown) =>
          err instanceof DsecError &&
          /file-backed: file mount refused; loop device: loop mount refused/.test(err.message),
      );
      assert.equal(existsSync(probeDir), false, 'the probe removes its directory');
    },
  );

  void test(
    'a probe clears what an interrupted probe left in its directory',
    {
      skip: hasMkfs ? false : 'needs mkfs.erofs',
    },
    async () => {
      const probeDir = join(dir, 'stale');
      await mkdir(join(probeDir, 'mnt'), { recursive: true });
      await writeFile(join(probeDir, 'image'), 'half-written');
      const probe = await probeErofsMount(probeDir, { mounter: fakeMounter(['loop']) });
      assert.deepEqual(probe, { file: true, loop: false, loopError: 'loop mount refused' });
      assert.equal(existsSync(probeDir), false);
    },
  );

  void test(
    'on this host: both ways mount, and nothing is left behind',
    {
      skip: !hasMkfs ? 'needs mkfs.erofs' : !isRoot ? 'needs root' : false,
    },
    async () => {
      const probeDir = join(dir, 'real');
      const probe = await probeErofsMount(probeDir);
      assert.equal(probe.loop, true, probe.loopError);
      // Kernels before 6.12 answer the file-backed mount with ENOTBLK.
      assert.equal(probe.file, kernelHasFileBackedErofs(), probe.fileError);
      assert.equal(existsSync(probeDir), false);
      assert.equal(
        [...(await mountPoints())].some((p) => p.startsWith(probeDir)),
        false,
      );
      for (const dev of await readdir('/sys/block')) {
        if (!dev.startsWith('loop')) continue;
        const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
        assert.ok(!file.startsWith(probeDir), `${dev} still bound to ${file}`);
      }
    },
  );
});

void describe(
  'hostErofsMounter',
  {
    skip: !hasMkfs ? 'needs mkfs.erofs' : !isRoot ? 'needs root' : false,
  },
  () => {
    void test('mounts the way it is told', async (t) => {
      const dir = await mkdtemp(join(tmpdir(), 'dsec-host-mounter-'));
      t.after(() => rm(dir, { recursive: true, force: true }));
      await mkdir(join(dir, 'src'));
      await writeFile(join(dir, 'src', 'f'), 'f\n');
      await mkdir(join(dir, 'mnt'));
      await execFileAsync('mkfs.erofs', ['--quiet', join(dir, 'img'), join(dir, 'src')]);
      const mounter = hostErofsMounter({ setting: 'loop' });
      await mounter.mountErofs(join(dir, 'img'), join(dir, 'mnt'));
      try {
        assert.equal(await readFile(join(dir, 'mnt', 'f'), 'utf8'), 'f\n');
        const line = (await readFile('/proc/self/mountinfo', 'utf8'))
          .split('\n')
          .find((l) => l.split(' ')[4] === join(dir, 'mnt'));
        assert.match(line ?? '', / - erofs \/dev\/loop\d+ /);
      } finally {
        await mounter.unmount([join(dir, 'mnt')]);
      }
    });
  },
);
