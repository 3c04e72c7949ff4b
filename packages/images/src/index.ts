/**
 * @dsec/images — builds immutable EROFS layers and keeps them in an image
 * store. A layer is made from a directory, a tar archive, an OCI image
 * (`importOci`: layout or docker-archive, whiteouts applied), a collapse of
 * consecutive layers (`collapseLayers`), or a root filesystem made here
 * (static busybox, or Debian via debootstrap), packed
 * with `mkfs.erofs` so the same content always gives the same digest, and
 * recorded as `name:version` in a store: a directory (`DirImageStore`, local
 * or a shared mount) or an S3 bucket (`S3ImageStore`; `openImageStore` opens
 * either from its location). Split layers keep metadata and file data in two
 * blobs (`--blobdev`) so an edge holds metadata locally and reads data on
 * demand from the store. Every store passes `imageStoreConformance`.
 *
 * @example
 * ```ts
 * import { DirImageStore, buildLayer, makeBusyboxRootfs } from '@dsec/images';
 * const store = new DirImageStore('/var/lib/dsec/images');
 * await makeBusyboxRootfs('/tmp/bb-root');
 * const layer = await buildLayer(store, {
 *   name: 'busybox', kind: 'base', from: { dir: '/tmp/bb-root' }, source: 'busybox',
 *   onProgress: (p) => console.log(p.phase),
 * });
 * const image = await store.blobPath(layer.digest); // mount this read-only (EROFS)
 * ```
 */
export {
  buildErofs,
  erofsArgs,
  erofsCompression,
  DEFAULT_CHUNK_SIZE_BYTES,
  EROFS_COMPRESSIONS,
  ZERO_UUID,
} from './erofs.js';
export type { BuildErofsOptions, BuildErofsResult, ErofsCompression } from './erofs.js';
export { buildLayer, extractTar } from './build.js';
export type { BuildLayerOptions, BuildProgress } from './build.js';
export { treeStats } from './walk.js';
export type { TreeStats } from './walk.js';
export { DirImageStore } from './store/dir-store.js';
export { S3ImageStore } from './store/s3-store.js';
export type { S3ImageStoreOptions } from './store/s3-store.js';
export { openImageStore } from './store/open.js';
export type { OpenImageStoreOptions } from './store/open.js';
export { importOci } from './oci/import.js';
export type { ImportOciOptions } from './oci/import.js';
export {
  importFromRegistry,
  isOciDiffLayer,
  listImages,
  MAX_IMAGE_BYTES,
  MAX_IMAGE_UNPACKED_BYTES,
  MAX_IMAGE_LAYERS,
  OCI_DIFF_LAYER_NAME,
  REGISTRY_DEFAULT_COMPRESSION,
  REGISTRY_IMPORT_TIMEOUT_MS,
} from './oci/registry.js';
export type { ImportRegistryOptions, RegistryImportResult } from './oci/registry.js';
export {
  buildPullHosts,
  isInsecureRegistry,
  MAX_MIRRORS_PER_REGISTRY,
  MAX_REGISTRY_ENTRIES,
  pullSources,
  registriesConf,
  registryHostOf,
  registrySettings,
} from './oci/registries.js';
export type { RegistryConfig, RegistrySettings } from './oci/registries.js';
export { convertDiffLayers } from './oci/diff-layers.js';
export type { ConvertDiffLayersOptions, DiffLayer } from './oci/diff-layers.js';
export {
  buildDockerfile,
  defaultAllow,
  DEFAULT_BUILD_TIMEOUT_MS,
  DEFAULT_MAX_BUILD_BYTES,
  DEFAULT_MAX_OUTPUT_BYTES,
  credentialHostsOf,
  rewriteStoreBases,
} from './dockerfile/build.js';
export type {
  StoreBase,
  DockerfileBuildOptions,
  DockerfileBuildProgress,
  DockerfileBuildResult,
} from './dockerfile/build.js';
export { egressBuildNetwork } from './dockerfile/network.js';
export type {
  BuildNetwork,
  BuildNetworkHandle,
  EgressManager,
  EgressSandbox,
} from './dockerfile/network.js';
export {
  parseDockerfile,
  DEFAULT_MAX_DOCKERFILE_BYTES,
  DEFAULT_MAX_INSTRUCTIONS,
} from './dockerfile/parse.js';
export type {
  DockerfileInstruction,
  DockerfileLimits,
  DockerfileStage,
  ParsedDockerfile,
} from './dockerfile/parse.js';
export { DEFAULT_MAX_CONTEXT_BYTES, DEFAULT_MAX_CONTEXT_ENTRIES } from './dockerfile/context.js';
export type { ContextLimits } from './dockerfile/context.js';
export { readOciImage } from './oci/read-image.js';
export type { OciImage } from './oci/read-image.js';
export { collapseLayers, DEFAULT_COLLAPSE_MAX_BYTES } from './collapse.js';
export type { CollapseLayersOptions, ErofsMounter } from './collapse.js';
export { transferLayer } from './transfer.js';
export type { TransferLayerOptions, TransferProgress } from './transfer.js';
export { mergeLayerTrees, ociLayerToOverlay, overlayLayerTree } from './overlay/merge.js';
export type { LayerTree, MergeOptions } from './overlay/merge.js';
export { validateLayerInfo } from './store/validate.js';
export { makeBusyboxRootfs } from './rootfs/busybox.js';
export type { BusyboxRootfsOptions, BusyboxRootfsResult } from './rootfs/busybox.js';
export {
  makeDebianRootfs,
  hostAptMirror,
  mirrorFromDeb822,
  mirrorFromList,
  DEFAULT_DEBIAN_MIRROR,
} from './rootfs/debian.js';
export type { DebianRootfsOptions } from './rootfs/debian.js';
export { shiftErofsIds, crc32c } from './erofs-ids.js';
export type { ShiftErofsIdsOptions, ShiftErofsIdsResult } from './erofs-ids.js';
export {
  copyUpperDir,
  packUpperDir,
  parseScrubPatterns,
  patternsShadowingLowers,
  scanUpper,
  scrubCopy,
  scrubExcludeArgs,
  MAX_SCRUB_PATTERNS,
  SPARSE_CHUNK_BYTES,
} from './upper-pack.js';
export type {
  ConfinedRun,
  PackUpperOptions,
  ScanCaps,
  ScanRefusal,
  ScrubPattern,
  UpperScan,
  UpperSource,
} from './upper-pack.js';
export {
  buildFromDebs,
  baseDpkgStatus,
  baseFacts,
  rememberBaseStatus,
  DEBS_MANIFEST_DIR,
} from './debs.js';
export type { BaseFacts } from './debs.js';
export { chooseDebianSuite, type BaseRelease } from './debs-suite.js';
export type {
  BuildFromDebsOptions,
  BuildFromDebsResult,
  DebsAptOptions,
  DebsManifest,
} from './debs.js';
export {
  compareDebVersions,
  installedFromStatus,
  packagesFromIndex,
  parseDeb822,
  parseRelations,
  resolveDebClosure,
} from './debs-resolve.js';
export type {
  DebClause,
  DebClosure,
  DebPackage,
  DebRelation,
  ResolveDebClosureInput,
} from './debs-resolve.js';
export {
  ensureEnvironment,
  loadEnvironmentRecipes,
  parseEnvironmentRecipes,
  recipeDigest,
} from './recipes.js';
export type {
  BaseRecipe,
  DebsRecipe,
  EnsureEnvironmentOptions,
  EnsureEnvironmentResult,
  EnvironmentProgress,
  EnvironmentRecipe,
  EnvironmentRecipes,
} from './recipes.js';
export {
  EGRESS_POLICIES,
  INSTALL_OUTPUT_TAIL_BYTES,
  installCommandFailed,
  installDomains,
} from './install-recipe.js';
export type { InstallRecipe, InstallRequest, InstallRunner } from './install-recipe.js';
