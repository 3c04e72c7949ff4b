import { readFile } from 'node:fs/promises';
import { dirname, isAbsolute, resolve } from 'node:path';
import { DsecError } from '@dsec/core';
import { parsePatch } from './diff.js';

/** Where the repository sits in a task's sandbox unless the task says (SWE-bench's `/testbed`). */
export const DEFAULT_WORKDIR = '/testbed';

/**
 * One task in the SWE-bench instance format, plus DSec's fields: the
 * environment (image and toolkits), the test command, and where the
 * repository comes from (these machines reach no Git host).
 */
export interface EvalTask {
  instance_id: string;
  repo: string;
  base_commit: string;
  problem_statement: string;
  /** The reference fix (`--agent gold` applies it). */
  patch: string;
  /** Tests added or changed by the fix, applied before grading. */
  test_patch: string;
  FAIL_TO_PASS: string[];
  PASS_TO_PASS: string[];
  environment: { image: string; toolkits: string[] };
  /** Run in `workdir` by the platform's `sh`; default `python3 -B -m pytest -rA` over the files `test_patch` touches. */
  test_command: string;
  /** A git bundle (absolute once loaded); exclusive with `repo_dir`. */
  repo_archive?: string | undefined;
  /** A local git checkout (absolute once loaded). */
  repo_dir?: string | undefined;
  /** The repository's path in the sandbox (default `/testbed`). */
  workdir: string;
  /**
   * How the task is graded (default `patch`). `patch`: the agent's changes to
   * the repository, without the test files and the files that steer the test
   * runner or the interpreter, are applied to a fresh sandbox of the same
   * environment and the tests run there. `in_place`: the tests run in the
   * agent's own sandbox, after every process the agent left is killed, for a
   * task whose outcome is the environment itself (a verifier checking state).
   */
  grading: 'patch' | 'in_place';
  /**
   * Why the task cannot run although its line was read (a patch the grader
   * cannot parse): the batch gives it an error line and runs the rest.
   */
  unrunnable?: { code: string; reason: string; message: string } | undefined;
  /** The task line's other fields, kept as they were. */
  [field: string]: unknown;
}

export interface LoadedTasks {
  /** Absolute path of the task file. */
  file: string;
  tasks: EvalTask[];
}

/**
 * Reads a JSONL task file. Relative `repo_archive` / `repo_dir` resolve
 * against the file's directory; `FAIL_TO_PASS` and `PASS_TO_PASS` may be
 * arrays or JSON-encoded arrays (as SWE-bench ships them). Every problem is
 * `invalid_argument` naming `<file>:<line>` and the field.
 */
export async function loadTasks(
  file: string,
  defaults: { image?: string | undefined; toolkits?: string[] | undefined } = {},
): Promise<LoadedTasks> {
  const abs = resolve(file);
  const text = await readFile(abs, 'utf8').catch((err: NodeJS.ErrnoException) => {
    throw new DsecError(
      err.code === 'ENOENT' ? 'not_found' : 'invalid_argument',
      `${file}: ${err.message}`,
      {
        field: 'tasks',
        cause: err,
      },
    );
  });
  const tasks: EvalTask[] = [];
  const seen = new Set<string>();
  for (const [n, line] of text.split('\n').entries()) {
    if (line.trim() === '') continue;
    const where = `${file}:${n + 1}`;
    let raw: unknown;
    try {
      raw = JSON.parse(line);
    } catch (err) {
      throw new DsecError('invalid_argument', `${where}: not JSON (${(err as Error).message})`, {
        field: 'tasks',
      });
    }
    const task = normalizeTask(raw, where, dirname(abs), defaults);
    if (seen.has(task.instance_id)) {
      throw new DsecError('invalid_argument', `${where}: instance_id ${task.instance_id} repeats`, {
        field: 'instance_id',
      });
    }
    seen.add(task.instance_id);
    tasks.push(task);
  }
  return { file: abs, tasks };
}

/** Validates one task object; `baseDir` resolves its relative paths. */
export function normalizeTask(
  raw: unknown,
  where: string,
  baseDir: string,
  defaults: { image?: string | undefined; toolkits?: string[] | undefined } = {},
): EvalTask {
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) {
    throw invalid(where, 'task', 'is not an object');
  }
  const o = raw as Record<string, unknown>;
  const str = (field: string, optional = false): string | undefined => {
    const v = o[field];
    if (v === undefined && optional) return undefined;
    if (typeof v !== 'string' || (v === '' && !optional))
      throw invalid(where, field, 'must be a non-empty string');
    return v;
  };
  const instance = str('instance_id')!;
  if (!/^[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}$/.test(instance)) {
    throw invalid(where, 'instance_id', 'must be 1–256 chars of [A-Za-z0-9._:/-]');
  }
  const env = o.environment as { image?: unknown; toolkits?: unknown } | undefined;
  if (env !== undefined && (typeof env !== 'object' || env === null)) {
    throw invalid(where, 'environment', 'must be an object');
  }
  const image = env?.image ?? defaults.image;
  if (typeof image !== 'string' || image === '') {
    throw invalid(where, 'environment.image', 'is missing (and no default image was given)');
  }
  const toolkits = env?.toolkits ?? defaults.toolkits ?? [];
  if (!Array.isArray(toolkits) || !toolkits.every((t) => typeof t === 'string' && t !== '')) {
    throw invalid(where, 'environment.toolkits', 'must be a list of layer names');
  }
  const archive = str('repo_archive', true);
  const dir = str('repo_dir', true);
  if ((archive === undefined) === (dir === undefined)) {
    throw invalid(where, 'repo_archive', 'give exactly one of repo_archive and repo_dir');
  }
  const workdir = str('workdir', true) ?? DEFAULT_WORKDIR;
  if (!isAbsolute(workdir) || workdir === '/' || workdir.split('/').includes('..')) {
    throw invalid(where, 'workdir', 'must be an absolute path below /');
  }
  const grading = str('grading', true) ?? 'patch';
  if (grading !== 'patch' && grading !== 'in_place') {
    throw invalid(where, 'grading', 'must be "patch" or "in_place"');
  }
  const testPatch = str('test_patch', true) ?? '';
  const patch = str('patch', true) ?? '';
  // A patch the grader cannot read (a binary hunk in test_patch, which it writes from the
  // host) makes this task unrunnable, not the file: it gets its own error line.
  let unrunnable: EvalTask['unrunnable'];
  let testFiles: string[] = [];
  try {
    testFiles = parsePatch(testPatch)
      .map((f) => f.newPath)
      .filter((p): p is string => p !== undefined);
  } catch (err) {
    unrunnable = patchProblem(where, 'test_patch', err);
  }
  if (!BINARY_HUNK.test(patch)) {
    // The gold agent applies a patch with a binary hunk with `git apply` in the sandbox.
    try {
      parsePatch(patch);
    } catch (err) {
      unrunnable ??= patchProblem(where, 'patch', err);
    }
  }
  let command = str('test_command', true);
  if (command === undefined) {
    if (testFiles.length === 0 && unrunnable === undefined)
      throw invalid(where, 'test_command', 'is missing and test_patch names no test file');
    // -B: no bytecode written, so no stale .pyc of the agent's stands in for a source.
    command = `python3 -B -m pytest -rA ${testFiles.map(shellQuote).join(' ')}`;
  }
  return {
    ...o,
    instance_id: instance,
    repo: str('repo')!,
    base_commit: str('base_commit')!,
    problem_statement: str('problem_statement', true) ?? '',
    patch,
    test_patch: testPatch,
    FAIL_TO_PASS: testList(o.FAIL_TO_PASS, where, 'FAIL_TO_PASS'),
    PASS_TO_PASS: testList(o.PASS_TO_PASS, where, 'PASS_TO_PASS'),
    environment: { image, toolkits: toolkits as string[] },
    test_command: command,
    repo_archive: archive === undefined ? undefined : resolve(baseDir, archive),
    repo_dir: dir === undefined ? undefined : resolve(baseDir, dir),
    workdir: workdir.replace(/\/+$/, ''),
    grading,
    ...(unrunnable ? { unrunnable } : {}),
  };
}

const BINARY_HUNK = /^(GIT binary patch|Binary files .* differ)$/m;

function patchProblem(
  where: string,
  field: string,
  err: unknown,
): { code: string; reason: string; message: string } {
  const message = (err as Error).message;
  return {
    code: 'invalid_argument',
    reason: /binary patch/.test(message) ? 'binary_patch' : 'bad_patch',
    message: `${where}: ${field} ${message}`,
  };
}

function testList(v: unknown, where: string, field: string): string[] {
  if (v === undefined) return [];
  let list = v;
  if (typeof v === 'string') {
    try {
      list = JSON.parse(v);
    } catch {
      throw invalid(where, field, 'must be a list of test IDs (or its JSON)');
    }
  }
  if (!Array.isArray(list) || !list.every((t) => typeof t === 'string')) {
    throw invalid(where, field, 'must be a list of test IDs');
  }
  return list;
}

export function shellQuote(s: string): string {
  return /^[A-Za-z0-9_./:=@%+-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
}

function invalid(where: string, field: string, message: string): DsecError {
  return new DsecError('invalid_argument', `${where}: ${field} ${message}`, { field });
}
