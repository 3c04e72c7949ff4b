/**
 * Test fixtures for @dsec/eval: a tiny SWE-style task set that needs only a
 * busybox image (shell "repositories" whose test suite prints TAP), and a
 * scripted OpenAI-compatible model server on loopback that drives the http
 * agent through the same fix.
 *
 * @example
 * ```ts
 * import { makeShellTaskSet, startScriptedModel } from '@dsec/eval/testing';
 * const { tasksFile } = await makeShellTaskSet('/tmp/tasks', { image: 'busybox' });
 * const model = await startScriptedModel();
 * // dsec eval run <tasksFile> --agent http --endpoint <model.url> --model scripted
 * await model.close();
 * ```
 */
import { execFile } from 'node:child_process';
import { createServer, type Server } from 'node:http';
import { mkdir, writeFile } from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { promisify } from 'node:util';

const execFileAsync = promisify(execFile);

const GIT_ENV = {
  GIT_AUTHOR_NAME: 'fixture',
  GIT_AUTHOR_EMAIL: 'fixture@localhost',
  GIT_COMMITTER_NAME: 'fixture',
  GIT_COMMITTER_EMAIL: 'fixture@localhost',
  GIT_AUTHOR_DATE: '2020-01-01T00:00:00Z',
  GIT_COMMITTER_DATE: '2020-01-01T00:00:00Z',
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
};

/** The TAP runner every fixture repository ships: `check NAME EXPECTED ACTUAL` per assertion. */
const RUNNER = `#!/bin/sh
cd "$(dirname "$0")/.." || exit 2
for lib in lib/*.sh; do . "./$lib"; done
n=0
failed=0
check() {
  n=$((n + 1))
  if [ "$2" = "$3" ]; then echo "ok $n - $1"; else echo "not ok $n - $1"; failed=1; fi
}
for t in tests/test_*.sh; do . "./$t"; done
echo "1..$n"
exit $failed
`;

export interface ShellTask {
  instance_id: string;
  /** The fix, as an edit the scripted model makes: file, old text, new text. */
  edit: { path: string; old: string; new: string };
}

export interface ShellTaskSet {
  dir: string;
  tasksFile: string;
  tasks: ShellTask[];
}

async function git(cwd: string, ...args: string[]): Promise<string> {
  const { stdout } = await execFileAsync('git', args, { cwd, env: { ...process.env, ...GIT_ENV } });
  return stdout;
}

async function commitAll(repo: string, message: string): Promise<string> {
  await git(repo, 'add', '-A');
  await git(repo, 'commit', '-q', '-m', message);
  return (await git(repo, 'rev-parse', 'HEAD')).trim();
}

/** `git diff` of the working tree against HEAD (then resets it), as a task's patch. */
async function diffAndReset(repo: string): Promise<string> {
  await git(repo, 'add', '-A');
  const diff = await git(repo, 'diff', '--cached');
  await git(repo, 'reset', '-q', '--hard');
  return diff;
}

/**
 * Writes three tasks over two shell repositories into `dir`: two at
 * different commits of `shcalc` (shipped as a git bundle, `repo_archive`)
 * and one in `strtool` (a checkout, `repo_dir`). Each has a real bug, a gold
 * patch, a test patch adding the FAIL_TO_PASS test, and PASS_TO_PASS tests.
 * `testDelaySeconds` makes the test command sleep first (a slow suite).
 */
export async function makeShellTaskSet(
  dir: string,
  options: { image: string; testDelaySeconds?: number; toolkits?: string[] },
): Promise<ShellTaskSet> {
  await mkdir(dir, { recursive: true });
  const environment = { image: options.image, toolkits: options.toolkits ?? [] };
  const delay = options.testDelaySeconds ? `sleep ${options.testDelaySeconds}; ` : '';
  const testCommand = `${delay}sh tests/run.sh`;

  // shcalc: commit 1 has a broken add; commit 2 fixed add and broke mul.
  const calc = join(dir, 'src', 'shcalc');
  await mkdir(join(calc, 'lib'), { recursive: true });
  await mkdir(join(calc, 'tests'), { recursive: true });
  await git(calc, 'init', '-q', '-b', 'main');
  await writeFile(join(calc, 'tests/run.sh'), RUNNER);
  await writeFile(join(calc, 'lib/calc.sh'), calcLib('-', '*'));
  await writeFile(join(calc, 'tests/test_sub.sh'), 'check sub_basic 2 "$(sub 5 3)"\n');
  const c1 = await commitAll(calc, 'calc with a broken add');
  await writeFile(join(calc, 'lib/calc.sh'), calcLib('+', '*'));
  const calcGold1 = await diffAndReset(calc);
  const addTests = 'check add_basic 8 "$(add 5 3)"\ncheck add_zero 5 "$(add 5 0)"\n';
  await writeFile(join(calc, 'tests/test_add.sh'), addTests);
  const calcTests1 = await diffAndReset(calc);

  await writeFile(join(calc, 'lib/calc.sh'), calcLib('+', '-'));
  await writeFile(join(calc, 'tests/test_add.sh'), addTests);
  const c2 = await commitAll(calc, 'fix add; mul breaks');
  await writeFile(join(calc, 'lib/calc.sh'), calcLib('+', '*'));
  const calcGold2 = await diffAndReset(calc);
  await writeFile(join(calc, 'tests/test_mul.sh'), 'check mul_basic 15 "$(mul 5 3)"\n');
  const calcTests2 = await diffAndReset(calc);
  await git(calc, 'bundle', 'create', '-q', join(dir, 'shcalc.bundle'), '--all');

  // strtool: upper lowercases.
  const str = join(dir, 'strtool');
  await mkdir(join(str, 'lib'), { recursive: true });
  await mkdir(join(str, 'tests'), { recursive: true });
  await git(str, 'init', '-q', '-b', 'main');
  await writeFile(join(str, 'tests/run.sh'), RUNNER);
  await writeFile(join(str, 'lib/str.sh'), strLib('A-Z a-z'));
  await writeFile(join(str, 'tests/test_len.sh'), 'check len_basic 5 "$(len hello)"\n');
  const s1 = await commitAll(str, 'strtool with a broken upper');
  await writeFile(join(str, 'lib/str.sh'), strLib('a-z A-Z'));
  const strGold = await diffAndReset(str);
  await writeFile(join(str, 'tests/test_upper.sh'), 'check upper_basic HELLO "$(upper hello)"\n');
  const strTests = await diffAndReset(str);

  const rows = [
    {
      instance_id: 'shcalc__add-1',
      repo: 'fixtures/shcalc',
      base_commit: c1,
      repo_archive: 'shcalc.bundle',
      problem_statement: 'add(5, 3) prints 2: it should print 8.',
      patch: calcGold1,
      test_patch: calcTests1,
      FAIL_TO_PASS: ['add_basic'],
      PASS_TO_PASS: ['sub_basic', 'add_zero'],
      environment,
      test_command: testCommand,
    },
    {
      instance_id: 'shcalc__mul-2',
      repo: 'fixtures/shcalc',
      base_commit: c2,
      repo_archive: 'shcalc.bundle',
      problem_statement: 'mul(5, 3) prints 2: it should print 15.',
      patch: calcGold2,
      test_patch: calcTests2,
      FAIL_TO_PASS: ['mul_basic'],
      PASS_TO_PASS: JSON.stringify(['sub_basic', 'add_basic']),
      environment,
      test_command: testCommand,
    },
    {
      instance_id: 'strtool__upper-1',
      repo: 'fixtures/strtool',
      base_commit: s1,
      repo_dir: 'strtool',
      problem_statement: 'upper hello prints hello: it should print HELLO.',
      patch: strGold,
      test_patch: strTests,
      FAIL_TO_PASS: ['upper_basic'],
      PASS_TO_PASS: ['len_basic'],
      environment,
      test_command: testCommand,
    },
  ];
  const tasksFile = join(dir, 'tasks.jsonl');
  await writeFile(tasksFile, rows.map((r) => JSON.stringify(r)).join('\n') + '\n');
  return {
    dir,
    tasksFile,
    tasks: [
      {
        instance_id: 'shcalc__add-1',
        edit: {
          path: 'lib/calc.sh',
          old: 'add() { echo $(( $1 - $2 )); }',
          new: 'add() { echo $(( $1 + $2 )); }',
        },
      },
      {
        instance_id: 'shcalc__mul-2',
        edit: {
          path: 'lib/calc.sh',
          old: 'mul() { echo $(( $1 - $2 )); }',
          new: 'mul() { echo $(( $1 * $2 )); }',
        },
      },
      {
        instance_id: 'strtool__upper-1',
        edit: { path: 'lib/str.sh', old: "tr 'A-Z' 'a-z'", new: "tr 'a-z' 'A-Z'" },
      },
    ],
  };
}

/** The calculator with `add` and `mul` using the given operators. */
function calcLib(addOp: string, mulOp: string): string {
  return `add() { echo $(( $1 ${addOp} $2 )); }\nsub() { echo $(( $1 - $2 )); }\nmul() { echo $(( $1 ${mulOp} $2 )); }\n`;
}

function strLib(tr: string): string {
  const [from, to] = tr.split(' ');
  return `upper() { echo "$1" | tr '${from}' '${to}'; }\nlen() { printf %s "$1" | wc -c | tr -d ' '; }\n`;
}

export interface ScriptedModel {
  /** The API base to pass as `--endpoint`. */
  url: string;
  /** Chat completion requests received. */
  requests: number;
  close(): Promise<void>;
}

/**
 * An OpenAI-compatible chat completions server on 127.0.0.1 that plays a
 * fixed script per task, chosen by the problem statement: read the file,
 * edit it (the task's `edit`), run the tests, finish. It checks that each
 * tool answer came back (a read must show the buggy line) and fails the
 * request with 400 otherwise. Reports usage of 100 + 10 tokens per turn.
 */
export async function startScriptedModel(
  tasks: ShellTask[],
  problems: Record<string, string>,
): Promise<ScriptedModel> {
  const byProblem = new Map(tasks.map((t) => [problems[t.instance_id], t] as const));
  const state = { requests: 0 };
  const server: Server = createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c.toString('utf8')));
    req.on('end', () => {
      state.requests++;
      const answer = (status: number, json: unknown) => {
        res.writeHead(status, { 'content-type': 'application/json' });
        res.end(JSON.stringify(json));
      };
      if (req.method !== 'POST' || !req.url?.endsWith('/chat/completions')) {
        answer(404, { error: { message: 'not found' } });
        return;
      }
      const request = JSON.parse(body) as {
        messages: { role: string; content: string | null; tool_call_id?: string }[];
        tools?: unknown[];
      };
      const problem = request.messages.find((m) => m.role === 'user')?.content ?? '';
      const task = byProblem.get(problem);
      if (!task || !Array.isArray(request.tools)) {
        answer(400, { error: { message: 'unknown task or no tools' } });
        return;
      }
      const turn = request.messages.filter((m) => m.role === 'assistant').length + 1;
      const lastTool = [...request.messages].reverse().find((m) => m.role === 'tool');
      if (turn === 2 && !lastTool?.content?.includes(task.edit.old)) {
        answer(400, { error: { message: `turn 2: the read did not show ${task.edit.old}` } });
        return;
      }
      const call = (name: string, args: unknown) => ({
        id: `call_${turn}`,
        type: 'function',
        function: { name, arguments: JSON.stringify(args) },
      });
      const script = [
        call('read_file', { path: task.edit.path }),
        call('edit_file', task.edit),
        call('shell', { command: 'sh tests/run.sh' }),
        call('finish', { summary: 'fixed' }),
      ];
      const next = script[Math.min(turn, script.length) - 1]!;
      answer(200, {
        id: `chatcmpl-${state.requests}`,
        object: 'chat.completion',
        choices: [
          {
            index: 0,
            finish_reason: 'tool_calls',
            message: {
              role: 'assistant',
              content: turn === 1 ? 'Let me look.' : null,
              tool_calls: [next],
            },
          },
        ],
        usage: { prompt_tokens: 100, completion_tokens: 10, total_tokens: 110 },
      });
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}/v1`,
    get requests() {
      return state.requests;
    },
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

export { makeToolchainRootfs, PYTHON_PACKAGES, NODE_PACKAGES } from './toolchain.js';
export {
  makeIntegrityTaskSet,
  ScriptedAgent,
  STEERING_ATTACKS,
  IN_PLACE_ATTACKS,
  PYAPP_FIXED_CALC,
  PYAPP_PORT,
  JSAPP_FIXED_PAGER,
  SHCALC_FIXED_LIB,
} from './integrity.js';
export type { IntegrityTaskSet, SteeringAttack, ToolStep } from './integrity.js';
export { pushSwebenchImages, SWEBENCH_IMAGE_CONFIG, TESTBED_ENV_BIN } from './swebench-images.js';
export type {
  PushedSwebenchImages,
  PushSwebenchImagesOptions,
  SwebenchFixtureInstance,
} from './swebench-images.js';
