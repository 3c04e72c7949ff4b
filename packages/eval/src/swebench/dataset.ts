import { readFile } from 'node:fs/promises';
import { resolve } from 'node:path';
import { z } from 'zod';
import { DsecError } from '@dsec/core';
import { DEFAULT_WORKDIR, shellQuote, type EvalTask } from '../task.js';
import { patchFiles } from './patch-files.js';
import { specFor, type InstanceSpec, type SpecTable } from './specs.js';

/**
 * SWE-bench datasets exactly as published (Lite, Verified, Full, and sets in
 * their shape): a JSON array or JSONL of instances, `FAIL_TO_PASS` /
 * `PASS_TO_PASS` as JSON-encoded strings (or arrays), `version` naming the
 * row of the spec table, nothing of DSec's. The repository is in the
 * instance's image at `/testbed` at `base_commit` (SWE-bench's images): no
 * workspace layer, no clone on the host.
 */

/** What a SWE-bench instance carries beyond DSec's task fields: how the grader runs it. */
export interface SwebenchInstanceInfo {
  version: string;
  spec: InstanceSpec;
  /** The test files as the test command's arguments (Django: module names). */
  directives: string[];
  /** Files `test_patch` changes that exist at `base_commit` (reset with `git checkout`). */
  modifiedFiles: string[];
  /** Files `test_patch` creates (removed before it is applied). */
  newFiles: string[];
  environmentSetupCommit?: string | undefined;
}

/** A task from a SWE-bench dataset: `swebench` says how it is graded. */
export type SwebenchTask = EvalTask & { swebench: SwebenchInstanceInfo };

/** Whether a task came from a SWE-bench dataset (`loadSwebenchDataset`). */
export function isSwebenchTask(task: EvalTask): task is SwebenchTask {
  const s = (task as { swebench?: unknown }).swebench;
  return typeof s === 'object' && s !== null && 'spec' in s;
}

/** An instance that cannot run, with a stable code: it gets a result line with `error`, the rest run. */
export interface InstanceError {
  instance_id: string;
  code: string;
  reason: string;
  message: string;
}

export interface LoadedDataset {
  file: string;
  tasks: SwebenchTask[];
  /** Instances that cannot run (no spec for their repository and version). */
  errors: InstanceError[];
}

const testList = z.union([z.array(z.string()), z.string()]);

const instanceSchema = z
  .object({
    // What an image name can hold (`task-images.ts`' swebenchImageKey): no `/`, `:` or `@`.
    instance_id: z
      .string()
      .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/)
      .refine((id) => !id.includes('..'), 'must not contain ".."'),
    repo: z.string().regex(/^[A-Za-z0-9_.-]+\/[A-Za-z0-9_.-]+$/),
    base_commit: z.string().regex(/^[0-9a-f]{7,64}$/),
    patch: z.string(),
    test_patch: z.string(),
    problem_statement: z.string().default(''),
    version: z.string().min(1),
    FAIL_TO_PASS: testList,
    PASS_TO_PASS: testList,
    environment_setup_commit: z.string().optional(),
    hints_text: z.string().optional(),
    created_at: z.string().optional(),
  })
  // The published exports carry more (difficulty, …): kept as they are.
  .passthrough();

/** SWE-bench's `NON_TEST_EXTS`: test_patch files that are not test directives. */
const NON_TEST_SUFFIXES = [
  '.json',
  '.png',
  'csv',
  '.txt',
  '.md',
  '.jpg',
  '.jpeg',
  '.pkl',
  '.yml',
  '.yaml',
  '.toml',
];

/**
 * The largest `test_patch` the grader takes: it travels on a command's
 * stdin, which takes 1 MiB (less the room the command itself needs).
 */
export const MAX_TEST_PATCH_BYTES = 1024 * 1024 - 4096;

/** The image reference a template gives an instance (`swebenchImageRef` of task-images.ts). */
export type ImageNamer = (instanceId: string) => string;

/**
 * Reads a SWE-bench dataset. A file that is not a dataset (not JSON, an
 * entry that is not an instance, a repeated instance_id) is
 * `invalid_argument` naming `<file>:<line or index>` and the field; an
 * instance whose (repo, version) the spec table lacks is returned in
 * `errors` (`invalid_argument`, reason `no_spec`), as is one whose
 * `test_patch` is over `MAX_TEST_PATCH_BYTES` (`payload_too_large`, reason
 * `test_patch_too_large`); the others run.
 */
export async function loadSwebenchDataset(
  file: string,
  options: { specs: SpecTable; image: ImageNamer },
): Promise<LoadedDataset> {
  const abs = resolve(file);
  const text = await readFile(abs, 'utf8').catch((err: NodeJS.ErrnoException) => {
    throw new DsecError(
      err.code === 'ENOENT' ? 'not_found' : 'invalid_argument',
      `${file}: ${err.message}`,
      { field: 'dataset', cause: err },
    );
  });
  const entries: { where: string; raw: unknown }[] = [];
  if (text.trimStart().startsWith('[')) {
    let list: unknown;
    try {
      list = JSON.parse(text);
    } catch (err) {
      throw new DsecError('invalid_argument', `${file}: not JSON (${(err as Error).message})`, {
        field: 'dataset',
      });
    }
    for (const [i, raw] of (list as unknown[]).entries())
      entries.push({ where: `${file}[${i}]`, raw });
  } else {
    for (const [n, line] of text.split('\n').entries()) {
      if (line.trim() === '') continue;
      const where = `${file}:${n + 1}`;
      try {
        entries.push({ where, raw: JSON.parse(line) });
      } catch (err) {
        throw new DsecError('invalid_argument', `${where}: not JSON (${(err as Error).message})`, {
          field: 'dataset',
        });
      }
    }
  }
  const tasks: SwebenchTask[] = [];
  const errors: InstanceError[] = [];
  const seen = new Set<string>();
  for (const { where, raw } of entries) {
    const parsed = instanceSchema.safeParse(raw);
    if (!parsed.success) {
      const issue = parsed.error.issues[0]!;
      const field = issue.path.join('.') || 'instance';
      throw new DsecError('invalid_argument', `${where}: ${field}: ${issue.message}`, { field });
    }
    const inst = parsed.data;
    if (seen.has(inst.instance_id)) {
      throw new DsecError('invalid_argument', `${where}: instance_id ${inst.instance_id} repeats`, {
        field: 'instance_id',
      });
    }
    seen.add(inst.instance_id);
    const f2p = tests(inst.FAIL_TO_PASS, where, 'FAIL_TO_PASS');
    const p2p = tests(inst.PASS_TO_PASS, where, 'PASS_TO_PASS');
    const spec = specFor(options.specs, inst.repo, inst.version);
    if (!spec) {
      errors.push({
        instance_id: inst.instance_id,
        code: 'invalid_argument',
        reason: 'no_spec',
        message: `the spec table has no entry for ${inst.repo} version ${inst.version}: add it with --specs FILE (docs/eval.md)`,
      });
      continue;
    }
    // Found here, not after the agent's whole run: the grader could not take it.
    const testPatchBytes = Buffer.byteLength(inst.test_patch);
    if (testPatchBytes > MAX_TEST_PATCH_BYTES) {
      errors.push({
        instance_id: inst.instance_id,
        code: 'payload_too_large',
        reason: 'test_patch_too_large',
        message: `test_patch is ${testPatchBytes} bytes, over the ${MAX_TEST_PATCH_BYTES} a command's stdin takes: the grader cannot apply it`,
      });
      continue;
    }
    const files = patchFiles(inst.test_patch);
    const directives = testDirectives(
      files.map((f) => f.path),
      spec.directives,
    );
    tasks.push({
      ...inst,
      instance_id: inst.instance_id,
      repo: inst.repo,
      base_commit: inst.base_commit,
      problem_statement: inst.problem_statement,
      patch: inst.patch,
      test_patch: inst.test_patch,
      FAIL_TO_PASS: f2p,
      PASS_TO_PASS: p2p,
      environment: { image: options.image(inst.instance_id), toolkits: [] },
      test_command: [spec.testCmd, ...directives.map(shellQuote)].join(' '),
      workdir: DEFAULT_WORKDIR,
      grading: 'patch',
      swebench: {
        version: inst.version,
        spec,
        directives,
        modifiedFiles: files.filter((f) => !f.created).map((f) => f.oldPath),
        newFiles: files.filter((f) => f.created).map((f) => f.path),
        environmentSetupCommit: inst.environment_setup_commit,
      },
    });
  }
  return { file: abs, tasks, errors };
}

function tests(v: string | string[], where: string, field: string): string[] {
  if (Array.isArray(v)) return v;
  let list: unknown;
  try {
    list = JSON.parse(v);
  } catch {
    throw new DsecError('invalid_argument', `${where}: ${field}: not a JSON-encoded list`, {
      field,
    });
  }
  if (!Array.isArray(list) || !list.every((t) => typeof t === 'string')) {
    throw new DsecError('invalid_argument', `${where}: ${field}: must be a list of test IDs`, {
      field,
    });
  }
  return list;
}

/**
 * The test command's arguments: the test files without SWE-bench's
 * non-test suffixes; for Django, module names (`tests/a/b.py` → `a.b`).
 */
export function testDirectives(paths: string[], kind: 'paths' | 'django-modules'): string[] {
  const kept = paths.filter((p) => !NON_TEST_SUFFIXES.some((s) => p.endsWith(s)));
  if (kind === 'paths') return kept;
  return kept.map((p) => {
    let d = p.endsWith('.py') ? p.slice(0, -3) : p;
    if (d.startsWith('tests/')) d = d.slice('tests/'.length);
    return d.replaceAll('/', '.');
  });
}
