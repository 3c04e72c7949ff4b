import type { DsecError } from '@dsec/core';
import { importTaskImages } from '@dsec/eval';
import type { CliContext } from '../context.js';
import { createProgress } from '../progress.js';
import { cliRegistrySettings } from '../registries.js';
import { localStore } from '../stores.js';
import { layerMounter } from './image-manage.js';

export interface PrepareTaskImagesOptions {
  /** Images imported at once (`--concurrency`; default 4). */
  concurrency?: number | undefined;
  /** A cluster config file whose `registries` section applies (`--config`; else `DSEC_CONFIG`). */
  config?: string | undefined;
}

/**
 * `dsec eval prepare`'s image step: imports every distinct `docker://`
 * image of `refs` into the node's local store (what `importTaskImages`
 * does: present ones cost a lookup, shared layers are converted once),
 * with one progress bar over the images on stderr and a line per failure.
 * Returns, per reference, the local layer (`name:version`) or the error
 * that image met, for the caller to record against the tasks that use it.
 */
export async function prepareTaskImages(
  ctx: CliContext,
  refs: Iterable<string>,
  options: PrepareTaskImagesOptions = {},
): Promise<Map<string, string | DsecError>> {
  const registries = await cliRegistrySettings(ctx, options.config);
  const wanted = [...new Set(refs)];
  const bar = createProgress({
    label: 'importing task images',
    total: wanted.length,
    enabled: !ctx.json,
  });
  try {
    return await importTaskImages(wanted, {
      store: localStore(ctx),
      registries,
      mounter: layerMounter(ctx),
      env: ctx.io.env,
      ...(options.concurrency !== undefined ? { concurrency: options.concurrency } : {}),
      ...(ctx.signal ? { signal: ctx.signal } : {}),
      onProgress: (p) => {
        if (p.state === 'importing') return;
        bar.update(p.done, p.total);
        if (p.state === 'failed' && !ctx.json) {
          ctx.err(
            `image ${p.ref}: ${p.error?.message ?? 'failed'} [${p.error?.code ?? 'internal'}]`,
          );
        }
      },
    });
  } finally {
    bar.done();
  }
}
