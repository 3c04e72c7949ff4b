import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import type { FileInfo } from '@dsec/core';
import { DirPoller, diffListings, MAX_WATCHED_ENTRIES } from './dir-poller.js';
import type { Listing } from './dir-poller.js';

function file(name: string, over: Partial<FileInfo> = {}): FileInfo {
  return {
    name: name.split('/').pop()!,
    path: `/w/${name}`,
    type: 'file',
    size: 1,
    mode: 0o644,
    mtime: '2026-01-01T00:00:00.000Z',
    uid: 0,
    gid: 0,
    ...over,
  };
}

const listing = (...fs: [string, FileInfo][]): Listing => new Map(fs);

test('creates, writes, removals and mode changes are told apart', () => {
  const before = listing(
    ['a', file('a')],
    ['b', file('b')],
    ['c', file('c')],
    ['d', file('d')],
    ['e', file('e')],
  );
  const after = listing(
    ['a', file('a')],
    ['b', file('b', { size: 2 })],
    ['c', file('c', { mode: 0o600 })],
    ['e', file('e', { type: 'directory' })],
    ['f', file('f')],
  );
  assert.deepEqual(
    diffListings(before, after).map((c) => [c.kind, c.name]),
    [
      ['write', 'b'],
      ['chmod', 'c'],
      ['remove', 'd'],
      ['remove', 'e'],
      ['create', 'e'],
      ['create', 'f'],
      ['write', 'f'],
    ],
  );
  // A new empty file is created only; a new directory too.
  assert.deepEqual(
    diffListings(
      listing(),
      listing(['n', file('n', { size: 0 })], ['m', file('m', { type: 'directory', size: 4096 })]),
    ).map((c) => [c.kind, c.name]),
    [
      ['create', 'm'],
      ['create', 'n'],
    ],
  );
  assert.equal(diffListings(before, before).length, 0);
  // An mtime change alone is a write; a directory's mtime is not (its entries tell).
  assert.deepEqual(
    diffListings(
      listing(['x', file('x')], ['d', file('d', { type: 'directory' })]),
      listing(
        ['x', file('x', { mtime: '2026-01-01T00:00:01.000Z' })],
        ['d', file('d', { type: 'directory', mtime: '2026-01-01T00:00:01.000Z' })],
      ),
    ).map((c) => [c.kind, c.name]),
    [['write', 'x']],
  );
});

test('a recursive poller names entries relative to the root and reports nested changes', async () => {
  const tree = new Map<string, FileInfo[]>([
    ['/w', [file('sub', { type: 'directory' }), file('top')]],
    ['/w/sub', [file('sub/inner')]],
  ]);
  const list = async (p: string) => {
    const entries = tree.get(p);
    if (!entries) throw new Error(`no ${p}`);
    return entries;
  };
  const flat = new DirPoller('/w', false, list);
  const deep = new DirPoller('/w', true, list);
  await flat.start();
  await deep.start();
  tree.set('/w/sub', [file('sub/inner', { size: 5 }), file('sub/new')]);
  assert.deepEqual(await flat.poll(), []);
  assert.deepEqual(
    (await deep.poll()).map((c) => [c.kind, c.name]),
    [
      ['write', 'sub/inner'],
      ['create', 'sub/new'],
      ['write', 'sub/new'],
    ],
  );
  assert.deepEqual(await deep.poll(), []);
});

test("each poll lists with its own caller's signal, never the creator's", async () => {
  const seen: (AbortSignal | undefined)[] = [];
  const p = new DirPoller('/w', false, async (_path, signal) => {
    if (signal?.aborted) throw new Error('listed with an aborted signal');
    seen.push(signal);
    return [file('a')];
  });
  const creator = new AbortController();
  await p.start(creator.signal);
  creator.abort(); // the CreateWatcher request has ended
  const poller = new AbortController();
  assert.deepEqual(await p.poll(poller.signal), []);
  assert.equal(seen[0], creator.signal);
  assert.equal(seen[1], poller.signal);
});

test('a tree with too many entries is refused', async () => {
  const many = Array.from({ length: MAX_WATCHED_ENTRIES + 1 }, (_, i) => file(`f${i}`));
  const p = new DirPoller('/w', false, async () => many);
  await assert.rejects(p.start(), (e) => isDsecError(e, 'resource_exhausted'));
});
