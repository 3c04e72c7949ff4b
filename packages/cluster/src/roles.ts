/**
 * The processes of a multi-node cluster (docs/cluster.md), each started from
 * the one config file: an edge serving its `EdgeApi` over HTTP, a stateless
 * apiserver over the shared control database, and a watcher that probes the
 * edges and records their health for every apiserver to place from.
 */
import { randomBytes } from 'node:crypto';
import { chmod, readFile, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { ApiMetrics, buildApiServer } from '@dsec/apiserver';
import { DsecError, SandboxIdCodec } from '@dsec/core';
import type { BackendKind, EdgeApi, ImageStore } from '@dsec/core';
import {
  EdgeMetrics,
  edgeLog,
  ensureDir,
  metricsText,
  openContainerEdge,
  parseListenAddress,
  PRIVATE_DIR_MODE,
  serveMetrics,
  TRAVERSE_DIR_MODE,
  type Edge,
  type EdgeLogFn,
  type MetricsListener,
  type SnapshotLimits,
} from '@dsec/edge';
import type { Logger } from 'pino';
import {
  certificateSha256,
  newEdgeSecret,
  RemoteEdge,
  serveEdge,
  type EdgeTlsOptions,
} from '@dsec/edge-http';
import { openControlDb, type ControlDb, type EdgeRecord } from '@dsec/iam';
import { DirImageStore, listImages, openImageStore, type RegistrySettings } from '@dsec/images';
import { PowerOfKPlacer } from '@dsec/placement';
import {
  apiBoundsOptions,
  apiserverDefaults,
  fncallOptions,
  nodeRegistrySettings,
  requireSection,
  watcherDefaults,
  type ClusterConfig,
  type EdgeConfig,
  type EdgeTlsConfig,
} from './config.js';
import { RegistryFleet } from './fleet.js';
import { e2bExtension } from './extensions.js';
import { listenApi } from './listen.js';
import { clusterServices, withServiceRanges } from './service-ranges.js';

/**
 * Reads a secret file, creating it (0600) with `make()` when missing. A file
 * others can read (an older release, a restored backup) loses those bits
 * first; group bits stay, so a service user in the file's group can read it.
 */
export async function readOrCreateSecret(file: string, make: () => string): Promise<string> {
  const st = await stat(file).catch((err: NodeJS.ErrnoException) => {
    if (err.code === 'ENOENT') return undefined;
    throw err;
  });
  if (st && (st.mode & 0o007) !== 0) await chmod(file, st.mode & 0o770);
  if (!st) {
    // `wx`: of two processes creating it at once, both end up reading the winner's.
    await writeFile(file, make() + '\n', { mode: 0o600, flag: 'wx' }).catch(
      (err: NodeJS.ErrnoException) => {
        if (err.code !== 'EEXIST') throw err;
      },
    );
  }
  const value = (await readFile(file, 'utf8')).trim();
  if (!value) throw new DsecError('invalid_argument', `secret file ${file} is empty`);
  return value;
}

export const newClusterSecret = (): string => randomBytes(32).toString('hex');

/**
 * How a role process logs: `logger` (pino, JSON lines; each component gets a
 * child with `component`), or else `log` for the edge's lifecycle only.
 */
export interface RoleLogging {
  logger?: Logger | undefined;
  log?: EdgeLogFn | undefined;
}

export interface EdgeServerHandle {
  edgeId: string;
  url: string;
  edge: Edge;
  /** The edge's metrics; served at `metricsUrl` when the config has `metricsListen`. */
  metrics: EdgeMetrics;
  metricsUrl?: string | undefined;
  /** The registry settings of this node (the config's `registries` plus the environment). */
  registries: RegistrySettings;
  close(options?: { stopSandboxes?: boolean }): Promise<void>;
}

/** `dsec serve edge`: a container edge behind the authenticated edge protocol. */
export async function startEdgeServer(
  config: ClusterConfig,
  options: RoleLogging = {},
): Promise<EdgeServerHandle> {
  const ec = requireSection(config, 'edge', 'an edge');
  // Checked before anything starts: a malformed DSEC_INSECURE_REGISTRIES fails the start.
  const registries = nodeRegistrySettings(config, process.env);
  const logger = options.logger?.child({ component: 'edge', edgeId: ec.id });
  const log = options.log ?? (logger && edgeLog(logger));
  const metrics = new EdgeMetrics({ defaultLabels: { edge: ec.id } });
  ensureDir(ec.stateDir, TRAVERSE_DIR_MODE);
  const secret = await readOrCreateSecret(ec.secretFile, newEdgeSecret);
  const tls = ec.tls ? await readEdgeTls(ec.tls) : undefined;
  const store = edgeImageStore(config, ec.stateDir);
  const url = edgeUrl(ec);
  const edge = await openContainerEdge({
    edgeId: ec.id,
    url,
    stateDir: ec.stateDir,
    store,
    labels: ec.labels,
    admission: ec.admission,
    // The cluster's own services (database, image store, listeners) stay closed to sandboxes.
    network: withServiceRanges(ec.network, clusterServices(config, ec, url)),
    cgroupParent: ec.cgroupParent ?? `dsec-${ec.id}`,
    blobCacheBytes: ec.blobCacheBytes,
    cgroupFavorDynmods: ec.cgroupFavorDynmods,
    ...(ec.pausedTtlSeconds ? { pausedTtlMs: ec.pausedTtlSeconds * 1000 } : {}),
    ...(ec.idlePauseSeconds ? { idleTimeoutMs: ec.idlePauseSeconds * 1000 } : {}),
    ...(ec.pauseSwapMaxMb !== undefined ? { pauseSwapMaxBytes: ec.pauseSwapMaxMb * 2 ** 20 } : {}),
    ...(ec.runtime ? { runtimeBinary: ec.runtime } : {}),
    ...(ec.erofsMount ? { erofsMount: ec.erofsMount } : {}),
    ...(ec.gpus ? { gpus: ec.gpus } : {}),
    ...(ec.fncall !== undefined ? { fncall: fncallOptions(ec.fncall) } : {}),
    ...(ec.snapshot ? { snapshot: snapshotLimits(ec.snapshot) } : {}),
    ...(log ? { log } : {}),
    metrics,
  });
  let server;
  let admin: MetricsListener | undefined;
  try {
    server = await serveEdge({
      edge,
      secret,
      host: ec.host,
      port: ec.port,
      logger: options.logger?.child({ component: 'edge-http' }) ?? ec.logRequests,
      metrics: () => metricsText([metrics.registry]),
      tls,
    });
    if (ec.metricsListen) {
      admin = await serveMetrics({
        registries: [metrics.registry],
        ...parseListenAddress(ec.metricsListen, 'edge.metricsListen'),
      });
      logger?.info({ url: admin.url }, 'metrics listening');
    }
  } catch (err) {
    await server?.close();
    await edge.close();
    throw err;
  }
  return {
    edgeId: ec.id,
    url: ec.url ?? server.url,
    edge,
    metrics,
    metricsUrl: admin?.url,
    registries,
    async close(closeOptions = {}) {
      await admin?.close();
      await server.close();
      if (closeOptions.stopSandboxes) await stopAll(edge);
      await edge.close();
    },
  };
}

/** The URL apiservers dial: the configured one, else where the edge listens. */
function edgeUrl(ec: EdgeConfig): string {
  const scheme = ec.tls ? 'https' : 'http';
  return ec.url ?? `${scheme}://${ec.host.includes(':') ? `[${ec.host}]` : ec.host}:${ec.port}`;
}

/** The edge's certificate and key, checked to be a certificate at start rather than at the first call. */
async function readEdgeTls(tls: EdgeTlsConfig): Promise<EdgeTlsOptions> {
  const read = (file: string, field: string) =>
    readFile(file, 'utf8').catch((cause: unknown) => {
      throw new DsecError('invalid_argument', `cannot read ${field} ${file}: ${String(cause)}`, {
        field,
        cause,
      });
    });
  const cert = await read(tls.certFile, 'edge.tls.certFile');
  certificateSha256(cert, 'edge.tls.certFile');
  return { cert, key: await read(tls.keyFile, 'edge.tls.keyFile') };
}

/**
 * The pins `dsec edge join` registers for an edge with TLS: `pinSha256`
 * and the fingerprints of `pinCertFiles`, or else that of `certFile`
 * (whoever joins needs whichever it names, never the key).
 */
export async function edgeTlsPins(tls: EdgeTlsConfig): Promise<string[]> {
  const pins = new Set(tls.pinSha256 ?? []);
  const files = tls.pinCertFiles ?? (tls.pinSha256 ? [] : [tls.certFile]);
  for (const [i, file] of files.entries()) {
    const field = tls.pinCertFiles ? `edge.tls.pinCertFiles.${i}` : 'edge.tls.certFile';
    const pem = await readFile(file, 'utf8').catch((cause: unknown) => {
      throw new DsecError(
        'invalid_argument',
        `cannot read ${field} ${file} to pin it (give edge.tls.pinSha256 where the certificate is not at hand): ${String(cause)}`,
        { field, cause },
      );
    });
    pins.add(certificateSha256(pem, field));
  }
  return [...pins];
}

function edgeImageStore(config: ClusterConfig, stateDir: string): ImageStore {
  if (!config.imageStore) {
    ensureDir(join(stateDir, 'images'), PRIVATE_DIR_MODE);
    return new DirImageStore(join(stateDir, 'images'));
  }
  const cacheDir = join(stateDir, 'image-cache');
  ensureDir(cacheDir, PRIVATE_DIR_MODE);
  return openImageStore(config.imageStore, { cacheDir });
}

/** Stops every sandbox of an edge, `concurrency` at a time (each stop waits on its runtime). */
export async function stopAll(edge: EdgeApi, concurrency = 16): Promise<void> {
  const queue = await edge.listSandboxes({});
  const worker = async () => {
    for (let sb = queue.pop(); sb; sb = queue.pop())
      await edge.stopSandbox(sb.id).catch(() => undefined);
  };
  await Promise.all(Array.from({ length: concurrency }, worker));
}

export interface ApiserverHandle {
  url: string;
  /** Where the admin listener serves the metrics (config `apiserver.metricsListen`). */
  metricsUrl?: string | undefined;
  /** Set on the first start of a new control database (also in `apiserver.adminKeyFile`). */
  adminKey?: string | undefined;
  db: ControlDb;
  fleet: RegistryFleet;
  close(options?: { drainMs?: number }): Promise<void>;
}

/** `dsec serve apiserver`: stateless; everything durable is in `database`. */
export async function startApiserver(
  config: ClusterConfig,
  options: RoleLogging & {
    port?: number;
    host?: string;
  } = {},
): Promise<ApiserverHandle> {
  const logger = options.logger?.child({ component: 'apiserver' });
  const log = options.log ?? (logger && edgeLog(logger));
  const database = requireSection(config, 'database', 'an apiserver');
  const secretFile = requireSection(config, 'clusterSecretFile', 'an apiserver');
  const ac = apiserverDefaults(config);
  const bounds = apiBoundsOptions(ac, config.e2b?.sandboxDomain);
  const idSecret = await readOrCreateSecret(secretFile, newClusterSecret);
  const db = await openControlDb(database, bounds.iam);
  let fleet: RegistryFleet | undefined;
  try {
    const boot = await db.iam.bootstrap();
    if (boot.key && ac.adminKeyFile)
      await writeFile(ac.adminKeyFile, boot.key + '\n', { mode: 0o600, flag: 'wx' });
    fleet = new RegistryFleet({
      registry: db.edges,
      refreshMs: ac.registryRefreshMs,
      watch: ac.watch ? watcherDefaults(config) : undefined,
      ...(log ? { onWarning: log } : {}),
    });
    await fleet.start();
    // Listing layers needs no blob cache: only metadata is read.
    const store = config.imageStore ? openImageStore(config.imageStore) : undefined;
    const live = fleet;
    const apiMetrics = new ApiMetrics();
    const app = buildApiServer({
      iam: db.iam,
      edges: (edgeId) => live.edge(edgeId),
      watcher: live,
      placer: new PowerOfKPlacer({ view: () => live.view() }),
      ids: new SandboxIdCodec(idSecret),
      // Every request at info with --log-requests; else warnings and failures only.
      logger: logger
        ? ac.logRequests
          ? logger
          : logger.child({}, { level: 'warn' })
        : ac.logRequests,
      imagesList: store ? (o) => listImages(store, o) : undefined,
      imagesRemove: store ? (ref, project) => store.removeLayer(ref, { project }) : undefined,
      extend: e2bExtension(config.e2b),
      metrics: apiMetrics,
      fncallQuotaShares: ac.fncallQuotaShares,
      ...bounds.api,
    });
    const listening = await listenApi(app, {
      host: options.host ?? ac.host,
      port: options.port ?? ac.port,
    });
    const admin = ac.metricsListen
      ? await serveMetrics({
          registries: [apiMetrics.registry],
          ...parseListenAddress(ac.metricsListen, 'apiserver.metricsListen'),
        }).catch(async (err: unknown) => {
          await listening.close(0);
          throw err;
        })
      : undefined;
    return {
      url: listening.url,
      metricsUrl: admin?.url,
      adminKey: boot.key,
      db,
      fleet: live,
      async close(closeOptions = {}) {
        await admin?.close();
        await listening.close(closeOptions.drainMs);
        live.close();
        await db.close();
      },
    };
  } catch (err) {
    fleet?.close();
    await db.close();
    throw err;
  }
}

/** `dsec serve watcher`: probes every registered edge and records its health. */
export async function startWatcher(
  config: ClusterConfig,
  options: RoleLogging = {},
): Promise<{ fleet: RegistryFleet; close(): Promise<void> }> {
  const logger = options.logger?.child({ component: 'watcher' });
  const log = options.log ?? (logger && edgeLog(logger));
  const database = requireSection(config, 'database', 'a watcher');
  const db = await openControlDb(database);
  const wc = watcherDefaults(config);
  const fleet = new RegistryFleet({
    registry: db.edges,
    refreshMs: Math.min(wc.intervalMs, 1000),
    watch: wc,
    ...(log ? { onWarning: log } : {}),
  });
  try {
    await fleet.start();
  } catch (err) {
    fleet.close();
    await db.close();
    throw err;
  }
  return {
    fleet,
    async close() {
      fleet.close();
      await db.close();
    },
  };
}

/**
 * `dsec edge join`: registers the config's edge in the control database,
 * after checking that it answers at its URL with its ID and credential.
 */
export async function joinEdge(
  config: ClusterConfig,
  options: { url?: string; backends?: BackendKind[]; signal?: AbortSignal } = {},
): Promise<EdgeRecord> {
  const database = requireSection(config, 'database', '`dsec edge join`');
  const ec = requireSection(config, 'edge', '`dsec edge join`');
  const secret = await readOrCreateSecret(ec.secretFile, newEdgeSecret);
  const url = options.url ?? edgeUrl(ec);
  const tlsPins = ec.tls ? await edgeTlsPins(ec.tls) : undefined;
  // The probe pins as every apiserver will: a join proves the registration works.
  const probe = new RemoteEdge({
    edgeId: ec.id,
    url,
    secret,
    ...(tlsPins ? { tls: { pinSha256: tlsPins } } : {}),
  });
  let backends: BackendKind[];
  try {
    const status = await probe.status(options.signal ?? AbortSignal.timeout(10_000));
    if (status.edgeId !== ec.id)
      throw new DsecError('conflict', `the edge at ${url} is ${status.edgeId}, not ${ec.id}`);
    backends = options.backends ?? status.backends;
  } catch (err) {
    if (err instanceof DsecError && err.code === 'conflict') throw err;
    throw new DsecError(
      'unavailable',
      `edge ${ec.id} does not answer at ${url} (${err instanceof Error ? err.message : String(err)}): start it with \`dsec serve edge --config FILE\` first`,
      { cause: err },
    );
  } finally {
    probe.close();
  }
  const db = await openControlDb(database);
  try {
    return await db.edges.register({
      edgeId: ec.id,
      url,
      secret,
      labels: ec.labels,
      backends,
      ...(tlsPins ? { tlsPins } : {}),
    });
  } finally {
    await db.close();
  }
}

/** The cluster config's snapshot bounds (MiB, seconds) as the edge takes them (bytes, ms). */
function snapshotLimits(s: {
  maxFiles?: number | undefined;
  maxMb?: number | undefined;
  memoryMb?: number | undefined;
  timeoutSeconds?: number | undefined;
}): SnapshotLimits {
  return {
    maxFiles: s.maxFiles,
    maxBytes: s.maxMb === undefined ? undefined : s.maxMb * 2 ** 20,
    memoryBytes: s.memoryMb === undefined ? undefined : s.memoryMb * 2 ** 20,
    timeoutMs: s.timeoutSeconds === undefined ? undefined : s.timeoutSeconds * 1000,
  };
}
