/**
 * Checks every instance of tasks.jsonl on this host, without sandboxes: for
 * each, clones its bundle at base_commit, applies test_patch, confirms each
 * FAIL_TO_PASS test fails and each PASS_TO_PASS test passes, applies the gold
 * patch and confirms they all pass. Needs git, patch, Debian's python3 with
 * pytest (python3-pytest) and node 18 or later.
 *
 *   node --import tsx examples/swe-tasks/check-tasks.ts [--json] [INSTANCE_ID…]
 */
import { spawn } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { checkTask, readTasks, type SweTask, type TaskCheck, type TaskShell } from './lib.js';

const HERE = dirname(fileURLToPath(import.meta.url));

/** Debian's interpreters first: a pyenv or nvm `python3`/`node` on PATH may lack pytest or be too old. */
const PATH = `/usr/bin:/bin:${process.env['PATH'] ?? ''}`;

function shellIn(dir: string): TaskShell {
  return {
    run: (script, stdin) =>
      new Promise((resolve, reject) => {
        const child = spawn('bash', ['-c', script], {
          cwd: dir,
          env: { PATH, HOME: dir, LC_ALL: 'C.UTF-8', PYTHONDONTWRITEBYTECODE: '1' },
          stdio: ['pipe', 'pipe', 'pipe'],
        });
        let output = '';
        child.stdout.setEncoding('utf8').on('data', (c: string) => (output += c));
        child.stderr.setEncoding('utf8').on('data', (c: string) => (output += c));
        child.once('error', reject);
        child.once('close', (code) => resolve({ exitCode: code ?? 1, output }));
        child.stdin.end(stdin ?? '');
      }),
  };
}

/** Checks one task in a fresh clone of its bundle under the OS temp dir. */
export async function checkTaskOnHost(task: SweTask): Promise<TaskCheck> {
  const scratch = await mkdtemp(join(tmpdir(), 'dsec-swe-check-'));
  try {
    const dir = join(scratch, 'repo');
    const setup = shellIn(scratch);
    const archive = `'${task.repo_archive.replaceAll("'", `'\\''`)}'`;
    const clone = await setup.run(
      `git clone -q --no-checkout ${archive} repo && git -C repo checkout -q --detach ${task.base_commit}`,
    );
    if (clone.exitCode !== 0) {
      return {
        instance_id: task.instance_id,
        ok: false,
        problems: [`cannot check out ${task.base_commit}: ${clone.output.trim()}`],
        before: {},
        after: {},
      };
    }
    return await checkTask(task, shellIn(dir));
  } finally {
    await rm(scratch, { recursive: true, force: true });
  }
}

async function main(): Promise<number> {
  const args = process.argv.slice(2);
  const json = args.includes('--json');
  const only = args.filter((a) => !a.startsWith('--'));
  const tasks = (await readTasks(join(HERE, 'tasks.jsonl'))).filter(
    (t) => only.length === 0 || only.includes(t.instance_id),
  );
  const results: TaskCheck[] = [];
  for (const task of tasks) {
    const r = await checkTaskOnHost(task);
    results.push(r);
    if (!json) {
      process.stdout.write(`${r.ok ? 'ok  ' : 'FAIL'} ${r.instance_id}\n`);
      for (const p of r.problems) process.stdout.write(`     ${p}\n`);
    }
  }
  if (json) process.stdout.write(`${JSON.stringify(results, null, 2)}\n`);
  return results.every((r) => r.ok) && results.length > 0 ? 0 : 1;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) process.exitCode = await main();
