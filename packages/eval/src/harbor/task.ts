import { existsSync, lstatSync } from 'node:fs';
import { readFile, readdir } from 'node:fs/promises';
import { basename, join, resolve } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import { z } from 'zod';
import { DsecError } from '@dsec/core';

/** Harbor's defaults where task.toml is silent (its TaskConfig model). */
export const HARBOR_DEFAULTS = {
  verifierTimeoutSec: 600,
  /** Harbor has no agent limit by default; DSec bounds it so a stuck agent ends. */
  agentTimeoutSec: 3600,
  buildTimeoutSec: 600,
  cpus: 1,
  memoryMb: 2048,
} as const;

/** task.toml, instruction.md and the like are read up to this size. */
const MAX_TEXT_BYTES = 1024 * 1024;
/** A task name becomes `instance_id`, a sandbox label and a layer name: kept plain. */
const TASK_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

/**
 * A timeout in task.toml: at most a day. Node's timers hold 2^31-1 ms (24.8
 * days); a longer agent limit fired at once (TimeoutOverflowWarning), ending
 * the agent before it started, and a sandbox's TTL is hours, not years.
 */
export const MAX_TIMEOUT_SEC = 24 * 3600;
const seconds = z.number().positive().finite().max(MAX_TIMEOUT_SEC);
const stringMap = z.record(z.string(), z.string());

/**
 * The task.toml fields DSec acts on. Unknown keys pass (Harbor's format
 * grows, and a task must run unedited); known ones are type-checked.
 */
const TaskToml = z
  .object({
    version: z.string().optional(),
    schema_version: z.string().optional(),
    metadata: z.record(z.string(), z.unknown()).optional(),
    agent: z
      .object({ timeout_sec: seconds.nullable().optional(), user: z.unknown().optional() })
      .passthrough()
      .optional(),
    verifier: z
      .object({ timeout_sec: seconds.optional(), env: stringMap.optional() })
      .passthrough()
      .optional(),
    solution: z.object({ env: stringMap.optional() }).passthrough().optional(),
    environment: z
      .object({
        build_timeout_sec: seconds.optional(),
        docker_image: z.string().nullable().optional(),
        cpus: z.number().positive().optional(),
        memory_mb: z.number().int().positive().optional(),
        storage_mb: z.number().int().positive().optional(),
        /** Deprecated in Harbor for memory_mb / storage_mb: `2G`, `512M`. */
        memory: z.string().optional(),
        storage: z.string().optional(),
        allow_internet: z.boolean().optional(),
      })
      .passthrough()
      .optional(),
  })
  .passthrough();

/** One Harbor / Terminal-Bench task directory, loaded. */
export interface HarborTask {
  /** The directory's name: `instance_id` of its result line. */
  name: string;
  /** Absolute path of the task directory. */
  dir: string;
  /** instruction.md: what the agent is told. */
  instruction: string;
  /** environment/ (the build context) and its Dockerfile. */
  environmentDir: string;
  dockerfile: string;
  /** The Dockerfile's last `WORKDIR` (where the agent's shell starts), default `/`. */
  workdir: string;
  testsDir: string;
  /** solution/ (undefined when the task ships none: `--agent oracle` is then an error for it). */
  solutionDir: string | undefined;
  agentTimeoutSec: number;
  verifierTimeoutSec: number;
  verifierEnv: Record<string, string>;
  solutionEnv: Record<string, string>;
  buildTimeoutSec: number;
  cpus: number;
  memoryMb: number;
  storageMb: number | undefined;
  metadata: Record<string, unknown>;
}

function invalid(message: string, field: string, details?: Record<string, unknown>): DsecError {
  return new DsecError('invalid_argument', message, { field, ...(details ? { details } : {}) });
}

async function readText(path: string, field: string): Promise<string> {
  const st = lstatSync(path, { throwIfNoEntry: false });
  if (!st) throw invalid(`${path} is missing: a Harbor task needs it`, field);
  if (!st.isFile()) throw invalid(`${path} must be a regular file`, field);
  if (st.size > MAX_TEXT_BYTES) {
    throw invalid(`${path} is larger than ${MAX_TEXT_BYTES} bytes`, field);
  }
  return readFile(path, 'utf8');
}

function isDir(path: string): boolean {
  return lstatSync(path, { throwIfNoEntry: false })?.isDirectory() ?? false;
}

/**
 * A subdirectory of the task's that must be a real directory when present:
 * a symlink (`solution -> /root`) would make the loader, the build and the
 * uploads read whatever host directory it names.
 */
function plainDir(path: string, field: string): boolean {
  const st = lstatSync(path, { throwIfNoEntry: false });
  if (!st) return false;
  if (!st.isDirectory()) {
    throw invalid(`${path} must be a directory (not a symlink or a file)`, field);
  }
  return true;
}

/** Harbor's deprecated size strings (`2G`, `512M`, `1024K`) in MiB. */
export function sizeToMb(size: string, field: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([GMK])\s*$/i.exec(size);
  if (!m) throw invalid(`${field} must look like 2G or 512M, not ${JSON.stringify(size)}`, field);
  const n = Number(m[1]);
  const unit = m[2]!.toUpperCase();
  const mb = unit === 'G' ? n * 1024 : unit === 'M' ? n : n / 1024;
  return Math.max(1, Math.floor(mb));
}

/** The last `WORKDIR` of the Dockerfile's last stage, if absolute and plain; else `/`. */
export function dockerfileWorkdir(text: string): string {
  let workdir = '/';
  // Continuation lines joined; comments dropped.
  const lines = text.replace(/\\\r?\n/g, ' ').split(/\r?\n/);
  for (const raw of lines) {
    const line = raw.trim();
    if (/^FROM\s/i.test(line)) workdir = '/';
    const m = /^WORKDIR\s+(.+)$/i.exec(line);
    if (!m) continue;
    let dir = m[1]!.trim();
    if (/^["'].*["']$/.test(dir)) dir = dir.slice(1, -1);
    if (dir.includes('$')) continue; // a build variable: the image's config knows, not the text
    workdir = dir.startsWith('/') ? dir : `${workdir.replace(/\/$/, '')}/${dir}`;
  }
  return workdir;
}

/** Loads one task directory (task.toml, instruction.md, environment/Dockerfile, tests/test.sh). */
export async function loadHarborTask(dirArg: string): Promise<HarborTask> {
  const dir = resolve(dirArg);
  const name = basename(dir);
  if (!TASK_NAME.test(name)) {
    throw invalid(
      `task directory name ${JSON.stringify(name)} must be letters, digits, '.', '_' or '-' (up to 128)`,
      'task',
    );
  }
  const tomlPath = join(dir, 'task.toml');
  let raw: unknown;
  try {
    raw = parseToml(await readText(tomlPath, 'task.toml'));
  } catch (err) {
    if (err instanceof DsecError) throw err;
    throw invalid(`${tomlPath}: ${(err as Error).message.split('\n')[0]}`, 'task.toml');
  }
  const parsed = TaskToml.safeParse(raw);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    const field = issue.path.join('.');
    throw invalid(`${tomlPath}: ${field}: ${issue.message}`, `task.toml.${field}`);
  }
  const cfg = parsed.data;
  const environmentDir = join(dir, 'environment');
  const dockerfile = join(environmentDir, 'Dockerfile');
  if (!plainDir(environmentDir, 'environment')) {
    throw invalid(`${environmentDir} is missing`, 'environment');
  }
  const dockerText = await readText(dockerfile, 'environment/Dockerfile');
  if (!plainDir(join(dir, 'tests'), 'tests')) throw invalid(`${dir}/tests is missing`, 'tests');
  await readText(join(dir, 'tests', 'test.sh'), 'tests/test.sh');
  const instruction = await readText(join(dir, 'instruction.md'), 'instruction.md');
  const solutionDir =
    plainDir(join(dir, 'solution'), 'solution') &&
    lstatSync(join(dir, 'solution', 'solve.sh'), { throwIfNoEntry: false })?.isFile()
      ? join(dir, 'solution')
      : undefined;
  const env = cfg.environment ?? {};
  return {
    name,
    dir,
    instruction,
    environmentDir,
    dockerfile,
    workdir: dockerfileWorkdir(dockerText),
    testsDir: join(dir, 'tests'),
    solutionDir,
    agentTimeoutSec: cfg.agent?.timeout_sec ?? HARBOR_DEFAULTS.agentTimeoutSec,
    verifierTimeoutSec: cfg.verifier?.timeout_sec ?? HARBOR_DEFAULTS.verifierTimeoutSec,
    verifierEnv: cfg.verifier?.env ?? {},
    solutionEnv: cfg.solution?.env ?? {},
    buildTimeoutSec: env.build_timeout_sec ?? HARBOR_DEFAULTS.buildTimeoutSec,
    cpus: env.cpus ?? HARBOR_DEFAULTS.cpus,
    memoryMb:
      env.memory_mb ??
      (env.memory !== undefined
        ? sizeToMb(env.memory, 'task.toml.environment.memory')
        : HARBOR_DEFAULTS.memoryMb),
    storageMb:
      env.storage_mb ??
      (env.storage !== undefined
        ? sizeToMb(env.storage, 'task.toml.environment.storage')
        : undefined),
    metadata: cfg.metadata ?? {},
  };
}

/**
 * Loads `path`: one task directory (it holds task.toml) or a folder of
 * them (every subdirectory with a task.toml, by name). A folder with none
 * is `invalid_argument`; so is any task that does not load, naming it.
 */
export async function loadHarborTasks(path: string): Promise<HarborTask[]> {
  const dir = resolve(path);
  if (!isDir(dir)) {
    throw new DsecError('not_found', `${path} is not a directory of Harbor tasks`, {
      field: 'tasks',
    });
  }
  if (existsSync(join(dir, 'task.toml'))) return [await loadHarborTask(dir)];
  const names = (await readdir(dir)).sort();
  const tasks: HarborTask[] = [];
  for (const n of names) {
    const sub = join(dir, n);
    if (!isDir(sub) || !existsSync(join(sub, 'task.toml'))) continue;
    tasks.push(await loadHarborTask(sub));
  }
  if (tasks.length === 0) {
    throw invalid(`${path} holds no task directory (a folder with task.toml)`, 'tasks');
  }
  return tasks;
}
