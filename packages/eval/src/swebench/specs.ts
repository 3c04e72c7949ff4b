import { readFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { z } from 'zod';
import { DsecError } from '@dsec/core';
import { LOG_PARSER_NAMES, type LogParserName } from '../log-parsers/python.js';

/**
 * The spec table: for each SWE-bench repository and `version`, how its
 * instance image runs the tests (SWE-bench's `MAP_REPO_VERSION_TO_SPECS`,
 * as data). The shipped table is `packages/eval/specs/swebench.json`;
 * `--specs FILE` merges a user's table over it (per repository: `parser`,
 * `directives`, `activate` replaced when given; versions merged, a version
 * replaced whole). docs/eval.md describes the fields.
 */

/** The shipped table. */
export const SHIPPED_SPECS_PATH = fileURLToPath(
  new URL('../../specs/swebench.json', import.meta.url),
);

const versionSchema = z
  .object({
    /** The test command; the test files (`directives`) are appended. */
    test_cmd: z.string().min(1),
    /** Run before the tests, after activation (SWE-bench re-runs the install at evaluation). */
    install: z.string().min(1).optional(),
    /** Run first, after activation (locale set-up, environment variables). */
    eval_commands: z.array(z.string()).optional(),
    /** Steps the image build ran (recorded; the image already holds their result). */
    pre_install: z.array(z.string()).optional(),
    /** Overrides the repository's (or the table's) activation for this version. */
    activate: z.string().min(1).optional(),
  })
  .strict();

const repoSchema = z
  .object({
    parser: z.enum(LOG_PARSER_NAMES),
    /** `paths`: the test files as they are; `django-modules`: `tests/a/b.py` → `a.b`. */
    directives: z.enum(['paths', 'django-modules']),
    activate: z.string().min(1).optional(),
    versions: z.record(z.string().min(1), versionSchema),
  })
  .strict();

const tableSchema = z
  .object({
    $schema_version: z.literal(1),
    /** Where the data came from (free text). */
    source: z.string().optional(),
    /** How the image's environment is activated (default SWE-bench's conda `testbed`). */
    activate: z.string().min(1).optional(),
    repos: z.record(z.string().regex(/^[A-Za-z0-9_.-]+\/[A-Za-z0-9_.-]+$/), repoSchema),
  })
  .strict();

/** A user's table: the same shape, every repository field optional but `versions`. */
const overlaySchema = tableSchema.extend({
  repos: z.record(
    z.string().regex(/^[A-Za-z0-9_.-]+\/[A-Za-z0-9_.-]+$/),
    repoSchema.partial({ parser: true, directives: true }).strict(),
  ),
});

export type SpecTable = z.infer<typeof tableSchema>;

/** What one (repo, version) runs. */
export interface InstanceSpec {
  repo: string;
  version: string;
  parser: LogParserName;
  directives: 'paths' | 'django-modules';
  activate: string;
  testCmd: string;
  install?: string | undefined;
  evalCommands: string[];
}

export const DEFAULT_ACTIVATE = 'source /opt/miniconda3/bin/activate && conda activate testbed';

/**
 * Reads the shipped table and, with `overlayPath`, merges the user's over
 * it. Every problem is `invalid_argument` naming the file and the key
 * (`repos.django/django.versions.3.0.test_cmd`).
 */
export async function loadSpecs(
  overlayPath?: string,
  options: { shippedPath?: string | undefined } = {},
): Promise<SpecTable> {
  const shippedPath = options.shippedPath ?? SHIPPED_SPECS_PATH;
  const table = await readJson(shippedPath, tableSchema);
  if (overlayPath === undefined) return table;
  const overlay = await readJson(overlayPath, overlaySchema);
  for (const [repo, over] of Object.entries(overlay.repos)) {
    const base = table.repos[repo];
    if (base === undefined && (over.parser === undefined || over.directives === undefined)) {
      throw new DsecError(
        'invalid_argument',
        `${overlayPath}: repos.${repo}: a repository the shipped table lacks needs parser and directives`,
        { field: 'specs', details: { file: overlayPath, key: `repos.${repo}` } },
      );
    }
    table.repos[repo] = {
      parser: over.parser ?? base!.parser,
      directives: over.directives ?? base!.directives,
      ...((over.activate ?? base?.activate) !== undefined
        ? { activate: over.activate ?? base?.activate }
        : {}),
      versions: { ...(base?.versions ?? {}), ...over.versions },
    };
  }
  if (overlay.activate !== undefined) table.activate = overlay.activate;
  return table;
}

async function readJson<T extends z.ZodTypeAny>(path: string, schema: T): Promise<z.infer<T>> {
  const text = await readFile(path, 'utf8').catch((err: NodeJS.ErrnoException) => {
    throw new DsecError(
      err.code === 'ENOENT' ? 'not_found' : 'invalid_argument',
      `${path}: ${err.message}`,
      {
        field: 'specs',
      },
    );
  });
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (err) {
    throw new DsecError('invalid_argument', `${path}: not JSON (${(err as Error).message})`, {
      field: 'specs',
    });
  }
  const parsed = schema.safeParse(raw);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    const key = issue.path.join('.') || '(top level)';
    throw new DsecError('invalid_argument', `${path}: ${key}: ${issue.message}`, {
      field: 'specs',
      details: { file: path, key },
    });
  }
  return parsed.data as z.infer<T>;
}

/** The spec of (repo, version), or undefined when the table has none. */
export function specFor(table: SpecTable, repo: string, version: string): InstanceSpec | undefined {
  const r = Object.hasOwn(table.repos, repo) ? table.repos[repo] : undefined;
  const v = r && Object.hasOwn(r.versions, version) ? r.versions[version] : undefined;
  if (!r || !v) return undefined;
  return {
    repo,
    version,
    parser: r.parser,
    directives: r.directives,
    activate: v.activate ?? r.activate ?? table.activate ?? DEFAULT_ACTIVATE,
    testCmd: v.test_cmd,
    install: v.install,
    evalCommands: v.eval_commands ?? [],
  };
}
