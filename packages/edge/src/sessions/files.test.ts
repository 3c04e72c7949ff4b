import { test } from 'node:test';
import assert from 'node:assert/strict';
import { normalizePath, parseListing, parseStatLine } from './files.js';

test('stat lines decode type, permission bits, size, mtime and owner', () => {
  const f = parseStatLine('81ed 12 1700000000 1000 100', '/tmp/run.sh');
  assert.deepEqual(f, {
    name: 'run.sh',
    path: '/tmp/run.sh',
    type: 'file',
    size: 12,
    mode: 0o755,
    mtime: '2023-11-14T22:13:20.000Z',
    uid: 1000,
    gid: 100,
  });
  assert.equal(parseStatLine('41ed 4096 0 0 0', '/').type, 'directory');
  assert.equal(parseStatLine('a1ff 7 0 0 0', '/l').type, 'symlink');
  assert.equal(parseStatLine('43ff 0 0 0 0', '/tmp').mode, 0o1777);
});

test('listings survive names with spaces, newlines and stat-like text', () => {
  const tricky = 'x\n81a4 0 0 0 0 y';
  const out = Buffer.concat([
    Buffer.from('81a4 5 0 0 0\n./a b\0'),
    Buffer.from(`81a4 1 0 0 0\n./${tricky}\0`),
    Buffer.from('41ed 4096 0 0 0\n./dir\0'),
  ]);
  const entries = parseListing(out, '/w');
  assert.deepEqual(
    entries.map((e) => [e.name, e.type, e.path]),
    [
      ['a b', 'file', '/w/a b'],
      ['dir', 'directory', '/w/dir'],
      [tricky, 'file', `/w/${tricky}`],
    ],
  );
});

test('relative paths cannot read as options', () => {
  assert.equal(normalizePath('-rf'), './-rf');
  assert.equal(normalizePath('/abs'), '/abs');
  assert.throws(() => normalizePath(''), /empty/);
  assert.throws(() => normalizePath('a\0b'), /NUL/);
});
