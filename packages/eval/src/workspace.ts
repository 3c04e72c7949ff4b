import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import {
  DsecError,
  formatLayerKey,
  isDsecError,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import { buildLayer } from '@dsec/images';
import { DEFAULT_WORKDIR, type EvalTask } from './task.js';

const execFileAsync = promisify(execFile);
const GIT_MAX_BUFFER = 256 * 1024 * 1024;
/** Fixed identity and dates: the same tree at the same commit always gives the same layer. */
const GIT_ENV = {
  GIT_AUTHOR_NAME: 'dsec',
  GIT_AUTHOR_EMAIL: 'dsec@localhost',
  GIT_COMMITTER_NAME: 'dsec',
  GIT_COMMITTER_EMAIL: 'dsec@localhost',
  GIT_AUTHOR_DATE: '2000-01-01T00:00:00Z',
  GIT_COMMITTER_DATE: '2000-01-01T00:00:00Z',
  GIT_CONFIG_NOSYSTEM: '1',
  GIT_CONFIG_GLOBAL: '/dev/null',
};

/**
 * The host's access to tasks' repositories: a `repo_dir` is used in place; a
 * `repo_archive` (git bundle) is cloned once, bare, into the cache and
 * reused. Reads files at a commit for the grader and exports trees for
 * workspace layers.
 */
export class RepoCache {
  readonly cacheDir: string;
  readonly #clones = new Map<string, Promise<string>>();

  constructor(cacheDir: string) {
    this.cacheDir = cacheDir;
  }

  /** The git directory holding the task's repository, with `base_commit` checked present. */
  async gitDir(task: EvalTask): Promise<string> {
    const source = task.repo_dir ?? task.repo_archive!;
    let pending = this.#clones.get(source);
    if (!pending) {
      pending = this.#open(task);
      this.#clones.set(source, pending);
      pending.catch(() => this.#clones.delete(source));
    }
    const dir = await pending;
    await git(dir, ['cat-file', '-e', `${task.base_commit}^{commit}`]).catch((err: unknown) => {
      throw new DsecError(
        'invalid_argument',
        `${task.instance_id}: ${source} has no commit ${task.base_commit}`,
        {
          field: 'base_commit',
          cause: err,
        },
      );
    });
    return dir;
  }

  /** A file's content at `base_commit`; undefined when the commit has no such file. */
  async fileAtBase(task: EvalTask, path: string): Promise<string | undefined> {
    const dir = await this.gitDir(task);
    try {
      return await git(dir, ['show', `${task.base_commit}:${path}`]);
    } catch {
      return undefined;
    }
  }

  /**
   * Writes the repository at `base_commit` into `dest` as a fresh one-commit
   * repository: the agent gets `git diff`/`git status`, and no history after
   * the base commit (which would hold the fix) reaches the sandbox.
   */
  async exportTree(task: EvalTask, dest: string): Promise<void> {
    const dir = await this.gitDir(task);
    await mkdir(dest, { recursive: true });
    const tar = join(
      this.cacheDir,
      `export-${process.pid}-${Math.random().toString(36).slice(2)}.tar`,
    );
    try {
      await git(dir, ['archive', '--format=tar', '-o', tar, task.base_commit]);
      await execFileAsync('tar', ['-xf', tar, '-C', dest, '--no-same-owner']);
    } finally {
      await rm(tar, { force: true });
    }
    await git(dest, ['init', '-q', '-b', 'main']);
    await git(dest, ['add', '-A', '-f']);
    await git(dest, [
      '-c',
      'core.hooksPath=/dev/null',
      'commit',
      '-q',
      '--allow-empty',
      '-m',
      `${task.repo} at ${task.base_commit}`,
    ]);
  }

  async #open(task: EvalTask): Promise<string> {
    if (task.repo_dir !== undefined) {
      await git(task.repo_dir, ['rev-parse', '--git-dir']).catch((err: unknown) => {
        throw new DsecError(
          'invalid_argument',
          `${task.instance_id}: ${task.repo_dir} is not a git checkout`,
          {
            field: 'repo_dir',
            cause: err,
          },
        );
      });
      return task.repo_dir;
    }
    const bundle = task.repo_archive!;
    const info = await stat(bundle).catch((err: unknown) => {
      throw new DsecError('not_found', `${task.instance_id}: no repo_archive at ${bundle}`, {
        field: 'repo_archive',
        cause: err,
      });
    });
    const key = createHash('sha256')
      .update(`${bundle}\0${info.size}\0${info.mtimeMs}`)
      .digest('hex')
      .slice(0, 16);
    const dest = join(this.cacheDir, 'repos', key);
    const ready = await stat(join(dest, 'HEAD')).then(
      () => true,
      () => false,
    );
    if (ready) return dest;
    await mkdir(join(this.cacheDir, 'repos'), { recursive: true });
    const tmp = await mkdtemp(join(this.cacheDir, 'repos', `${key}.tmp-`));
    try {
      await git(this.cacheDir, ['clone', '--bare', '-q', bundle, tmp]).catch((err: unknown) => {
        throw new DsecError(
          'invalid_argument',
          `${task.instance_id}: ${bundle} is not a git bundle`,
          {
            field: 'repo_archive',
            cause: err,
          },
        );
      });
      await rm(dest, { recursive: true, force: true });
      await execFileAsync('mv', ['-T', tmp, dest]);
    } catch (err) {
      await rm(tmp, { recursive: true, force: true });
      throw err;
    }
    return dest;
  }
}

/** The workspace layer's name for a task: from its repository and base commit (and a non-default workdir). */
export function workspaceLayerName(task: EvalTask): string {
  const slug = task.repo
    .toLowerCase()
    .replace(/[^a-z0-9._-]+/g, '-')
    .replace(/^[^a-z0-9]+/, '')
    .slice(0, 80);
  const commit = task.base_commit
    .toLowerCase()
    .replace(/[^a-z0-9]/g, '')
    .slice(0, 12);
  const where =
    task.workdir === DEFAULT_WORKDIR
      ? ''
      : `-${createHash('sha256').update(task.workdir).digest('hex').slice(0, 6)}`;
  return `ws-${slug || 'repo'}-${commit}${where}`;
}

/** The `source` a task's workspace layer is built with: what proves a present one is it. */
export function workspaceSource(task: EvalTask): string {
  return `eval:${task.repo}@${task.base_commit}`;
}

/**
 * The refusal for a layer that holds a name eval would use but is not what
 * eval would put there (another kind, another source, not the platform's):
 * `conflict`, `details.reason: 'foreign_layer'`, naming what was found and
 * what was expected. Eval never runs a task on it, and never deletes it
 * (it may be an operator's): the operator removes or renames it.
 */
export function foreignLayer(
  layer: LayerInfo,
  expected: { kind: LayerInfo['kind']; source?: string | undefined },
): DsecError {
  const key = formatLayerKey(layer);
  return new DsecError(
    'conflict',
    `layer ${key} is a ${layer.kind} from ${JSON.stringify(layer.source)}, not the ${expected.kind}${expected.source ? ` from ${JSON.stringify(expected.source)}` : ''} eval needs there; check it and remove it (dsec image rm ${key}) to let eval build its own`,
    {
      details: {
        reason: 'foreign_layer',
        layer: key,
        kind: layer.kind,
        source: layer.source,
        ...(layer.project !== undefined ? { project: layer.project } : {}),
        expected,
      },
    },
  );
}

/**
 * Makes sure the task's workspace layer (the repository at `base_commit`
 * under `workdir`) is in the store: built once per repository and commit,
 * skipped when the platform's layer of that name is exactly that (kind
 * `workspace`, `source` from `workspaceSource`). Any other layer under the
 * name (snapshots from before layers had owners were the platform's too) is
 * `foreignLayer`'s `conflict`. Returns its name and whether it was built now.
 */
export async function ensureWorkspace(
  store: ImageStore,
  task: EvalTask,
  repos: RepoCache,
  options: { signal?: AbortSignal | undefined } = {},
): Promise<{ name: string; built: boolean }> {
  const name = workspaceLayerName(task);
  const source = workspaceSource(task);
  // The platform's namespace only: no tenant's layer of the name is ever looked at.
  const present = await store.getLayer(name).catch((err: unknown) => {
    if (isDsecError(err, 'image_not_found')) return undefined;
    throw err;
  });
  if (present) {
    if (present.kind === 'workspace' && present.source === source && present.project === undefined)
      return { name, built: false };
    throw foreignLayer(present, { kind: 'workspace', source });
  }
  await mkdir(repos.cacheDir, { recursive: true });
  const tree = await mkdtemp(join(repos.cacheDir, 'ws-'));
  try {
    await repos.exportTree(task, join(tree, task.workdir));
    await buildLayer(store, {
      name,
      kind: 'workspace',
      from: { dir: tree },
      source,
      signal: options.signal,
    });
  } finally {
    await rm(tree, { recursive: true, force: true });
  }
  return { name, built: true };
}

async function git(cwd: string, args: string[]): Promise<string> {
  const { stdout } = await execFileAsync('git', args, {
    cwd,
    env: { ...process.env, ...GIT_ENV },
    maxBuffer: GIT_MAX_BUFFER,
  });
  return stdout;
}
