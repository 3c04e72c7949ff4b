import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { test } from 'node:test';
import { gzipSync } from 'node:zlib';
import { isDsecError } from '@dsec/core';
import { templateDockerfile, type TemplateBuildStart } from './template-build.js';
import { TemplateFiles } from './template-files.js';

const HASH = 'a'.repeat(64);
const files = (h: string) => `files/${h}`;

test('E2B steps become a Dockerfile: base user, RUN as a user, COPY owned and moded, ENV, WORKDIR, USER', () => {
  const start: TemplateBuildStart = {
    fromImage: 'registry.local:5000/debian:12',
    steps: [
      { type: 'RUN', args: ['apt-get update && apt-get install -y git', 'root'] },
      { type: 'COPY', args: ['./app', '/home/user/app', '', '0755'], filesHash: HASH },
      { type: 'COPY', args: ['cfg.txt', '/etc/cfg.txt', 'root', ''], filesHash: HASH },
      { type: 'ENV', args: ['A', 'one two', 'B', 'quote " and $dollar'] },
      { type: 'WORKDIR', args: ['/srv'] },
      { type: 'USER', args: ['root'] },
      { type: 'RUN', args: ['echo "multi\nline"'] },
    ],
    startCmd: 'python -m http.server',
  };
  const { dockerfile, stepOfLine } = templateDockerfile(start, files);
  const lines = dockerfile.trimEnd().split('\n');
  assert.equal(lines[0], 'FROM registry.local:5000/debian:12');
  assert.equal(lines[1], 'USER root');
  assert.match(lines[2]!, /^RUN \["\/bin\/sh","-c",".*id user/);
  assert.equal(lines[3], 'USER user');
  assert.equal(lines[4], 'WORKDIR /home/user');
  assert.deepEqual(lines.slice(5), [
    'USER root',
    'RUN ["/bin/sh","-c","apt-get update && apt-get install -y git"]',
    'USER user',
    `COPY --chown=user --chmod=0755 ["files/${HASH}/app","/home/user/app"]`,
    `COPY --chown=root ["files/${HASH}/cfg.txt","/etc/cfg.txt"]`,
    'ENV A="one two" B="quote \\" and \\$dollar"',
    'WORKDIR /srv',
    'USER root',
    'RUN ["/bin/sh","-c","echo \\"multi\\nline\\""]',
    'ENTRYPOINT ["/bin/sh","-c","python -m http.server"]',
  ]);
  // Each line knows its E2B step (`reason.step`): base, 1…n, finalize.
  assert.equal(stepOfLine.get(1), 'base');
  assert.equal(stepOfLine.get(7), '1');
  assert.equal(stepOfLine.get(9), '2');
  assert.equal(stepOfLine.get(14), '7');
  assert.equal(stepOfLine.get(15), 'finalize');
});

test('steps DSec cannot build, or that try to escape, are refused with their step', () => {
  const refused = (start: TemplateBuildStart, step: string) =>
    assert.throws(
      () => templateDockerfile(start, files),
      (err: unknown) =>
        isDsecError(err, 'invalid_argument') &&
        err.field === 'steps' &&
        err.details?.['step'] === step,
    );
  const base = { fromImage: 'debian:12' };
  refused({ fromTemplate: 'other', steps: [] }, 'base');
  refused({ steps: [] }, 'base');
  refused({ fromImage: 'debian:12\nRUN evil', steps: [] }, 'base');
  refused({ ...base, steps: [{ type: 'ARG', args: ['X'] }] }, '1');
  refused(
    { ...base, steps: [{ type: 'COPY', args: ['../../etc/shadow', '/x'], filesHash: HASH }] },
    '1',
  );
  refused(
    { ...base, steps: [{ type: 'COPY', args: ['/etc/shadow', '/x'], filesHash: HASH }] },
    '1',
  );
  refused({ ...base, steps: [{ type: 'COPY', args: ['a', '/x'] }] }, '1');
  refused(
    { ...base, steps: [{ type: 'COPY', args: ['a', '/x', '', 'rwx'], filesHash: HASH }] },
    '1',
  );
  refused({ ...base, steps: [{ type: 'ENV', args: ['A'] }] }, '1');
  refused({ ...base, steps: [{ type: 'ENV', args: ['BAD-NAME', 'x'] }] }, '1');
  refused({ ...base, steps: [{ type: 'ENV', args: ['A', 'line\nRUN evil'] }] }, '1');
  refused({ ...base, steps: [{ type: 'WORKDIR', args: ['/x\nRUN evil'] }] }, '1');
  refused({ ...base, steps: [{ type: 'USER', args: ['root\nRUN evil'] }] }, '1');
  refused({ ...base, steps: [{ type: 'RUN', args: ['true', 'bad user'] }] }, '1');
  refused(
    { ...base, steps: Array.from({ length: 1001 }, () => ({ type: 'RUN', args: ['true'] })) },
    'base',
  );
});

test('upload links: bound to project, template and hash, and they expire', () => {
  const f = new TemplateFiles(() => '/nonexistent');
  const t = f.token('prj-a', 'tmpl', HASH);
  f.checkToken(t, 'prj-a', 'tmpl', HASH);
  const denied = (fn: () => void) =>
    assert.throws(fn, (err: unknown) => isDsecError(err, 'permission_denied'));
  denied(() => f.checkToken(t, 'prj-b', 'tmpl', HASH));
  denied(() => f.checkToken(t, 'prj-a', 'other', HASH));
  denied(() => f.checkToken(t, 'prj-a', 'tmpl', 'b'.repeat(64)));
  denied(() =>
    f.checkToken(t.replace(/^\d+/, String(Date.now() + 10 ** 9)), 'prj-a', 'tmpl', HASH),
  );
  denied(() =>
    f.checkToken(f.token('prj-a', 'tmpl', HASH, Date.now() - 2 * 3600_000), 'prj-a', 'tmpl', HASH),
  );
  denied(() => f.checkToken('garbage', 'prj-a', 'tmpl', HASH));
  // Another process's secret makes other tokens.
  denied(() => new TemplateFiles(() => '/x').checkToken(t, 'prj-a', 'tmpl', HASH));
  assert.throws(
    () => TemplateFiles.checkHash('../../etc'),
    (err: unknown) => isDsecError(err, 'invalid_argument'),
  );
});

test('stored files: gzip or plain, bounded before and after decompression, evicted past the count', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-tmpl-files-'));
  try {
    const f = new TemplateFiles(() => dir, { maxFileBytes: 64 * 1024, maxFilesPerProject: 2 });
    const plain = Buffer.alloc(1024, 1);
    await f.store('prj-a', HASH, Readable.from([gzipSync(plain)]));
    assert.deepEqual(await readFile(join(dir, 'prj-a', `${HASH}.tar`)), plain);
    assert.equal(await f.present('prj-a', HASH), true);
    assert.equal(await f.present('prj-b', HASH), false);
    // A small gzip that inflates past the bound (a decompression bomb) is stopped at the bound.
    const bomb = gzipSync(Buffer.alloc(10 * 1024 * 1024));
    assert.ok(bomb.length < 64 * 1024);
    await assert.rejects(f.store('prj-a', 'c'.repeat(64), Readable.from([bomb])), (err: unknown) =>
      isDsecError(err, 'payload_too_large'),
    );
    assert.equal(await f.present('prj-a', 'c'.repeat(64)), false);
    await assert.rejects(
      f.store('prj-a', 'd'.repeat(64), Readable.from([Buffer.alloc(65 * 1024)])),
      (err: unknown) => isDsecError(err, 'payload_too_large'),
    );
    await assert.rejects(
      f.store('prj-a', 'e'.repeat(64), Readable.from([Buffer.from([0x1f, 0x8b, 1, 2, 3])])),
      (err: unknown) => isDsecError(err, 'invalid_argument'),
    );
    // Past two files, an older one goes (never the one just stored).
    await f.store('prj-a', 'b'.repeat(64), Readable.from([plain]));
    await f.store('prj-a', 'f'.repeat(64), Readable.from([plain]));
    const kept = [HASH, 'b'.repeat(64), 'f'.repeat(64)];
    const present = await Promise.all(kept.map((h) => f.present('prj-a', h)));
    assert.equal(present.filter(Boolean).length, 2);
    assert.equal(present[2], true);
    await assert.rejects(
      f.unpack('prj-a', '9'.repeat(64), join(dir, 'out')),
      (err: unknown) =>
        isDsecError(err, 'invalid_argument') && err.details?.['reason'] === 'files_missing',
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
