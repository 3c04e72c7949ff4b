import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdir, mkdtemp, readFile, readlink, rm, stat, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { READ_SCRIPT, parseListing, resolveWithin } from './agent-patch.js';
import { diffOfChanges } from './patch-text.js';
import type { Change } from './steering.js';

test('parseListing reads types, modes and times, and sets aside names it cannot carry', () => {
  const out = [
    '81a4 11 1700000000 1700000001 ./a/b.py',
    'a1ff 5 1700000000 1700000000 ./link',
    '81ed 0 1 2 ./bin/run me',
    '11a4 0 1 2 ./fifo',
    '81a4 3 1 2 ./bad',
    'name',
    '81a4 3 1 2 ./ctl\x1bx',
    '81a4 3 1 2 ./bad\ufffdutf8',
    '81a4 3 1 2 ./x/../y',
    '81a4 3 1 2 ./sub/.GIT/config',
    'not a line at all',
    '',
  ].join('\n');
  const l = parseListing(out);
  assert.deepEqual([...l.entries.keys()], ['a/b.py', 'link', 'bin/run me', 'fifo']);
  assert.deepEqual(l.entries.get('a/b.py'), {
    path: 'a/b.py',
    type: 'file',
    mode: 0o644,
    size: 11,
    mtime: 1700000000,
    ctime: 1700000001,
  });
  assert.equal(l.entries.get('link')?.type, 'symlink');
  assert.equal(l.entries.get('bin/run me')?.mode, 0o755);
  assert.equal(l.entries.get('fifo')?.type, 'other');
  assert.deepEqual(l.unsupported, [
    'bad\nname',
    'ctl\x1bx',
    'bad\ufffdutf8',
    'x/../y',
    'sub/.GIT/config\nnot a line at all',
  ]);
});

test('READ_SCRIPT reads files and symlinks, and nothing through a symlinked directory (a forged listing line cannot make it)', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-read-'));
  try {
    const work = join(dir, 'work');
    await mkdir(join(dir, 'outside'), { recursive: true });
    await writeFile(join(dir, 'outside', 'secret'), 'root only\n');
    await mkdir(join(work, 'pkg'), { recursive: true });
    await writeFile(join(work, 'pkg', 'a.py'), 'A = 1\n');
    await symlink(join(dir, 'outside'), join(work, 'pkg', 'out'));
    await symlink('a.py', join(work, 'pkg', 'alias'));
    const out = execFileSync('sh', ['-c', READ_SCRIPT], {
      cwd: work,
      input: 'pkg/a.py\npkg/out/secret\npkg/alias\npkg/gone\n',
      encoding: 'utf8',
    }).split('\n');
    assert.match(out[0]!, /^F \d+ /);
    assert.equal(Buffer.from(out[0]!.split(' ')[2]!, 'base64').toString(), 'A = 1\n');
    assert.equal(out[1], 'M');
    assert.equal(Buffer.from(out[2]!.slice(2), 'base64').toString(), 'a.py\n');
    assert.equal(out[3], 'M');
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('resolveWithin follows a symlink lexically and refuses one that leaves the repository', () => {
  assert.equal(resolveWithin('pkg', 'core.py', '/testbed'), 'pkg/core.py');
  assert.equal(resolveWithin('pkg/sub', '../../README', '/testbed'), 'README');
  assert.equal(resolveWithin('pkg', '../../etc', '/testbed'), undefined);
  assert.equal(resolveWithin('', '/testbed/pkg', '/testbed'), 'pkg');
  assert.equal(resolveWithin('', '/etc/passwd', '/testbed'), undefined);
  assert.equal(resolveWithin('', '/testbedx/a', '/testbed'), undefined);
});

test('diffOfChanges is a git diff that `git apply` takes back: text, binary, modes, symlinks, deletions, odd names', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-patch-text-'));
  try {
    const git = (...args: string[]) =>
      execFileSync('git', ['-C', dir, ...args], {
        env: {
          PATH: process.env['PATH'] ?? '/usr/bin:/bin',
          GIT_CONFIG_NOSYSTEM: '1',
          GIT_CONFIG_GLOBAL: '/dev/null',
          GIT_AUTHOR_NAME: 't',
          GIT_AUTHOR_EMAIL: 't@t',
          GIT_COMMITTER_NAME: 't',
          GIT_COMMITTER_EMAIL: 't@t',
        },
      });
    git('init', '-q');
    await writeFile(join(dir, 'a.py'), 'x = 1\n');
    await writeFile(join(dir, 'gone.txt'), 'bye\n');
    await writeFile(join(dir, 'run.sh'), 'echo\n');
    git('add', '-A');
    git('commit', '-qm', 'base');
    const binary = Buffer.from([0, 1, 2, 255, 254, 10, 0]);
    const changes: Change[] = [
      {
        path: 'a.py',
        base: { type: 'file', mode: 0o644, content: Buffer.from('x = 1\n') },
        next: { type: 'file', mode: 0o644, content: Buffer.from('x = 2\n') },
      },
      {
        path: 'gone.txt',
        base: { type: 'file', mode: 0o644, content: Buffer.from('bye\n') },
        next: undefined,
      },
      {
        path: 'run.sh',
        base: { type: 'file', mode: 0o644, content: Buffer.from('echo\n') },
        next: { type: 'file', mode: 0o755, content: Buffer.from('echo\n') },
      },
      {
        path: 'data/blob.bin',
        base: undefined,
        next: { type: 'file', mode: 0o644, content: binary },
      },
      { path: 'alias', base: undefined, next: { type: 'symlink', target: 'a.py' } },
      {
        path: 'dir with space/ü.txt',
        base: undefined,
        next: { type: 'file', mode: 0o600, content: Buffer.from('u\n') },
      },
    ];
    const diff = await diffOfChanges(changes);
    assert.match(diff, /^diff --git a\/a\.py b\/a\.py$/m);
    assert.match(diff, /^-x = 1\n\+x = 2$/m);
    assert.match(diff, /^deleted file mode 100644$/m);
    assert.match(diff, /^old mode 100644\nnew mode 100755$/m);
    assert.match(diff, /^GIT binary patch$/m);
    assert.match(diff, /^new file mode 120000$/m);
    execFileSync('git', ['-C', dir, 'apply', '--binary', '-'], { input: diff });
    assert.equal(await readFile(join(dir, 'a.py'), 'utf8'), 'x = 2\n');
    assert.deepEqual(await readFile(join(dir, 'data/blob.bin')), binary);
    assert.equal(await readlink(join(dir, 'alias')), 'a.py');
    assert.equal((await stat(join(dir, 'run.sh'))).mode & 0o111, 0o111);
    assert.equal(await readFile(join(dir, 'dir with space/ü.txt'), 'utf8'), 'u\n');
    await assert.rejects(stat(join(dir, 'gone.txt')));
    assert.equal(await diffOfChanges([]), '');
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
