import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { release, tmpdir } from 'node:os';
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { after, before, describe, test } from 'node:test';
import { Command } from 'commander';
import { loadClusterConfig } from '@dsec/cluster';
import { DsecError } from '@dsec/core';
import { attachContext, CliContext } from '../context.js';
import { main, VERSION } from '../main.js';
import { register as registerUp } from './up.js';
import { upSettings, type UpSettings } from './up-config.js';
import { gitCommit } from './version.js';

const execFileAsync = promisify(execFile);

async function dsec(
  args: string[],
  env: Record<string, string> = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = '';
  let stderr = '';
  const code = await main(args, {
    stdout: { write: (s: string) => (stdout += s) },
    stderr: { write: (s: string) => (stderr += s) },
    env,
  });
  return { code, stdout, stderr };
}

let dir: string;
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-service-test-'));
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

const SHA1 = 'a'.repeat(40);
const SHA2 = 'b'.repeat(40);

void describe('dsec version', () => {
  void test('--json: version, commit, node, kernel', async () => {
    const r = await dsec(['version', '--json'], { DSEC_COMMIT: SHA1 });
    assert.equal(r.code, 0, r.stderr);
    assert.deepEqual(JSON.parse(r.stdout), {
      version: VERSION,
      commit: SHA1,
      node: process.version,
      kernel: release(),
    });
    const text = await dsec(['version'], { DSEC_COMMIT: SHA1 });
    assert.match(text.stdout, new RegExp(`^dsec ${VERSION} \\(a{12}\\)\\nnode v`));
  });

  void test('the commit is read from .git: loose ref, packed ref, detached, worktree', async () => {
    const repo = join(dir, 'repo');
    await mkdir(join(repo, '.git', 'refs', 'heads'), { recursive: true });
    await mkdir(join(repo, 'packages', 'cli'), { recursive: true });
    const inside = join(repo, 'packages', 'cli');
    await writeFile(join(repo, '.git', 'HEAD'), 'ref: refs/heads/main\n');
    await writeFile(join(repo, '.git', 'packed-refs'), `# pack-refs\n${SHA2} refs/heads/main\n`);
    assert.equal(await gitCommit(inside), SHA2, 'packed');
    await writeFile(join(repo, '.git', 'refs', 'heads', 'main'), `${SHA1}\n`);
    assert.equal(await gitCommit(inside), SHA1, 'loose wins');
    await writeFile(join(repo, '.git', 'HEAD'), `${SHA2}\n`);
    assert.equal(await gitCommit(inside), SHA2, 'detached');

    const worktree = join(dir, 'wt');
    const wtGit = join(repo, '.git', 'worktrees', 'wt');
    await mkdir(wtGit, { recursive: true });
    await mkdir(worktree);
    await writeFile(join(worktree, '.git'), `gitdir: ${wtGit}\n`);
    await writeFile(join(wtGit, 'HEAD'), 'ref: refs/heads/main\n');
    await writeFile(join(wtGit, 'commondir'), '../..\n');
    assert.equal(await gitCommit(worktree), SHA1, 'worktree refs live in the main repository');

    const none = join(dir, 'no-repo');
    await mkdir(none);
    // tmpdir() is not inside a checkout on any machine these tests run on.
    assert.equal(await gitCommit(none), null);
  });
});

void describe('dsec doctor', { skip: process.getuid?.() === 0 ? false : 'needs root' }, () => {
  void test('--json prints exactly { checks: [{ name, ok, detail, fix }] }; a required failure exits 1', async () => {
    const r = await dsec(['doctor', '--json', '--shell', join(dir, 'no-shell')], {
      DSEC_STATE_DIR: join(dir, 'state'),
    });
    assert.equal(r.code, 1, 'the sandbox shell is required');
    const out = JSON.parse(r.stdout) as { checks: Array<Record<string, unknown>> };
    assert.deepEqual(Object.keys(out), ['checks']);
    for (const c of out.checks) {
      assert.deepEqual(Object.keys(c), ['name', 'ok', 'detail', 'fix']);
      assert.equal(typeof c.ok, 'boolean');
    }
    const shell = out.checks.find((c) => c.name === 'busybox-static');
    assert.equal(shell?.ok, false);
    assert.match(String(shell?.fix), /apt-get install busybox-static/);

    const text = await dsec(['doctor', '--shell', join(dir, 'no-shell')], {
      DSEC_STATE_DIR: join(dir, 'state'),
    });
    assert.equal(text.code, 1);
    assert.match(text.stdout, /^FAIL {2}busybox-static +.*no-shell/m);
    assert.match(text.stdout, /fix: apt-get install busybox-static/);
    assert.match(text.stdout, /required check.* failed$/m);
  });
});

/** Parses `dsec [global] up ARGS` and returns the merged settings (nothing is started). */
async function settingsFor(args: string[], env: Record<string, string> = {}): Promise<UpSettings> {
  const program = new Command('dsec')
    .option('--state-dir <dir>')
    .option('--image-store <location>')
    .option('--json')
    .exitOverride();
  const ctx = new CliContext({ stdout: process.stdout, stderr: process.stderr, env }, program);
  attachContext(program, ctx);
  registerUp(program);
  let settings: UpSettings | undefined;
  program.commands
    .find((c) => c.name() === 'up')!
    .action(async (opts: Parameters<typeof upSettings>[0], command: Command) => {
      settings = await upSettings(opts, command, ctx);
    });
  await program.parseAsync(args, { from: 'user' });
  return settings!;
}

void describe('dsec up --config', () => {
  let file: string;
  before(async () => {
    await mkdir(join(dir, 'etc'), { recursive: true });
    file = join(dir, 'etc', 'dsec.json');
    await writeFile(
      file,
      JSON.stringify({
        imageStore: 's3://bucket/prefix?endpoint=http://127.0.0.1:9000',
        apiserver: { host: '0.0.0.0', port: 7500, logRequests: true },
        e2b: { sandboxDomain: 'sb.example', templates: { base: 'busybox' } },
        up: {
          stateDir: 'state',
          edges: 2,
          erofsMount: 'loop',
          admission: { maxSandboxes: 10, memoryOvercommit: 4 },
          pausedTtlSeconds: 60,
          cgroupFavorDynmods: false,
          stopSandboxes: true,
        },
      }),
    );
  });

  void test('the file supplies what no flag gives; relative paths are from its directory', async () => {
    const s = await settingsFor(['up', '--config', file], { DSEC_STATE_DIR: '/from/env' });
    assert.equal(s.stateDir, join(dir, 'etc', 'state'));
    assert.equal(s.imageStore, 's3://bucket/prefix?endpoint=http://127.0.0.1:9000');
    assert.equal(s.host, '0.0.0.0');
    assert.equal(s.port, 7500);
    assert.equal(s.logRequests, true);
    assert.equal(s.edges, 2);
    assert.equal(s.erofsMount, 'loop');
    assert.deepEqual(s.admission, { maxSandboxes: 10, memoryOvercommit: 4 });
    assert.equal(s.pausedTtlSeconds, 60);
    assert.equal(s.cgroupFavorDynmods, false);
    assert.equal(s.stopSandboxes, true);
    assert.deepEqual(s.e2b, { sandboxDomain: 'sb.example', templates: { base: 'busybox' } });
  });

  void test('flags win over the file; admission limits merge', async () => {
    const s = await settingsFor([
      '--state-dir',
      '/flag/state',
      'up',
      '--config',
      file,
      '--port',
      '8000',
      '--erofs-mount',
      'file',
      '--max-sandboxes',
      '5',
      '--e2b-domain',
      'other.example',
    ]);
    assert.equal(s.stateDir, '/flag/state');
    assert.equal(s.port, 8000);
    assert.equal(s.host, '0.0.0.0', 'the file still sets what the flags do not');
    assert.equal(s.erofsMount, 'file');
    assert.deepEqual(s.admission, { maxSandboxes: 5, memoryOvercommit: 4 });
    assert.equal(s.e2b.sandboxDomain, 'other.example');
  });

  void test('without a file: the defaults, and the environment for the state dir', async () => {
    const s = await settingsFor(['up'], { DSEC_STATE_DIR: '/from/env' });
    assert.equal(s.stateDir, '/from/env');
    assert.equal(s.host, '127.0.0.1');
    assert.equal(s.port, 7420);
    assert.equal(s.edges, undefined);
    assert.equal(s.erofsMount, undefined);
    assert.equal(s.cgroupFavorDynmods, true);
    assert.deepEqual(s.admission, {});
  });

  void test('a bad file names the field', async () => {
    const bad = join(dir, 'etc', 'bad.json');
    await writeFile(bad, JSON.stringify({ up: { erofsMount: 'block' } }));
    await assert.rejects(
      settingsFor(['up', '--config', bad]),
      (err: unknown) =>
        err instanceof DsecError &&
        err.code === 'invalid_argument' &&
        err.field === 'up.erofsMount',
    );
    await writeFile(bad, JSON.stringify({ up: { id: 'edge-1' } }));
    await assert.rejects(settingsFor(['up', '--config', bad]), /up: Unrecognized key/);
    await assert.rejects(
      settingsFor(['up', '--erofs-mount', 'block']),
      /argument 'block' is invalid. Allowed choices are auto, file, loop/,
    );
  });
});

void describe('deploy/', () => {
  const deploy = fileURLToPath(new URL('../../../../deploy/', import.meta.url));

  void test('every systemd unit runs a dsec command with options the CLI accepts', async () => {
    // `--help` would short-circuit unknown words, so the command path and its
    // options are read from the completion tables, which come from the program.
    const script = join(dir, 'dsec.bash');
    await writeFile(script, (await dsec(['completion', 'bash'])).stdout);
    const units = (await readdir(join(deploy, 'systemd'))).filter((f) => f.endsWith('.service'));
    assert.ok(units.includes('dsec.service'), units.join());
    for (const unit of units) {
      const text = await readFile(join(deploy, 'systemd', unit), 'utf8');
      const commands = [...text.matchAll(/^Exec(?:Start|StartPre)=-?(\S+)(.*)$/gm)];
      assert.ok(commands.length > 0, unit);
      for (const [, binary, rest] of commands) {
        assert.equal(binary, '/opt/dsec/bin/dsec', unit);
        const args = rest!.trim().split(/\s+/);
        const { stdout } = await execFileAsync('bash', [
          '--norc',
          '-c',
          `source "$0"; shift; _dsec_walk "$@"; echo "$_dsec_path"; _dsec_opts "$_dsec_path"; _dsec_valued "$_dsec_path"`,
          script,
          'x',
          ...args,
        ]);
        const [path, opts, valued] = stdout.split('\n') as [string, string, string];
        const known = opts.split(' ');
        const takesValue = valued.split(' ');
        const words: string[] = [];
        for (let i = 0; i < args.length; i++) {
          const a = args[i]!;
          if (!a.startsWith('-')) words.push(a);
          else {
            assert.ok(known.includes(a), `${unit}: dsec ${path} has no ${a}`);
            if (takesValue.includes(a)) i++;
          }
        }
        assert.equal(path, words.join(' '), `${unit}: every word is a command`);
      }
    }
  });

  void test('the example configs are valid', async () => {
    const up = await loadClusterConfig(join(deploy, 'up.example.json'));
    assert.equal(up.up?.erofsMount, 'auto');
    const cluster = await loadClusterConfig(join(deploy, 'cluster.example.json'));
    assert.ok(cluster.edge);
  });
});
