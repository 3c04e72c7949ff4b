import { join } from 'node:path';
import type { ImageStore } from '@dsec/core';
import { ensureDir, PRIVATE_DIR_MODE, TRAVERSE_DIR_MODE } from '@dsec/edge';
import { DirImageStore, openImageStore } from '@dsec/images';
import type { CliContext } from './context.js';

/**
 * The node's own image store: `--image-store` / DSEC_IMAGE_STORE (the same
 * location `dsec up` serves from), else `<state-dir>/images`. Made here with
 * the modes `dsec up` keeps them in (docs/adr/0010-private-host-state.md), so
 * that a build before the first `dsec up` leaves nothing readable by others.
 */
export function localStore(ctx: CliContext): ImageStore {
  const { imageStore, stateDir } = ctx.options;
  ensureDir(stateDir, TRAVERSE_DIR_MODE);
  const dir = imageStore ? join(stateDir, 'image-cache') : join(stateDir, 'images');
  ensureDir(dir, PRIVATE_DIR_MODE);
  if (!imageStore) return new DirImageStore(dir);
  return openImageStore(imageStore, { cacheDir: dir });
}
