import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import { main } from './main.js';

const execFileAsync = promisify(execFile);

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = '';
  let stderr = '';
  const code = await main(args, {
    stdout: { write: (s: string) => (stdout += s) },
    stderr: { write: (s: string) => (stderr += s) },
    env: {},
  });
  return { code, stdout, stderr };
}

/** Every command path, read from `--help` output (independent of the generator's walk). */
async function helpCommandPaths(path: string[] = []): Promise<string[]> {
  const { stdout } = await dsec([...path, '--help']);
  const section = stdout.split('\nCommands:\n')[1]?.split('\n\n')[0] ?? '';
  const names = section
    .split('\n')
    .map((l) => /^ {2}([a-z][\w-]*)/.exec(l)?.[1])
    .filter((n): n is string => !!n && n !== 'help');
  const paths: string[] = [];
  for (const name of names) {
    paths.push([...path, name].join(' '));
    paths.push(...(await helpCommandPaths([...path, name])));
  }
  return paths;
}

void describe('dsec completion', () => {
  let dir: string;
  let bash: string;
  let zsh: string;
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-completion-'));
    bash = (await dsec(['completion', 'bash'])).stdout;
    zsh = (await dsec(['completion', 'zsh'])).stdout;
    await writeFile(join(dir, 'dsec.bash'), bash);
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  void test('every command of the program appears in both scripts', async () => {
    const paths = await helpCommandPaths();
    for (const expected of [
      'sandbox create',
      'image import',
      'up',
      'doctor',
      'version',
      'completion',
    ])
      assert.ok(paths.includes(expected), `${expected} in --help`);
    for (const path of paths) {
      assert.ok(bash.includes(`\n    '${path}') echo `), `bash: ${path}`);
      assert.ok(zsh.includes(`\n    '${path}') reply=(`), `zsh: ${path}`);
    }
  });

  /** What bash offers for the words typed so far (the last one being completed). */
  const complete = async (words: string[]): Promise<string[]> => {
    const script = [
      `source ${JSON.stringify(join(dir, 'dsec.bash'))}`,
      `COMP_WORDS=(dsec ${words.map((w) => `'${w}'`).join(' ')})`,
      `COMP_CWORD=${words.length}`,
      '_dsec',
      'printf "%s\\n" "${COMPREPLY[@]}"',
    ].join('\n');
    const { stdout } = await execFileAsync('bash', ['--norc', '-c', script]);
    return stdout.split('\n').filter(Boolean);
  };

  void test('bash completes commands, subcommands and options, and skips option values', async () => {
    assert.deepEqual(await complete(['doc']), ['doctor']);
    assert.deepEqual(await complete(['sandbox', 'cre']), ['create']);
    // A global option's value is not mistaken for a command.
    assert.deepEqual(await complete(['--state-dir', 'sandbox', 'sandbox', 'cre']), ['create']);
    assert.ok((await complete(['sandbox', 'create', '--im'])).includes('--image'));
    assert.ok((await complete(['up', '--erofs'])).includes('--erofs-mount'));
    // An option with choices offers them; any other value falls back to file names.
    assert.deepEqual(await complete(['up', '--erofs-mount', '']), ['auto', 'file', 'loop']);
    assert.deepEqual(await complete(['up', '--erofs-mount', 'l']), ['loop']);
    assert.deepEqual(await complete(['up', '--config', '']), []);
    assert.deepEqual(await complete(['completion', 'bash', 'x']), []);
  });

  void test(
    'zsh: the script loads under compinit; walk and descriptions',
    {
      skip: existsSync('/usr/bin/zsh') ? false : 'needs zsh',
    },
    async () => {
      await writeFile(join(dir, '_dsec'), zsh);
      await execFileAsync('zsh', ['-n', join(dir, '_dsec')]);
      const script = [
        'autoload -Uz compinit && compinit -u -D',
        `source ${JSON.stringify(join(dir, '_dsec'))}`,
        '_dsec_walk --state-dir x sandbox cre; print "path=$_dsec_path"',
        '_dsec_walk up --config; print "value=$_dsec_value"',
        '_dsec_walk up --erofs-mount; print "choices=$(_dsec_choices "$_dsec_path|$_dsec_option")"',
        '_dsec_described sandbox; print -l -- $reply',
      ].join('\n');
      const { stdout } = await execFileAsync('zsh', ['-f', '-c', script], {
        env: { ...process.env, HOME: dir },
      });
      const lines = stdout.split('\n');
      assert.equal(lines[0], 'path=sandbox');
      assert.equal(lines[1], 'value=1');
      assert.equal(lines[2], 'choices=auto file loop');
      const described = lines.slice(3).filter(Boolean);
      assert.ok(
        described.some((l) => l.startsWith('create:create a sandbox')),
        stdout,
      );
      // One entry per subcommand: multi-line descriptions are folded.
      assert.ok(
        described.every((l) => /^[a-z][\w-]*:/.test(l)),
        stdout,
      );
    },
  );

  void test('an unknown shell is refused', async () => {
    const r = await dsec(['completion', 'fish']);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /want bash or zsh/);
  });
});
