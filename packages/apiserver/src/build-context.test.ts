import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { lstat, mkdir, mkdtemp, readFile, readlink, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { DEFAULT_BUILD_CONTEXT_LIMITS, unpackBuildContext } from './build-context.js';

// The tar unpacker of `POST /v1/images/builds` against hostile archives: each
// attack is written byte by byte (a ustar header per entry) so the archive
// holds exactly what a hostile client would send.

interface Entry {
  name: string;
  type?: string;
  data?: string | Buffer;
  link?: string;
  mode?: number;
  /** Use a pax header for the name (long paths). */
  pax?: boolean;
}

function header(name: string, type: string, size: number, link = '', mode = 0o644): Buffer {
  const h = Buffer.alloc(512);
  h.write(name, 0, 100, 'utf8');
  h.write(mode.toString(8).padStart(7, '0') + '\0', 100, 'latin1');
  h.write('0000000\0', 108, 'latin1');
  h.write('0000000\0', 116, 'latin1');
  h.write(size.toString(8).padStart(11, '0') + '\0', 124, 'latin1');
  h.write('00000000000\0', 136, 'latin1');
  h.write(type, 156, 'latin1');
  h.write(link, 157, 100, 'utf8');
  h.write('ustar\0', 257, 'latin1');
  h.write('00', 263, 'latin1');
  h.fill(0x20, 148, 156);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(sum.toString(8).padStart(6, '0') + '\0 ', 148, 'latin1');
  return h;
}

function pad(b: Buffer): Buffer {
  return Buffer.concat([b, Buffer.alloc((512 - (b.length % 512)) % 512)]);
}

function tar(entries: Entry[]): Buffer {
  const parts: Buffer[] = [];
  for (const e of entries) {
    const data = Buffer.from(e.data ?? '');
    let name = e.name;
    if (e.pax) {
      const rec = (k: string, v: string): string => {
        const body = ` ${k}=${v}\n`;
        let len = body.length + 1;
        while (`${len}${body}`.length !== len) len++;
        return `${len}${body}`;
      };
      const paxData = Buffer.from(rec('path', e.name));
      parts.push(header('PaxHeader', 'x', paxData.length), pad(paxData));
      name = 'short';
    }
    parts.push(header(name, e.type ?? '0', data.length, e.link ?? '', e.mode ?? 0o644), pad(data));
  }
  parts.push(Buffer.alloc(1024));
  return Buffer.concat(parts);
}

let dir: string;
let n = 0;
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-ctx-'));
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

async function unpack(archive: Buffer, limits = DEFAULT_BUILD_CONTEXT_LIMITS) {
  const file = join(dir, `a${++n}.tar`);
  await writeFile(file, archive);
  const dest = join(dir, `d${n}`);
  await mkdir(dest);
  return { dest, result: await unpackBuildContext(file, dest, limits) };
}

async function refused(archive: Buffer, reason: string, limits = DEFAULT_BUILD_CONTEXT_LIMITS) {
  await assert.rejects(unpack(archive, limits), (err: unknown) => {
    assert.ok(isDsecError(err, 'invalid_argument'), String(err));
    assert.equal(err.field, 'context');
    assert.equal(err.details?.['reason'], reason, err.message);
    return true;
  });
}

test('an ordinary context: files, directories, symlinks, hard links, pax long names', async () => {
  const long = `${'d'.repeat(120)}/${'f'.repeat(120)}`;
  const { dest, result } = await unpack(
    tar([
      { name: './', type: '5' },
      { name: './Dockerfile', data: 'FROM x\n' },
      { name: 'src/', type: '5', mode: 0o750 },
      { name: 'src/run.sh', data: '#!/bin/sh\n', mode: 0o4755 },
      { name: 'src/link', type: '2', link: '../Dockerfile' },
      { name: 'src/abs', type: '2', link: '/etc/passwd' },
      { name: 'src/hard', type: '1', link: 'src/run.sh' },
      { name: 'implied/dir/file', data: 'x' },
      { name: long, pax: true, data: 'long' },
    ]),
  );
  assert.equal(await readFile(join(dest, 'Dockerfile'), 'utf8'), 'FROM x\n');
  // Set-id bits are dropped; permission bits kept.
  assert.equal((await stat(join(dest, 'src/run.sh'))).mode & 0o7777, 0o755);
  assert.equal(await readlink(join(dest, 'src/link')), '../Dockerfile');
  // A symlink's text is kept as is and never followed by the unpacker.
  assert.equal(await readlink(join(dest, 'src/abs')), '/etc/passwd');
  assert.equal(
    (await stat(join(dest, 'src/hard'))).ino,
    (await stat(join(dest, 'src/run.sh'))).ino,
  );
  assert.equal(await readFile(join(dest, 'implied/dir/file'), 'utf8'), 'x');
  assert.equal(await readFile(join(dest, long), 'utf8'), 'long');
  assert.equal(result.kindOf('Dockerfile'), 'file');
  assert.equal(result.kindOf('./src/link'), 'symlink');
  assert.equal(result.kindOf('src'), 'dir');
  assert.equal(result.kindOf('../etc/passwd'), undefined);
  assert.equal(result.kindOf('/Dockerfile'), undefined);
});

test('what tar(1) writes unpacks the same', async () => {
  const src = join(dir, 'tar-src');
  await mkdir(join(src, 'a/b'), { recursive: true });
  await writeFile(join(src, 'Dockerfile'), 'FROM y\n');
  await writeFile(join(src, 'a/b/c.txt'), 'c'.repeat(5000));
  const file = join(dir, 'gnu.tar');
  const r = spawnSync('tar', ['-C', src, '-cf', file, '.'], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  const dest = join(dir, 'gnu');
  await mkdir(dest);
  await unpackBuildContext(file, dest);
  assert.equal(await readFile(join(dest, 'a/b/c.txt'), 'utf8'), 'c'.repeat(5000));
});

test('absolute paths and .. are refused', async () => {
  await refused(tar([{ name: '/etc/passwd', data: 'x' }]), 'tar_path');
  await refused(tar([{ name: '../outside', data: 'x' }]), 'tar_path');
  await refused(tar([{ name: 'a/../../outside', data: 'x' }]), 'tar_path');
  await refused(tar([{ name: `a/${'../'.repeat(5)}x`, pax: true, data: 'x' }]), 'tar_path');
});

test('nothing is written through a symlink the archive made', async () => {
  const outside = join(dir, 'outside');
  await mkdir(outside);
  await refused(
    tar([
      { name: 'esc', type: '2', link: outside },
      { name: 'esc/pwned', data: 'x' },
    ]),
    'tar_path',
  );
  await refused(
    tar([
      { name: 'esc', type: '2', link: outside },
      { name: 'esc/sub/', type: '5' },
    ]),
    'tar_path',
  );
  // A file replaced by a symlink (or the other way round) is a duplicate, refused.
  await refused(
    tar([
      { name: 'f', data: 'x' },
      { name: 'f', type: '2', link: outside },
    ]),
    'tar_duplicate',
  );
  await refused(
    tar([
      { name: 'f', type: '2', link: join(outside, 'target') },
      { name: 'f', data: 'x' },
    ]),
    'tar_duplicate',
  );
  assert.deepEqual(await readdirNames(outside), []);
});

test('hard links only to a regular file earlier in the archive', async () => {
  await refused(tar([{ name: 'h', type: '1', link: '/etc/shadow' }]), 'tar_link');
  await refused(tar([{ name: 'h', type: '1', link: '../x' }]), 'tar_link');
  await refused(tar([{ name: 'h', type: '1', link: 'later' }]), 'tar_link');
  await refused(
    tar([
      { name: 's', type: '2', link: '/etc/shadow' },
      { name: 'h', type: '1', link: 's' },
    ]),
    'tar_link',
  );
  await refused(
    tar([
      { name: 'd/', type: '5' },
      { name: 'h', type: '1', link: 'd' },
    ]),
    'tar_link',
  );
});

test('device nodes, FIFOs and unknown kinds are refused', async () => {
  for (const type of ['3', '4', '6', 'S', 'Z'])
    await refused(tar([{ name: 'dev', type }]), 'tar_entry_kind');
});

test('bounds: entries, depth, path length, extended headers', async () => {
  const many = Array.from({ length: 11 }, (_, i) => ({ name: `f${i}`, data: '' }));
  await refused(tar(many), 'context_too_large', {
    ...DEFAULT_BUILD_CONTEXT_LIMITS,
    maxEntries: 10,
  });
  await refused(tar([{ name: `${'a/'.repeat(20)}f`, data: '' }]), 'context_too_large', {
    ...DEFAULT_BUILD_CONTEXT_LIMITS,
    maxDepth: 10,
  });
  await refused(tar([{ name: `${'x'.repeat(300)}`, pax: true, data: '' }]), 'tar_path');
  // A pax header claiming 2 GiB is refused from its size, never read.
  const big = header('PaxHeader', 'x', 2 ** 31);
  await refused(Buffer.concat([big, Buffer.alloc(1024)]), 'tar_malformed');
});

test('malformed archives: bad checksum, truncated entries, not a tar', async () => {
  const good = tar([{ name: 'f', data: 'hello' }]);
  const bad = Buffer.from(good);
  bad[0] = 'g'.charCodeAt(0);
  await refused(bad, 'tar_malformed');
  await refused(good.subarray(0, 512 + 2), 'tar_malformed');
  await refused(Buffer.from('{"not":"a tar"}'.padEnd(600, ' ')), 'tar_malformed');
  // An empty body is an empty context (the missing Dockerfile is the caller's error).
  const { result } = await unpack(Buffer.alloc(0));
  assert.equal(result.entries, 0);
});

test('a directory given twice is fine; anything else twice is not', async () => {
  const { dest } = await unpack(
    tar([
      { name: 'd/', type: '5' },
      { name: 'd/', type: '5' },
      { name: 'd/f', data: '1' },
    ]),
  );
  assert.ok((await lstat(join(dest, 'd'))).isDirectory());
  await refused(
    tar([
      { name: 'f', data: '1' },
      { name: 'f', data: '2' },
    ]),
    'tar_duplicate',
  );
  await refused(
    tar([
      { name: 'f', data: '1' },
      { name: 'f/', type: '5' },
    ]),
    'tar_duplicate',
  );
});

async function readdirNames(p: string): Promise<string[]> {
  const { readdir } = await import('node:fs/promises');
  return (await readdir(p)).sort();
}
