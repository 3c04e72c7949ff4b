import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { chmod, chown, mkdir, mkdtemp, readdir, rm, stat, symlink } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { DsecError, isDsecError } from '@dsec/core';
import type { CommandSpec, FileInfo } from '@dsec/core';
import { entryOf } from './filesystem-service.js';
import { FileType } from '../gen/filesystem/filesystem_pb.js';
import {
  FileMetadata,
  MAX_METADATA_BYTES,
  MAX_METADATA_KEY_BYTES,
  parseMetadataLines,
  uploadMetadata,
} from './metadata.js';
import type { OpenedSandbox } from '../sandbox-access.js';
import { ensureDirsAs, nameOf, OwnerNames, parseIdFile, parseResolved } from './sandbox-files.js';

const link = (over: Partial<FileInfo> = {}): FileInfo => ({
  name: 'l',
  path: '/w/l',
  type: 'symlink',
  size: 5,
  mode: 0o777,
  mtime: '2026-01-01T00:00:00.000Z',
  uid: 1000,
  gid: 1000,
  ...over,
});

test('passwd and group files: first name of an ID wins, malformed lines are skipped', () => {
  const m = parseIdFile(
    'root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n' +
      'dup:x:1000:1000::/:/bin/sh\nbad:x:notanumber:1\n:x:5:5\n# comment\nhuge:x:99999999999:1\n',
  );
  assert.deepEqual(
    [...m],
    [
      [0, 'root'],
      [1000, 'user'],
    ],
  );
  assert.equal(nameOf(m, 1000), 'user');
  assert.equal(nameOf(m, 4242), '4242');
  assert.equal(nameOf(undefined, 0), 'root');
  assert.equal(nameOf(new Map(), 7), '7');
});

test('resolved symlinks: two lines per link, in order; a missing end is unknown', () => {
  const r = parseResolved(
    ['/a', '/b', '/c'],
    '8000 /t/file\nfile\n4000 /t/dir\n../dir\n- \nmissing\n',
  );
  assert.deepEqual(r.get('/a'), { type: 'file', path: '/t/file', text: 'file' });
  assert.deepEqual(r.get('/b'), { type: 'directory', path: '/t/dir', text: '../dir' });
  assert.deepEqual(r.get('/c'), { type: 'unknown', path: '', text: 'missing' });
  // A short answer leaves the rest unresolved rather than shifting them.
  assert.equal(parseResolved(['/a', '/b'], '8000 /t\nt\n').get('/b'), undefined);
  // A relative "resolution" is not taken as a target.
  assert.equal(parseResolved(['/a'], '8000 t\nt\n').get('/a')?.path, '');
});

test('a symlink entry: its target type, absolute target, never SYMLINK; broken ones are files', () => {
  const names = { users: new Map([[1000, 'user']]), groups: new Map([[1000, 'user']]) };
  const dir = entryOf(link({ target: 'sub' }), names, {
    type: 'directory',
    path: '/w/sub',
  });
  assert.equal(dir.type, FileType.DIRECTORY);
  assert.equal(dir.symlinkTarget, '/w/sub');
  assert.equal(dir.owner, 'user');
  const broken = entryOf(link({ target: '../gone' }), names, { type: 'unknown', path: '/x' });
  assert.equal(broken.type, FileType.FILE);
  assert.equal(broken.symlinkTarget, '/gone');
  // Unresolved (no answer from the sandbox): the link's own text, made absolute.
  const plain = entryOf(link({ target: 'a/./b' }));
  assert.equal(plain.type, FileType.FILE);
  assert.equal(plain.symlinkTarget, '/w/a/b');
  assert.equal(plain.owner, '1000');
  // From a listing (no text in DSec's entry): the text the resolution read.
  const listed = entryOf(link(), undefined, { type: 'unknown', path: '', text: '/abs/t' });
  assert.equal(listed.symlinkTarget, '/abs/t');
  for (const e of [dir, broken, plain, listed]) assert.notEqual(e.type, FileType.SYMLINK);
});

test('upload metadata: lower-cased keys, first header wins, printable ASCII, bounded', () => {
  assert.equal(uploadMetadata({ 'content-type': 'x' }, ['Content-Type', 'x']), undefined);
  assert.deepEqual(
    uploadMetadata({ 'x-metadata-a': '1, 2', 'x-metadata-b-c': 'v w' }, [
      'X-Metadata-A',
      '1',
      'x-metadata-a',
      '2',
      'X-METADATA-B-C',
      'v w',
    ]),
    { a: '1', 'b-c': 'v w' },
  );
  const refused = (raw: string[]) =>
    assert.throws(
      () => uploadMetadata({ [raw[0]!.toLowerCase()]: raw[1]! }, raw),
      (e) => isDsecError(e, 'invalid_argument'),
    );
  refused(['X-Metadata-k', 'caf\u00e9']);
  refused(['X-Metadata-k', 'tab\there']);
  refused([`X-Metadata-${'k'.repeat(MAX_METADATA_KEY_BYTES + 1)}`, 'v']);
  const big = Array.from({ length: 3 }, (_, i) => [`X-Metadata-k${i}`, 'v'.repeat(1500)]).flat();
  assert.throws(
    () => uploadMetadata({ 'x-metadata-k0': 'v' }, big),
    (e) => isDsecError(e, 'invalid_argument') && e.message.includes(String(MAX_METADATA_BYTES)),
  );
  // Exactly at the limit is fine.
  const key = 'k';
  const fits = 'v'.repeat(MAX_METADATA_BYTES - 'user.e2b.'.length - key.length);
  assert.deepEqual(uploadMetadata({ 'x-metadata-k': fits }, ['X-Metadata-k', fits]), {
    k: fits,
  });
});

test("the metadata tool's answer: hex pairs per path; what envd would refuse is not shown", () => {
  const hex = (s: string) => Buffer.from(s, 'latin1').toString('hex');
  const out = [
    `+ ${hex('a')}=${hex('1')} ${hex('b')}=${hex('x y')}`,
    '-',
    '+',
    `+ ${hex('bad')}=${hex('\u0001')} ${hex('ok')}=${hex('v')} junk`,
  ].join('\n');
  const m = parseMetadataLines(['/1', '/2', '/3', '/4', '/5'], `${out}\n`);
  assert.deepEqual(m.get('/1'), { a: '1', b: 'x y' });
  assert.equal(m.get('/2'), undefined);
  assert.deepEqual(m.get('/3'), {});
  assert.deepEqual(m.get('/4'), { ok: 'v' });
  assert.equal(m.get('/5'), undefined);
});

test('owner names: read through the sandbox, cached by what was asked, read again for an unknown ID', async () => {
  const reads: string[] = [];
  let passwd =
    'root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\nb:x:1001:1001::/:/bin/sh\n';
  const sb = {
    id: 'sb-1',
    io: {
      readFile: async (_id: string, path: string, o: { user?: string }) => {
        assert.equal(o.user, 'root');
        reads.push(path);
        if (path === '/etc/group') throw new DsecError('not_found', path);
        return Readable.from([Buffer.from(passwd)]);
      },
    },
  } as unknown as OpenedSandbox;
  const owners = new OwnerNames();
  const f = (uid: number, gid = 0) => ({ ...link({ uid, gid }), type: 'file' as const });
  const first = await owners.lookup(sb, [f(1000)], undefined);
  assert.equal(nameOf(first.users, 1000), 'user');
  assert.deepEqual(reads, ['/etc/passwd', '/etc/group']);
  // gid 0 is unknown (no /etc/group): asked again, it is read again; uid 1000 is cached.
  reads.length = 0;
  await owners.lookup(sb, [f(1000, 0)], undefined);
  assert.equal(reads.length, 2);
  // Only asked-about names are kept: 1001 (in the file, never asked) makes a read.
  passwd += 'late:x:1002:1002::/:/bin/sh\n';
  reads.length = 0;
  const later = await owners.lookup(sb, [f(1001), f(1002)], undefined);
  assert.equal(reads.length, 2);
  assert.equal(nameOf(later.users, 1001), 'b');
  assert.equal(nameOf(later.users, 1002), 'late');
  owners.forget('sb-1');
});

/**
 * The parents scripts run for real: the platform's shell (busybox) as root,
 * and as an unprivileged user through setpriv, on a tree made here, so what
 * they may touch is what the sandbox's root and user could.
 */
const NOBODY = 65534;
const canRunAs =
  process.getuid?.() === 0 &&
  spawnSync('busybox', ['true']).status === 0 &&
  spawnSync('setpriv', ['--version']).status === 0;

function localSandbox(): OpenedSandbox {
  const run = (spec: CommandSpec) => {
    const sh = ['busybox', 'sh', '-c', spec.shell ?? ''];
    const argv =
      spec.user === 'root'
        ? sh
        : ['setpriv', `--reuid=${spec.user}`, `--regid=${spec.user}`, '--clear-groups', ...sh];
    const r = spawnSync(argv[0]!, argv.slice(1), {
      env: { PATH: process.env['PATH'], ...spec.env },
      encoding: 'utf8',
    });
    return {
      commandId: 'c',
      exitCode: r.status ?? -1,
      outcome: 'exited',
      stdout: r.stdout,
      stderr: r.stderr,
      truncated: false,
      stdoutBytes: 0,
      stderrBytes: 0,
      durationMs: 0,
    };
  };
  return {
    id: 'sb-local',
    io: { runCommand: async (_id: string, spec: CommandSpec) => run(spec) },
  } as unknown as OpenedSandbox;
}

test(
  'attack: parents for a user never make root work through a symlink the user planted',
  { skip: !canRunAs && 'needs root, busybox and setpriv' },
  async () => {
    const top = await mkdtemp(join(tmpdir(), 'dsec-parents-'));
    try {
      await chmod(top, 0o755);
      const rootOnly = join(top, 'usr');
      const home = join(top, 'home');
      await mkdir(rootOnly);
      await mkdir(home);
      await chown(home, NOBODY, NOBODY);
      // The user points a name in its home at a directory only root may write.
      await symlink(rootOnly, join(home, 'lnk'));
      const sb = localSandbox();
      await assert.rejects(
        ensureDirsAs(sb, join(home, 'lnk', 'evil', 'deep'), String(NOBODY), undefined),
        (e) => isDsecError(e) && e.code === 'permission_denied',
      );
      assert.deepEqual(await readdir(rootOnly), []);
      // Its own directories the user makes itself; root's tree gets them made by root, given to it.
      await ensureDirsAs(sb, join(home, 'a', 'b'), String(NOBODY), undefined);
      assert.equal((await stat(join(home, 'a', 'b'))).uid, NOBODY);
      await ensureDirsAs(sb, join(rootOnly, 'new', 'deep'), String(NOBODY), undefined);
      for (const d of [join(rootOnly, 'new'), join(rootOnly, 'new', 'deep')]) {
        const s = await stat(d);
        assert.equal(s.uid, NOBODY, d);
        assert.equal(s.mode & 0o777, 0o755, d);
      }
      assert.equal((await stat(rootOnly)).uid, 0);
      // Below a directory others may write (not sticky), the user could swap root's directory
      // for a symlink while root works: root does not work there either.
      const open = join(top, 'open');
      await mkdir(join(open, 'r'), { recursive: true });
      await chmod(open, 0o777);
      await assert.rejects(
        ensureDirsAs(sb, join(open, 'r', 'x'), String(NOBODY), undefined),
        (e) => isDsecError(e) && e.code === 'permission_denied',
      );
      assert.deepEqual(await readdir(join(open, 'r')), []);
    } finally {
      await rm(top, { recursive: true, force: true });
    }
  },
);

test('attack: the metadata tool is never copied where a user could swap it, and runs as the caller', async () => {
  const modes: Record<string, number> = { '/': 0o755, '/tmp': 0o777 };
  const writes: string[] = [];
  const runs: (string | undefined)[] = [];
  const sb = {
    id: 'sb-meta',
    io: {
      statFile: async (_id: string, path: string, o: { user?: string }) => {
        assert.equal(o.user, 'root');
        const mode = modes[path];
        if (mode === undefined) throw new DsecError('not_found', path);
        return { ...link({ uid: 0, gid: 0 }), path, type: 'directory' as const, mode };
      },
      writeFile: async (_id: string, path: string) => {
        writes.push(path);
        modes[path] = 0o755;
        return { ...link({ uid: 0 }), path, type: 'file' as const };
      },
      runCommand: async (_id: string, spec: CommandSpec) => {
        runs.push(spec.user);
        return { outcome: 'exited', exitCode: 0, stdout: '+\n', stderr: '', truncated: false };
      },
    },
  } as unknown as OpenedSandbox;
  const meta = new FileMetadata();
  // A /tmp others may write, not sticky: a user could replace the tool before root runs it.
  await assert.rejects(
    meta.set(sb, '/home/user/f', { k: 'v' }, 'user', undefined),
    (e) => isDsecError(e) && e.code === 'unavailable',
  );
  assert.deepEqual(writes, []);
  assert.deepEqual(runs, []);
  assert.equal((await meta.get(sb, ['/home/user/f'], 'root', undefined)).size, 0);
  // Sticky, as /tmp is: copied once; set and get run as the caller, never as root for a user.
  modes['/tmp'] = 0o1777;
  await meta.set(sb, '/home/user/f', { k: 'v' }, 'user', undefined);
  assert.equal(writes.length, 1);
  await meta.get(sb, ['/home/user/f'], 'user', undefined);
  assert.deepEqual(runs, ['user', 'user']);
  meta.forget('sb-meta');
});
