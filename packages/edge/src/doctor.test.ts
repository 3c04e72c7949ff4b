import assert from 'node:assert/strict';
import { readFile, readdir, mkdtemp, rm, writeFile, mkdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import {
  doctorFailed,
  elfIsStatic,
  runDoctor,
  swapTotalBytes,
  type DoctorCheck,
} from './doctor.js';
import { mountPoints } from './layers/mountinfo.js';

/** A minimal little-endian ELF64 header with the given program header types. */
function elf(types: number[]): Buffer {
  const b = Buffer.alloc(64 + 56 * types.length);
  b.writeUInt32BE(0x7f454c46, 0);
  b[4] = 2; // ELFCLASS64
  b[5] = 1; // little-endian
  b.writeBigUInt64LE(64n, 32); // e_phoff
  b.writeUInt16LE(56, 54); // e_phentsize
  b.writeUInt16LE(types.length, 56); // e_phnum
  types.forEach((t, i) => b.writeUInt32LE(t, 64 + i * 56));
  return b;
}

const check = (over: Partial<DoctorCheck>): DoctorCheck => ({
  name: 'x',
  ok: true,
  detail: '',
  fix: '',
  required: true,
  ...over,
});

void describe('doctor: parsers', () => {
  void test('a static binary has no PT_INTERP program header', () => {
    assert.equal(elfIsStatic(elf([1, 1, 4])), true);
    assert.equal(elfIsStatic(elf([6, 3, 1])), false);
    assert.equal(elfIsStatic(Buffer.from('#!/bin/sh\necho hi\n'.padEnd(80))), undefined);
    // Program headers past the bytes read: unknown, not "static".
    assert.equal(elfIsStatic(elf([1, 3]).subarray(0, 100)), undefined);
  });

  void test('swap total comes from /proc/meminfo', () => {
    assert.equal(swapTotalBytes('MemTotal: 100 kB\nSwapTotal:        2048 kB\n'), 2048 * 1024);
    assert.equal(swapTotalBytes('SwapTotal:           0 kB\n'), 0);
    assert.equal(swapTotalBytes(''), 0);
  });

  void test('only a failed required check fails the run', () => {
    assert.equal(doctorFailed([check({}), check({ ok: false, required: false })]), false);
    assert.equal(doctorFailed([check({}), check({ ok: false, required: true })]), true);
  });
});

void describe(
  'doctor on this host',
  { skip: process.getuid?.() === 0 ? false : 'needs root' },
  () => {
    let dir: string;
    let checks: DoctorCheck[];
    before(async () => {
      dir = await mkdtemp(join(tmpdir(), 'dsec-doctor-test-'));
      await mkdir(join(dir, 'state'));
      // No KVM device and a dynamically linked "busybox": both must be reported.
      await writeFile(join(dir, 'busybox'), elf([6, 3, 1]));
      checks = await runDoctor({
        stateDir: join(dir, 'state'),
        shellBinary: join(dir, 'busybox'),
        paths: { devKvm: join(dir, 'no-kvm'), kvmPvmModule: join(dir, 'none') },
      });
    });
    after(async () => {
      await rm(dir, { recursive: true, force: true });
    });

    void test('every check is there, named once, each failure with a fix', () => {
      const names = checks.map((c) => c.name);
      assert.deepEqual(names, [
        'root',
        'kernel',
        'dsec-helper',
        'erofs-utils',
        'erofs-file-backed',
        'loop-devices',
        'overlayfs',
        'idmapped-mounts',
        'cgroups',
        'inotify',
        'nftables',
        'runc',
        'swap-for-pause',
        'kvm',
        'busybox-static',
        'debootstrap',
      ]);
      for (const c of checks) {
        assert.ok(c.detail, `${c.name} says what it found`);
        assert.equal(c.fix === '', c.ok, `${c.name}: a fix exactly when it failed`);
      }
    });

    void test('probes see what this host has (mounts work here; the fakes fail)', () => {
      const by = new Map(checks.map((c) => [c.name, c]));
      // This host (the CI machine) runs the container tests: these must pass.
      for (const name of [
        'root',
        'dsec-helper',
        'loop-devices',
        'overlayfs',
        'idmapped-mounts',
        'cgroups',
        'runc',
      ])
        assert.equal(by.get(name)?.ok, true, `${name}: ${by.get(name)?.detail}`);
      assert.equal(by.get('kvm')?.ok, false);
      assert.match(by.get('kvm')!.detail, /no-kvm is missing/);
      assert.equal(by.get('kvm')?.required, false);
      assert.equal(by.get('busybox-static')?.ok, false);
      assert.match(by.get('busybox-static')!.detail, /dynamically linked/);
      assert.match(by.get('busybox-static')!.fix, /busybox-static/);
      assert.equal(doctorFailed(checks), true, 'a dynamic shell is a required failure');
    });

    void test('probes leave nothing behind: mounts, loop devices, swap, files', async () => {
      assert.deepEqual(
        [...(await mountPoints())].filter((p) => p.startsWith(dir)),
        [],
      );
      for (const dev of await readdir('/sys/block')) {
        if (!dev.startsWith('loop')) continue;
        const file = await readFile(`/sys/block/${dev}/loop/backing_file`, 'utf8').catch(() => '');
        assert.ok(!file.startsWith(dir), `${dev} still bound to ${file}`);
      }
      assert.ok(!(await readFile('/proc/swaps', 'utf8')).includes(dir), 'no swap file left on');
      assert.deepEqual(await readdir(join(dir, 'state')), []);
    });
  },
);
