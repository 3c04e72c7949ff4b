/**
 * Task images by convention (issue 25, "Environments by convention"): a
 * template such as `docker://REGISTRY/swebench/sweb.eval.x86_64.{id}:latest`
 * names each instance's image the way SWE-bench's harness names it, and
 * `importTaskImages` brings the images a batch needs into the local image
 * store on first use, through the registry import (layers shared between
 * instances are converted once, by diff ID), reporting per image so that
 * one missing image fails one task, not the batch.
 */
import { createHash } from 'node:crypto';
import {
  DsecError,
  isDsecError,
  LAYER_NAME_PATTERN,
  LAYER_VERSION_PATTERN,
  throwIfAborted,
  toDsecError,
  type ImageStore,
} from '@dsec/core';
import {
  importFromRegistry,
  type ErofsMounter,
  type ImportRegistryOptions,
  type RegistrySettings,
} from '@dsec/images';

/** Where `{id}` goes in an image template. */
export const INSTANCE_ID_PLACEHOLDER = '{id}';
/** Images imported at once by default: each is a skopeo pull plus an mkfs on 2+ cores. */
export const DEFAULT_IMAGE_CONCURRENCY = 4;
/** Longest image reference (template or result) accepted: Docker's own limit on a name is 255. */
export const MAX_IMAGE_REF_CHARS = 512;
/** Longest instance ID accepted (SWE-bench's longest are under 60). */
export const MAX_INSTANCE_ID_CHARS = 128;

// SWE-bench's IDs: `owner__repo-number`; letters, digits, `.`, `_`, `-`.
const INSTANCE_ID = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
// docker://HOST[:PORT]/PATH[:TAG]: the same grammar `importFromRegistry` takes.
const HOST =
  /^(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+|[a-z0-9-]+(?:\.[a-z0-9-]+)*:\d{1,5}|\[[0-9a-f:.]+\](?::\d{1,5})?)$/i;
const PATH_PART = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const TAG = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$/;

/** A parsed `docker://HOST/REPO[:TAG|@sha256:…]` image reference. */
export interface DockerImageRef {
  /** The whole reference, `docker://…`. */
  ref: string;
  host: string;
  /** The repository path below the host (`swebench/sweb.eval.x86_64.x`). */
  repository: string;
  /** The tag (default `latest`) or the digest (`sha256:…`). */
  tag?: string | undefined;
  digest?: string | undefined;
}

/**
 * Parses and checks `docker://HOST[:PORT]/REPO[:TAG|@sha256:DIGEST]`: the
 * host spelled out (never a bare name that search rules would send to
 * Docker Hub), each path component in Docker's grammar (no `..`, no empty
 * component), at most `MAX_IMAGE_REF_CHARS`. `invalid_argument` naming
 * `field` otherwise.
 */
export function parseDockerImageRef(text: string, field = 'image'): DockerImageRef {
  const fail = (why: string): never => {
    throw new DsecError(
      'invalid_argument',
      `${field}: ${JSON.stringify(text.slice(0, 120))} ${why} (want docker://HOST[:PORT]/REPO[:TAG])`,
      { field },
    );
  };
  if (typeof text !== 'string') return fail('is not a string');
  if (text.length > MAX_IMAGE_REF_CHARS) return fail(`is longer than ${MAX_IMAGE_REF_CHARS}`);
  if (!text.startsWith('docker://')) return fail('is not a docker:// reference');
  const rest = text.slice('docker://'.length);
  const slash = rest.indexOf('/');
  if (slash <= 0) return fail('names no repository');
  const host = rest.slice(0, slash);
  if (!HOST.test(host)) return fail('has no registry host');
  let path = rest.slice(slash + 1);
  let tag: string | undefined;
  let digest: string | undefined;
  const at = path.indexOf('@');
  if (at >= 0) {
    digest = path.slice(at + 1);
    path = path.slice(0, at);
    if (!/^sha256:[0-9a-f]{64}$/.test(digest)) return fail('has a malformed digest');
  } else {
    const colon = path.lastIndexOf(':');
    if (colon >= 0) {
      tag = path.slice(colon + 1);
      path = path.slice(0, colon);
      if (!TAG.test(tag)) return fail('has a malformed tag');
    }
  }
  if (path.split('/').some((p) => !PATH_PART.test(p))) return fail('has a malformed repository');
  return {
    ref: text,
    host: host.toLowerCase(),
    repository: path,
    ...(tag !== undefined ? { tag } : {}),
    ...(digest !== undefined ? { digest } : {}),
  };
}

/**
 * The instance ID as SWE-bench writes it in an image name: `__` becomes
 * `_1776_`, then lower case (`astropy__astropy-12907` →
 * `astropy_1776_astropy-12907`). `invalid_argument` (field `instance_id`)
 * for an ID that is empty, longer than `MAX_INSTANCE_ID_CHARS`, or holds
 * anything but letters, digits, `.`, `_`, `-` (a `/`, `:`, `@` or `..` could
 * steer the reference to another repository or registry).
 */
export function swebenchImageKey(instanceId: string): string {
  if (
    typeof instanceId !== 'string' ||
    instanceId.length > MAX_INSTANCE_ID_CHARS ||
    !INSTANCE_ID.test(instanceId) ||
    instanceId.includes('..')
  ) {
    throw new DsecError(
      'invalid_argument',
      `instance_id ${JSON.stringify(String(instanceId).slice(0, 80))} cannot name an image: want 1-${MAX_INSTANCE_ID_CHARS} of A-Z a-z 0-9 . _ - (no "..")`,
      { field: 'instance_id' },
    );
  }
  return instanceId.replaceAll('__', '_1776_').toLowerCase();
}

/** Whether an `--image` value is a template naming one image per instance. */
export function isImageTemplate(text: string): boolean {
  return text.includes(INSTANCE_ID_PLACEHOLDER);
}

/**
 * The image of one instance: `template` with `{id}` replaced by
 * `swebenchImageKey(instanceId)`. The template must be a `docker://`
 * reference with `{id}` in its repository path only (never in the host, tag
 * or digest); the result is parsed and checked again. A template without
 * `{id}` is returned as it is, checked (every instance then shares it).
 * `invalid_argument` naming `image` or `instance_id`.
 */
export function swebenchImageRef(template: string, instanceId: string): string {
  checkTemplate(template);
  const key = swebenchImageKey(instanceId);
  const ref = template.replaceAll(INSTANCE_ID_PLACEHOLDER, key);
  const parsed = parseDockerImageRef(ref, 'image');
  const tplHost = template.slice('docker://'.length).split('/')[0]!;
  if (parsed.host !== tplHost.toLowerCase()) {
    throw new DsecError('invalid_argument', 'image: the instance ID changed the registry host', {
      field: 'image',
    });
  }
  return parsed.ref;
}

/**
 * Checks an `--image` template once, before any instance: a `docker://`
 * reference, `{id}` only in the repository path, at most a few times, and
 * at least once in its last component (which names the local layer, so
 * that two instances never share one).
 */
export function checkTemplate(template: string): void {
  if (typeof template !== 'string' || template.length > MAX_IMAGE_REF_CHARS) {
    throw new DsecError(
      'invalid_argument',
      `image: a template is at most ${MAX_IMAGE_REF_CHARS} characters`,
      {
        field: 'image',
      },
    );
  }
  const count = template.split(INSTANCE_ID_PLACEHOLDER).length - 1;
  if (count > 4) {
    throw new DsecError('invalid_argument', 'image: {id} appears more than 4 times', {
      field: 'image',
    });
  }
  // With a harmless stand-in for {id}, the template must already be a valid
  // reference, and {id} must sit between the host's `/` and the tag's `:`.
  const probe = parseDockerImageRef(template.replaceAll(INSTANCE_ID_PLACEHOLDER, 'x'), 'image');
  if (count === 0) return;
  const rest = template.slice('docker://'.length);
  const pathStart = rest.indexOf('/') + 1;
  const tagAt = probe.digest !== undefined ? rest.indexOf('@') : rest.lastIndexOf(':');
  const pathEnd = tagAt > pathStart ? tagAt : rest.length;
  for (
    let i = rest.indexOf(INSTANCE_ID_PLACEHOLDER);
    i >= 0;
    i = rest.indexOf(INSTANCE_ID_PLACEHOLDER, i + 1)
  ) {
    if (i < pathStart || i + INSTANCE_ID_PLACEHOLDER.length > pathEnd) {
      throw new DsecError('invalid_argument', 'image: {id} may only stand in the repository path', {
        field: 'image',
      });
    }
  }
  // The local layer is named after the last component (`taskImageLayerRef`): without {id}
  // there, every instance would share the first one's image.
  const last = rest.slice(rest.lastIndexOf('/', pathEnd - 1) + 1, pathEnd);
  if (!last.includes(INSTANCE_ID_PLACEHOLDER)) {
    throw new DsecError(
      'invalid_argument',
      "image: {id} must stand in the repository's last component (the local layer is named after it), as in docker://HOST/swebench/sweb.eval.x86_64.{id}:latest",
      { field: 'image' },
    );
  }
}

/**
 * The local layer an image reference is imported as: its repository's last
 * component as the name and its tag as the version
 * (`docker://r/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest` →
 * `sweb.eval.x86_64.astropy_1776_astropy-12907:latest`; a digest becomes
 * `sha256-<first 32 hex>`). A name the store would refuse (too long) becomes
 * `img-<sha256 of the reference, 32 hex>` so every reference still has one.
 * Deterministic: the same reference always names the same layer, which is how
 * a second run finds it imported.
 */
export function taskImageLayerRef(ref: string): string {
  const parsed = parseDockerImageRef(ref, 'image');
  const last = parsed.repository.split('/').pop()!;
  const version =
    parsed.digest !== undefined
      ? `sha256-${parsed.digest.slice('sha256:'.length, 'sha256:'.length + 32)}`
      : (parsed.tag ?? 'latest');
  const name = LAYER_NAME_PATTERN.test(last)
    ? last
    : `img-${createHash('sha256').update(ref).digest('hex').slice(0, 32)}`;
  if (!LAYER_VERSION_PATTERN.test(version)) {
    throw new DsecError('invalid_argument', `image: ${ref} has a tag no layer version can hold`, {
      field: 'image',
    });
  }
  return `${name}:${version}`;
}

/** Where an instance's image comes from: a local layer, and the registry reference it is imported from. */
export interface TaskImage {
  /** The local layer (`name:version`) the sandbox starts from. */
  layer: string;
  /** The `docker://` reference it is imported from on first use; absent for a local layer template. */
  source?: string | undefined;
}

/**
 * An instance's image from an `--image` value: a `docker://` template (see
 * `swebenchImageRef`) is imported as `taskImageLayerRef(ref)`; anything else
 * is a local layer template (`sweb.eval.x86_64.{id}:latest`, a layer built or
 * imported beforehand, `dsec image import NAME --from-oci …`) whose `{id}`
 * becomes `swebenchImageKey(instanceId)`, checked as a layer reference.
 * `invalid_argument` naming `image` or `instance_id`.
 */
export function resolveTaskImage(template: string, instanceId: string): TaskImage {
  if (template.startsWith('docker://')) {
    const source = swebenchImageRef(template, instanceId);
    return { layer: taskImageLayerRef(source), source };
  }
  if (typeof template !== 'string' || template.length > 256) {
    throw new DsecError('invalid_argument', 'image: a layer template is at most 256 characters', {
      field: 'image',
    });
  }
  const layer = template.replaceAll(INSTANCE_ID_PLACEHOLDER, swebenchImageKey(instanceId));
  const i = layer.lastIndexOf(':');
  const name = i < 0 ? layer : layer.slice(0, i);
  const version = i < 0 ? 'latest' : layer.slice(i + 1);
  if (!LAYER_NAME_PATTERN.test(name) || !LAYER_VERSION_PATTERN.test(version)) {
    throw new DsecError(
      'invalid_argument',
      `image: ${JSON.stringify(layer.slice(0, 120))} is not a layer NAME[:VERSION] (or a docker:// reference)`,
      { field: 'image' },
    );
  }
  return { layer: `${name}:${version}` };
}

/** One image's progress in `importTaskImages`. */
export interface TaskImageProgress {
  ref: string;
  layer: string;
  /** `present`: already in the store, nothing done; `imported`; `failed`. */
  state: 'importing' | 'present' | 'imported' | 'failed';
  /** Images settled so far, and in all. */
  done: number;
  total: number;
  error?: DsecError | undefined;
}

export interface ImportTaskImagesOptions {
  store: ImageStore;
  /** The node's registry settings (`registrySettings`; the CLI's `cliRegistrySettings`). */
  registries?: RegistrySettings | undefined;
  /** Mounts stored per-layer EROFS images to copy reused layers out of them. */
  mounter: ErofsMounter;
  /** Images imported at once (default `DEFAULT_IMAGE_CONCURRENCY`, 4; at most 64). */
  concurrency?: number | undefined;
  /** Where `DSEC_REGISTRY_USERNAME`/`PASSWORD` and the like are read (default `process.env`). */
  env?: NodeJS.ProcessEnv | undefined;
  /** Per image: its import's deadline (default the import's own, an hour). */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
  onProgress?: ((p: TaskImageProgress) => void) | undefined;
  /** Passed to each import (tests: a smaller `maxBytes`, `compress`). */
  importOptions?: Pick<ImportRegistryOptions, 'maxBytes' | 'maxLayers' | 'compress' | 'insecure'>;
}

/**
 * Brings each distinct `docker://` reference of `refs` into `store` as a
 * base layer named by `taskImageLayerRef`, at most `concurrency` at a time,
 * and returns, per reference, the layer ref (`name:version`) or the
 * `DsecError` that reference met (`image_not_found` for a missing tag,
 * `unavailable` for an unreachable registry, `invalid_argument` for a
 * malformed reference or an image that cannot be imported,
 * `permission_denied`, `resource_exhausted`, `deadline_exceeded`): errors
 * are per image, never thrown, so one missing image fails one task.
 *
 * A layer already in the store is not imported again (one record lookup,
 * no registry traffic); an import shares converted layers with earlier ones
 * by diff ID. Throws only when `signal` aborts (`aborted`) or the options are
 * malformed.
 */
export async function importTaskImages(
  refs: Iterable<string>,
  options: ImportTaskImagesOptions,
): Promise<Map<string, string | DsecError>> {
  const concurrency = options.concurrency ?? DEFAULT_IMAGE_CONCURRENCY;
  if (!Number.isSafeInteger(concurrency) || concurrency < 1 || concurrency > 64) {
    throw new DsecError('invalid_argument', 'concurrency must be an integer from 1 to 64', {
      field: 'concurrency',
    });
  }
  const { signal } = options;
  const distinct = [...new Set(refs)];
  const results = new Map<string, string | DsecError>();
  let done = 0;
  const report = (p: Omit<TaskImageProgress, 'done' | 'total'>): void =>
    options.onProgress?.({ ...p, done, total: distinct.length });
  type Outcome = { result: string | DsecError; state: 'present' | 'imported' | 'failed' };
  // One import per layer name at a time: two references that map to the
  // same layer (the same tag through two spellings) must not race its build.
  const byLayer = new Map<string, Promise<Outcome>>();

  const one = async (ref: string): Promise<Outcome> => {
    let layer: string;
    try {
      layer = taskImageLayerRef(ref);
    } catch (err) {
      return { result: toDsecError(err), state: 'failed' };
    }
    const prior = byLayer.get(layer);
    if (prior) return await prior;
    const work = (async (): Promise<Outcome> => {
      try {
        if (await present(options.store, layer)) return { result: layer, state: 'present' };
        report({ ref, layer, state: 'importing' });
        const [name, version] = splitRef(layer);
        const attempt = () =>
          importFromRegistry(options.store, {
            source: ref,
            name,
            version,
            kind: 'base',
            mounter: options.mounter,
            ...(options.registries ? { registries: options.registries } : {}),
            ...(options.env ? { env: options.env } : {}),
            ...(options.timeoutMs !== undefined ? { timeoutMs: options.timeoutMs } : {}),
            ...options.importOptions,
            ...(signal ? { signal } : {}),
          });
        try {
          await attempt();
        } catch (err) {
          // Another process (or a concurrent import sharing a layer) stored the
          // same record first: what it stored is what this import would have.
          if (!isDsecError(err, 'conflict')) throw err;
          if (!(await present(options.store, layer))) await attempt();
        }
        return { result: layer, state: 'imported' };
      } catch (err) {
        if (signal?.aborted) throw err;
        return { result: toDsecError(err), state: 'failed' };
      }
    })();
    byLayer.set(layer, work);
    return await work;
  };

  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < distinct.length) {
      throwIfAborted(signal);
      const ref = distinct[next++]!;
      const { result, state } = await one(ref);
      results.set(ref, result);
      done++;
      report({
        ref,
        layer: typeof result === 'string' ? result : '',
        state,
        ...(typeof result === 'string' ? {} : { error: result }),
      });
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, distinct.length) }, worker));
  // In the order given, whatever order the imports finished in.
  return new Map(distinct.map((r) => [r, results.get(r)!]));
}

async function present(store: ImageStore, layer: string): Promise<boolean> {
  return await store.getLayer(layer).then(
    () => true,
    (err: unknown) => {
      if (isDsecError(err, 'image_not_found')) return false;
      throw err;
    },
  );
}

function splitRef(layer: string): [string, string] {
  const i = layer.lastIndexOf(':');
  return [layer.slice(0, i), layer.slice(i + 1)];
}
