import { createHash } from 'node:crypto';
import { DsecError, isDsecError, type ImageStore } from '@dsec/core';

/**
 * Instance images named by a template, the way SWE-bench names them:
 * `docker://REGISTRY/swebench/sweb.eval.x86_64.{id}:latest`, `{id}` the
 * instance ID with `__` written `_1776_`, lower case
 * (`django__django-11099` → `django_1776_django-11099`). Each distinct
 * reference becomes one DSec base layer, imported on first use.
 *
 * The import itself is a `TaskImageImporter`: the registry import
 * (`packages/eval/src/task-images.ts`, the registry helper's part of issue
 * 25) plugs in there; `registryImporter` below is the plain
 * `importFromRegistry` call it stands in for.
 */

/** SWE-bench's image-name form of an instance ID. */
export function swebenchImageKey(instanceId: string): string {
  return instanceId.replaceAll('__', '_1776_').toLowerCase();
}

/** The `docker://` reference a template gives an instance (`{id}` required). */
export function instanceImageRef(template: string, instanceId: string): string {
  if (!template.includes('{id}')) {
    throw new DsecError('invalid_argument', `--image ${template} must contain {id}`, {
      field: 'image',
    });
  }
  const ref = template.replaceAll('{id}', swebenchImageKey(instanceId));
  if (!ref.startsWith('docker://')) {
    throw new DsecError('invalid_argument', `--image ${template} must start with docker://`, {
      field: 'image',
    });
  }
  return ref;
}

/**
 * The DSec layer a reference is imported as: the repository's last part
 * (cut to fit) and 10 hex digits of the whole reference, so two registries'
 * images of one name stay apart and the same reference always maps to the
 * same layer.
 */
export function layerNameForRef(ref: string): string {
  const path = ref.replace(/^docker:\/\//, '').replace(/[@:][^/]*$/, '');
  const last = (path.split('/').at(-1) ?? 'image')
    .toLowerCase()
    .replace(/[^a-z0-9._-]+/g, '-')
    .replace(/^[^a-z0-9]+/, '');
  const hash = createHash('sha256').update(ref).digest('hex').slice(0, 10);
  return `${(last || 'image').slice(0, 100)}-${hash}`;
}

/** Imports one reference as the base layer `name` (idempotent: reused layers are not pulled again). */
export type TaskImageImporter = (
  ref: string,
  name: string,
  options: { signal?: AbortSignal | undefined },
) => Promise<unknown>;

export interface EnsureImagesOptions {
  store: ImageStore;
  importer: TaskImageImporter;
  /** Imports at once (default 4). */
  concurrency?: number | undefined;
  onProgress?: ((p: { done: number; total: number; ref: string }) => void) | undefined;
  signal?: AbortSignal | undefined;
}

/**
 * Makes sure each reference is a layer in the store, importing the missing
 * ones `concurrency` at a time. Never throws for one image: the map holds
 * each failed reference's error (`image_not_found`, `unavailable`,
 * `permission_denied` as the import classified it), the rest are imported.
 */
export async function ensureInstanceImages(
  refs: Iterable<string>,
  options: EnsureImagesOptions,
): Promise<Map<string, DsecError>> {
  const todo = [...new Set(refs)];
  const failed = new Map<string, DsecError>();
  let next = 0;
  let done = 0;
  const worker = async () => {
    while (next < todo.length) {
      const ref = todo[next++]!;
      const name = layerNameForRef(ref);
      try {
        const present = await options.store.getLayer(name).catch((err: unknown) => {
          if (isDsecError(err, 'image_not_found')) return undefined;
          throw err;
        });
        if (!present) await options.importer(ref, name, { signal: options.signal });
      } catch (err) {
        if (options.signal?.aborted) throw err;
        failed.set(
          ref,
          isDsecError(err)
            ? err
            : new DsecError('internal', `importing ${ref}: ${(err as Error).message}`, {
                cause: err,
              }),
        );
      }
      done++;
      options.onProgress?.({ done, total: todo.length, ref });
    }
  };
  const n = Math.max(1, Math.min(options.concurrency ?? 4, todo.length));
  await Promise.all(Array.from({ length: n }, worker));
  return failed;
}
