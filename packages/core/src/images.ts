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
 */
export type LayerKind = 'base' | 'workspace' | 'toolkit' | 'snapshot';

export const DEFAULT_LAYER_VERSION = 'latest';
export const LAYER_NAME_PATTERN = /^[a-z0-9][a-z0-9._-]{0,127}$/;
export const LAYER_VERSION_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
export const DIGEST_PATTERN = /^sha256:[0-9a-f]{64}$/;

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
  /** Where it came from: `dir`, `tar`, `oci`, `busybox`, `debootstrap`, `collapse`. */
  source: string;
  /** The runtime defaults of an imported OCI image (its config), when it came from one. */
  config?: ImageConfig | undefined;
  /**
   * For a collapsed layer: the `name:version` refs it merges, bottom first.
   * For a snapshot: the whole stack below it, bottom first (base, workspace,
   * toolkits, earlier snapshots), each pinned by `parentDigests`.
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
  /** Records a layer. `conflict` if `name:version` exists with another digest. */
  putLayer(layer: LayerInfo): Promise<void>;
  /** Throws `image_not_found` for an unknown or malformed reference. */
  getLayer(ref: string): Promise<LayerInfo>;
  listLayers(): Promise<LayerInfo[]>;
  /** Removes the record and any blob no other record uses. */
  removeLayer(ref: string): Promise<void>;
}
