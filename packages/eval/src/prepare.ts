import {
  DsecError,
  formatLayerRef,
  isDsecError,
  type ImageStore,
  type LayerInfo,
} from '@dsec/core';
import type { PreparedTask } from './runner.js';
import type { EvalTask } from './task.js';
import { ensureWorkspace, foreignLayer, workspaceLayerName, type RepoCache } from './workspace.js';

/**
 * Builds a missing environment layer (base image or toolkit) by name; from
 * `@dsec/images`' recipes. With `workspace`, an install recipe built on a
 * task's workspace; it then resolves with the layer it made (`{ layer }`,
 * named after the recipe and the workspace), and without it such a recipe
 * rejects with `details.reason: 'install_needs_workspace'`.
 */
export type EnvironmentBuilder = (
  name: string,
  options: {
    signal?: AbortSignal | undefined;
    onPhase?: ((phase: string) => void) | undefined;
    workspace?: LayerInfo | undefined;
  },
) => Promise<unknown>;

export interface PrepareProgress {
  done: number;
  total: number;
  /** The layer being looked at now. */
  layer: string;
  phase: 'check' | 'build' | 'present' | 'built';
}

export interface PrepareOptions {
  store: ImageStore;
  repos: RepoCache;
  /** Absent: a missing environment layer is `image_not_found`. */
  buildEnvironment?: EnvironmentBuilder | undefined;
  onProgress?: ((p: PrepareProgress) => void) | undefined;
  signal?: AbortSignal | undefined;
}

export interface PrepareReport {
  tasks: PreparedTask[];
  /** Layers built by this call. */
  built: string[];
  /** Layers that were already there. */
  present: string[];
}

/**
 * Makes sure every layer the tasks need is in the store: each environment
 * layer (image and toolkits, built from its recipe when missing or built
 * from another recipe or builder revision) and each
 * workspace layer (the repository at `base_commit`, once per repository and
 * commit). Idempotent: a second call finds everything present and builds
 * nothing.
 *
 * Only the platform's layers count (docs/adr/0019-layer-ownership.md): a
 * tenant's snapshot under a task's public names is in its own namespace and
 * never seen here, and a create resolves the platform's layer first. A
 * platform layer is accepted only as what prepare would make there: the
 * image a `base`, toolkits `toolkit`s (their recipes check the rest), a
 * workspace a `workspace` built from the task's repository and commit. Any
 * other layer under one of those names is refused, `conflict` with
 * `details.reason: 'foreign_layer'` (`foreignLayer`), never run and never
 * deleted.
 */
export async function prepareTasks(
  tasks: EvalTask[],
  options: PrepareOptions,
): Promise<PrepareReport> {
  const envLayers = unique(tasks.flatMap((t) => [t.environment.image, ...t.environment.toolkits]));
  const workspaces = new Map<string, EvalTask>();
  for (const t of tasks)
    if (!workspaces.has(workspaceLayerName(t))) workspaces.set(workspaceLayerName(t), t);
  const total = envLayers.length + workspaces.size;
  const built: string[] = [];
  const present: string[] = [];
  let done = 0;
  const report = (layer: string, phase: PrepareProgress['phase']) =>
    options.onProgress?.({ done, total, layer, phase });

  const images = new Set(tasks.map((t) => t.environment.image));
  // Toolkits built per task workspace (install recipes with `workspace: true`): after the workspaces.
  const perWorkspace = new Set<string>();
  for (const layer of envLayers) {
    report(layer, 'check');
    const before = await layerDigest(options.store, layer);
    if (!options.buildEnvironment) {
      if (before === undefined) {
        throw new DsecError(
          'image_not_found',
          `layer ${layer} is missing and no recipe builds it`,
          {
            details: { layer },
          },
        );
      }
    } else {
      // Also when the layer exists: the builder rebuilds one its recipe (or builder) no longer
      // matches, and only checks a record otherwise. A layer no recipe names (built by hand) stays.
      const needsWorkspace = await options
        .buildEnvironment(layer, { signal: options.signal })
        .then(() => false)
        .catch((err: unknown) => {
          const details = (isDsecError(err) ? err.details : undefined) as
            { layer?: unknown; reason?: unknown } | undefined;
          if (
            isDsecError(err, 'invalid_argument') &&
            details?.reason === 'install_needs_workspace' &&
            !images.has(layer)
          )
            return true;
          const noRecipe = isDsecError(err, 'image_not_found') && details?.layer === layer;
          if (!(noRecipe && before !== undefined)) throw err;
          return false;
        });
      if (needsWorkspace) {
        perWorkspace.add(layer);
        done++;
        continue;
      }
    }
    const found = await platformLayer(options.store, layer);
    const after = found?.digest;
    if (found === undefined) {
      throw new DsecError('image_not_found', `the recipe for ${layer} did not produce it`, {
        details: { layer },
      });
    }
    // A name may be a task's image and another task's toolkit: then it must be a base.
    const kind = images.has(layer) ? 'base' : 'toolkit';
    if (found.kind !== kind) throw foreignLayer(found, { kind });
    (after === before ? present : built).push(layer);
    done++;
    report(layer, built.includes(layer) ? 'built' : 'present');
  }
  for (const [name, task] of workspaces) {
    report(name, 'check');
    const r = await ensureWorkspace(options.store, task, options.repos, { signal: options.signal });
    (r.built ? built : present).push(name);
    done++;
    report(name, r.built ? 'built' : 'present');
  }
  // Each task's per-workspace toolkits, on its own workspace; the task runs on those layers.
  const toolkitsOf = new Map<string, string[]>();
  for (const t of tasks) {
    const names: string[] = [];
    for (const tk of t.environment.toolkits) {
      if (!perWorkspace.has(tk)) {
        names.push(tk);
        continue;
      }
      const ws = await options.store.getLayer(workspaceLayerName(t));
      const r = (await options.buildEnvironment!(tk, { signal: options.signal, workspace: ws })) as
        { layer?: LayerInfo; built?: boolean } | undefined;
      if (r?.layer?.kind !== 'toolkit') {
        throw new DsecError('image_not_found', `the recipe for ${tk} did not produce it`, {
          details: { layer: tk },
        });
      }
      const name = formatLayerRef(r.layer);
      if (!built.includes(name) && !present.includes(name)) (r.built ? built : present).push(name);
      names.push(name);
    }
    toolkitsOf.set(t.instance_id, names);
  }
  return {
    tasks: tasks.map((t) => ({
      instance_id: t.instance_id,
      image: t.environment.image,
      toolkits: toolkitsOf.get(t.instance_id) ?? t.environment.toolkits,
      workspace: workspaceLayerName(t),
      workdir: t.workdir,
    })),
    built,
    present,
  };
}

async function layerDigest(store: ImageStore, ref: string): Promise<string | undefined> {
  return (await platformLayer(store, ref))?.digest;
}

/** The platform's record of `ref` (a store's default namespace), if any. */
async function platformLayer(store: ImageStore, ref: string): Promise<LayerInfo | undefined> {
  try {
    return await store.getLayer(ref);
  } catch (err) {
    if (isDsecError(err) && err.code === 'image_not_found') return undefined;
    throw err;
  }
}

function unique(xs: string[]): string[] {
  return [...new Set(xs)];
}
