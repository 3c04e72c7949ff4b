import type { ImageConfig, LayerInfo } from '@dsec/core';

/** Most `Env` entries of an image config a sandbox takes (the import refuses more). */
export const MAX_IMAGE_ENV_ENTRIES = 1024;
/** Most bytes of `Env` entries, all together, a sandbox takes. */
export const MAX_IMAGE_ENV_BYTES = 256 * 1024;

/** What an image's own config gives every command of a sandbox made from it. */
export interface ImageDefaults {
  /** The image's `Env` (`K=V` entries), under the sandbox's and the call's own. */
  env: Record<string, string>;
  /** The image's `WorkingDir`: where a command runs unless it names a `cwd`. */
  cwd?: string | undefined;
}

const cache = new WeakMap<readonly LayerInfo[], ImageDefaults>();

/**
 * The defaults of a sandbox's base image (the bottom `base` layer of its
 * stack, as `docker run` takes them from the image config): `Env` and
 * `WorkingDir`. An entry without `=`, with a name that is not a plain
 * variable name, or past `MAX_IMAGE_ENV_ENTRIES`/`MAX_IMAGE_ENV_BYTES` is
 * left out (the store checked the record's shape, not its sizes, and a
 * layer record may predate the import's checks); a `WorkingDir` that is not
 * an absolute path is ignored. Resolved once per record.
 */
export function imageDefaults(layers: readonly LayerInfo[]): ImageDefaults {
  const hit = cache.get(layers);
  if (hit) return hit;
  const base = layers.find((l) => l.kind === 'base');
  const out = fromConfig(base?.config);
  cache.set(layers, out);
  return out;
}

function fromConfig(config: ImageConfig | undefined): ImageDefaults {
  const env: Record<string, string> = Object.create(null) as Record<string, string>;
  let bytes = 0;
  let count = 0;
  for (const entry of config?.env ?? []) {
    if (count >= MAX_IMAGE_ENV_ENTRIES) break;
    const eq = entry.indexOf('=');
    if (eq <= 0) continue;
    const name = entry.slice(0, eq);
    if (!/^[A-Za-z_][A-Za-z0-9_]{0,255}$/.test(name)) continue;
    bytes += entry.length;
    if (bytes > MAX_IMAGE_ENV_BYTES || entry.includes('\0')) break;
    env[name] = entry.slice(eq + 1);
    count++;
  }
  const dir = config?.workingDir;
  const cwd =
    dir !== undefined && dir.startsWith('/') && dir.length <= 4096 && !dir.includes('\0')
      ? dir
      : undefined;
  return { env: { ...env }, ...(cwd !== undefined ? { cwd } : {}) };
}
