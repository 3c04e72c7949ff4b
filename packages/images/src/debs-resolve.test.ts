import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import {
  compareDebVersions,
  installedFromStatus,
  packagesFromIndex,
  parseDeb822,
  parseRelations,
  resolveDebClosure,
} from './debs-resolve.js';

// A slice of bookworm's index, trimmed to the fields that matter, plus a few
// packages made up to reach the corners (alternatives, virtual names, pins).
const INDEX = `Package: python3
Version: 3.11.2-1+b1
Architecture: amd64
Pre-Depends: python3-minimal (= 3.11.2-1+b1)
Depends: python3.11 (>= 3.11.2-1~), libpython3-stdlib (= 3.11.2-1+b1)
Filename: pool/main/p/python3-defaults/python3_3.11.2-1+b1_amd64.deb
SHA256: 1111111111111111111111111111111111111111111111111111111111111111

Package: python3-minimal
Version: 3.11.2-1+b1
Architecture: amd64
Pre-Depends: python3.11-minimal (>= 3.11.2-1~)
Depends: dpkg (>= 1.13.20)

Package: python3.11
Version: 3.11.2-6
Architecture: amd64
Depends: python3.11-minimal (= 3.11.2-6), libpython3.11-stdlib (= 3.11.2-6), media-types | mime-support

Package: python3.11
Version: 3.11.2-6+deb12u5
Architecture: amd64
Depends: python3.11-minimal (= 3.11.2-6+deb12u5), libpython3.11-stdlib (= 3.11.2-6+deb12u5), media-types | mime-support

Package: python3.11-minimal
Version: 3.11.2-6
Architecture: amd64
Depends: libc6 (>= 2.36)

Package: python3.11-minimal
Version: 3.11.2-6+deb12u5
Architecture: amd64
Pre-Depends: libc6 (>= 2.36), zlib1g (>= 1:1.2.0)

Package: libpython3-stdlib
Version: 3.11.2-1+b1
Architecture: amd64
Depends: libpython3.11-stdlib (>= 3.11.2-1~)

Package: libpython3.11-stdlib
Version: 3.11.2-6+deb12u5
Architecture: amd64
Depends: libc6 (>= 2.38), libffi8 (>= 3.4)

Package: libpython3.11-stdlib
Version: 3.11.2-6
Architecture: amd64
Depends: libc6 (>= 2.36), libffi8 (>= 3.4)

Package: libc6
Version: 2.36-9+deb12u10
Architecture: amd64

Package: libc6
Version: 2.38-1
Architecture: amd64

Package: libffi8
Version: 3.4.4-1
Architecture: amd64

Package: media-types
Version: 10.0.0
Architecture: all

Package: zlib1g
Version: 1:1.2.13.dfsg-1
Architecture: amd64

Package: python3-pytest
Version: 7.2.1-2
Architecture: all
Depends: python3-iniconfig, python3-pluggy, python3:any

Package: python3-iniconfig
Version: 1.1.1-2
Architecture: all
Depends: python3:any

Package: pluggy-ng
Version: 1.0
Architecture: all
Provides: python3-pluggy (= 1.0.0)

Package: apluggy
Version: 2.0
Architecture: all
Provides: python3-pluggy

Package: foreign-tool
Version: 1.0
Architecture: arm64
`;

// What a minbase already has: libc6 (older than the 2.38 some versions want), dpkg, zlib1g.
const STATUS = `Package: libc6
Status: install ok installed
Version: 2.36-9+deb12u10
Architecture: amd64

Package: dpkg
Status: install ok installed
Version: 1.21.22
Architecture: amd64

Package: zlib1g
Status: install ok installed
Version: 1:1.2.13.dfsg-1
Architecture: amd64

Package: libffi8
Status: deinstall ok config-files
Version: 3.4.4-1
Architecture: amd64
`;

const available = packagesFromIndex(INDEX, 'amd64');
const installed = installedFromStatus(STATUS);
const names = (pkgs: { name: string; version: string }[]): string[] =>
  pkgs.map((p) => `${p.name}=${p.version}`);

void test('Debian version order follows dpkg: epochs, tildes, revisions, digits by value', () => {
  const ordered = [
    '1.0~rc1',
    '1.0',
    '1.0-1',
    '1.0-1+b1',
    '1.0a',
    '1.1',
    '1.10',
    '2.36-9+deb12u9',
    '2.36-9+deb12u10',
    '1:0.1',
  ];
  for (let i = 0; i < ordered.length - 1; i++) {
    assert.ok(
      compareDebVersions(ordered[i]!, ordered[i + 1]!) < 0,
      `${ordered[i]} < ${ordered[i + 1]}`,
    );
    assert.ok(
      compareDebVersions(ordered[i + 1]!, ordered[i]!) > 0,
      `${ordered[i + 1]} > ${ordered[i]}`,
    );
  }
  assert.equal(compareDebVersions('1.01', '1.1'), 0);
  assert.equal(compareDebVersions('0:1.2-3', '1.2-3'), 0);
});

void test('deb822 stanzas and relations parse with alternatives, qualifiers and restrictions', () => {
  const [first] = parseDeb822('Package: a\nDescription: one\n two\n\n\nPackage: b\n');
  assert.equal(first?.['Description'], 'one\n two');
  assert.deepEqual(parseRelations('a (>= 1.0), b:any | c (<< 2) [amd64], d <!nocheck>, e (> 3)'), [
    [{ name: 'a', op: '>=', version: '1.0' }],
    [{ name: 'b' }, { name: 'c', op: '<<', version: '2' }],
    [{ name: 'd' }],
    [{ name: 'e', op: '>=', version: '3' }],
  ]);
  assert.throws(
    () => parseRelations('Bad Name'),
    (e) => isDsecError(e, 'invalid_argument'),
  );
  assert.deepEqual(
    installed.map((p) => p.name),
    ['libc6', 'dpkg', 'zlib1g'],
    'config-files only is not installed',
  );
  assert.ok(!available.some((p) => p.name === 'foreign-tool'), 'other architectures are left out');
});

void test('the closure takes the newest versions, leaves out what the base has, and re-adds a base package too old', () => {
  const closure = resolveDebClosure({
    available,
    installed,
    wanted: ['python3', 'python3-pytest'],
  });
  assert.deepEqual(names(closure.install), [
    'apluggy=2.0',
    'libc6=2.38-1',
    'libffi8=3.4.4-1',
    'libpython3-stdlib=3.11.2-1+b1',
    'libpython3.11-stdlib=3.11.2-6+deb12u5',
    'media-types=10.0.0',
    'python3=3.11.2-1+b1',
    'python3-iniconfig=1.1.1-2',
    'python3-minimal=3.11.2-1+b1',
    'python3-pytest=7.2.1-2',
    'python3.11=3.11.2-6+deb12u5',
    'python3.11-minimal=3.11.2-6+deb12u5',
  ]);
  // libc6 is in the layer (the stdlib wants 2.38), so it is not "from the base".
  assert.deepEqual(closure.fromBase, ['dpkg', 'zlib1g']);
});

void test('pins choose older versions, and what a pinned package needs follows the pin', () => {
  const closure = resolveDebClosure({
    available,
    installed,
    wanted: ['python3.11=3.11.2-6', 'libpython3.11-stdlib=3.11.2-6'],
  });
  assert.deepEqual(names(closure.install), [
    'libffi8=3.4.4-1',
    'libpython3.11-stdlib=3.11.2-6',
    'media-types=10.0.0',
    'python3.11=3.11.2-6',
    'python3.11-minimal=3.11.2-6',
  ]);
  assert.deepEqual(closure.fromBase, ['libc6']);
});

void test('a versioned dependency needs a versioned Provides; a requested package the base has adds nothing', () => {
  const closure = resolveDebClosure({
    available: packagesFromIndex(
      `Package: wants-new-pluggy\nVersion: 1\nArchitecture: all\nDepends: python3-pluggy (>= 1.0)\n\n${INDEX}`,
      'amd64',
    ),
    installed,
    wanted: ['wants-new-pluggy', 'zlib1g'],
  });
  assert.deepEqual(names(closure.install), ['pluggy-ng=1.0', 'wants-new-pluggy=1']);
  assert.deepEqual(closure.fromBase, ['zlib1g']);
});

void test('unknown packages, missing versions and unsatisfiable dependencies are invalid_argument', () => {
  for (const wanted of [['no-such-package'], ['python3=9.9'], ['python3-pluggy=1.0.0']]) {
    assert.throws(
      () => resolveDebClosure({ available, installed, wanted }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'packages.0',
      wanted.join(),
    );
  }
  const broken = packagesFromIndex(
    'Package: broken\nVersion: 1\nArchitecture: all\nDepends: gone | also-gone (>= 2)\n',
    'amd64',
  );
  assert.throws(
    () => resolveDebClosure({ available: broken, installed, wanted: ['broken'] }),
    (e) => isDsecError(e, 'invalid_argument') && /gone \| also-gone \(>= 2\)/.test(e.message),
  );
});
