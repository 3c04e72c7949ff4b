import { createHash } from 'node:crypto';
import { chmod, mkdir, mkdtemp, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { dirname, join, normalize, resolve } from 'node:path';
import {
  DEFAULT_LAYER_VERSION,
  DsecError,
  formatLayerRef,
  isDsecError,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import { buildLayer, type BuildProgress } from './build.js';
import { baseFacts, buildFromDebs, rememberBaseStatus, type DebsManifest } from './debs.js';
import { baseReleaseOfTree, chooseDebianSuite } from './debs-suite.js';
import {
  buildInstall,
  checkInstallRecipe,
  installLayerName,
  type InstallRecipe,
  type InstallRunner,
} from './install-recipe.js';
import { makeDebianRootfs } from './rootfs/debian.js';
import { assertLayerName } from './store/validate.js';
import { withLockFile } from './util/lock-file.js';

/**
 * Environments built from recipes: a named image (a Debian base made with
 * debootstrap, or a layer unpacked from .debs on such a base) described in a
 * JSON file such as `examples/swe-tasks/environments.json`, built on demand
 * and only again when its recipe (or the base under it) changes.
 */

/** A base image: Debian minbase plus packages, optionally with files written over it. */
export interface BaseRecipe {
  kind: 'base';
  debootstrap: { suite?: string; mirror?: string; packages?: string[] };
  /** Paths (relative to /) and the text written there after debootstrap, e.g. `etc/gitconfig`. */
  files?: Record<string, string>;
  version?: string;
  split?: boolean;
}

/** A toolkit (or workspace) layer unpacked from .debs, without what its base has. */
export interface DebsRecipe {
  kind: 'toolkit' | 'workspace';
  debs: string[];
  /** The environment (a name in the same recipes) it goes on. */
  base: string;
  suite?: string;
  version?: string;
  split?: boolean;
}

export type EnvironmentRecipe = BaseRecipe | DebsRecipe | InstallRecipe;
export type EnvironmentRecipes = Record<string, EnvironmentRecipe>;

export interface EnvironmentProgress extends BuildProgress {
  /** The environment being built (a base while its toolkit waits for it). */
  environment: string;
}

export interface EnsureEnvironmentOptions {
  /** Downloads, apt state and the record of which recipe built which layer (`environments/`). */
  cacheDir: string;
  /** Rebuild even when the recorded recipe matches. */
  force?: boolean;
  /**
   * Runs an `install` recipe's builder sandbox (`@dsec/eval`'s
   * `clusterInstallRunner`). Without one, an install recipe that needs
   * building is `invalid_argument` (`details.reason: install_needs_cluster`).
   */
  installer?: InstallRunner | undefined;
  /**
   * The task's workspace layer, for an install recipe with `workspace: true`
   * (built per workspace, as `installLayerName(name, workspace)`); without
   * it such a recipe is `invalid_argument`, `details.reason:
   * install_needs_workspace`. Other recipes ignore it.
   */
  workspace?: LayerInfo | undefined;
  signal?: AbortSignal;
  /** `check`, then the builder's phases, then `done` or `skip` (already built). */
  onProgress?(p: EnvironmentProgress): void;
}

export interface EnsureEnvironmentResult {
  layer: LayerInfo;
  /** False when the stored layer already came from this recipe. */
  built: boolean;
  recipeDigest: string;
  /** For a debs layer: the pinned packages. */
  manifest?: DebsManifest | undefined;
}

/** What `ensureEnvironment` records beside the cache for each environment it built. */
interface EnvironmentRecord {
  name: string;
  ref: string;
  recipeDigest: string;
  layerDigest: string;
  builtAt: string;
  manifest?: DebsManifest | undefined;
}

/**
 * Bumped when the same debs (or install) recipe builds different content (2: Python
 * bytecode compiled, unchecked; 3: checked-hash bytecode).
 */
const DEBS_BUILDER_REVISION = 3;

const PACKAGE_PATTERN = /^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?$/;

/**
 * Checks parsed JSON against the recipe format; unknown fields are refused.
 * @throws DsecError `invalid_argument` with `field` set to the offending path.
 */
export function parseEnvironmentRecipes(json: unknown): EnvironmentRecipes {
  const bad = (field: string, msg: string): never => {
    throw new DsecError('invalid_argument', `${field}: ${msg}`, { field });
  };
  const isObject = (v: unknown): v is Record<string, unknown> =>
    typeof v === 'object' && v !== null && !Array.isArray(v);
  const only = (v: Record<string, unknown>, keys: string[], field: string): void => {
    for (const k of Object.keys(v)) if (!keys.includes(k)) bad(`${field}.${k}`, 'unknown field');
  };
  const packages = (v: unknown, field: string): string[] => {
    if (!Array.isArray(v)) return bad(field, 'must be an array of package names');
    v.forEach((p, i) => {
      if (typeof p !== 'string' || !PACKAGE_PATTERN.test(p))
        bad(`${field}.${i}`, 'bad package name');
    });
    return v as string[];
  };
  const optString = (v: unknown, field: string): void => {
    if (v !== undefined && typeof v !== 'string') bad(field, 'must be a string');
  };
  const optBool = (v: unknown, field: string): void => {
    if (v !== undefined && typeof v !== 'boolean') bad(field, 'must be a boolean');
  };
  if (!isObject(json)) return bad('recipes', 'must be an object of name → recipe');
  const out: EnvironmentRecipes = {};
  for (const [name, r] of Object.entries(json)) {
    assertLayerName(name, name);
    if (!isObject(r)) return bad(name, 'must be an object');
    optString(r['version'], `${name}.version`);
    optBool(r['split'], `${name}.split`);
    if (r['kind'] === 'base') {
      only(r, ['kind', 'debootstrap', 'files', 'version', 'split'], name);
      const d = r['debootstrap'];
      if (!isObject(d)) return bad(`${name}.debootstrap`, 'must be an object');
      only(d, ['suite', 'mirror', 'packages'], `${name}.debootstrap`);
      optString(d['suite'], `${name}.debootstrap.suite`);
      optString(d['mirror'], `${name}.debootstrap.mirror`);
      if (d['packages'] !== undefined) packages(d['packages'], `${name}.debootstrap.packages`);
      const files = r['files'];
      if (files !== undefined) {
        if (!isObject(files)) return bad(`${name}.files`, 'must be an object of path → text');
        for (const [path, text] of Object.entries(files)) {
          if (typeof text !== 'string') bad(`${name}.files.${path}`, 'must be a string');
          safeRelative(path, `${name}.files.${path}`);
        }
      }
    } else if (r['kind'] === 'toolkit' || r['kind'] === 'workspace') {
      only(r, ['kind', 'debs', 'base', 'suite', 'version', 'split'], name);
      packages(r['debs'], `${name}.debs`);
      if ((r['debs'] as string[]).length === 0) bad(`${name}.debs`, 'name at least one package');
      if (typeof r['base'] !== 'string') return bad(`${name}.base`, 'must name an environment');
      optString(r['suite'], `${name}.suite`);
    } else if (r['kind'] === 'install') {
      checkInstallRecipe(name, r, bad);
    } else {
      return bad(`${name}.kind`, 'must be base, toolkit, workspace or install');
    }
    out[name] = r as unknown as EnvironmentRecipe;
  }
  for (const [name, r] of Object.entries(out)) {
    if (r.kind !== 'base' && out[r.base]?.kind !== 'base') {
      bad(`${name}.base`, `${JSON.stringify(r.base)} is not a base recipe in this file`);
    }
    if (r.kind === 'install') {
      (r.toolkits ?? []).forEach((t, i) => {
        const tk = out[t];
        if (tk?.kind !== 'toolkit' || tk.base !== r.base)
          bad(`${name}.toolkits.${i}`, `${JSON.stringify(t)} is not a toolkit recipe on ${r.base}`);
      });
    }
  }
  return out;
}

/** Reads and checks an environments file. */
export async function loadEnvironmentRecipes(file: string): Promise<EnvironmentRecipes> {
  const text = await readFile(file, 'utf8').catch((err: unknown) => {
    throw new DsecError('invalid_argument', `cannot read ${file}`, {
      field: 'environments',
      cause: err,
    });
  });
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (err) {
    throw new DsecError('invalid_argument', `${file} is not JSON`, {
      field: 'environments',
      cause: err,
    });
  }
  return parseEnvironmentRecipes(json);
}

function safeRelative(path: string, field: string): string {
  const n = normalize(path);
  if (path.startsWith('/') || n.startsWith('..') || n === '.' || n.includes('\0')) {
    throw new DsecError('invalid_argument', `${field}: must be a path inside the image`, { field });
  }
  return n;
}

/** Canonical JSON: keys sorted, so equal recipes hash equally whatever their key order. */
function canonical(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(canonical).join(',')}]`;
  if (typeof v === 'object' && v !== null) {
    const o = v as Record<string, unknown>;
    return `{${Object.keys(o)
      .filter((k) => o[k] !== undefined)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${canonical(o[k])}`)
      .join(',')}}`;
  }
  return JSON.stringify(v);
}

/**
 * The digest that decides whether a stored layer still matches its recipe:
 * the recipe itself, plus for a debs layer the digest of the base it was
 * resolved against (a new base means new exclusions) and the Debian suite
 * it is resolved from (the base's: `debs-suite.ts`).
 */
export function recipeDigest(
  recipe: EnvironmentRecipe,
  baseLayerDigest?: string,
  suite?: string,
): string {
  // A debs layer built by an older builder (one without bytecode) is rebuilt once.
  const input = canonical({
    recipe,
    base: baseLayerDigest,
    builder: recipe.kind === 'base' ? undefined : DEBS_BUILDER_REVISION,
    // Every debs layer was resolved from bookworm before the base's suite was read: those
    // digests stay, and a layer wrongly resolved from bookworm on another base is rebuilt.
    suite: suite === 'bookworm' ? undefined : suite,
  });
  return `sha256:${createHash('sha256').update(input).digest('hex')}`;
}

/**
 * Makes sure the environment `name` of `recipes` is in `store`, building it
 * (and, first, the base it stands on) when missing or built from another
 * recipe. Idempotent: when the stored layer is the one recorded for this
 * recipe digest under `cacheDir/environments/`, nothing is built. A layer
 * of that name from elsewhere (another recipe, a hand-built one) is
 * replaced. Concurrent calls, in this process or another sharing
 * `cacheDir`, build each environment once.
 *
 * @throws DsecError `invalid_argument` for a name not in `recipes` or a bad
 *   recipe; errors of `makeDebianRootfs`, `buildFromDebs` and `buildLayer`.
 */
export async function ensureEnvironment(
  store: ImageStore,
  name: string,
  recipes: EnvironmentRecipes,
  options: EnsureEnvironmentOptions,
): Promise<EnsureEnvironmentResult> {
  const recipe = recipes[name];
  if (recipe === undefined) {
    throw new DsecError(
      'invalid_argument',
      `no environment ${JSON.stringify(name)} in the recipes`,
      {
        field: 'environment',
      },
    );
  }
  const { signal } = options;
  const cacheDir = resolve(options.cacheDir);
  const progress = (p: BuildProgress, environment = name): void =>
    options.onProgress?.({ ...p, environment });
  let base: EnsureEnvironmentResult | undefined;
  if (recipe.kind !== 'base') {
    if (recipes[recipe.base]?.kind !== 'base') {
      throw new DsecError(
        'invalid_argument',
        `${name}.base ${JSON.stringify(recipe.base)} is not a base recipe`,
        {
          field: `${name}.base`,
        },
      );
    }
    base = await ensureEnvironment(store, recipe.base, recipes, options);
  }
  // A toolkit takes its base's suite; one its recipe names must agree (`invalid_argument`).
  // An install recipe runs on its base and toolkits: each is built first, and its digest covers theirs.
  const under: LayerInfo[] = base === undefined ? [] : [base.layer];
  let layerName = name;
  let workspace: LayerInfo | undefined;
  if (recipe.kind === 'install') {
    for (const t of recipe.toolkits ?? [])
      under.push((await ensureEnvironment(store, t, recipes, options)).layer);
    if (recipe.workspace === true) {
      workspace = options.workspace;
      if (workspace === undefined) {
        throw new DsecError(
          'invalid_argument',
          `${name} is built on a task's workspace (workspace: true): name the workspace`,
          {
            field: `${name}.workspace`,
            details: { reason: 'install_needs_workspace', layer: name },
          },
        );
      }
      layerName = installLayerName(name, formatLayerRef(workspace));
    }
  }
  const suite =
    base === undefined || recipe.kind === 'install'
      ? undefined
      : chooseDebianSuite(
          recipe.kind === 'toolkit' || recipe.kind === 'workspace' ? recipe.suite : undefined,
          (await baseFacts(store, base.layer, cacheDir, signal)).release,
          `${name}.suite`,
        );
  const digest = recipeDigest(
    recipe,
    recipe.kind === 'install'
      ? [...under, ...(workspace ? [workspace] : [])].map((l) => l.digest).join(',')
      : base?.layer.digest,
    suite,
  );
  const ref = `${layerName}:${recipe.version ?? DEFAULT_LAYER_VERSION}`;
  const recordDir = join(cacheDir, 'environments');
  await mkdir(recordDir, { recursive: true, mode: 0o700 });
  const recordFile = join(recordDir, `${ref.replace(':', '_')}.json`);

  return await withLockFile(
    join(recordDir, `${ref.replace(':', '_')}.lock`),
    async () => {
      progress({ phase: 'check' });
      const existing = await store.getLayer(ref).catch((err: unknown) => {
        if (isDsecError(err, 'image_not_found')) return undefined;
        throw err;
      });
      const record = await readRecord(recordFile);
      if (
        options.force !== true &&
        existing !== undefined &&
        record?.recipeDigest === digest &&
        record.layerDigest === existing.digest
      ) {
        progress({ phase: 'skip' });
        return { layer: existing, built: false, recipeDigest: digest, manifest: record.manifest };
      }
      // Another recipe's layer holds the name: buildLayer would refuse the new content.
      if (existing !== undefined) await store.removeLayer(ref);
      throwIfAborted(signal);
      const result =
        recipe.kind === 'base'
          ? {
              layer: await buildBase(store, name, recipe, cacheDir, progress, signal),
              manifest: undefined,
            }
          : recipe.kind === 'install'
            ? {
                layer: await buildInstall(store, {
                  name,
                  layerName,
                  workspace,
                  recipe,
                  layers: under,
                  recipeDigest: digest,
                  runner: options.installer,
                  signal,
                }),
                manifest: undefined,
              }
            : await buildFromDebs(store, {
                name,
                ...(recipe.version !== undefined ? { version: recipe.version } : {}),
                kind: recipe.kind,
                packages: recipe.debs,
                base: formatLayerRef(base!.layer),
                cacheDir,
                ...(suite !== undefined ? { suite } : {}),
                ...(recipe.split !== undefined ? { split: recipe.split } : {}),
                ...(signal ? { signal } : {}),
                onProgress: (p) => progress(p),
              });
      const next: EnvironmentRecord = {
        name,
        ref,
        recipeDigest: digest,
        layerDigest: result.layer.digest,
        builtAt: new Date().toISOString(),
        ...(result.manifest ? { manifest: result.manifest } : {}),
      };
      await writeFile(`${recordFile}.tmp`, `${JSON.stringify(next, null, 2)}\n`);
      await rename(`${recordFile}.tmp`, recordFile);
      return { layer: result.layer, built: true, recipeDigest: digest, manifest: result.manifest };
    },
    signal,
  );
}

async function readRecord(file: string): Promise<EnvironmentRecord | undefined> {
  const text = await readFile(file, 'utf8').catch(() => undefined);
  if (text === undefined) return undefined;
  try {
    return JSON.parse(text) as EnvironmentRecord;
  } catch {
    return undefined; // A torn record only costs a rebuild.
  }
}

async function buildBase(
  store: ImageStore,
  name: string,
  recipe: BaseRecipe,
  cacheDir: string,
  progress: (p: BuildProgress) => void,
  signal: AbortSignal | undefined,
): Promise<LayerInfo> {
  await mkdir(join(cacheDir, 'work'), { recursive: true, mode: 0o700 });
  const work = await mkdtemp(join(cacheDir, 'work', 'base-'));
  try {
    const root = join(work, 'root');
    await makeDebianRootfs(root, {
      ...(recipe.debootstrap.suite !== undefined ? { suite: recipe.debootstrap.suite } : {}),
      ...(recipe.debootstrap.mirror !== undefined ? { mirror: recipe.debootstrap.mirror } : {}),
      packages: recipe.debootstrap.packages ?? [],
      ...(signal ? { signal } : {}),
      onProgress: progress,
    });
    for (const [path, text] of Object.entries(recipe.files ?? {})) {
      const file = join(root, safeRelative(path, `${name}.files.${path}`));
      await mkdir(dirname(file), { recursive: true, mode: 0o755 });
      await writeFile(file, text, { mode: 0o644 });
      await chmod(file, 0o644);
    }
    const status = await readFile(join(root, 'var/lib/dpkg/status'), 'utf8');
    const layer = await buildLayer(store, {
      name,
      ...(recipe.version !== undefined ? { version: recipe.version } : {}),
      kind: 'base',
      from: { dir: root },
      source: 'debootstrap',
      ...(recipe.split !== undefined ? { split: recipe.split } : {}),
      ...(signal ? { signal } : {}),
      onProgress: progress,
    });
    await rememberBaseStatus(cacheDir, layer.digest, status, await baseReleaseOfTree(root));
    return layer;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}
