import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, readFile, readdir, rm, stat, writeFile, lstat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import {
  DEFAULT_LAYER_VERSION,
  DsecError,
  isDsecError,
  parseLayerRef,
  throwIfAborted,
  type ImageStore,
  type ImageConfig,
  type LayerInfo,
  type LayerKind,
  type NetworkTarget,
} from '@dsec/core';
import { buildLayer, type BuildProgress } from '../build.js';
import type { ErofsMounter } from '../collapse.js';
import { erofsCompression, type ErofsCompression } from '../erofs.js';
import {
  convertDiffLayers,
  convertStoredLayers,
  type DiffLayer,
  type StoredDiffLayer,
} from '../oci/diff-layers.js';
import { imageConfig, readOciImage } from '../oci/read-image.js';
import { registriesConf, type RegistrySettings } from '../oci/registries.js';
import { REGISTRY_DEFAULT_COMPRESSION } from '../oci/registry.js';
import { mergeImageLayers, type LayerTree } from '../overlay/merge.js';
import { DirImageStore } from '../store/dir-store.js';
import { assertLayerKind, assertLayerName, assertLayerVersion } from '../store/validate.js';
import { withLockFile } from '../util/lock-file.js';
import { runTool } from '../util/run-tool.js';
import { stageContext, type ContextLimits } from './context.js';
import { readStoredLayers } from './storage.js';
import { assertPullHost, baseImageRefs, checkBaseImages, copyFromImageRefs } from './onbuild.js';
import type { BuildNetwork, BuildNetworkHandle } from './network.js';
import {
  parseDockerfile,
  StepTracker,
  type DockerfileLimits,
  type ParsedDockerfile,
} from './parse.js';

/** One hour: a build that runs longer is stopped (`deadline_exceeded`). */
export const DEFAULT_BUILD_TIMEOUT_MS = 60 * 60 * 1000;
/** The build output kept for a failure's tail and the result (the rest streams past). */
export const DEFAULT_MAX_OUTPUT_BYTES = 256 * 1024;
/** Lines of a failed step's output quoted in the error. */
const TAIL_LINES = 30;
/** One output line is cut here: a step printing without newlines costs bounded memory. */
const MAX_LINE_BYTES = 8 * 1024;
/** Build arguments, and the bytes of each. */
const MAX_BUILD_ARGS = 256;
const MAX_BUILD_ARG_BYTES = 64 * 1024;
/**
 * 32 GiB: what one build may add to buildah's storage (pulled bases and what
 * its steps write) before it is stopped (`resource_exhausted`, `build_disk`).
 */
export const DEFAULT_MAX_BUILD_BYTES = 32 * 2 ** 30;
/** How often the storage is measured during a build (a step can overshoot by what it writes meanwhile). */
const DISK_POLL_MS = 1000;
/** Bumped when what the cache digest covers changes. */
const CACHE_FORMAT = 'dsec-dockerfile-v1';

export interface DockerfileBuildProgress extends BuildProgress {
  /**
   * Phase `step`: buildah's line as it printed it (`STEP 3/7: RUN …`);
   * phase `output`: one line of a step's output (cut at 8 KiB).
   */
  message?: string | undefined;
  /** Phase `step`: the instruction's line in the Dockerfile. */
  line?: number | undefined;
}

export interface DockerfileBuildOptions extends DockerfileLimits, ContextLimits {
  name: string;
  version?: string | undefined;
  /** Default `base`. */
  kind?: LayerKind | undefined;
  /**
   * The project that owns the result (the build API's caller): the layer,
   * and the cached build it may answer with, are that project's namespace's,
   * never the platform's (absent: the platform's).
   */
  project?: string | undefined;
  /** The build context directory. */
  contextDir: string;
  /** The Dockerfile: relative to `contextDir` or absolute (default `Dockerfile` in the context). */
  dockerfile?: string | undefined;
  buildArgs?: Record<string, string> | undefined;
  /** Build up to this stage (`--target`). */
  target?: string | undefined;
  /** Domains `RUN` steps may reach besides Debian's mirrors and the configured registries. */
  networkAllow?: string[] | undefined;
  /** How this node reaches registries (`registrySettings`): `FROM` pulls follow it as imports do. */
  registries: RegistrySettings;
  /** Mounts stored per-layer images to copy reused base layers out of them. */
  mounter: ErofsMounter;
  /**
   * Where `RUN` steps get their network: the node's egress machinery
   * (`egressBuildNetwork`). Without it they get none at all (loopback only).
   */
  network?: BuildNetwork | undefined;
  /**
   * Read the built image's layers straight from buildah's storage (default
   * true); false pushes it to an OCI layout and unpacks that, as a storage
   * that cannot be read directly gets anyway. The result is the same image.
   */
  fromStorage?: boolean | undefined;
  /** Build even when an identical build is stored (the result must still match it). */
  noCache?: boolean | undefined;
  /** Compression of the merged image (default `lz4`, as registry imports). */
  compress?: boolean | ErofsCompression | undefined;
  split?: boolean | undefined;
  /** Default {@link DEFAULT_BUILD_TIMEOUT_MS}. */
  timeoutMs?: number | undefined;
  /** Default {@link DEFAULT_MAX_BUILD_BYTES}. */
  maxBuildBytes?: number | undefined;
  /** Default {@link DEFAULT_MAX_OUTPUT_BYTES}. */
  maxOutputBytes?: number | undefined;
  /**
   * buildah's storage (images pulled for `FROM`, kept between builds), under
   * a lock: default `<store tmp>/../buildah` for a directory store, else
   * `<workDir>/buildah`. Never the host's `/var/lib/containers`.
   */
  buildahRoot?: string | undefined;
  /** Scratch space (default: the store's `tmp/`, else the OS temp dir). */
  workDir?: string | undefined;
  /** Where `DSEC_REGISTRY_USERNAME`/`DSEC_REGISTRY_PASSWORD` are read (default `process.env`). */
  env?: NodeJS.ProcessEnv | undefined;
  /**
   * The registry hosts (`host[:port]`, lower case) those credentials may be
   * sent to. Absent: every host a stage's `FROM` names, as `dsec image
   * build` does for the operator's own Dockerfile. A Dockerfile somebody
   * else wrote (the build API's) must not get them for a host it picks
   * (`FROM attacker.example/x` would be sent the node's password).
   */
  credentialHosts?: readonly string[] | undefined;
  /**
   * The registry hosts `FROM` and `COPY --from` images may come from
   * (`buildPullHosts`), checked before any pull. Absent: any host, as for
   * `dsec image build` run by the node's operator.
   */
  pullHosts?: readonly string[] | undefined;
  /**
   * Stages whose `FROM` names one of these references start from the
   * store's layer instead (`FROM e2bdev/base` → the platform's
   * `e2b-base:1`): the layer (a `base`, read from the namespace its record
   * names, `project` absent for the platform's, and refused unless its
   * digest is still `digest`) is copied into buildah's storage under a
   * name of DSec's own and the stage built on it, never pulled. The
   * caller decides what a build may start from (the build API resolves a
   * layer in the caller's own view); the names are resolved before any
   * pull, so such a reference never reaches a registry.
   */
  storeBases?: Record<string, StoreBase> | undefined;
  signal?: AbortSignal | undefined;
  onProgress?(p: DockerfileBuildProgress): void;
}

/** A layer of the store a stage starts `FROM` (`DockerfileBuildOptions.storeBases`). */
export interface StoreBase {
  /** `name:version`. */
  ref: string;
  /** The namespace it is read from (absent: the platform's). */
  project?: string | undefined;
  /** The layer's digest when it was resolved: a record replaced since is refused. */
  digest: string;
}

/** The names store bases get in buildah's storage (no Dockerfile may name them itself). */
const STORE_BASE_PREFIX = 'localhost/dsec-store-base-';

export interface DockerfileBuildResult {
  layer: LayerInfo;
  /** True when an identical build was stored and nothing ran. */
  cached: boolean;
  /** The image's layers bottom first: base layers are shared by diff ID (`oci-diff:<hex>`). */
  layers: DiffLayer[];
  /** buildah's `STEP k/n: …` lines, in order (empty when cached). */
  steps: string[];
  /** The digest of the build's inputs, recorded with the layer (`source: dockerfile@<digest>`). */
  inputDigest: string;
}

/**
 * Builds a Dockerfile into an EROFS layer `name:version`: DSec's one
 * Dockerfile builder (`dsec image build --dockerfile`, Harbor task
 * environments, and the E2B template build to come all call it).
 *
 * The context is copied (bounded, never following a link out of it) into
 * scratch space and hashed with the Dockerfile, build arguments, target,
 * kind and network allowlist; a stored layer of that name whose
 * `source` records the same digest is the answer (`cached: true`) and
 * nothing runs. Otherwise buildah 1.28 (`buildah bud`) builds it in a
 * private storage root under a lock: `FROM` through `registriesConf(registries)`
 * (insecure registries, mirrors, no short-name search) and the same
 * credentials as imports; each `RUN` in a runc container (`--isolation
 * oci`, docs/adr/0021-dockerfile-builds.md) on the network of `network`
 * (DSec's egress policy: Debian's mirrors, the configured registries and
 * `networkAllow`) or on none. The image is pushed to an OCI layout and
 * imported layer by layer: layers of the pulled base images are converted
 * once and shared by diff ID (`oci-diff:<hex>`, as registry imports keep
 * them); layers the build made are sandbox-made and lose device nodes,
 * set-id bits and file capabilities; then they are merged into the layer.
 *
 * Errors (all `DsecError`): `invalid_argument` for a bad Dockerfile,
 * context or option (`field`, `details.reason`, `details.line`), and for a
 * failed step (`details.reason: build_step_failed` with `instruction`,
 * `line`, `outputTail`); `deadline_exceeded` past `timeoutMs`
 * (`build_timeout`); `unavailable` for an unreachable registry; `conflict`
 * when `name:version` holds another build; `aborted` on `signal`. Nothing
 * is left behind on failure: the namespace, the scratch space and the
 * build's container and image are removed.
 */
export async function buildDockerfile(
  store: ImageStore,
  options: DockerfileBuildOptions,
): Promise<DockerfileBuildResult> {
  assertLayerName(options.name);
  const version = options.version ?? DEFAULT_LAYER_VERSION;
  assertLayerVersion(version);
  const kind = options.kind ?? 'base';
  assertLayerKind(kind);
  const compression = erofsCompression(options.compress, REGISTRY_DEFAULT_COMPRESSION);
  const buildArgs = checkBuildArgs(options.buildArgs ?? {});
  const networkAllow = (options.networkAllow ?? []).map(checkDomain);
  const timeoutMs = options.timeoutMs ?? DEFAULT_BUILD_TIMEOUT_MS;
  if (!Number.isInteger(timeoutMs) || timeoutMs <= 0) {
    throw new DsecError('invalid_argument', 'timeoutMs must be a positive integer', {
      field: 'timeoutMs',
    });
  }
  const progress = (p: DockerfileBuildProgress): void => options.onProgress?.(p);
  const contextDir = resolve(options.contextDir);
  const dockerfilePath = resolve(contextDir, options.dockerfile ?? 'Dockerfile');
  const dockerfileText = await readDockerfile(dockerfilePath, options);
  const parsed = parseDockerfile(dockerfileText, options);
  const storeBases = checkStoreBases(options.storeBases);
  if (
    options.target !== undefined &&
    !parsed.stages.some((s) => s.name === options.target!.toLowerCase())
  ) {
    throw new DsecError('invalid_argument', `--target ${options.target}: no stage of that name`, {
      field: 'target',
      details: {
        reason: 'unknown_target',
        stages: parsed.stages.flatMap((s) => (s.name ? [s.name] : [])),
      },
    });
  }

  const workRoot = options.workDir ?? (store instanceof DirImageStore ? store.tmpDir : tmpdir());
  await mkdir(workRoot, { recursive: true });
  const work = await mkdtemp(join(workRoot, 'dockerfile-'));
  const signal = withTimeout(options.signal, timeoutMs);
  try {
    progress({ phase: 'context' });
    const staged = await stageContext(contextDir, join(work, 'context'), options, signal.signal);
    const inputDigest = digestInputs({
      dockerfile: dockerfileText,
      context: staged.digest,
      buildArgs,
      target: options.target?.toLowerCase() ?? '',
      kind,
      networkAllow: [...networkAllow].sort(),
      // Only when there are some: the digests of builds without them stay as they were.
      ...(storeBases.length > 0
        ? { storeBases: storeBases.map(([from, b]) => [from, b.project ?? '', b.ref, b.digest]) }
        : {}),
    });
    const source = `dockerfile@${inputDigest}`;
    if (!options.noCache) {
      const existing = await store
        .getLayer(
          `${options.name}:${version}`,
          options.project !== undefined ? { project: options.project } : {},
        )
        .catch((err: unknown) => {
          if (isDsecError(err, 'image_not_found')) return undefined;
          throw err;
        });
      if (existing?.source === source) {
        progress({ phase: 'done' });
        return { layer: existing, cached: true, layers: [], steps: [], inputDigest };
      }
    }

    const buildahRoot =
      options.buildahRoot ??
      (store instanceof DirImageStore
        ? join(store.tmpDir, '..', 'buildah')
        : join(workRoot, 'buildah'));
    await mkdir(buildahRoot, { recursive: true, mode: 0o700 });
    const built = await withLockFile(
      join(buildahRoot, 'lock'),
      async () =>
        await runBuild({
          options,
          parsed,
          buildArgs,
          networkAllow,
          buildahRoot,
          work,
          dockerfileText,
          storeBases,
          store,
          layoutDir: join(work, 'layout'),
          signal: signal.signal,
          timedOut: signal.timedOut,
          progress,
          importImage: async (image) =>
            await importBuilt(store, image, {
              options,
              kind,
              version,
              source,
              compression,
              work,
              signal: signal.signal,
              progress,
            }),
        }),
      signal.signal,
    );
    return { ...built.imported, cached: false, steps: built.steps, inputDigest };
  } catch (err) {
    if (signal.timedOut() && !options.signal?.aborted) {
      throw new DsecError('deadline_exceeded', `the build ran past ${timeoutMs} ms`, {
        field: 'timeoutMs',
        details: { reason: 'build_timeout', timeoutMs },
        cause: err,
      });
    }
    throw err;
  } finally {
    signal.dispose();
    await rm(work, { recursive: true, force: true });
  }
}

/**
 * The built image as `runBuild` hands it over, buildah's storage still
 * holding it: its layers read in place from that storage, or (where the
 * storage cannot be read directly) pushed to an OCI layout.
 */
type BuiltImage =
  | {
      from: 'storage';
      config: ImageConfig;
      layers: StoredDiffLayer[];
      baseDiffIds: Set<string>;
    }
  | { from: 'layout'; layoutDir: string; baseDiffIds: Set<string> };

interface ImportInput {
  options: DockerfileBuildOptions;
  kind: LayerKind;
  version: string;
  source: string;
  compression: ErofsCompression;
  work: string;
  signal: AbortSignal;
  progress: (p: DockerfileBuildProgress) => void;
}

/**
 * Imports the built image layer by layer: pulled base layers shared by diff
 * ID (`oci-diff:<hex>`), sandbox-made ones cleaned, then merged into the
 * layer. Records of base layers first seen here are stored while the merge
 * and the layer's image are made.
 */
async function importBuilt(
  store: ImageStore,
  image: BuiltImage,
  input: ImportInput,
): Promise<{ layer: LayerInfo; layers: DiffLayer[] }> {
  const { options, work, signal, progress } = input;
  const sandboxMade = (diffId: string | undefined): boolean =>
    diffId === undefined || !image.baseDiffIds.has(diffId);
  let config: ImageConfig;
  let converted: { trees: LayerTree[]; layers: DiffLayer[]; recorded: Promise<void> };
  if (image.from === 'storage') {
    config = image.config;
    converted = await convertStoredLayers(store, {
      layers: image.layers,
      work,
      mounter: options.mounter,
      sandboxMade: (i) => sandboxMade(image.layers[i]?.diffId),
      field: 'dockerfile',
      signal,
      onProgress: progress,
    });
  } else {
    progress({ phase: 'read' });
    const read = await readOciImage(image.layoutDir, { ref: 'image', signal });
    if (read.diffIds.length !== read.layers.length) {
      throw new DsecError(
        'internal',
        'buildah wrote an image whose config lacks one diff ID per layer',
      );
    }
    config = read.config;
    converted = {
      ...(await convertDiffLayers(store, {
        diffIds: read.diffIds,
        blobs: read.layers,
        work,
        mounter: options.mounter,
        sandboxMade: (i) => sandboxMade(read.diffIds[i]),
        field: 'dockerfile',
        signal,
        onProgress: progress,
      })),
      recorded: Promise.resolve(),
    };
  }
  const { trees, layers, recorded } = converted;
  try {
    progress({ phase: 'merge' });
    const rootDir = await mergeImageLayers(trees, {
      emptyDir: join(work, 'layers', 'empty'),
      keepMarks: input.kind !== 'base',
      signal,
    });
    const parents = layers.filter((l) => l.ref !== '').map((l) => l.ref);
    const layer = await buildLayer(store, {
      name: options.name,
      version: input.version,
      kind: input.kind,
      from: { dir: rootDir },
      source: input.source,
      config,
      ...(parents.length > 0 ? { parents } : {}),
      ...(options.split !== undefined ? { split: options.split } : {}),
      ...(options.project !== undefined ? { project: options.project } : {}),
      compress: input.compression,
      workDir: work,
      signal,
      onProgress: progress,
    });
    await recorded;
    return { layer, layers };
  } catch (err) {
    await recorded.catch(() => undefined);
    throw err;
  }
}

interface RunBuildInput {
  options: DockerfileBuildOptions;
  parsed: ParsedDockerfile;
  buildArgs: Record<string, string>;
  networkAllow: string[];
  buildahRoot: string;
  work: string;
  dockerfileText: string;
  storeBases: [string, StoreBase][];
  store: ImageStore;
  layoutDir: string;
  signal: AbortSignal;
  timedOut: () => boolean;
  progress: (p: DockerfileBuildProgress) => void;
  importImage: (image: BuiltImage) => Promise<{ layer: LayerInfo; layers: DiffLayer[] }>;
}

/**
 * `buildah bud`, then the image imported (`importImage`) while buildah's
 * storage still holds it, under the storage lock; the build's image is
 * removed.
 */
async function runBuild(
  input: RunBuildInput,
): Promise<{ steps: string[]; imported: { layer: LayerInfo; layers: DiffLayer[] } }> {
  const { options, buildahRoot, work, signal } = input;
  const storage = [
    '--root',
    join(buildahRoot, 'root'),
    '--runroot',
    join(buildahRoot, 'run'),
    '--storage-driver',
    'overlay',
  ];
  const registriesFile = join(work, 'registries.conf');
  await writeFile(registriesFile, registriesConf(options.registries), { mode: 0o600 });
  const authFile = await credentials(options, input.parsed, work);
  const dockerfileCopy = join(work, 'Dockerfile');
  const workHash = createHash('sha256').update(work).digest('hex').slice(0, 16);
  // Each store base under a name of this build's: a platform's layer named as a pulled base
  // (its layers shared by diff ID, as an import's), a project's as this build's own (its
  // files sandbox-made: a tenant's layer keeps no set-id bit or device node it could not write).
  const localBases = new Map(
    input.storeBases.map(([from, b], i) => [
      from,
      b.project === undefined
        ? `${STORE_BASE_PREFIX}${workHash}-${i}`
        : `localhost/dsec-build-${workHash}-base-${i}`,
    ]),
  );
  await writeFile(
    dockerfileCopy,
    rewriteStoreBases(input.dockerfileText, input.parsed, localBases),
    { mode: 0o600 },
  );
  const env: NodeJS.ProcessEnv = {
    PATH: process.env['PATH'] ?? '/usr/sbin:/usr/bin:/sbin:/bin',
    HOME: work,
    CONTAINERS_REGISTRIES_CONF: registriesFile,
    // No containers.conf or storage.conf of the host's changes what runs.
    CONTAINERS_CONF: join(work, 'containers.conf'),
    CONTAINERS_STORAGE_CONF: join(work, 'storage.conf'),
    TMPDIR: work,
  };
  await writeFile(join(work, 'containers.conf'), '');
  await writeFile(join(work, 'storage.conf'), '[storage]\ndriver = "overlay"\n');
  const tag = `localhost/dsec-build-${workHash}`;

  let net: BuildNetworkHandle | undefined;
  // The network is closed once the RUN steps are over, while the image is imported.
  let closing: Promise<void> | undefined;
  const closeNet = (): Promise<void> => (closing ??= net?.close() ?? Promise.resolve());
  let built = false;
  let removed = false;
  try {
    // The store's bases are not pulled; every other image's registry is checked before the
    // network opens or anything is pulled.
    const pulled = baseImageRefs(input.parsed, input.buildArgs).filter((r) => !localBases.has(r));
    const copied = copyFromImageRefs(input.parsed);
    for (const ref of [...pulled, ...copied]) assertPullHost(ref, options.pullHosts);
    if (options.network) {
      input.progress({ phase: 'network' });
      net = await options.network.open({
        allow: await defaultAllow(options.registries, input.networkAllow),
        signal,
      });
    }
    // Base images pulled and checked first; bud then builds on exactly those (--pull=false).
    for (const [i, [from, base]] of input.storeBases.entries()) {
      input.progress({ phase: 'base', message: `FROM ${from}: the store's ${base.ref}` });
      await importStoreBase(input.store, base, localBases.get(from)!, {
        storage,
        env,
        mounter: options.mounter,
        dir: join(work, `base-${i}`),
        signal,
      });
    }
    await checkBaseImages(pulled, { storage, env, authFile, signal });
    await checkBaseImages(copied, { storage, env, authFile, refuseTriggers: false, signal });
    const args = [
      ...storage,
      'bud',
      '--isolation',
      'oci',
      '--runtime',
      'runc',
      '--format',
      'oci',
      '--layers=false',
      '--pull=false',
      '--retry',
      '0',
      '--network',
      net ? `ns:${net.nsPath}` : 'none',
      ...(net ? ['--dns', net.nameserver] : []),
      ...(authFile ? ['--authfile', authFile] : []),
      '--iidfile',
      join(work, 'iid'),
      '-f',
      dockerfileCopy,
      '-t',
      tag,
      ...Object.entries(input.buildArgs).flatMap(([k, v]) => ['--build-arg', `${k}=${v}`]),
      ...(options.target !== undefined ? ['--target', options.target] : []),
      join(work, 'context'),
    ];
    const steps = await runBud(args, env, input);
    built = true;
    void closeNet().catch(() => undefined);
    try {
      input.progress({ phase: 'export' });
      const [baseDiffIds, stored] = await Promise.all([
        pulledDiffIds(storage, env, tag, signal),
        options.fromStorage === false ? undefined : storedImage(storage, env, input, tag),
      ]);
      if (stored) {
        const imported = await input.importImage({ from: 'storage', ...stored, baseDiffIds });
        return { steps, imported };
      }
      await runTool(
        'buildah',
        [
          ...storage,
          'push',
          '--quiet',
          '--disable-compression',
          tag,
          `oci:${input.layoutDir}:image`,
        ],
        { env, signal },
      );
      const imported = await input.importImage({
        from: 'layout',
        layoutDir: input.layoutDir,
        baseDiffIds,
      });
      return { steps, imported };
    } finally {
      await runTool('buildah', [...storage, 'rmi', '--force', tag], { env }).catch(() => undefined);
      removed = true;
    }
  } finally {
    // A failed or stopped build leaves its working container mounted (a
    // finished `bud` removed its own); and the storage keeps its own home
    // mounted: nothing of the build stays mounted.
    if (!built)
      await runTool('buildah', [...storage, 'rm', '--all'], { env }).catch(() => undefined);
    if (!removed)
      await runTool('buildah', [...storage, 'rmi', '--force', tag], { env }).catch(() => undefined);
    for (const name of localBases.values())
      await runTool('buildah', [...storage, 'rmi', '--force', name], { env }).catch(
        () => undefined,
      );
    await runTool('umount', [join(buildahRoot, 'root', 'overlay')]).catch(() => undefined);
    await closeNet();
  }
}

/**
 * The built image's config and layers read from buildah's storage, or
 * `undefined` where `readStoredLayers` cannot vouch for them (the caller
 * then pushes the image to an OCI layout).
 */
async function storedImage(
  storage: string[],
  env: NodeJS.ProcessEnv,
  input: RunBuildInput,
  tag: string,
): Promise<{ config: ImageConfig; layers: StoredDiffLayer[] } | undefined> {
  const iid = (await readFile(join(input.work, 'iid'), 'utf8').catch(() => '')).trim();
  if (!/^(sha256:)?[0-9a-f]{64}$/.test(iid)) return undefined;
  const out = await runTool('buildah', [...storage, 'inspect', '--type', 'image', tag], {
    env,
    signal: input.signal,
  });
  const oci = (JSON.parse(out.stdout) as { OCIv1?: unknown }).OCIv1;
  const diffIds = (oci as { rootfs?: { diff_ids?: unknown } } | undefined)?.rootfs?.diff_ids;
  if (!Array.isArray(diffIds) || !diffIds.every((d) => typeof d === 'string')) return undefined;
  const layers = await readStoredLayers(join(input.buildahRoot, 'root'), iid, diffIds);
  if (!layers) return undefined;
  return { config: imageConfig(oci), layers };
}

/**
 * The diff IDs of the images buildah pulled (named, not this build's):
 * layers the build's image shares with them came from a registry, as an
 * import would have taken them; the rest a `RUN` or `COPY` made.
 */
async function pulledDiffIds(
  storage: string[],
  env: NodeJS.ProcessEnv,
  tag: string,
  signal: AbortSignal,
): Promise<Set<string>> {
  const { stdout } = await runTool('buildah', [...storage, 'images', '--json'], { env, signal });
  const images = JSON.parse(stdout || '[]') as { id?: string; names?: string[] | null }[];
  const ids = new Set<string>();
  for (const img of images) {
    const names = img.names ?? [];
    if (typeof img.id !== 'string' || names.length === 0) continue;
    if (names.some((n) => n.startsWith('localhost/dsec-build-') || n.startsWith(`${tag}:`)))
      continue;
    const out = await runTool('buildah', [...storage, 'inspect', '--type', 'image', img.id], {
      env,
      signal,
    });
    const inspected = JSON.parse(out.stdout) as { OCIv1?: { rootfs?: { diff_ids?: unknown } } };
    const diffIds = inspected.OCIv1?.rootfs?.diff_ids;
    if (Array.isArray(diffIds)) for (const d of diffIds) if (typeof d === 'string') ids.add(d);
  }
  return ids;
}

/** Runs `buildah bud`, streaming its `STEP` lines; a failure names the step, its line and its output's tail. */
async function runBud(
  args: string[],
  env: NodeJS.ProcessEnv,
  input: RunBuildInput,
): Promise<string[]> {
  const { signal } = input;
  throwIfAborted(signal);
  const maxOutput = input.options.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
  const tracker = new StepTracker(input.parsed);
  const steps: string[] = [];
  let current: { text: string; line: number } | undefined;
  let sinceStep: string[] = [];
  let sinceStepBytes = 0;
  let lastError = '';
  const onLine = (raw: string): void => {
    const line = raw.length > MAX_LINE_BYTES ? `${raw.slice(0, MAX_LINE_BYTES)}…` : raw;
    const step = tracker.step(line);
    if (step) {
      steps.push(line);
      current = { text: step.instruction.text, line: step.instruction.line };
      sinceStep = [];
      sinceStepBytes = 0;
      input.progress({
        phase: 'step',
        done: step.done,
        total: step.total,
        message: line,
        line: step.instruction.line,
      });
      return;
    }
    if (line.startsWith('Error: ')) lastError = line;
    input.progress({ phase: 'output', message: line });
    sinceStep.push(line);
    sinceStepBytes += line.length + 1;
    while (sinceStepBytes > maxOutput && sinceStep.length > 1)
      sinceStepBytes -= sinceStep.shift()!.length + 1;
  };
  const child = spawn('buildah', args, { env, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  const partial = { out: '', err: '' };
  const feed = (which: 'out' | 'err', chunk: string): void => {
    const parts = (partial[which] + chunk).split(/\r?\n/);
    partial[which] = parts.pop() ?? '';
    // A line without end is cut, not buffered without bound.
    if (partial[which].length > MAX_LINE_BYTES) {
      parts.push(partial[which]);
      partial[which] = '';
    }
    for (const p of parts) if (p !== '') onLine(p);
  };
  child.stdout.setEncoding('utf8').on('data', (c: string) => feed('out', c));
  child.stderr.setEncoding('utf8').on('data', (c: string) => feed('err', c));
  const kill = (): void => {
    // The process group: buildah and the runc it started.
    try {
      if (child.pid !== undefined) process.kill(-child.pid, 'SIGKILL');
    } catch {
      // already gone
    }
  };
  signal.addEventListener('abort', kill, { once: true });
  // What the build adds to buildah's storage (pulled bases and what steps
  // write), sampled while it runs: past the bound, the build is stopped.
  const maxBytes = input.options.maxBuildBytes ?? DEFAULT_MAX_BUILD_BYTES;
  const storageDir = join(input.buildahRoot, 'root');
  const before = await duBytes(storageDir);
  let overBytes: number | undefined;
  let sampling = false;
  const poll = setInterval(() => {
    if (sampling) return;
    sampling = true;
    void duBytes(storageDir)
      .then((now) => {
        if (now - before > maxBytes && overBytes === undefined) {
          overBytes = now - before;
          kill();
        }
      })
      .finally(() => {
        sampling = false;
      });
  }, DISK_POLL_MS);
  const code = await new Promise<number | null>((res, rej) => {
    child.once('error', (err) =>
      rej(new DsecError('internal', `cannot run buildah: ${err.message}`, { cause: err })),
    );
    child.once('close', (c) => res(c));
  }).finally(() => {
    signal.removeEventListener('abort', kill);
    clearInterval(poll);
  });
  if (overBytes !== undefined) {
    throw new DsecError(
      'resource_exhausted',
      `the build wrote more than ${maxBytes} bytes${current ? ` (at Dockerfile line ${current.line}: ${current.text})` : ''}; raise maxBuildBytes`,
      {
        field: 'dockerfile',
        details: {
          reason: 'build_disk',
          maxBuildBytes: maxBytes,
          ...(current ? { line: current.line, instruction: current.text } : {}),
        },
      },
    );
  }
  for (const which of ['out', 'err'] as const) if (partial[which] !== '') onLine(partial[which]);
  if (signal.aborted) {
    throw new DsecError('aborted', 'the Dockerfile build was stopped', { cause: signal.reason });
  }
  if (code === 0) return steps;
  const tail = sinceStep.filter((l) => !l.startsWith('Error: ')).slice(-TAIL_LINES);
  const registry = classifyPullError(lastError);
  if (registry && current?.text.startsWith('FROM ')) {
    throw new DsecError(
      registry.code,
      `Dockerfile line ${current.line}: ${current.text}: ${lastError.slice(7)}`,
      {
        field: 'dockerfile',
        details: { reason: registry.reason, instruction: current.text, line: current.line },
      },
    );
  }
  if (!current) {
    throw new DsecError(
      'invalid_argument',
      `buildah refused the Dockerfile: ${lastError.slice(7) || tail.join('\n')}`,
      {
        field: 'dockerfile',
        details: { reason: 'syntax', outputTail: tail.join('\n') },
      },
    );
  }
  throw new DsecError(
    'invalid_argument',
    `Dockerfile line ${current.line}: ${current.text} failed${lastError ? ` (${lastError.slice(7)})` : ''}${tail.length > 0 ? `:\n${tail.join('\n')}` : ''}`,
    {
      field: 'dockerfile',
      details: {
        reason: 'build_step_failed',
        instruction: current.text,
        line: current.line,
        exitCode: code,
        outputTail: tail.join('\n'),
      },
    },
  );
}

function classifyPullError(
  text: string,
): { code: 'unavailable' | 'permission_denied' | 'image_not_found'; reason: string } | undefined {
  if (text === '') return undefined;
  if (/unauthorized|authentication required|denied|401|403/i.test(text)) {
    return { code: 'permission_denied', reason: 'registry_auth' };
  }
  if (/manifest unknown|name unknown|not found|\b404\b/i.test(text)) {
    return { code: 'image_not_found', reason: 'unknown_tag' };
  }
  if (
    /connection refused|no such host|i\/o timeout|network is unreachable|server gave HTTP response|x509|tls:/i.test(
      text,
    )
  ) {
    return { code: 'unavailable', reason: 'registry_unreachable' };
  }
  return undefined;
}

/**
 * An auth file for buildah: the configured one, else one written from
 * `DSEC_REGISTRY_USERNAME`/`DSEC_REGISTRY_PASSWORD` for every registry a
 * `FROM` names (0600, in scratch space; never on a command line).
 */
/**
 * The registry hosts of the stages' `FROM`s that get the environment's
 * registry credentials: each named host (`host.name/…`, `host:port/…`,
 * `localhost/…`), only those in `allowed` when it is given.
 */
export function credentialHostsOf(
  parsed: ParsedDockerfile,
  allowed?: readonly string[],
): Set<string> {
  const ok = allowed === undefined ? undefined : new Set(allowed.map((h) => h.toLowerCase()));
  const stageNames = new Set(parsed.stages.flatMap((s) => (s.name ? [s.name] : [])));
  const hosts = new Set<string>();
  for (const s of parsed.stages) {
    if (stageNames.has(s.from.toLowerCase())) continue;
    const host = s.from.split('/')[0]!;
    if (!s.from.includes('/') || !/[.:]|^localhost$/.test(host)) continue;
    if (ok === undefined || ok.has(host.toLowerCase())) hosts.add(host);
  }
  return hosts;
}

async function credentials(
  options: DockerfileBuildOptions,
  parsed: ParsedDockerfile,
  work: string,
): Promise<string | undefined> {
  if (options.registries.authFile !== undefined) {
    if (!(await stat(options.registries.authFile).catch(() => undefined))?.isFile()) {
      throw new DsecError(
        'invalid_argument',
        `auth file ${options.registries.authFile} does not exist`,
        {
          field: 'authFile',
        },
      );
    }
    return options.registries.authFile;
  }
  const env = options.env ?? process.env;
  const user = env['DSEC_REGISTRY_USERNAME'];
  if (user === undefined || user === '') return undefined;
  const auth = Buffer.from(`${user}:${env['DSEC_REGISTRY_PASSWORD'] ?? ''}`).toString('base64');
  const hosts = credentialHostsOf(parsed, options.credentialHosts);
  const file = join(work, 'auth.json');
  await writeFile(
    file,
    JSON.stringify({ auths: Object.fromEntries([...hosts].map((h) => [h, { auth }])) }),
    {
      mode: 0o600,
    },
  );
  return file;
}

/**
 * What `RUN` steps reach by default: Debian's mirrors (`deb.debian.org`,
 * `security.debian.org` and every host the node's apt sources name), the
 * configured registries (their host names; IP literals as /32 or /128 on
 * their port), and `extra`.
 */
export async function defaultAllow(
  registries: RegistrySettings,
  extra: string[],
): Promise<NetworkTarget[]> {
  const domains = new Set(['deb.debian.org', 'security.debian.org', ...extra]);
  for (const host of await aptHosts()) domains.add(host);
  const cidrs: NetworkTarget[] = [];
  const hosts = new Set([
    ...registries.insecure,
    ...Object.keys(registries.mirrors),
    ...Object.values(registries.mirrors).flat(),
  ]);
  for (const hp of hosts) {
    const m = /^(?:\[([0-9a-f:]+)\]|([^:]+))(?::(\d+))?$/i.exec(hp);
    if (!m) continue;
    const port = m[3] !== undefined ? [Number(m[3])] : undefined;
    if (m[1] !== undefined) {
      if (m[1] !== '::1') cidrs.push({ cidr: `${m[1]}/128`, ...(port ? { ports: port } : {}) });
    } else if (/^\d+\.\d+\.\d+\.\d+$/.test(m[2]!)) {
      // Loopback is the build's own namespace, never the host's.
      if (!m[2]!.startsWith('127.'))
        cidrs.push({ cidr: `${m[2]}/32`, ...(port ? { ports: port } : {}) });
    } else if (m[2] !== 'localhost') domains.add(m[2]!.toLowerCase());
  }
  return [...[...domains].sort().map((domain) => ({ domain })), ...cidrs];
}

/** Host names in the node's apt sources (`sources.list`, `sources.list.d/*`). */
async function aptHosts(aptDir = '/etc/apt'): Promise<string[]> {
  const files = [join(aptDir, 'sources.list')];
  const d = join(aptDir, 'sources.list.d');
  for (const f of (await readdir(d).catch(() => [] as string[])).sort()) files.push(join(d, f));
  const hosts = new Set<string>();
  for (const file of files) {
    const text = await readFile(file, 'utf8').catch(() => '');
    for (const m of text.matchAll(/https?:\/\/([A-Za-z0-9.-]+)(?::\d+)?\//g)) {
      if (!/^(#|\s*#)/.test(m.input.slice(m.input.lastIndexOf('\n', m.index) + 1, m.index)))
        hosts.add(m[1]!.toLowerCase());
    }
  }
  return [...hosts];
}

async function readDockerfile(path: string, limits: DockerfileLimits): Promise<string> {
  const st = await lstat(path).catch(() => undefined);
  if (!st?.isFile()) {
    throw new DsecError('invalid_argument', `no Dockerfile at ${path} (a regular file)`, {
      field: 'dockerfile',
    });
  }
  const max = limits.maxDockerfileBytes ?? 1024 * 1024;
  if (st.size > max) {
    throw new DsecError('invalid_argument', `${path} is larger than ${max} bytes`, {
      field: 'dockerfile',
      details: { reason: 'too_large', maxDockerfileBytes: max },
    });
  }
  return await readFile(path, 'utf8');
}

function checkBuildArgs(args: Record<string, string>): Record<string, string> {
  const entries = Object.entries(args);
  if (entries.length > MAX_BUILD_ARGS) {
    throw new DsecError('invalid_argument', `at most ${MAX_BUILD_ARGS} build arguments`, {
      field: 'buildArgs',
    });
  }
  const out: Record<string, string> = {};
  for (const [k, v] of entries.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))) {
    if (
      !/^[A-Za-z_][A-Za-z0-9_]{0,127}$/.test(k) ||
      typeof v !== 'string' ||
      Buffer.byteLength(v) > MAX_BUILD_ARG_BYTES ||
      v.includes('\0')
    ) {
      throw new DsecError(
        'invalid_argument',
        `build argument ${JSON.stringify(k)}: NAME=VALUE with a shell-style name and at most ${MAX_BUILD_ARG_BYTES} bytes`,
        {
          field: 'buildArgs',
        },
      );
    }
    out[k] = v;
  }
  return out;
}

function checkDomain(d: string): string {
  const domain = d.trim().toLowerCase();
  if (
    !/^(\*\.)?([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9-]{1,63}$/.test(domain) ||
    domain.length > 253
  ) {
    throw new DsecError(
      'invalid_argument',
      `--network-allow ${JSON.stringify(d)} is not a domain (example.com or *.example.com)`,
      {
        field: 'networkAllow',
      },
    );
  }
  return domain;
}

/** `storeBases` checked: references and layer names well formed, at most 16. */
function checkStoreBases(bases: Record<string, StoreBase> | undefined): [string, StoreBase][] {
  const entries = Object.entries(bases ?? {});
  if (entries.length > 16) {
    throw new DsecError('invalid_argument', 'at most 16 store bases', { field: 'storeBases' });
  }
  for (const [from, base] of entries) {
    if (!/^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$/.test(from) || from.startsWith('localhost/dsec-')) {
      throw new DsecError(
        'invalid_argument',
        `store base ${from.slice(0, 80)}: not an image reference`,
        {
          field: 'storeBases',
        },
      );
    }
    if (parseLayerRef(base.ref) === undefined || !/^sha256:[0-9a-f]{64}$/.test(base.digest)) {
      throw new DsecError(
        'invalid_argument',
        `store base ${from}: ${base.ref.slice(0, 80)} is not a layer`,
        {
          field: 'storeBases',
        },
      );
    }
  }
  return entries;
}

/**
 * The Dockerfile buildah gets: each stage's `FROM` that names a store base
 * names its local copy instead (the `FROM` must be one line, as the E2B
 * template build writes it).
 */
export function rewriteStoreBases(
  text: string,
  parsed: ParsedDockerfile,
  local: ReadonlyMap<string, string>,
): string {
  if (local.size === 0) return text;
  const lines = text.split('\n');
  for (const stage of parsed.stages) {
    const name = local.get(stage.from);
    const ins = stage.instructions[0];
    if (name === undefined || ins === undefined) continue;
    const i = ins.line - 1;
    const m = /^(\s*FROM\s+(?:--platform=\S+\s+)?)(\S+)(.*)$/i.exec(lines[i] ?? '');
    if (!m || m[2] !== stage.from) {
      throw new DsecError(
        'invalid_argument',
        `FROM ${stage.from} (line ${ins.line}): a store base's FROM must be on one line`,
        { field: 'dockerfile', details: { reason: 'store_base', line: ins.line } },
      );
    }
    lines[i] = `${m[1]}${name}${m[3]}`;
  }
  return lines.join('\n');
}

/**
 * Copies the store's layer `base` into buildah's storage as image `name`:
 * its EROFS mounted read-only, its tree copied (`cp -a`: owners, modes,
 * links, xattrs) into a `scratch` container, its config's environment and
 * working directory set, committed. `invalid_argument` (`store_base`) when
 * the record is gone, replaced or not a base.
 */
async function importStoreBase(
  store: ImageStore,
  base: StoreBase,
  name: string,
  o: {
    storage: string[];
    env: NodeJS.ProcessEnv;
    mounter: ErofsMounter;
    dir: string;
    signal: AbortSignal;
  },
): Promise<void> {
  const refused = (why: string): DsecError =>
    new DsecError('invalid_argument', `the base image ${base.ref}: ${why}`, {
      field: 'dockerfile',
      details: { reason: 'store_base', ref: base.ref },
    });
  const layer = await store
    .getLayer(base.ref, base.project !== undefined ? { project: base.project } : {})
    .catch((err: unknown) => {
      if (isDsecError(err, 'image_not_found')) throw refused('no such layer');
      throw err;
    });
  if (layer.digest !== base.digest) throw refused('the layer was replaced during the build');
  if (layer.kind !== 'base') throw refused(`a ${layer.kind} layer, not a base`);
  const { storage, env, signal } = o;
  const mnt = join(o.dir, 'mnt');
  await mkdir(mnt, { recursive: true });
  const image = await store.blobPath(layer.digest, { signal });
  const blobDevice = layer.blobDigest ? await store.blobPath(layer.blobDigest) : undefined;
  const container = `dsec-store-base-${createHash('sha256').update(name).digest('hex').slice(0, 16)}`;
  await runTool('buildah', [...storage, 'rm', container], { env }).catch(() => undefined);
  await runTool(
    'buildah',
    [...storage, 'from', '--quiet', '--pull=false', '--name', container, 'scratch'],
    { env, signal },
  );
  let mounted = false;
  try {
    const root = (
      await runTool('buildah', [...storage, 'mount', container], { env, signal })
    ).stdout.trim();
    await o.mounter.mountErofs(image, mnt, blobDevice ? { blobDevice } : {});
    mounted = true;
    // The copy never follows a link of the layer's (-a is -d: links are copied as links).
    await runTool('cp', ['-a', '--', `${mnt}/.`, `${root}/`], { signal });
    await o.mounter.unmount([mnt], { detach: true });
    mounted = false;
    const config = layer.config ?? {};
    await runTool(
      'buildah',
      [
        ...storage,
        'config',
        ...(config.env ?? []).flatMap((e) => ['--env', e]),
        ...(config.workingDir ? ['--workingdir', config.workingDir] : []),
        ...(config.user ? ['--user', config.user] : []),
        container,
      ],
      { env, signal },
    );
    await runTool(
      'buildah',
      [...storage, 'commit', '--quiet', '--format', 'oci', '--rm', container, name],
      { env, signal },
    );
  } finally {
    if (mounted) await o.mounter.unmount([mnt], { detach: true }).catch(() => undefined);
    await runTool('buildah', [...storage, 'rm', container], { env }).catch(() => undefined);
  }
}

function digestInputs(inputs: Record<string, unknown>): string {
  return `sha256:${createHash('sha256')
    .update(JSON.stringify({ format: CACHE_FORMAT, ...inputs }))
    .digest('hex')}`;
}

function withTimeout(
  outer: AbortSignal | undefined,
  timeoutMs: number,
): { signal: AbortSignal; timedOut: () => boolean; dispose: () => void } {
  const controller = new AbortController();
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    controller.abort(new DsecError('deadline_exceeded', `the build ran past ${timeoutMs} ms`));
  }, timeoutMs);
  timer.unref();
  const onAbort = (): void => controller.abort(outer?.reason);
  if (outer?.aborted) controller.abort(outer.reason);
  else outer?.addEventListener('abort', onAbort, { once: true });
  return {
    signal: controller.signal,
    timedOut: () => timedOut,
    dispose: () => {
      clearTimeout(timer);
      outer?.removeEventListener('abort', onAbort);
    },
  };
}

/** Bytes under `dir` on its filesystem (`du -sxb`), 0 when it is not there yet. */
async function duBytes(dir: string): Promise<number> {
  const r = await runTool('du', ['-sxb', '--', dir]).catch(() => ({ stdout: '0' }));
  return Number(r.stdout.split('\t')[0]) || 0;
}
