import { join } from 'node:path';
import type { ImageStore } from '@dsec/core';
import { DirImageStore, openImageStore } from '@dsec/images';
import type { CliContext } from './context.js';

/**
 * The node's own image store: `--image-store` / DSEC_IMAGE_STORE (the same
 * location `dsec up` serves from), else `<state-dir>/images`.
 */
export function localStore(ctx: CliContext): ImageStore {
  const { imageStore, stateDir } = ctx.options;
  if (!imageStore) return new DirImageStore(join(stateDir, 'images'));
  return openImageStore(imageStore, { cacheDir: join(stateDir, 'image-cache') });
}
