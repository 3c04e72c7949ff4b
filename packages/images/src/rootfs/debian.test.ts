import assert from 'node:assert/strict';
import { mkdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { tempDir } from '../testing/fixtures.js';
import {
  hostAptMirror,
  makeDebianRootfs,
  mirrorFromDeb822,
  mirrorFromList,
  type DebianRootfsOptions,
} from './debian.js';

const DEB822 = `Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
`;

void test('the mirror is read from deb822 and one-line apt sources', () => {
  assert.equal(mirrorFromDeb822(DEB822, 'bookworm'), 'http://deb.debian.org/debian');
  assert.equal(
    mirrorFromDeb822(DEB822, 'bookworm-security'),
    'http://deb.debian.org/debian-security',
  );
  assert.equal(mirrorFromDeb822(DEB822, 'trixie'), undefined);
  assert.equal(mirrorFromDeb822(`Enabled: no\n${DEB822}`, 'bookworm'), undefined);
  const list =
    '# comment\ndeb-src http://src/debian bookworm main\ndeb [arch=amd64] http://m.example/debian bookworm main\n';
  assert.equal(mirrorFromList(list, 'bookworm'), 'http://m.example/debian');
  assert.equal(mirrorFromList(list, 'bullseye'), undefined);
});

void test('hostAptMirror looks through sources.list and sources.list.d', async () => {
  const t = await tempDir();
  try {
    await mkdir(join(t.dir, 'sources.list.d'));
    await writeFile(join(t.dir, 'sources.list.d', 'debian.sources'), DEB822);
    await writeFile(
      join(t.dir, 'sources.list.d', 'other.list'),
      'deb https://x.example/apt nodistro main\n',
    );
    assert.equal(await hostAptMirror('bookworm', t.dir), 'http://deb.debian.org/debian');
    assert.equal(await hostAptMirror('nodistro', t.dir), 'https://x.example/apt');
    assert.equal(await hostAptMirror('sid', t.dir), undefined);
  } finally {
    await t.cleanup();
  }
});

void test('bad suites, packages and mirrors are refused before anything runs', async () => {
  const t = await tempDir();
  try {
    const dir = join(t.dir, 'root');
    const cases: [DebianRootfsOptions, string][] = [
      [{ suite: '../x' }, 'suite'],
      [{ packages: ['python3', '--evil'] }, 'packages.1'],
      [{ mirror: 'ftp://x' }, 'mirror'],
    ];
    for (const [options, field] of cases) {
      await assert.rejects(
        makeDebianRootfs(dir, options),
        (e) => isDsecError(e, 'invalid_argument') && e.field === field,
      );
    }
  } finally {
    await t.cleanup();
  }
});
