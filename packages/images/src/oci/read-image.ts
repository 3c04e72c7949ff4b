import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { readFile, stat } from 'node:fs/promises';
import { isAbsolute, join, normalize } from 'node:path';
import { DsecError, throwIfAborted, type ImageConfig } from '@dsec/core';

/** What an OCI image layout or a docker-archive says the image is. */
export interface OciImage {
  format: 'oci-layout' | 'docker-archive';
  /** Layer tarballs (possibly compressed), bottom first. */
  layers: string[];
  config: ImageConfig;
  /**
   * The config's `rootfs.diff_ids` (sha256 of each layer's uncompressed tar),
   * bottom first; empty when the config lists none or not one per layer.
   */
  diffIds: string[];
  /** Each layer's media type (OCI layout only; empty for a docker-archive). */
  layerMediaTypes: string[];
}

const INDEX_TYPES = new Set([
  'application/vnd.oci.image.index.v1+json',
  'application/vnd.docker.distribution.manifest.list.v2+json',
]);
const REF_ANNOTATION = 'org.opencontainers.image.ref.name';

interface Descriptor {
  mediaType?: string;
  digest: string;
  size?: number;
  annotations?: Record<string, string>;
  platform?: { os?: string; architecture?: string; variant?: string };
}

/**
 * Reads an unpacked OCI image layout (`oci-layout`, `index.json`, `blobs/`)
 * or an unpacked docker-archive (`manifest.json` naming config and layer
 * files, as `docker save`/`podman save` write). `ref` picks an image by tag
 * when the layout holds several; otherwise the one for this host's platform,
 * else the first. Blobs of an OCI layout are checked against their digests.
 */
export async function readOciImage(
  root: string,
  options: { ref?: string | undefined; signal?: AbortSignal | undefined } = {},
): Promise<OciImage> {
  const dockerManifest = await readJson(join(root, 'manifest.json')).catch(() => undefined);
  if (Array.isArray(dockerManifest))
    return await readDockerArchive(root, dockerManifest, options.ref);
  const index = await readJson(join(root, 'index.json')).catch(() => undefined);
  if (index === undefined) {
    throw new DsecError(
      'invalid_argument',
      `${root} is neither an OCI image layout (index.json) nor a docker-archive (manifest.json)`,
      { field: 'path' },
    );
  }
  return await readOciLayout(root, index, options);
}

async function readDockerArchive(
  root: string,
  manifest: unknown[],
  ref: string | undefined,
): Promise<OciImage> {
  const entries = manifest as { Config?: unknown; Layers?: unknown; RepoTags?: unknown }[];
  const entry =
    ref === undefined
      ? entries[0]
      : entries.find(
          (e) =>
            Array.isArray(e.RepoTags) &&
            e.RepoTags.some((t) => t === ref || String(t).endsWith(`/${ref}`)),
        );
  if (!entry) {
    throw new DsecError(
      'invalid_argument',
      `no image ${ref ?? ''} in docker-archive manifest.json`,
      {
        field: 'ref',
      },
    );
  }
  if (typeof entry.Config !== 'string' || !Array.isArray(entry.Layers)) {
    throw bad('docker-archive manifest.json entry lacks Config or Layers');
  }
  const config = await readJson(inside(root, entry.Config));
  const layers = (entry.Layers as unknown[]).map((l) => {
    if (typeof l !== 'string') throw bad('docker-archive layer paths must be strings');
    return inside(root, l);
  });
  for (const l of layers) await mustBeFile(l);
  return {
    format: 'docker-archive',
    layers,
    config: imageConfig(config),
    diffIds: diffIdsOf(config, layers.length),
    layerMediaTypes: [],
  };
}

async function readOciLayout(
  root: string,
  index: unknown,
  options: { ref?: string | undefined; signal?: AbortSignal | undefined },
): Promise<OciImage> {
  let manifests = descriptors((index as { manifests?: unknown }).manifests, 'index.json manifests');
  if (options.ref !== undefined) {
    manifests = manifests.filter((d) => d.annotations?.[REF_ANNOTATION] === options.ref);
    if (manifests.length === 0) {
      throw new DsecError('invalid_argument', `no image tagged ${options.ref} in the layout`, {
        field: 'ref',
      });
    }
  }
  let desc = pickPlatform(manifests);
  // Follow nested indexes (a multi-platform image) down to one manifest.
  for (let depth = 0; desc && INDEX_TYPES.has(desc.mediaType ?? ''); depth++) {
    if (depth > 4) throw bad('image index nesting is too deep');
    const nested = await readBlobJson(root, desc, options.signal);
    desc = pickPlatform(
      descriptors((nested as { manifests?: unknown }).manifests, 'index manifests'),
    );
  }
  if (!desc) throw bad('the image layout lists no manifest');
  const manifest = (await readBlobJson(root, desc, options.signal)) as {
    config?: unknown;
    layers?: unknown;
  };
  const [configDesc] = descriptors([manifest.config], 'manifest config');
  const config = await readBlobJson(root, configDesc!, options.signal);
  const layers: string[] = [];
  const layerMediaTypes: string[] = [];
  for (const layer of descriptors(manifest.layers, 'manifest layers')) {
    layers.push(await verifiedBlob(root, layer, options.signal));
    layerMediaTypes.push(layer.mediaType ?? '');
  }
  return {
    format: 'oci-layout',
    layers,
    config: imageConfig(config),
    diffIds: diffIdsOf(config, layers.length),
    layerMediaTypes,
  };
}

function pickPlatform(list: Descriptor[]): Descriptor | undefined {
  const arch = { x64: 'amd64', arm64: 'arm64', arm: 'arm', ppc64: 'ppc64le', s390x: 's390x' }[
    process.arch as string
  ];
  return (
    list.find((d) => d.platform?.os === 'linux' && d.platform.architecture === arch) ??
    list.find((d) => d.platform === undefined) ??
    list[0]
  );
}

function descriptors(value: unknown, what: string): Descriptor[] {
  if (!Array.isArray(value)) throw bad(`${what} must be an array`);
  return value.map((d: unknown) => {
    const desc = d as Descriptor | undefined;
    if (typeof desc?.digest !== 'string' || !/^sha256:[0-9a-f]{64}$/.test(desc.digest)) {
      throw bad(`${what}: a descriptor lacks a sha256 digest`);
    }
    return desc;
  });
}

async function readBlobJson(
  root: string,
  desc: Descriptor,
  signal?: AbortSignal,
): Promise<unknown> {
  return await readJson(await verifiedBlob(root, desc, signal));
}

async function verifiedBlob(root: string, desc: Descriptor, signal?: AbortSignal): Promise<string> {
  throwIfAborted(signal);
  const path = join(root, 'blobs', 'sha256', desc.digest.slice('sha256:'.length));
  await mustBeFile(path);
  const hash = createHash('sha256');
  for await (const chunk of createReadStream(path, { signal })) hash.update(chunk as Buffer);
  if (`sha256:${hash.digest('hex')}` !== desc.digest) {
    throw bad(`blob ${desc.digest} does not match its digest`);
  }
  return path;
}

/** The config's `rootfs.diff_ids` when it lists one valid ID per layer; else empty. */
export function diffIdsOf(config: unknown, layers: number): string[] {
  const ids = (config as { rootfs?: { diff_ids?: unknown } } | undefined)?.rootfs?.diff_ids;
  if (!Array.isArray(ids) || ids.length !== layers) return [];
  return ids.every((d) => typeof d === 'string' && /^sha256:[0-9a-f]{64}$/.test(d))
    ? (ids as string[])
    : [];
}

/** Most entries of an image config's `Env`, `Cmd` or `Entrypoint` an import takes. */
export const MAX_CONFIG_ENTRIES = 1024;
/** Most bytes of one of those lists, all entries together. */
export const MAX_CONFIG_LIST_BYTES = 256 * 1024;
// `name`, `uid`, `name:group`, `uid:gid`: what `docker run --user` takes, and nothing path-like.
const CONFIG_USER = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})?$/;

/**
 * The parts of an OCI/docker image config a sandbox uses. The config is the
 * registry's (or the archive's) word: `Env`, `Cmd` and `Entrypoint` are
 * bounded (`MAX_CONFIG_ENTRIES`, `MAX_CONFIG_LIST_BYTES`, each `Env` entry
 * `NAME=value` without NUL), `User` must be a user or uid (optionally with
 * `:group`), never a path, and `WorkingDir` an absolute path of at most 4096
 * bytes without NUL. Anything else is `invalid_argument` naming the field
 * (`config.Env`, …) with `details.reason` `image_config`: the image is
 * refused, rather than run with half its config.
 */
export function imageConfig(value: unknown): ImageConfig {
  const c = (value as { config?: Record<string, unknown> } | undefined)?.config ?? {};
  const refuse = (field: string, why: string): never => {
    throw new DsecError('invalid_argument', `the image config's ${field} ${why}`, {
      field: `config.${field}`,
      details: { reason: 'image_config' },
    });
  };
  const strings = (v: unknown, field: string): string[] | undefined => {
    if (v === undefined || v === null) return undefined;
    if (!Array.isArray(v) || !v.every((s) => typeof s === 'string')) return undefined;
    if (v.length > MAX_CONFIG_ENTRIES) refuse(field, `has more than ${MAX_CONFIG_ENTRIES} entries`);
    let bytes = 0;
    for (const s of v) {
      bytes += Buffer.byteLength(s);
      if (s.includes('\0')) refuse(field, 'holds a NUL byte');
    }
    if (bytes > MAX_CONFIG_LIST_BYTES)
      refuse(field, `is larger than ${MAX_CONFIG_LIST_BYTES} bytes`);
    return v;
  };
  const str = (v: unknown): string | undefined =>
    typeof v === 'string' && v !== '' ? v : undefined;
  const out: ImageConfig = {};
  const env = strings(c['Env'], 'Env');
  if (env?.some((e) => !/^[^=\0]+=/.test(e))) refuse('Env', 'has an entry that is not NAME=value');
  const cmd = strings(c['Cmd'], 'Cmd');
  const entrypoint = strings(c['Entrypoint'], 'Entrypoint');
  const workingDir = str(c['WorkingDir']);
  if (
    workingDir !== undefined &&
    (!workingDir.startsWith('/') || workingDir.length > 4096 || workingDir.includes('\0'))
  )
    refuse('WorkingDir', 'must be an absolute path');
  const user = str(c['User']);
  if (user !== undefined && !CONFIG_USER.test(user))
    refuse('User', 'must be a user name or uid, optionally with :group (not a path)');
  if (env) out.env = env;
  if (cmd) out.cmd = cmd;
  if (entrypoint) out.entrypoint = entrypoint;
  if (workingDir) out.workingDir = workingDir;
  if (user) out.user = user;
  return out;
}

// A path from the archive's own JSON must stay inside the archive.
function inside(root: string, rel: string): string {
  const n = normalize(rel);
  if (isAbsolute(n) || n === '..' || n.startsWith('../'))
    throw bad(`path ${rel} leaves the archive`);
  return join(root, n);
}

async function mustBeFile(path: string): Promise<void> {
  if (!(await stat(path).catch(() => undefined))?.isFile()) throw bad(`${path} is missing`);
}

async function readJson(path: string): Promise<unknown> {
  const text = await readFile(path, 'utf8');
  try {
    return JSON.parse(text) as unknown;
  } catch (err) {
    throw new DsecError('invalid_argument', `${path} is not valid JSON`, {
      field: 'path',
      cause: err,
    });
  }
}

function bad(message: string): DsecError {
  return new DsecError('invalid_argument', message, { field: 'path' });
}
