import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import {
  chmod,
  chown,
  mkdir,
  mkdtemp,
  readFile,
  rm,
  stat,
  writeFile,
  appendFile,
  readdir,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { promisify } from 'node:util';

import { DsecError } from '@dsec/core';

import { mountErofs, mountRootfs, unmount } from './index.js';
import { integrationSkipReason } from './test-support.js';

const run = promisify(execFile);
const skip = integrationSkipReason() ?? false;

/** Mount points under `dir` right now. */
async function mountsUnder(dir: string): Promise<string[]> {
  const info = await readFile('/proc/self/mountinfo', 'utf8');
  return info
    .split('\n')
    .map((l) => l.split(' ')[4] ?? '')
    .filter((p) => p === dir || p.startsWith(`${dir}/`) || p.startsWith(`${dir}.`));
}

/** Loop devices bound to files under `dir`: device name (loopN) → backing file. */
async function loopsBoundUnder(dir: string): Promise<Map<string, string>> {
  const bound = new Map<string, string>();
  for (const dev of await readdir('/sys/block')) {
    if (!dev.startsWith('loop')) continue;
    const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
    if (file.trim().startsWith(`${dir}/`)) bound.set(dev, file.trim());
  }
  return bound;
}

/** A temp dir with a root-owned tree packed as EROFS (optionally split into meta + blob). */
async function fixture(t: { after: (fn: () => Promise<void>) => void }): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-native-mnt-'));
  await chmod(dir, 0o755); // host uid 100000 writes through the overlay below
  t.after(async () => {
    await unmount((await mountsUnder(dir)).reverse(), { detach: true });
    assert.deepEqual(await mountsUnder(dir), [], 'no mounts left behind');
    await rm(dir, { recursive: true, force: true });
  });
  await mkdir(join(dir, 'src/etc'), { recursive: true });
  await writeFile(join(dir, 'src/etc/hostname'), 'base\n');
  await writeFile(join(dir, 'src/big'), Buffer.alloc(300_000, 7));
  await run('mkfs.erofs', ['-zlz4hc', join(dir, 'img.erofs'), join(dir, 'src')]);
  return dir;
}

describe('EROFS and overlay mounts', { skip }, () => {
  test('mount-erofs: file-backed, read-only, no loop device; umount is idempotent', async (t) => {
    const dir = await fixture(t);
    const mnt = join(dir, 'mnt');
    await mkdir(mnt);
    const loopsBefore = (await readdir('/sys/block')).filter((b) => b.startsWith('loop')).length;
    await mountErofs(join(dir, 'img.erofs'), mnt);
    assert.equal(await readFile(join(mnt, 'etc/hostname'), 'utf8'), 'base\n');
    const line = (await readFile('/proc/self/mountinfo', 'utf8'))
      .split('\n')
      .find((l) => l.split(' ')[4] === mnt);
    assert.match(line ?? '', / - erofs \S*img\.erofs ro/);
    assert.match(line ?? '', /\bro,nosuid,nodev\b/);
    assert.equal(
      (await readdir('/sys/block')).filter((b) => b.startsWith('loop')).length,
      loopsBefore,
    );
    await assert.rejects(writeFile(join(mnt, 'x'), 'x'), { code: 'EROFS' });
    await unmount([mnt]);
    assert.deepEqual(await mountsUnder(dir), []);
    await unmount([mnt, join(dir, 'does-not-exist')]); // not mounted / missing: fine
  });

  test('mount-erofs with a split metadata/blob layer (device=)', async (t) => {
    const dir = await fixture(t);
    const mnt = join(dir, 'mnt');
    await mkdir(mnt);
    await run('mkfs.erofs', [
      '--chunksize=65536',
      `--blobdev=${join(dir, 'l.blob')}`,
      join(dir, 'l.meta'),
      join(dir, 'src'),
    ]);
    await mountErofs(join(dir, 'l.meta'), mnt, { blobDevice: join(dir, 'l.blob') });
    assert.deepEqual(await readFile(join(mnt, 'big')), Buffer.alloc(300_000, 7));
    await unmount([mnt]);
  });

  test('mount-erofs --loop: auto-clearing read-only loop devices, for the blob too', async (t) => {
    const dir = await fixture(t);
    const mnt = join(dir, 'mnt');
    await mkdir(mnt);
    await run('mkfs.erofs', [
      '--chunksize=65536',
      `--blobdev=${join(dir, 'l.blob')}`,
      join(dir, 'l.meta'),
      join(dir, 'src'),
    ]);
    await mountErofs(join(dir, 'l.meta'), mnt, { blobDevice: join(dir, 'l.blob'), loop: true });
    assert.deepEqual(await readFile(join(mnt, 'big')), Buffer.alloc(300_000, 7));
    const line = (await readFile('/proc/self/mountinfo', 'utf8'))
      .split('\n')
      .find((l) => l.split(' ')[4] === mnt);
    const source = / - erofs (\/dev\/loop\d+) ro/.exec(line ?? '')?.[1];
    assert.ok(source, `a loop device is the source: ${line}`);
    const bound = await loopsBoundUnder(dir);
    assert.deepEqual(
      [...bound.values()].sort(),
      [join(dir, 'l.blob'), join(dir, 'l.meta')],
      'one device per file',
    );
    assert.equal(bound.get(source.slice('/dev/'.length)), join(dir, 'l.meta'));
    for (const dev of bound.keys()) {
      assert.equal((await readFile(`/sys/block/${dev}/ro`, 'utf8')).trim(), '1');
      assert.equal((await readFile(`/sys/block/${dev}/loop/autoclear`, 'utf8')).trim(), '1');
    }
    await unmount([mnt]);
    assert.deepEqual(
      [...(await loopsBoundUnder(dir)).keys()],
      [],
      'the devices went with the mount',
    );

    // A mount that fails (not an EROFS image) leaves no device behind either.
    await assert.rejects(mountErofs(join(dir, 'src/big'), mnt, { loop: true }), (err: unknown) => {
      assert.match(String(err), /mount erofs \S*src\/big via \/dev\/loop\d+ on /);
      return true;
    });
    assert.deepEqual([...(await loopsBoundUnder(dir)).keys()], []);
  });

  test('errors are one-line DsecErrors', async (t) => {
    const dir = await fixture(t);
    await assert.rejects(mountErofs(join(dir, 'nope.erofs'), join(dir, 'src')), (err: unknown) => {
      assert.ok(err instanceof DsecError);
      assert.equal(err.code, 'internal');
      assert.match(
        err.message,
        /^dsec-helper: mount erofs .*nope\.erofs.*: No such file or directory \(errno 2\)$/,
      );
      return true;
    });
  });

  test('mount-rootfs with idmapped lowers: ownership, copy-up, untouched layers, clean teardown', async (t) => {
    const dir = await fixture(t);
    const [base, top, root, upper, work] = ['base', 'top', 'root', 'upper', 'work'].map((n) =>
      join(dir, n),
    ) as [string, string, string, string, string];
    for (const d of [base, top, root, upper, work]) await mkdir(d);
    await chown(upper, 100000, 100000);
    await chown(work, 100000, 100000);
    await mountErofs(join(dir, 'img.erofs'), base);
    await mkdir(join(dir, 'topsrc/etc'), { recursive: true });
    await writeFile(join(dir, 'topsrc/etc/hostname'), 'top\n');
    await run('mkfs.erofs', [join(dir, 'top.erofs'), join(dir, 'topsrc')]);
    await mountErofs(join(dir, 'top.erofs'), top);
    const before = await mountsUnder(dir);

    await mountRootfs({
      target: root,
      upper,
      work,
      lowers: [top, base],
      idmap: { hostId: 100000, size: 65536 },
    });
    // The idmapped staging mounts are already detached: only the overlay is new.
    assert.deepEqual(await mountsUnder(dir), [...before, root]);
    assert.deepEqual(
      (await readdir(dir)).filter((n) => n.startsWith('root.l')),
      [],
    );

    const st = await stat(join(root, 'etc/hostname'));
    assert.equal(st.uid, 100000);
    assert.equal(st.gid, 100000);
    assert.equal(await readFile(join(root, 'etc/hostname'), 'utf8'), 'top\n', 'top layer wins');
    assert.equal((await readFile(join(root, 'big'))).length, 300_000);

    // Write as the sandbox's root (host uid 100000): copy-up lands in upper, owned by 100000.
    await run('setpriv', [
      '--reuid=100000',
      '--regid=100000',
      '--clear-groups',
      'sh',
      '-c',
      `echo more >> ${root}/etc/hostname`,
    ]);
    await appendFile(join(root, 'big'), 'x');
    assert.equal(await readFile(join(root, 'etc/hostname'), 'utf8'), 'top\nmore\n');
    assert.equal((await stat(join(upper, 'etc/hostname'))).uid, 100000);
    assert.equal(await readFile(join(top, 'etc/hostname'), 'utf8'), 'top\n', 'layer untouched');
    assert.equal((await stat(join(base, 'big'))).size, 300_000, 'layer untouched');

    await unmount([root]);
    assert.deepEqual(await mountsUnder(dir), before);
  });

  test('mount-rootfs failure leaves nothing behind', async (t) => {
    const dir = await fixture(t);
    const base = join(dir, 'base');
    await mkdir(base);
    await mountErofs(join(dir, 'img.erofs'), base);
    const before = await mountsUnder(dir);
    await assert.rejects(
      mountRootfs({
        target: join(dir, 'root'), // does not exist: the overlay mount fails after staging
        upper: join(dir, 'up'),
        work: join(dir, 'wk'),
        lowers: [base],
        idmap: { hostId: 100000, size: 65536 },
      }),
      /mount overlay/,
    );
    assert.deepEqual(await mountsUnder(dir), before);
    assert.deepEqual(
      (await readdir(dir)).filter((n) => n.startsWith('root.l')),
      [],
    );
  });
});
