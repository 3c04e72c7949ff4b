/**
 * A whole single-node DSec cluster in one process:
 * IAM on embedded SQLite, a local `dir` image store, one edge with the
 * container backend, the watcher, placement and the apiserver. It is what
 * `dsec up` runs, and the in-process test cluster SDK and CLI tests use.
 *
 * @example
 * ```ts
 * import { startSingleNode } from '@dsec/cluster';
 * const node = await startSingleNode({ stateDir: '/var/lib/dsec', port: 7420 });
 * console.log(`ready ${node.url}`); // admin key in /var/lib/dsec/admin.key
 * await node.close();
 * ```
 */
import { chmod, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import {
  ApiMetrics,
  buildApiServer,
  buildSandboxFusionListener,
  type ImageBuildLimits,
} from '@dsec/apiserver';
import type { FnCallService } from '@dsec/apiserver';
import { DsecError, SandboxIdCodec } from '@dsec/core';
import type { EdgeApi, ImageStore, LayerInfo } from '@dsec/core';
import {
  EdgeMetrics,
  edgeLog,
  ensureDir,
  openContainerEdge,
  serveMetrics,
  type MetricsListener,
  PRIVATE_DIR_MODE,
  TRAVERSE_DIR_MODE,
  type AdmissionConfig,
  type Edge,
  type EdgeCapacity,
  type EdgeGpuConfig,
  type EdgeNetworkOptions,
  type ErofsMountSetting,
  type FnCallPoolsOptions,
} from '@dsec/edge';
import { openControlDb } from '@dsec/iam';
import type { Iam } from '@dsec/iam';
import {
  buildLayer,
  DirImageStore,
  listImages,
  openImageStore,
  registrySettings,
  type RegistrySettings,
} from '@dsec/images';
import { PowerOfKPlacer } from '@dsec/placement';
import { Watcher } from '@dsec/watcher';
import type { Logger } from 'pino';
import { apiBoundsOptions, type ApiBoundsConfig } from './config.js';
import { e2bExtension, type E2bOptions, type LifecycleOptions } from './extensions.js';
import { nodeImageBuilder } from './image-builder.js';
import { listenApi, type Listening } from './listen.js';
import { newClusterSecret, readOrCreateSecret, stopAll } from './roles.js';
import { withServiceRanges } from './service-ranges.js';

export interface SingleNodeOptions {
  /** Everything durable lives here: IAM, image store, edge state, the admin key. */
  stateDir: string;
  /** 0 picks a free port. Default 7420. */
  port?: number;
  host?: string;
  edgeId?: string;
  /** Admission by measured use: caps, overcommit ratios, thresholds (docs/adr/0007). */
  admission?: AdmissionConfig;
  /** Absolute caps, the older form (override the matching `admission` limits). */
  capacity?: Partial<EdgeCapacity>;
  /** Log requests as JSON lines (pino) to stdout. */
  logRequests?: boolean;
  watcherIntervalMs?: number;
  ttlSweepMs?: number;
  /** Sandbox networking of the edge (mode, address ranges, upstream resolver, rule catalogue). */
  network?: EdgeNetworkOptions;
  /** Parent cgroup of the edge's sandboxes. Default `dsec`. */
  cgroupParent?: string;
  /**
   * Where layers live (`openImageStore`): default `stateDir/images`. An
   * `s3://bucket/prefix?endpoint=…` store has its data blobs served on demand
   * through the edge's blob daemon and chunk cache.
   */
  imageStore?: string;
  /** Bytes of the edge's on-demand chunk cache for a remote image store. */
  blobCacheBytes?: number;
  /** OCI runtime binary (default: crun where installed, else runc; ADR 0009). */
  runtimeBinary?: string;
  /** Remount cgroup2 with favordynmods for faster creates (default true; a host-wide setting). */
  cgroupFavorDynmods?: boolean;
  /** How the edge mounts layers: `file`, `loop` or `auto` (default: `DSEC_EROFS_MOUNT`, else probe). */
  erofsMount?: ErofsMountSetting | undefined;
  /** GPUs for FnCall workers (docs/gpu.md; default off). */
  gpus?: EdgeGpuConfig | undefined;
  /** Function calls: runtimes, warm pools, limits; `false` runs none (docs/fncall.md). */
  fncall?: FnCallPoolsOptions | false | undefined;
  /** The E2B-compatible API (docs/e2b.md): template names and the wildcard domain. */
  e2b?: E2bOptions;
  /** Pause and idle settings of the edge (ADR 0012). */
  lifecycle?: LifecycleOptions;
  /**
   * JSON logs (docs/observability.md): the edge's lifecycle, the watcher's
   * edge health, the apiserver's warnings and failures (every request with
   * `logRequests`). Default: none.
   */
  logger?: Logger | undefined;
  /** Serve the node's metrics (apiserver and edge) without a key at `host:port/metrics`. */
  metricsListen?: { host: string; port: number } | undefined;
  /**
   * A keyless SandboxFusion listener bound to one project (docs/fncall.md
   * "SandboxFusion-compatible endpoint"): every `/run_code` on it is a call of
   * `projectId`, counted in its quota. Default: none.
   */
  sandboxFusion?: { host: string; port: number; projectId: string } | undefined;
  /**
   * The apiserver's Host allow-list, per-caller limits and audit retention
   * (a cluster config's `apiserver` section; docs/security.md).
   */
  apiBounds?: ApiBoundsConfig | undefined;
  /**
   * How this node reaches image registries (a config's `registries` section
   * plus the environment, `nodeRegistrySettings`): what its registry imports
   * and builds use. Default: the environment alone.
   */
  registries?: RegistrySettings | undefined;
  /**
   * Dockerfile builds over the API (`POST /v1/images/builds`, docs/images.md):
   * on by default; `false` refuses them (503, `builds_unavailable`);
   * `network: false` gives `RUN` steps no network (else the node's egress
   * policy, as `dsec image build`); `limits` bound them.
   */
  imageBuilds?:
    false | { network?: false | undefined; limits?: Partial<ImageBuildLimits> } | undefined;
}

export interface SingleNode {
  url: string;
  /** The admin listener's `/metrics` URL, with `metricsListen`. */
  metricsUrl?: string | undefined;
  /** The keyless SandboxFusion listener's URL, with `sandboxFusion`. */
  sandboxFusionUrl?: string | undefined;
  /** The admin API key of the root project (also in `stateDir/admin.key`). */
  adminKey: string;
  edge: Edge;
  store: ImageStore;
  iam: Iam;
  /** The registry settings its imports and builds use (`SingleNodeOptions.registries`). */
  registries: RegistrySettings;
  /** Builds a layer into this node's image store. */
  buildLayer(input: Omit<Parameters<typeof buildLayer>[1], 'signal'>): Promise<LayerInfo>;
  /**
   * Stops serving. Requests in flight get `drainMs` (default 2000) to finish
   * while new ones are refused with 503; then every connection is cut,
   * terminals and streams included. Sandboxes keep running (the next start
   * adopts them) unless `stopSandboxes`. Resolves once nothing of the node
   * holds the process: a `dsec up` then exits by itself.
   */
  close(options?: { stopSandboxes?: boolean; drainMs?: number }): Promise<void>;
}

export async function startSingleNode(options: SingleNodeOptions): Promise<SingleNode> {
  const { stateDir } = options;
  // Nothing here is for other host users (docs/adr/0010-private-host-state.md). 0711, not
  // 0700: the sandboxes' mapped roots pass through it to their root filesystems under
  // edge/; without read permission nobody can list it, and everything in it is private.
  ensureDir(stateDir, TRAVERSE_DIR_MODE);
  // A key an older release (or a restored backup) left readable is tightened before use.
  await chmod(join(stateDir, 'admin.key'), 0o600).catch((err: NodeJS.ErrnoException) => {
    if (err.code !== 'ENOENT') throw err;
  });
  const secret = await readOrCreateSecret(join(stateDir, 'cluster.secret'), newClusterSecret);
  // The node's own layers and its cache of a remote store's: root's alone. Layers are
  // tenants' code and data, and nothing unprivileged reads them (root mounts them).
  const cacheDir = join(stateDir, 'image-cache');
  if (options.imageStore) ensureDir(cacheDir, PRIVATE_DIR_MODE);
  else ensureDir(join(stateDir, 'images'), PRIVATE_DIR_MODE);
  const store = options.imageStore
    ? openImageStore(options.imageStore, { cacheDir })
    : new DirImageStore(join(stateDir, 'images'));
  const bounds = apiBoundsOptions(options.apiBounds, options.e2b?.sandboxDomain);
  const control = await openControlDb(join(stateDir, 'iam.db'), bounds.iam);
  const { iam } = control;
  const boot = await iam.bootstrap();
  const keyFile = join(stateDir, 'admin.key');
  if (boot.key) await writeFile(keyFile, boot.key + '\n', { mode: 0o600 });
  const adminKey = (await readFile(keyFile, 'utf8').catch(() => '')).trim();
  if (!adminKey) {
    await control.close();
    throw new Error(
      `${keyFile} is missing but ${join(stateDir, 'iam.db')} exists: restore the key file or use a new --state-dir`,
    );
  }

  const edgeId = options.edgeId ?? 'node-1';
  const { logger } = options;
  const edgeMetrics = new EdgeMetrics({ defaultLabels: { edge: edgeId } });
  let edge: Edge;
  try {
    edge = await openContainerEdge({
      edgeId,
      stateDir: join(stateDir, 'edge'),
      store,
      admission: options.admission,
      capacity: options.capacity,
      ttlSweepMs: options.ttlSweepMs,
      // The node's own services (its API listener, an image store's endpoint) stay closed to sandboxes.
      network: withServiceRanges(options.network, {
        urls: [options.imageStore],
        hosts: [options.host],
      }),
      cgroupParent: options.cgroupParent,
      blobCacheBytes: options.blobCacheBytes,
      ...(options.erofsMount ? { erofsMount: options.erofsMount } : {}),
      ...(options.gpus ? { gpus: options.gpus } : {}),
      ...(options.fncall !== undefined ? { fncall: options.fncall } : {}),
      ...(options.runtimeBinary ? { runtimeBinary: options.runtimeBinary } : {}),
      ...(options.cgroupFavorDynmods !== undefined
        ? { cgroupFavorDynmods: options.cgroupFavorDynmods }
        : {}),
      ...options.lifecycle,
      metrics: edgeMetrics,
      ...(logger ? { log: edgeLog(logger.child({ component: 'edge', edgeId })) } : {}),
    });
  } catch (err) {
    await control.close();
    throw err;
  }
  const edges = new Map<string, EdgeApi>([[edgeId, edge]]);
  const watcher = new Watcher({
    edges,
    intervalMs: options.watcherIntervalMs ?? 1000,
    // The edge runs in this process: a slow probe means a busy event loop, never a lost edge,
    // and marking the only edge down would refuse every placement. It still goes down when it
    // reports itself unhealthy.
    failuresBeforeDown: Number.POSITIVE_INFINITY,
    ...(logger ? { log: edgeLog(logger.child({ component: 'watcher' })) } : {}),
  });
  // From here on a failure (the port taken, a route declared twice, an unknown project) closes
  // what was opened: a node that failed to start leaves no edge, watcher or listener behind.
  let listening: Listening | undefined;
  let sandboxFusion: Listening | undefined;
  let admin: MetricsListener | undefined;
  let fncall: FnCallService | undefined;
  try {
    await watcher.refresh();
    watcher.start();
    const placer = new PowerOfKPlacer({ view: () => watcher.view() });
    // One node: its key-protected `/metrics` shows the edge's series too.
    const apiMetrics = new ApiMetrics();
    apiMetrics.included.push(edgeMetrics.registry);
    const app = buildApiServer({
      iam,
      edges,
      watcher,
      placer,
      ids: new SandboxIdCodec(secret),
      // Every request at info with logRequests; else warnings and failures only.
      logger: logger
        ? logger.child({ component: 'apiserver' }, { level: options.logRequests ? 'info' : 'warn' })
        : (options.logRequests ?? false),
      metrics: apiMetrics,
      imagesList: (o) => listImages(store, o),
      imagesRemove: (ref, project) => store.removeLayer(ref, { project }),
      ...(options.imageBuilds !== false
        ? {
            imageBuilder: nodeImageBuilder({
              store,
              stateDir,
              registries: options.registries ?? registrySettings(undefined, process.env),
              network: options.imageBuilds?.network === false ? false : options.network,
              concurrency: options.imageBuilds?.limits?.maxBuilds,
            }),
            imageBuildLimits: options.imageBuilds?.limits,
          }
        : {}),
      extend: e2bExtension(options.e2b),
      onFnCallService: (service) => {
        fncall = service;
      },
      ...bounds.api,
    });
    listening = await listenApi(app, {
      host: options.host ?? '127.0.0.1',
      port: options.port ?? 7420,
    });
    if (options.sandboxFusion) {
      const { projectId } = options.sandboxFusion;
      if ((await iam.lineage(projectId)).length === 0) {
        throw new DsecError('invalid_argument', `no project ${JSON.stringify(projectId)}`, {
          field: 'sandboxfusion-project',
        });
      }
      sandboxFusion = await listenApi(
        buildSandboxFusionListener({ fncall: fncall!, projectId }),
        options.sandboxFusion,
      );
      logger?.info({ url: sandboxFusion.url, projectId }, 'sandboxfusion listening');
    }
    if (options.metricsListen) {
      admin = await serveMetrics({ registries: apiMetrics.registries(), ...options.metricsListen });
      logger?.info({ url: admin.url }, 'metrics listening');
    }
  } catch (err) {
    await admin?.close().catch(() => undefined);
    await sandboxFusion?.close(0).catch(() => undefined);
    await listening?.close(0).catch(() => undefined);
    watcher.stop();
    await edge.close().catch(() => undefined);
    await control.close().catch(() => undefined);
    throw err;
  }
  const api = listening;

  return {
    url: api.url,
    metricsUrl: admin?.url,
    sandboxFusionUrl: sandboxFusion?.url,
    adminKey,
    edge,
    store,
    iam,
    registries: options.registries ?? registrySettings(undefined, process.env),
    buildLayer: (input) => buildLayer(store, input),
    async close(closeOptions = {}) {
      await admin?.close();
      await sandboxFusion?.close(closeOptions.drainMs);
      await api.close(closeOptions.drainMs);
      watcher.stop();
      if (closeOptions.stopSandboxes) await stopAll(edge);
      await edge.close();
      await control.close();
    },
  };
}
