import { access, mkdir, mkdtemp, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  DsecError,
  isDsecError,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import { buildLayer, type BuildProgress } from '../build.js';
import { erofsCompression, type ErofsCompression } from '../erofs.js';
import type { ErofsMounter } from '../collapse.js';
import { mergeImageLayers } from '../overlay/merge.js';
import { DirImageStore } from '../store/dir-store.js';
import { assertLayerKind, assertLayerName } from '../store/validate.js';
import { runTool } from '../util/run-tool.js';
import { diffIdsOf, imageConfig, readOciImage, type OciImage } from './read-image.js';
import { isInsecureRegistry, pullSources, type RegistrySettings } from './registries.js';
import { convertDiffLayers, OCI_DIFF_LAYER_NAME } from './diff-layers.js';

// The per-layer conversion (diff-ID check, reuse, record) is shared with Dockerfile builds.
export { OCI_DIFF_LAYER_NAME } from './diff-layers.js';

/** A per-OCI-layer conversion record (`oci-diff:<hex>`): plumbing that `dsec image ls` hides without `--all`. */
export function isOciDiffLayer(layer: Pick<LayerInfo, 'name'>): boolean {
  return layer.name === OCI_DIFF_LAYER_NAME;
}

/**
 * The store's layers as users list them: without the `oci-diff` records unless
 * `all`; with `projects`, only the platform's and those projects' (`listLayers`).
 */
export async function listImages(
  store: Pick<ImageStore, 'listLayers'>,
  options: { all: boolean; projects?: readonly string[] | undefined },
): Promise<LayerInfo[]> {
  const layers = await store.listLayers(
    options.projects === undefined ? undefined : { projects: options.projects },
  );
  return options.all ? layers : layers.filter((l) => !isOciDiffLayer(l));
}

/**
 * How the merged image of a registry import is compressed unless asked
 * otherwise: `lz4` builds about 5 × faster than `lz4hc` on source trees for
 * about 12 % more bytes, and 30 × faster on incompressible data, which
 * `lz4hc` turned into most of an import's time (docs/adr/0018-registry-import.md).
 */
export const REGISTRY_DEFAULT_COMPRESSION: ErofsCompression = 'lz4';

/** Layer media types the importer can unpack (after skopeo's conversion to OCI). */
const SUPPORTED_LAYER_TYPES = new Set([
  'application/vnd.oci.image.layer.v1.tar',
  'application/vnd.oci.image.layer.v1.tar+gzip',
  'application/vnd.oci.image.layer.v1.tar+zstd',
  'application/vnd.docker.image.rootfs.diff.tar',
  'application/vnd.docker.image.rootfs.diff.tar.gzip',
]);

export interface ImportRegistryOptions {
  /** `docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`. */
  source: string;
  name: string;
  version?: string;
  kind: LayerKind;
  /**
   * Plain HTTP or an unverified certificate for every registry and mirror
   * this import reaches. Without it, TLS is decided per host by `registries`
   * (a host listed as insecure there needs no flag).
   */
  insecure?: boolean;
  /**
   * The node's registry settings (`registrySettings`: the config file's
   * `registries` section and the environment): insecure hosts, mirrors tried
   * in order before the registry itself, the auth file. Default: none.
   */
  registries?: RegistrySettings;
  /**
   * A containers-auth.json file; default `DSEC_REGISTRY_USERNAME`/`PASSWORD`,
   * then `registries.authFile` (the config's, or `REGISTRY_AUTH_FILE`), then
   * `$XDG_RUNTIME_DIR/containers/auth.json`.
   */
  authFile?: string;
  /** Most layers an image may have (default `MAX_IMAGE_LAYERS`). */
  maxLayers?: number;
  /** Most bytes the image's layers may take, as the manifest says and as pulled (default `MAX_IMAGE_BYTES`). */
  maxBytes?: number;
  /**
   * Most bytes the image's new layers may unpack to, all together (default
   * `MAX_IMAGE_UNPACKED_BYTES`): a small blob can decompress to terabytes.
   */
  maxUnpackedBytes?: number;
  /** The whole import's deadline (default `REGISTRY_IMPORT_TIMEOUT_MS`): a registry that stalls ends it. */
  timeoutMs?: number;
  /**
   * Where `DSEC_REGISTRY_USERNAME`/`DSEC_REGISTRY_PASSWORD`, `REGISTRY_AUTH_FILE`
   * and `XDG_RUNTIME_DIR` are read (default `process.env`).
   */
  env?: NodeJS.ProcessEnv;
  /** Mounts stored per-layer EROFS images to copy reused layers out of them. */
  mounter: ErofsMounter;
  /** As in `importOci`: keep whiteouts as overlay marks (default: not for a base). */
  keepWhiteouts?: boolean;
  split?: boolean;
  /** Compression of the merged image when not split (default `REGISTRY_DEFAULT_COMPRESSION`, `lz4`). */
  compress?: boolean | ErofsCompression;
  workDir?: string;
  signal?: AbortSignal;
  /** Phases `inspect`, `pull` (bytes), `convert` (layers), `merge`, then the build's. */
  onProgress?(p: BuildProgress): void;
}

/** Most layers an imported image may have (SWE-bench's have about 10; Docker's own limit is 127). */
export const MAX_IMAGE_LAYERS = 256;
/** Most bytes of (compressed) layer blobs one import may pull: 64 GiB. */
export const MAX_IMAGE_BYTES = 64 * 1024 ** 3;
/**
 * Most bytes the layers of one import may unpack to: 64 GiB (SWE-bench's
 * images unpack to under 20). Counted while each layer decompresses, before
 * its diff ID can be checked, so a decompression bomb (gzip's ratio is about
 * 1000:1, zstd's far more) stops at the bound instead of filling the disk.
 */
export const MAX_IMAGE_UNPACKED_BYTES = 64 * 1024 ** 3;
/** How long one import may take by default: an hour. */
export const REGISTRY_IMPORT_TIMEOUT_MS = 60 * 60_000;
/** Most bytes of a manifest or config skopeo may print (a registry's own limit is 4 MiB). */
const MAX_DOCUMENT_BYTES = 4 * 1024 * 1024;

export interface RegistryImportResult {
  layer: LayerInfo;
  /** The reference the image was read from: `source`, or a mirror's rewrite of it. */
  pulledFrom: string;
  /** The image's layers bottom first: their diff ID, the per-layer record, and whether it was reused. */
  layers: { diffId: string; ref: string; reused: boolean }[];
  /** Bytes skopeo wrote into the temporary layout (compressed blobs, manifests, config). */
  pulledBytes: number;
}

/**
 * Imports an image from a registry: when the image config (`skopeo inspect
 * --config`) names only layers already converted, nothing is pulled;
 * otherwise `skopeo copy` pulls it into an OCI layout in scratch space; each layer is converted into an EROFS layer of
 * its own (whiteouts kept as overlay marks), recorded as
 * `oci-diff:<diff-ID hex>` after its uncompressed bytes were checked against
 * the diff ID, or reused when that record exists; the layers are then merged
 * bottom to top (as `importOci` does) into `name:version`, whose `parents`
 * list the per-layer records, `lz4`-compressed by default (ADR 0018).
 *
 * Credentials: `authFile`, else `DSEC_REGISTRY_USERNAME`/`DSEC_REGISTRY_PASSWORD`
 * (handed to skopeo in a 0600 auth file, never on its command line), else
 * `REGISTRY_AUTH_FILE`, else `$XDG_RUNTIME_DIR/containers/auth.json` when it
 * exists. Failures carry stable codes, with `details.reason`:
 * `unavailable` (`registry_unreachable`), `permission_denied` (`registry_auth`),
 * `image_not_found` (`unknown_tag`), `invalid_argument` (`unsupported_media_type`,
 * or a bad source reference).
 */
export async function importFromRegistry(
  store: ImageStore,
  options: ImportRegistryOptions,
): Promise<RegistryImportResult> {
  assertLayerName(options.name);
  assertLayerKind(options.kind);
  const source = parseDockerSource(options.source);
  const compression = erofsCompression(options.compress, REGISTRY_DEFAULT_COMPRESSION);
  const maxLayers = positive(options.maxLayers, MAX_IMAGE_LAYERS, 'maxLayers');
  const maxBytes = positive(options.maxBytes, MAX_IMAGE_BYTES, 'maxBytes');
  const unpacked = {
    left: positive(options.maxUnpackedBytes, MAX_IMAGE_UNPACKED_BYTES, 'maxUnpackedBytes'),
  };
  const maxUnpackedBytes = unpacked.left;
  const timeoutMs = positive(options.timeoutMs, REGISTRY_IMPORT_TIMEOUT_MS, 'timeoutMs');
  const deadline = AbortSignal.timeout(timeoutMs);
  const signal = options.signal ? AbortSignal.any([options.signal, deadline]) : deadline;
  const env = options.env ?? process.env;
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const workRoot = options.workDir ?? (store instanceof DirImageStore ? store.tmpDir : tmpdir());
  await mkdir(workRoot, { recursive: true });
  const work = await mkdtemp(join(workRoot, 'registry-'));
  try {
    progress({ phase: 'inspect' });
    const { from, info, args } = await firstSource(source, options, env, work, signal);
    if (info.sizes.length > maxLayers) {
      throw new DsecError(
        'invalid_argument',
        `${from.ref}: the image has ${info.sizes.length} layers, more than ${maxLayers}`,
        { field: 'source', details: { reason: 'too_many_layers', layers: info.sizes.length } },
      );
    }
    const totalBytes = info.sizes.reduce((a, b) => a + b, 0);
    if (totalBytes > maxBytes) throw tooBig(from.ref, totalBytes, maxBytes);

    // Every layer already converted (a re-import, a new tag of the same
    // layers): the config, checked by skopeo against the manifest, says so,
    // and no blob needs to travel.
    const known = await knownImage(store, from.ref, info.mediaTypes, args, signal);
    const pulled = known ?? (await pull(work, from, totalBytes, maxBytes, args, signal, progress));
    const { image, pulledBytes } = pulled;
    if (image.diffIds.length > maxLayers) {
      throw new DsecError(
        'invalid_argument',
        `${from.ref}: the image has ${image.diffIds.length} layers, more than ${maxLayers}`,
        { field: 'source', details: { reason: 'too_many_layers', layers: image.diffIds.length } },
      );
    }

    const { trees, layers } = await convertDiffLayers(store, {
      diffIds: image.diffIds,
      blobs: image.layers,
      work,
      mounter: options.mounter,
      signal,
      onProgress: progress,
      unpacked: { budget: unpacked, maxBytes: maxUnpackedBytes, ref: from.ref },
    });
    progress({ phase: 'merge' });
    const rootDir = await mergeImageLayers(trees, {
      emptyDir: join(work, 'layers', 'empty'),
      keepMarks: options.keepWhiteouts ?? options.kind !== 'base',
      signal,
    });
    const layer = await buildLayer(store, {
      name: options.name,
      ...(options.version !== undefined ? { version: options.version } : {}),
      kind: options.kind,
      from: { dir: rootDir },
      source: 'registry',
      config: image.config,
      ...(layers.length > 0 ? { parents: layers.map((l) => l.ref) } : {}),
      ...(options.split !== undefined ? { split: options.split } : {}),
      compress: compression,
      workDir: work,
      signal,
      onProgress: progress,
    });
    return { layer, layers, pulledBytes, pulledFrom: from.ref };
  } catch (err) {
    if (deadline.aborted && !options.signal?.aborted) {
      throw new DsecError(
        'deadline_exceeded',
        `${options.source}: the import took longer than ${timeoutMs} ms`,
        { field: 'source', details: { reason: 'registry_timeout', timeoutMs }, cause: err },
      );
    }
    throw err;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

interface Source extends DockerSource {
  /** skopeo's TLS and credential arguments for this host (inspect form). */
  args: string[];
}

/**
 * The first of the image's pull sources (its mirrors in order, then the
 * registry itself) that answers `skopeo inspect`, with the TLS and
 * credentials for that host. A mirror that cannot serve the image (down,
 * no such tag, refusing us) is passed over; when none can, the registry's
 * own answer is the error.
 */
async function firstSource(
  source: DockerSource,
  options: ImportRegistryOptions,
  env: NodeJS.ProcessEnv,
  work: string,
  signal: AbortSignal,
): Promise<{ from: Source; info: { mediaTypes: string[]; sizes: number[] }; args: string[] }> {
  const settings = options.registries ?? { insecure: [], mirrors: {} };
  const hosts = pullSources(settings, source.host);
  let last: unknown;
  for (const [i, host] of hosts.entries()) {
    const from = rewrite(source, host);
    const insecure = options.insecure === true || isInsecureRegistry(settings, from.host);
    const authArgs = await credentials(
      options.authFile,
      settings.authFile,
      env,
      source.host,
      from.host,
      join(work, `auth-${i}.json`),
    );
    const args = [...(insecure ? ['--tls-verify=false'] : []), ...authArgs];
    try {
      const inspected = await skopeo(
        ['inspect', '--raw', '--retry-times', '0', ...args, from.ref],
        from.ref,
        signal,
      );
      const info = parseManifest(inspected.stdout, from.ref);
      checkMediaTypes(info.mediaTypes, from.ref);
      return { from: { ...from, args }, info, args };
    } catch (err) {
      last = err;
      const passOver =
        i < hosts.length - 1 &&
        (isDsecError(err, 'unavailable') ||
          isDsecError(err, 'image_not_found') ||
          isDsecError(err, 'permission_denied'));
      if (!passOver) throw err;
    }
  }
  throw last;
}

/** `source` as pulled from `host` (a mirror `host[:port][/namespace]`, or the registry itself). */
function rewrite(source: DockerSource, host: string): DockerSource {
  if (host === source.host) return source;
  const rest = source.ref.slice('docker://'.length + source.host.length);
  const slash = host.indexOf('/');
  return { ref: `docker://${host}${rest}`, host: slash < 0 ? host : host.slice(0, slash) };
}

function positive(value: number | undefined, fallback: number, field: string): number {
  if (value === undefined) return fallback;
  if (!Number.isSafeInteger(value) || value <= 0) {
    throw new DsecError('invalid_argument', `${field} must be a positive integer`, { field });
  }
  return value;
}

function tooBig(ref: string, bytes: number, maxBytes: number): DsecError {
  return new DsecError(
    'resource_exhausted',
    `${ref}: the image's layers take ${bytes} bytes, more than ${maxBytes}`,
    { field: 'source', details: { reason: 'image_too_large', bytes, maxBytes } },
  );
}

/**
 * The image from its manifest and config alone when every layer's conversion
 * is already stored; else undefined (and the caller pulls). The manifest's
 * media types are checked as a pull checks them.
 */
async function knownImage(
  store: ImageStore,
  ref: string,
  mediaTypes: string[],
  args: string[],
  signal: AbortSignal | undefined,
): Promise<{ image: OciImage; pulledBytes: number } | undefined> {
  const json = async (flag: string): Promise<unknown> => {
    const out = await skopeo(['inspect', flag, '--retry-times', '0', ...args, ref], ref, signal);
    // skopeo checked the document against its digest; a huge one was refused in skopeo().
    try {
      return JSON.parse(out.stdout) as unknown;
    } catch {
      return undefined; // the pull reads and checks it properly
    }
  };
  // A list of platforms has no layers of its own: the pull resolves it.
  if (mediaTypes.length === 0) return undefined;
  const config = await json('--config');
  const diffIds = diffIdsOf(config, mediaTypes.length);
  if (diffIds.length === 0) return undefined;
  for (const diffId of diffIds) {
    const record = `${OCI_DIFF_LAYER_NAME}:${diffId.slice('sha256:'.length)}`;
    const stored = await store.getLayer(record).catch((err: unknown) => {
      if (isDsecError(err, 'image_not_found')) return undefined;
      throw err;
    });
    if (!stored) return undefined;
  }
  return {
    image: {
      format: 'oci-layout',
      layers: [],
      config: imageConfig(config),
      diffIds,
      layerMediaTypes: mediaTypes,
    },
    pulledBytes: 0,
  };
}

/**
 * `skopeo copy` into an OCI layout under `work`, with progress, stopped as
 * soon as it has written more than `maxBytes` (a manifest can understate
 * its sizes); the image read back and checked.
 */
async function pull(
  work: string,
  from: Source,
  totalBytes: number,
  maxBytes: number,
  args: string[],
  outer: AbortSignal,
  progress: (p: BuildProgress) => void,
): Promise<{ image: OciImage; pulledBytes: number }> {
  const ref = from.ref;
  progress({ phase: 'pull', done: 0, total: totalBytes });
  const layout = join(work, 'layout');
  const over = new AbortController();
  const signal = AbortSignal.any([outer, over.signal]);
  let overBytes = 0;
  const poll = setInterval(() => {
    void dirBytes(layout).then((done) => {
      if (done > maxBytes && !over.signal.aborted) {
        overBytes = done;
        over.abort();
      }
      progress({ phase: 'pull', done, total: totalBytes });
    });
  }, 250);
  try {
    await skopeo(
      [
        'copy',
        '--quiet',
        '--retry-times',
        '0',
        ...args.map((a) =>
          a.replace(/^--authfile/, '--src-authfile').replace(/^--tls-verify/, '--src-tls-verify'),
        ),
        ref,
        `oci:${layout}:image`,
      ],
      ref,
      signal,
    );
  } catch (err) {
    if (over.signal.aborted && !outer.aborted) throw tooBig(ref, overBytes, maxBytes);
    throw err;
  } finally {
    clearInterval(poll);
  }
  const pulledBytes = await dirBytes(layout);
  if (pulledBytes > maxBytes) throw tooBig(ref, pulledBytes, maxBytes);
  progress({ phase: 'pull', done: pulledBytes, total: Math.max(totalBytes, pulledBytes) });

  const image = await readOciImage(layout, { ref: 'image', signal });
  checkMediaTypes(image.layerMediaTypes, ref);
  if (image.diffIds.length !== image.layers.length) {
    throw new DsecError(
      'invalid_argument',
      `${ref}: the image config does not list one diff ID per layer`,
      { field: 'source', details: { reason: 'unsupported_media_type' } },
    );
  }
  return { image, pulledBytes };
}

interface DockerSource {
  /** The reference as skopeo takes it (`docker://…`). */
  ref: string;
  /** The registry host (and port), the key of an auth file's `auths`. */
  host: string;
}

function parseDockerSource(text: string): DockerSource {
  const m =
    /^docker:\/\/([^/\s]+)\/([a-z0-9._/-]+)(?::[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})?$/.exec(
      text,
    );
  // A bare name (`docker://busybox`) would reach Docker Hub through registries.conf
  // search rules; the host is spelled out so credentials and TLS settings are unambiguous.
  if (!m || !/[.:]|^localhost$/.test(m[1]!)) {
    throw new DsecError(
      'invalid_argument',
      `--from-registry must be docker://HOST/REPO[:TAG|@sha256:DIGEST], got ${text}`,
      { field: 'source' },
    );
  }
  return { ref: text, host: m[1]! };
}

/**
 * `--authfile` arguments for skopeo reaching `host` for an image of
 * `origin`: the caller's file, else `DSEC_REGISTRY_USERNAME`/`PASSWORD`
 * written to a private (0600) file, keyed by the origin registry only (a
 * mirror gets them from an auth file, not by forwarding), else the
 * settings' auth file (the config's, or `REGISTRY_AUTH_FILE`), else
 * `$XDG_RUNTIME_DIR/containers/auth.json` when it exists.
 */
async function credentials(
  authFile: string | undefined,
  settingsFile: string | undefined,
  env: NodeJS.ProcessEnv,
  origin: string,
  host: string,
  file: string,
): Promise<string[]> {
  if (authFile !== undefined) {
    if (!(await stat(authFile).catch(() => undefined))?.isFile()) {
      throw new DsecError('invalid_argument', `auth file ${authFile} does not exist`, {
        field: 'authFile',
      });
    }
    return [`--authfile=${authFile}`];
  }
  const user = env['DSEC_REGISTRY_USERNAME'];
  const password = env['DSEC_REGISTRY_PASSWORD'];
  if (user !== undefined && user !== '' && host === origin) {
    const auth = Buffer.from(`${user}:${password ?? ''}`).toString('base64');
    await writeFile(file, JSON.stringify({ auths: { [host]: { auth } } }), { mode: 0o600 });
    return [`--authfile=${file}`];
  }
  const candidates = [
    settingsFile ?? env['REGISTRY_AUTH_FILE'],
    env['XDG_RUNTIME_DIR'] ? join(env['XDG_RUNTIME_DIR'], 'containers', 'auth.json') : undefined,
  ];
  for (const candidate of candidates) {
    if (
      candidate &&
      (await access(candidate).then(
        () => true,
        () => false,
      ))
    )
      return [`--authfile=${candidate}`];
  }
  return [];
}

async function skopeo(
  args: string[],
  ref: string,
  signal: AbortSignal | undefined,
): Promise<{ stdout: string }> {
  try {
    // skopeo reads REGISTRY_AUTH_FILE itself; the file chosen above is passed explicitly instead.
    const env = { ...process.env };
    delete env['REGISTRY_AUTH_FILE'];
    return await runTool('skopeo', args, { signal, env, maxStdoutBytes: MAX_DOCUMENT_BYTES });
  } catch (err) {
    throw classifySkopeoError(err, ref);
  }
}

/** Maps skopeo's failure text to a stable code; the text itself stays in the message. */
export function classifySkopeoError(err: unknown, ref: string): unknown {
  if (!isDsecError(err, 'internal') || err.details?.['exitCode'] === undefined) return err;
  const text = err.message;
  const tail = text.replace(/^skopeo exited with \d+: /, '');
  const rules: [
    RegExp,
    'unavailable' | 'permission_denied' | 'image_not_found' | 'invalid_argument',
    string,
  ][] = [
    [
      /unauthorized|authentication required|denied|401 Unauthorized|403 Forbidden|invalid username\/password/i,
      'permission_denied',
      'registry_auth',
    ],
    // `\b404\b`, not `404`: a registry on port 40461 is not a missing tag.
    [/manifest unknown|not found|name unknown|\b404\b/i, 'image_not_found', 'unknown_tag'],
    [
      /unsupported (MIME|manifest|media|image|layer)|unknown media ?type|unsupported schema|unsupported image-specific operation/i,
      'invalid_argument',
      'unsupported_media_type',
    ],
    [
      /connection refused|no such host|i\/o timeout|network is unreachable|connection reset|dial tcp|server gave HTTP response to HTTPS client|tls:|x509:|EOF|stopped after \d+ redirects|too many redirects/i,
      'unavailable',
      'registry_unreachable',
    ],
  ];
  for (const [re, code, reason] of rules) {
    if (re.test(tail)) {
      return new DsecError(code, `${ref}: ${tail}`, {
        field: 'source',
        details: { reason },
        cause: err,
      });
    }
  }
  return err;
}

/**
 * The layers a manifest (`skopeo inspect --raw`) names: media type and the
 * size it claims, checked against the limits before anything is pulled. An
 * image index names none (the pull picks the platform's manifest, and the
 * limits are checked on what it brings).
 */
function parseManifest(stdout: string, ref: string): { mediaTypes: string[]; sizes: number[] } {
  let parsed: { layers?: unknown };
  try {
    parsed = JSON.parse(stdout) as typeof parsed;
  } catch (err) {
    throw new DsecError(
      'invalid_argument',
      `${ref}: the registry sent a manifest that is not JSON`,
      {
        field: 'source',
        details: { reason: 'unsupported_media_type' },
        cause: err,
      },
    );
  }
  const layers = Array.isArray(parsed?.layers) ? (parsed.layers as unknown[]) : [];
  const field = (l: unknown, k: string): unknown => (l as Record<string, unknown> | null)?.[k];
  return {
    mediaTypes: layers.map((l) => {
      const t = field(l, 'mediaType');
      return typeof t === 'string' ? t : '';
    }),
    sizes: layers.map((l) => {
      const n = field(l, 'size');
      return typeof n === 'number' && Number.isFinite(n) && n > 0 ? n : 0;
    }),
  };
}

function checkMediaTypes(types: string[], ref: string): void {
  const bad = types.filter((t) => t !== '' && !SUPPORTED_LAYER_TYPES.has(t));
  if (bad.length > 0) {
    throw new DsecError(
      'invalid_argument',
      `${ref}: unsupported layer media type ${[...new Set(bad)].join(', ')}`,
      { field: 'source', details: { reason: 'unsupported_media_type', mediaTypes: bad } },
    );
  }
}

async function dirBytes(dir: string): Promise<number> {
  let total = 0;
  const entries = await readdir(dir, { withFileTypes: true, recursive: true }).catch(() => []);
  for (const e of entries) {
    if (!e.isFile()) continue;
    const st = await stat(join(e.parentPath, e.name)).catch(() => undefined);
    total += st?.size ?? 0;
  }
  return total;
}
