import { DsecError, isDsecError } from './errors.js';

/**
 * Image vocabulary. A *layer* is an immutable, read-only filesystem (EROFS)
 * named `name:version` and addressed by the digest of its bytes. A sandbox's
 * root is a stack of layers: one base, at most one workspace, any number of
 * toolkits, plus a private writable upper directory (paper 4.2, 5.1).
 *
 * A *snapshot* layer (kind `snapshot`, paper 6.1 pack_diff) is a sandbox's
 * captured writable layer; it names an image by itself: `create` with it as
 * `image` stacks its `parents` and then the snapshot layer.
 *
 * Blobs are content-addressed (`sha256:<hex>`) and never change once stored;
 * the name index maps `name:version` to a layer record. Storing the same input
 * twice yields the same digest.
 *
 * Every layer has an owner (docs/adr/0019-layer-ownership.md): the platform
 * (`project` absent: what operators build and import, eval workspaces, FnCall
 * runtimes, and every record written before owners existed) or one project
 * (`project` set: a snapshot or fork of one of its sandboxes). A store keeps
 * one namespace per owner, so one `name:version` may exist for the platform
 * and for any number of projects without a clash. A project sees the
 * platform's layers, its ancestors' and its own (its `LayerView`), and a name
 * resolves to the first namespace holding it in the order platform, root
 * project, …, the project itself (`resolveLayer`): a name held higher up is
 * never shadowed from below, and nothing a tenant names blocks the platform.
 */
export type LayerKind = 'base' | 'workspace' | 'toolkit' | 'snapshot';

export const DEFAULT_LAYER_VERSION = 'latest';
export const LAYER_NAME_PATTERN = /^[a-z0-9][a-z0-9._-]{0,127}$/;
export const LAYER_VERSION_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
export const DIGEST_PATTERN = /^sha256:[0-9a-f]{64}$/;
/** A project ID as a layer owner (IAM's `prj-<base64url>`): one safe path and key component. */
export const LAYER_PROJECT_PATTERN = /^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$/;

export interface LayerInfo {
  name: string;
  version: string;
  kind: LayerKind;
  /** Digest of the EROFS image (the metadata image when `blobDigest` is set). */
  digest: string;
  /** Digest of the separate data blob (`mkfs.erofs --blobdev`), when split. */
  blobDigest?: string | undefined;
  /**
   * Digest of the data blob's chunk table (`encodeChunkTable`: the sha256 of
   * each 1 MiB chunk), which on-demand readers check every fetched chunk against.
   */
  blobChunksDigest?: string | undefined;
  /** Bytes of the EROFS image plus its data blob. */
  sizeBytes: number;
  /** Bytes of the files the layer holds, uncompressed. */
  contentBytes: number;
  fileCount: number;
  createdAt: string;
  /** Where it came from: `dir`, `tar`, `oci`, `busybox`, `debootstrap`, `collapse`, `snapshot`. */
  source: string;
  /**
   * The project that owns the layer (its snapshots and forks); absent for the
   * platform's (operator builds and imports, and records older than owners).
   */
  project?: string | undefined;
  /** The runtime defaults of an imported OCI image (its config), when it came from one. */
  config?: ImageConfig | undefined;
  /**
   * For a collapsed layer: the `name:version` refs it merges, bottom first.
   * For a snapshot: the whole stack below it, bottom first (base, workspace,
   * toolkits, earlier snapshots), each pinned by `parentDigests`, as layer
   * keys (`formatLayerKey`: `project/name:version` for a project's layer).
   */
  parents?: string[] | undefined;
  /** For a snapshot: the digest each of `parents` had when it was taken (same order). */
  parentDigests?: string[] | undefined;
  /** For a snapshot: the scrub patterns removed from it (paper 6.1). */
  scrub?: string[] | undefined;
}

/** The parts of an OCI image config a sandbox may use as defaults. */
export interface ImageConfig {
  env?: string[] | undefined;
  cmd?: string[] | undefined;
  entrypoint?: string[] | undefined;
  workingDir?: string | undefined;
  user?: string | undefined;
}

export interface LayerRef {
  name: string;
  version: string;
}

/** Parses `name` or `name:version`; returns undefined when malformed. */
export function parseLayerRef(ref: string): LayerRef | undefined {
  const i = ref.lastIndexOf(':');
  const name = i < 0 ? ref : ref.slice(0, i);
  const version = i < 0 ? DEFAULT_LAYER_VERSION : ref.slice(i + 1);
  if (!LAYER_NAME_PATTERN.test(name) || !LAYER_VERSION_PATTERN.test(version)) return undefined;
  return { name, version };
}

export function formatLayerRef(ref: LayerRef): string {
  return `${ref.name}:${ref.version}`;
}

/** Where a record lives in a store: its owner's namespace (absent: the platform's) and its ref. */
export interface LayerKey extends LayerRef {
  project?: string | undefined;
}

/** `name:version` for a platform layer, `project/name:version` for a project's. */
export function formatLayerKey(key: LayerKey): string {
  const ref = formatLayerRef(key);
  return key.project === undefined ? ref : `${key.project}/${ref}`;
}

/** Parses what `formatLayerKey` writes (a bare ref is the platform's); undefined when malformed. */
export function parseLayerKey(text: string): LayerKey | undefined {
  const slash = text.indexOf('/');
  const ref = parseLayerRef(slash < 0 ? text : text.slice(slash + 1));
  if (!ref) return undefined;
  if (slash < 0) return ref;
  const project = text.slice(0, slash);
  return LAYER_PROJECT_PATTERN.test(project) ? { ...ref, project } : undefined;
}

/**
 * The projects whose layers a sandbox may stack besides the platform's,
 * root first and ending with the sandbox's own (IAM's `lineage`). Empty: the
 * platform's layers only.
 */
export type LayerView = readonly string[];

/** Whether `view` sees the layer: the platform's always, a project's when the project is in it. */
export function layerVisible(layer: Pick<LayerInfo, 'project'>, view: LayerView): boolean {
  return layer.project === undefined || view.includes(layer.project);
}

/**
 * The records of `layers` that `view` sees, by name and version, and for one
 * `name:version` in resolution order (the one `resolveLayer` picks first).
 */
export function visibleLayers(layers: readonly LayerInfo[], view: LayerView): LayerInfo[] {
  const rank = (l: LayerInfo) => (l.project === undefined ? -1 : view.indexOf(l.project));
  return layers
    .filter((l) => layerVisible(l, view))
    .sort((a, b) => cmp(a.name, b.name) || cmp(a.version, b.version) || rank(a) - rank(b));
}

function cmp(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/**
 * The layer `ref` names for a sandbox whose project sees `view`: the
 * platform's if it has one, else the first of `view` (root first) that does.
 * Throws `image_not_found` (naming only `ref`, never where it looked) when
 * none does or `ref` is malformed, so a caller learns nothing of layers
 * outside its view.
 */
export async function resolveLayer(
  store: Pick<ImageStore, 'getLayer'>,
  ref: string,
  view: LayerView,
): Promise<LayerInfo> {
  for (const project of [undefined, ...view]) {
    try {
      return await store.getLayer(ref, project === undefined ? {} : { project });
    } catch (err) {
      if (!isDsecError(err, 'image_not_found')) throw err;
    }
  }
  throw new DsecError('image_not_found', `no layer ${JSON.stringify(ref.slice(0, 300))}`);
}

/**
 * Where layer blobs and the layer index live. Implementations: `dir` (a POSIX
 * path: local disk, or a mount of a distributed filesystem) and `s3`.
 * Every implementation passes the conformance suite in @dsec/images.
 *
 * Lifecycle: blobs are written once (`putBlob`), referenced by layer records
 * (`putLayer`), and deleted only when no record refers to them.
 */
export interface ImageStore {
  readonly kind: string;
  /**
   * True when `blobPath` is the stored file itself (a POSIX store, local or a
   * distributed-filesystem mount): the kernel reads data blobs in place.
   * False for remote stores (`s3`): their `blobPath` downloads a whole copy,
   * and an edge serves their data blobs on demand through its blob daemon.
   */
  readonly local: boolean;
  /**
   * How another process reopens this store (`openImageStore(location)`):
   * `dir:/abs/path` or `s3://bucket/prefix?endpoint=…&region=…`. Never holds
   * secrets; S3 credentials come from the environment.
   */
  readonly location: string;
  /**
   * Copies a local file in as an immutable blob; idempotent; returns its
   * digest. With `move` the caller gives the file up: a store on the same
   * filesystem may take it over (link and rename) instead of copying it, and
   * the file may be gone afterwards.
   */
  putBlob(
    file: string,
    options?: { signal?: AbortSignal; onProgress?: (bytesDone: number) => void; move?: boolean },
  ): Promise<{ digest: string; sizeBytes: number }>;
  hasBlob(digest: string): Promise<boolean>;
  /**
   * A local path the kernel can read the blob from (the file itself for `dir`,
   * a cache entry for remote stores). Throws `image_not_found` when absent.
   */
  blobPath(digest: string, options?: { signal?: AbortSignal }): Promise<string>;
  deleteBlob(digest: string): Promise<void>;
  /** The blob's size. Throws `image_not_found` when absent. */
  statBlob(digest: string, options?: { signal?: AbortSignal }): Promise<{ sizeBytes: number }>;
  /**
   * Reads up to `length` bytes at `offset` (fewer only at the end of the
   * blob; empty at or past it). Remote stores fetch just this range: this is
   * what on-demand loading is built on. Throws `image_not_found` when absent.
   */
  readBlobRange(
    digest: string,
    offset: number,
    length: number,
    options?: { signal?: AbortSignal },
  ): Promise<Buffer>;
  /**
   * Records a layer in its owner's namespace (`layer.project`; the
   * platform's when absent). `conflict` if that namespace holds
   * `name:version` with another digest; namespaces never clash.
   */
  putLayer(layer: LayerInfo): Promise<void>;
  /**
   * The record of `ref` in the platform's namespace, or in `project`'s: never
   * another one (resolution across a view is `resolveLayer`'s). Throws
   * `image_not_found` for an unknown or malformed reference or project.
   */
  getLayer(ref: string, options?: { project?: string | undefined }): Promise<LayerInfo>;
  /**
   * Every record of every namespace, by name, version, then owner (the
   * platform first). With `projects`, only the platform's and those
   * projects' records: what one caller's view can hold, read without
   * touching any other tenant's namespace (their number and size are theirs).
   */
  listLayers(options?: { projects?: readonly string[] | undefined }): Promise<LayerInfo[]>;
  /** Removes the record (of `project`'s namespace, else the platform's) and any blob no other record uses. */
  removeLayer(ref: string, options?: { project?: string | undefined }): Promise<void>;
}
