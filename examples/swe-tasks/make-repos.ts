/**
 * Generates the task set from `src/`: one git repository per `src/<repo>/`
 * (its `base/` tree committed with a fixed author, committer and date, so
 * the commit hash is the same on every machine), written as
 * `repos/<repo>.bundle`, and `tasks.jsonl` with one SWE-bench instance per
 * `src/<repo>/instances/<n>/`: the gold `patch` is the diff from `base/` to
 * the files under `fix/`, the `test_patch` the diff to those under `tests/`.
 *
 *   node --import tsx examples/swe-tasks/make-repos.ts [--check]
 *
 * `--check` writes nothing and exits 1 when tasks.jsonl or a bundle would change.
 */
import { execFile } from 'node:child_process';
import { cp, mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import type { SweTask } from './lib.js';

const run = promisify(execFile);
const HERE = dirname(fileURLToPath(import.meta.url));
const DATE = '2025-01-15T12:00:00+00:00';

interface RepoMeta {
  repo: string;
  version: string;
  environment: SweTask['environment'];
  test_command: string;
}

interface InstanceMeta {
  created_at: string;
  FAIL_TO_PASS: string[];
  PASS_TO_PASS: string[];
}

function gitEnv(home: string): NodeJS.ProcessEnv {
  return {
    PATH: process.env['PATH'] ?? '/usr/bin:/bin',
    HOME: home,
    GIT_CONFIG_NOSYSTEM: '1',
    GIT_CONFIG_GLOBAL: '/dev/null',
    GIT_AUTHOR_NAME: 'DSec Examples',
    GIT_AUTHOR_EMAIL: 'examples@dsec.invalid',
    GIT_AUTHOR_DATE: DATE,
    GIT_COMMITTER_NAME: 'DSec Examples',
    GIT_COMMITTER_EMAIL: 'examples@dsec.invalid',
    GIT_COMMITTER_DATE: DATE,
    LC_ALL: 'C',
  };
}

async function git(cwd: string, env: NodeJS.ProcessEnv, ...args: string[]): Promise<string> {
  return (await run('git', args, { cwd, env, maxBuffer: 64 * 1024 * 1024 })).stdout;
}

/** The diff a set of files (a tree overlaid on the checkout) makes, then the checkout reset. */
async function diffOf(work: string, env: NodeJS.ProcessEnv, overlay: string): Promise<string> {
  await cp(overlay, work, { recursive: true });
  await git(work, env, 'add', '-A');
  const diff = await git(
    work,
    env,
    'diff',
    '--cached',
    '--no-color',
    '--no-ext-diff',
    '--no-renames',
    '--src-prefix=a/',
    '--dst-prefix=b/',
  );
  await git(work, env, 'reset', '-q', '--hard', 'HEAD');
  if (diff === '') throw new Error(`${overlay} changes nothing`);
  return diff;
}

async function main(): Promise<number> {
  const check = process.argv.includes('--check');
  const scratch = await mkdtemp(join(tmpdir(), 'dsec-swe-make-'));
  const tasks: SweTask[] = [];
  const stale: string[] = [];
  try {
    const env = gitEnv(scratch);
    for (const name of (await readdir(join(HERE, 'src'))).sort()) {
      const src = join(HERE, 'src', name);
      const meta = JSON.parse(await readFile(join(src, 'repo.json'), 'utf8')) as RepoMeta;
      const work = join(scratch, name);
      await mkdir(work);
      await git(work, env, 'init', '-q', '-b', 'main');
      await git(work, env, 'config', 'core.autocrlf', 'false');
      await cp(join(src, 'base'), work, { recursive: true });
      await git(work, env, 'add', '-A');
      await git(work, env, 'commit', '-q', '-m', `Initial import of ${name}`);
      const base = (await git(work, env, 'rev-parse', 'HEAD')).trim();

      const bundle = join(HERE, 'repos', `${name}.bundle`);
      const heads = await git(work, env, 'bundle', 'list-heads', bundle).catch(() => '');
      if (!heads.includes(`${base} refs/heads/main`)) {
        stale.push(`repos/${name}.bundle`);
        if (!check) {
          await mkdir(dirname(bundle), { recursive: true });
          await git(work, env, 'bundle', 'create', '-q', bundle, 'HEAD', 'main');
        }
      }

      const instances = join(src, 'instances');
      const numbers = (await readdir(instances)).sort((a, b) => Number(a) - Number(b));
      for (const n of numbers) {
        const dir = join(instances, n);
        const inst = JSON.parse(await readFile(join(dir, 'instance.json'), 'utf8')) as InstanceMeta;
        const [owner, short] = meta.repo.split('/');
        tasks.push({
          repo: meta.repo,
          instance_id: `${owner}__${short}-${n}`,
          base_commit: base,
          patch: await diffOf(work, env, join(dir, 'fix')),
          test_patch: await diffOf(work, env, join(dir, 'tests')),
          problem_statement: await readFile(join(dir, 'problem.md'), 'utf8'),
          hints_text: '',
          created_at: inst.created_at,
          version: meta.version,
          FAIL_TO_PASS: inst.FAIL_TO_PASS,
          PASS_TO_PASS: inst.PASS_TO_PASS,
          environment: meta.environment,
          test_command: meta.test_command,
          repo_archive: `repos/${name}.bundle`,
        });
      }
    }
    const jsonl = tasks.map((t) => JSON.stringify(t)).join('\n') + '\n';
    const file = join(HERE, 'tasks.jsonl');
    if ((await readFile(file, 'utf8').catch(() => '')) !== jsonl) {
      stale.push('tasks.jsonl');
      if (!check) await writeFile(file, jsonl);
    }
  } finally {
    await rm(scratch, { recursive: true, force: true });
  }
  if (check && stale.length > 0) {
    process.stderr.write(`out of date (run make-repos.ts): ${stale.join(', ')}\n`);
    return 1;
  }
  process.stdout.write(
    `${tasks.length} tasks${stale.length > 0 ? `; wrote ${stale.join(', ')}` : '; nothing changed'}\n`,
  );
  return 0;
}

process.exitCode = await main();
