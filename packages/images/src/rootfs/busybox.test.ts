import assert from 'node:assert/strict';
import { lstat, readFile, readlink, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { buildLayer } from '../build.js';
import { DirImageStore } from '../store/dir-store.js';
import { isRoot, tempDir } from '../testing/fixtures.js';
import { runTool } from '../util/run-tool.js';
import { makeBusyboxRootfs } from './busybox.js';

const haveBusybox = await stat('/bin/busybox').then(
  () => true,
  () => false,
);

void test(
  'a busybox rootfs has the binary, its applets, the dirs and /etc',
  { skip: !haveBusybox && 'no /bin/busybox' },
  async () => {
    const t = await tempDir();
    try {
      const root = join(t.dir, 'root');
      const { applets, version } = await makeBusyboxRootfs(root);
      assert.match(version, /^\d+\.\d+/);
      assert.ok(applets.includes('bin/sh'));
      assert.ok(applets.length > 100);
      const listed = (await runTool('/bin/busybox', ['--list'])).stdout.split('\n').filter(Boolean);
      for (const name of listed.filter((n) => n !== 'busybox')) {
        const path = applets.find((a) => a === name || a.endsWith(`/${name}`));
        assert.ok(path, `applet ${name} is linked`);
        assert.equal(await readlink(join(root, path)), '/bin/busybox');
      }
      assert.equal((await stat(join(root, 'bin/busybox'))).mode & 0o777, 0o755);

      for (const d of [
        'bin',
        'sbin',
        'usr/bin',
        'usr/sbin',
        'etc',
        'root',
        'home',
        'var/tmp',
        'proc',
        'sys',
        'dev',
        'run',
      ]) {
        assert.ok((await lstat(join(root, d))).isDirectory(), d);
      }
      assert.equal((await stat(join(root, 'tmp'))).mode & 0o7777, 0o1777);

      const passwd = await readFile(join(root, 'etc/passwd'), 'utf8');
      assert.match(passwd, /^root:x:0:0:root:\/root:\/bin\/sh$/m);
      assert.match(passwd, /^nobody:x:65534:65534:/m);
      assert.match(passwd, /^user:x:1000:1000:[^:]*:\/home\/user:\/bin\/sh$/m);
      assert.match(await readFile(join(root, 'etc/group'), 'utf8'), /^root:x:0:$/m);
      assert.match(await readFile(join(root, 'etc/os-release'), 'utf8'), /^ID=busybox$/m);
      assert.match(await readFile(join(root, 'etc/hosts'), 'utf8'), /localhost/);
      assert.ok((await readFile(join(root, 'etc/hostname'), 'utf8')).trim().length > 0);

      if (isRoot) {
        for (const p of ['bin/busybox', 'bin/sh', 'etc/passwd', 'tmp', 'root']) {
          const st = await lstat(join(root, p));
          assert.equal(st.uid, 0, p);
          assert.equal(st.gid, 0, p);
        }
        assert.equal((await stat(join(root, 'home/user'))).uid, 1000);
        // The rootfs actually works: its shell runs its applets.
        const out = await runTool('chroot', [
          root,
          '/bin/sh',
          '-c',
          'echo $(id -un) && ls /bin | wc -l',
        ]);
        assert.match(out.stdout, /^root\n\s*\d+/);
      }
    } finally {
      await t.cleanup();
    }
  },
);

void test(
  'two busybox rootfs builds give the same layer digest',
  { skip: !haveBusybox && 'no /bin/busybox' },
  async () => {
    const t = await tempDir();
    try {
      const store = new DirImageStore(join(t.dir, 'store'));
      await makeBusyboxRootfs(join(t.dir, 'a'));
      await makeBusyboxRootfs(join(t.dir, 'b'));
      const a = await buildLayer(store, {
        name: 'busybox',
        kind: 'base',
        from: { dir: join(t.dir, 'a') },
        source: 'busybox',
      });
      const b = await buildLayer(store, {
        name: 'busybox',
        version: 'b',
        kind: 'base',
        from: { dir: join(t.dir, 'b') },
        source: 'busybox',
      });
      assert.equal(a.digest, b.digest);
      assert.equal(a.source, 'busybox');
    } finally {
      await t.cleanup();
    }
  },
);

void test('a non-empty target or a dynamic busybox is refused', async () => {
  const t = await tempDir();
  try {
    await writeFile(join(t.dir, 'junk'), 'x');
    await assert.rejects(
      makeBusyboxRootfs(t.dir),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'dir',
    );
    await assert.rejects(
      makeBusyboxRootfs(join(t.dir, 'r'), { busyboxPath: process.execPath }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'busyboxPath',
    );
    await assert.rejects(
      makeBusyboxRootfs(join(t.dir, 'r'), { busyboxPath: join(t.dir, 'junk') }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'busyboxPath',
    );
  } finally {
    await t.cleanup();
  }
});
