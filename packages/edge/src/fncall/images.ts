import type { ImageStore, LayerInfo } from '@dsec/core';
import { ensureEnvironment, type EnvironmentProgress, type EnvironmentRecipes } from '@dsec/images';

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
  for (const name of Object.keys(FNCALL_IMAGE_RECIPES)) {
    const r = await ensureEnvironment(store, name, FNCALL_IMAGE_RECIPES, {
      cacheDir: options.cacheDir,
      ...(options.signal ? { signal: options.signal } : {}),
      ...(options.onProgress ? { onProgress: options.onProgress } : {}),
    });
    layers.push(r.layer);
    if (r.built) built.push(name);
  }
  return { layers, built };
}
