import { toDsecError, type DsecError } from '@dsec/core';
import { importTaskImages, resolveTaskImage, type TaskImage } from '@dsec/eval';
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

/**
 * Each instance's image under an `--image` value (`resolveTaskImage`): a
 * `docker://` template gives the layer and the reference to import it from,
 * a local layer template the layer alone. A malformed template or instance
 * ID is the `DsecError` of that instance (one bad ID fails one task).
 *
 * @example
 * ```ts
 * const images = taskImagesOf(tasks.map((t) => t.instance_id), opts.image);
 * const sources = [...images.values()].flatMap((i) => ('source' in i && i.source ? [i.source] : []));
 * const imported = await prepareTaskImages(ctx, sources, { concurrency: opts.concurrency });
 * // a task whose source maps to a DsecError gets a result line with that error's code
 * ```
 */
export function taskImagesOf(
  instanceIds: Iterable<string>,
  template: string,
): Map<string, TaskImage | DsecError> {
  const out = new Map<string, TaskImage | DsecError>();
  for (const id of instanceIds) {
    try {
      out.set(id, resolveTaskImage(template, id));
    } catch (err) {
      out.set(id, toDsecError(err));
    }
  }
  return out;
}
