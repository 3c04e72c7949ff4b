import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { findVmImage, VM_CMDLINE } from './image.js';

test('an image is offered only complete and when it mounts the sandbox image as its root', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-vm-image-'));
  try {
    for (const f of ['disk.img', 'vmlinuz', 'initrd.img']) writeFileSync(join(dir, f), 'x');
    assert.equal(findVmImage(dir), undefined, 'no VERSION: not complete');
    // Built before the backend mounted the spec's image (its own Debian was the root).
    writeFileSync(join(dir, 'VERSION'), '6.1.0-50-amd64 dfeced43ebfd5107\n');
    assert.equal(findVmImage(dir), undefined);
    writeFileSync(join(dir, 'VERSION'), '6.1.0-50-amd64 94fff8e1dd669b1e spec-root\n');
    assert.deepEqual(findVmImage(dir), {
      disk: join(dir, 'disk.img'),
      kernel: join(dir, 'vmlinuz'),
      initrd: join(dir, 'initrd.img'),
      cmdline: VM_CMDLINE,
      version: '6.1.0-50-amd64 94fff8e1dd669b1e spec-root',
    });
    // The hash itself is not a feature word.
    writeFileSync(join(dir, 'VERSION'), '6.1.0-50-amd64 spec-root\n');
    assert.equal(findVmImage(dir), undefined);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
