import assert from 'node:assert/strict';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PassThrough } from 'node:stream';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { TemplateFiles } from './template-files.js';

// Attacks on E2B template builds (adversarial review of h/imgbuild).

const HASH = 'b'.repeat(64);

test('one upload link PUT many times at once cannot hold unbounded disk: uploads per project are bounded', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxUploadsPerProject: 3 });
  // Each PUT of the same link writes a part file of its own while its body trickles in.
  const bodies = [0, 1, 2].map(() => new PassThrough());
  const running = bodies.map((b) => files.store('proj-a', HASH, b));
  for (const b of bodies) b.write(Buffer.alloc(1024));
  const extra = new PassThrough();
  await assert.rejects(
    files.store('proj-a', HASH, extra),
    (e) => isDsecError(e, 'quota_exceeded') && e.details?.['resource'] === 'templateUploads',
  );
  // Another project's uploads are not this one's to block.
  const other = new PassThrough();
  const otherDone = files.store('proj-b', HASH, other);
  other.end(Buffer.from('x'));
  await otherDone;
  for (const b of bodies) b.end();
  await Promise.all(running);
  // Once they are done the slots are free again, and no part file is left behind.
  const again = new PassThrough();
  const againDone = files.store('proj-a', HASH, again);
  again.end(Buffer.from('y'));
  await againDone;
  assert.deepEqual(await readdir(join(dir, 'proj-a')), [`${HASH}.tar`]);
});

test('a failed upload gives its slot back', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxUploadsPerProject: 1, maxFileBytes: 10 });
  for (let i = 0; i < 3; i++) {
    const body = new PassThrough();
    const done = files.store('proj-a', HASH, body);
    body.end(Buffer.alloc(100));
    await assert.rejects(done, (e) => isDsecError(e, 'payload_too_large'));
  }
  assert.deepEqual(await readdir(join(dir, 'proj-a')), []);
});

test('uploads in progress are bounded in bytes per project, not only one by one', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-files-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const files = new TemplateFiles(() => dir, { maxFileBytes: 4096, maxProjectBytes: 5000 });
  // Each upload stays under maxFileBytes; together they would hold 3 × 2048 bytes of part files.
  const bodies = [0, 1, 2].map(() => new PassThrough());
  const running = bodies.map((b) => files.store('proj-a', HASH, b));
  const settled = running.map((p) =>
    p.then(
      () => 'ok',
      (e: unknown) => (isDsecError(e, 'quota_exceeded') ? 'refused' : String(e)),
    ),
  );
  bodies[0]!.write(Buffer.alloc(2048));
  bodies[1]!.write(Buffer.alloc(2048));
  bodies[2]!.write(Buffer.alloc(2048));
  assert.equal(await settled[2], 'refused');
  bodies[0]!.end();
  bodies[1]!.end();
  assert.deepEqual(await Promise.all(settled.slice(0, 2)), ['ok', 'ok']);
  // Their bytes are given back once they are done.
  const next = new PassThrough();
  const nextDone = files.store('proj-a', 'c'.repeat(64), next);
  next.end(Buffer.alloc(2048));
  await nextDone;
});
