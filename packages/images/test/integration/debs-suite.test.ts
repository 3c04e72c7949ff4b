/**
 * Issue 25: a toolkit on a Debian 11 base was resolved from bookworm. Here a
 * small base layer says bullseye only through an absolute /etc/os-release
 * link (followed on this bookworm host, it would read the host's file), and
 * two recorded Packages indexes, one per suite, offer the same package at
 * different versions: the layer must come from bullseye's, and a recipe
 * naming bookworm on that base is refused before anything is fetched.
 * Offline: the indexes are seeded into the private apt state and the .debs
 * into the download cache, under a mirror URL that does not exist.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { copyFile, mkdir, readFile, symlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { baseFacts, buildFromDebs, buildLayer, DirImageStore } from '@dsec/images';
import { aptStateDir } from '../../src/debs.js';
import { tempDir } from '../../src/testing/fixtures.js';
import { runTool } from '../../src/util/run-tool.js';

const skip = process.getuid?.() === 0 ? false : 'needs root';
const MIRROR = 'file:///nonexistent/dsec-suite-test-mirror';
const ARCH = 'amd64';

let tmp: { dir: string; cleanup(): Promise<void> };
let store: DirImageStore;
let cacheDir: string;

async function makeDeb(suite: string): Promise<{ file: string; stanza: string }> {
  const src = join(tmp.dir, `deb-${suite}`);
  await mkdir(join(src, 'DEBIAN'), { recursive: true });
  await mkdir(join(src, 'usr/share/dsec-hello'), { recursive: true });
  await writeFile(join(src, 'usr/share/dsec-hello/suite'), `${suite}\n`);
  const version = `1.0~${suite}`;
  await writeFile(
    join(src, 'DEBIAN/control'),
    `Package: dsec-hello\nVersion: ${version}\nArchitecture: all\nMaintainer: DSec <t@dsec.invalid>\nDescription: test\n`,
  );
  const name = `dsec-hello_${version}_all.deb`;
  const file = join(tmp.dir, name);
  await runTool('dpkg-deb', ['--root-owner-group', '--build', src, file]);
  const sha = createHash('sha256')
    .update(await readFile(file))
    .digest('hex');
  const stanza =
    `Package: dsec-hello\nVersion: ${version}\nArchitecture: all\n` +
    `Filename: pool/main/d/dsec-hello/${name}\nSHA256: ${sha}\n\n`;
  return { file, stanza };
}

before(async () => {
  tmp = await tempDir('dsec-suite-it-');
  store = new DirImageStore(join(tmp.dir, 'images'));
  cacheDir = join(tmp.dir, 'cache');
  // The base: a dpkg status, and its release only behind an absolute link.
  const root = join(tmp.dir, 'base');
  await mkdir(join(root, 'var/lib/dpkg'), { recursive: true });
  await mkdir(join(root, 'usr/lib'), { recursive: true });
  await mkdir(join(root, 'etc'), { recursive: true });
  await writeFile(
    join(root, 'var/lib/dpkg/status'),
    'Package: base-files\nStatus: install ok installed\nVersion: 11.1+deb11u9\nArchitecture: amd64\n\n',
  );
  await writeFile(
    join(root, 'usr/lib/os-release'),
    'PRETTY_NAME="Debian GNU/Linux 11 (bullseye)"\nVERSION_ID="11"\nVERSION_CODENAME=bullseye\nID=debian\n',
  );
  await symlink('/usr/lib/os-release', join(root, 'etc/os-release'));
  await buildLayer(store, { name: 'bullseye-mini', kind: 'base', from: { dir: root } });
  await mkdir(join(cacheDir, 'debs'), { recursive: true });
  for (const suite of ['bullseye', 'bookworm']) {
    const deb = await makeDeb(suite);
    await copyFile(deb.file, join(cacheDir, 'debs', deb.file.split('/').pop()!));
    const { dir } = await aptStateDir(cacheDir, {
      suites: [suite],
      mirror: MIRROR,
      components: ['main'],
      architecture: ARCH,
    });
    await mkdir(join(dir, 'state/lists'), { recursive: true });
    await writeFile(
      join(dir, 'state/lists', `dsec_${suite}_main_binary-${ARCH}_Packages`),
      deb.stanza,
    );
  }
});

after(async () => {
  await tmp?.cleanup();
});

void test("a toolkit on a bullseye base comes from bullseye's index", { skip }, async () => {
  const facts = await baseFacts(store, await store.getLayer('bullseye-mini'), cacheDir);
  assert.deepEqual(facts.release, { id: 'debian', suite: 'bullseye', from: 'os-release' });
  const { layer, manifest } = await buildFromDebs(store, {
    name: 'hello',
    packages: ['dsec-hello'],
    base: 'bullseye-mini',
    cacheDir,
    mirror: MIRROR,
    architecture: ARCH,
  });
  assert.equal(manifest.suite, 'bullseye');
  assert.deepEqual(
    manifest.packages.map((p) => `${p.name}=${p.version}`),
    ['dsec-hello=1.0~bullseye'],
  );
  // The layer holds bullseye's file, not bookworm's.
  const out = join(tmp.dir, 'extract');
  await runTool('fsck.erofs', [`--extract=${out}`, await store.blobPath(layer.digest)]);
  assert.equal(await readFile(join(out, 'usr/share/dsec-hello/suite'), 'utf8'), 'bullseye\n');
});

void test(
  'a toolkit naming a suite its base contradicts is refused before any fetch',
  { skip },
  async () => {
    await assert.rejects(
      buildFromDebs(store, {
        name: 'hello-wrong',
        packages: ['dsec-hello'],
        base: 'bullseye-mini',
        suite: 'bookworm',
        cacheDir,
        mirror: MIRROR,
        architecture: ARCH,
      }),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') &&
        e.field === 'suite' &&
        (e.details as { reason?: string }).reason === 'suite_mismatch',
    );
    await assert.rejects(store.getLayer('hello-wrong'), (e: unknown) =>
      isDsecError(e, 'image_not_found'),
    );
  },
);
