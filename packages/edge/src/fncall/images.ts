import { DsecError, type ImageStore, type LayerInfo } from '@dsec/core';
import { ensureEnvironment, type EnvironmentProgress, type EnvironmentRecipes } from '@dsec/images';
import { SANDBOXFUSION_IMAGE_RECIPES } from './sandboxfusion.js';

/**
 * The images DSec's own runtimes run on (docs/adr/0014-fncall.md): one Debian
 * base with python3 (the worker's zygote is a Python script, so every
 * runtime image needs python3), and a toolkit with nodejs over it. bash is
 * in the base already.
 */
export const FNCALL_IMAGE_RECIPES: EnvironmentRecipes = {
  'fncall-base': { kind: 'base', debootstrap: { packages: ['python3'] } },
  'fncall-node': { kind: 'toolkit', debs: ['nodejs'], base: 'fncall-base' },
};

export interface PrepareFnCallImagesOptions {
  /** Downloads and the record of what was built (the same directory `ensureEnvironment` takes). */
  cacheDir: string;
  signal?: AbortSignal | undefined;
  onProgress?: ((p: EnvironmentProgress) => void) | undefined;
  /**
   * Images to build besides the base: names of `FNCALL_IMAGE_RECIPES` or of
   * `SANDBOXFUSION_IMAGE_RECIPES` (`fncall-sf-gcc`), or `'sandboxfusion'`
   * for all of the latter. Default: the default runtimes' (`fncall-node`).
   */
  images?: readonly string[] | undefined;
}

/** Every recipe `prepareFnCallImages` knows. */
const ALL_RECIPES: EnvironmentRecipes = { ...FNCALL_IMAGE_RECIPES, ...SANDBOXFUSION_IMAGE_RECIPES };

function imagesToBuild(images: readonly string[] | undefined): string[] {
  if (images === undefined) return Object.keys(FNCALL_IMAGE_RECIPES);
  const out = new Set(['fncall-base']);
  for (const name of images) {
    if (name === 'sandboxfusion') {
      for (const n of Object.keys(SANDBOXFUSION_IMAGE_RECIPES)) out.add(n);
    } else if (name in ALL_RECIPES) out.add(name);
    else
      throw new DsecError('invalid_argument', `no FnCall image ${JSON.stringify(name)}`, {
        field: 'images',
      });
  }
  return [...out];
}

/**
 * Builds the runtime images of the default FnCall runtimes (python, node,
 * bash) into `store`, only when missing or built from another recipe: a
 * second call builds nothing. Needs root and the Debian mirror the first time
 * (debootstrap, a few minutes).
 */
export async function prepareFnCallImages(
  store: ImageStore,
  options: PrepareFnCallImagesOptions,
): Promise<{ layers: LayerInfo[]; built: string[] }> {
  const layers: LayerInfo[] = [];
  const built: string[] = [];
  for (const name of imagesToBuild(options.images)) {
    const r = await ensureEnvironment(store, name, ALL_RECIPES, {
      cacheDir: options.cacheDir,
      ...(options.signal ? { signal: options.signal } : {}),
      ...(options.onProgress ? { onProgress: options.onProgress } : {}),
    });
    layers.push(r.layer);
    if (r.built) built.push(name);
  }
  return { layers, built };
}
