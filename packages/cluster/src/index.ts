/**
 * @dsec/cluster — assembles a whole single-node DSec cluster in one process:
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
import { randomBytes } from 'node:crypto';
import { chmod, readFile, writeFile } from 'node:fs/promises';
import type { Socket } from 'node:net';
import { join } from 'node:path';
import type { AddressInfo } from 'node:net';
import { buildApiServer } from '@dsec/apiserver';
import { SandboxIdCodec } from '@dsec/core';
import type { EdgeApi, ImageStore, LayerInfo } from '@dsec/core';
import {
  ensureDir,
  openContainerEdge,
  PRIVATE_DIR_MODE,
  TRAVERSE_DIR_MODE,
  type AdmissionConfig,
  type Edge,
  type EdgeCapacity,
  type EdgeNetworkOptions,
} from '@dsec/edge';
import { Iam } from '@dsec/iam';
import { buildLayer, DirImageStore, openImageStore } from '@dsec/images';
import { PowerOfKPlacer } from '@dsec/placement';
import { Watcher } from '@dsec/watcher';

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
}

export interface SingleNode {
  url: string;
  /** The admin API key of the root project (also in `stateDir/admin.key`). */
  adminKey: string;
  edge: Edge;
  store: ImageStore;
  iam: Iam;
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
  // Keys an older release (or a restored backup) left readable are tightened before use.
  for (const name of ['admin.key', 'cluster.secret']) {
    await chmod(join(stateDir, name), 0o600).catch((err: NodeJS.ErrnoException) => {
      if (err.code !== 'ENOENT') throw err;
    });
  }
  const secret = await readOrCreate(join(stateDir, 'cluster.secret'), () =>
    randomBytes(32).toString('hex'),
  );
  // The node's own layers and its cache of a remote store's: root's alone. Layers are
  // tenants' code and data, and nothing unprivileged reads them (root mounts them).
  const cacheDir = join(stateDir, 'image-cache');
  if (options.imageStore) ensureDir(cacheDir, PRIVATE_DIR_MODE);
  else ensureDir(join(stateDir, 'images'), PRIVATE_DIR_MODE);
  const store = options.imageStore
    ? openImageStore(options.imageStore, { cacheDir })
    : new DirImageStore(join(stateDir, 'images'));
  const iam = Iam.open({ path: join(stateDir, 'iam.db') });
  const boot = iam.bootstrap();
  const keyFile = join(stateDir, 'admin.key');
  if (boot.key) await writeFile(keyFile, boot.key + '\n', { mode: 0o600 });
  const adminKey = (await readFile(keyFile, 'utf8').catch(() => '')).trim();
  if (!adminKey) {
    iam.close();
    throw new Error(
      `${keyFile} is missing but ${join(stateDir, 'iam.db')} exists: restore the key file or use a new --state-dir`,
    );
  }

  const edgeId = options.edgeId ?? 'node-1';
  let edge: Edge;
  try {
    edge = await openContainerEdge({
      edgeId,
      stateDir: join(stateDir, 'edge'),
      store,
      admission: options.admission,
      capacity: options.capacity,
      ttlSweepMs: options.ttlSweepMs,
      network: options.network,
      cgroupParent: options.cgroupParent,
      blobCacheBytes: options.blobCacheBytes,
      ...(options.runtimeBinary ? { runtimeBinary: options.runtimeBinary } : {}),
      ...(options.cgroupFavorDynmods !== undefined
        ? { cgroupFavorDynmods: options.cgroupFavorDynmods }
        : {}),
    });
  } catch (err) {
    iam.close();
    throw err;
  }
  const edges = new Map<string, EdgeApi>([[edgeId, edge]]);
  const watcher = new Watcher({ edges, intervalMs: options.watcherIntervalMs ?? 1000 });
  await watcher.refresh();
  watcher.start();
  const placer = new PowerOfKPlacer({ view: () => watcher.view() });
  const app = buildApiServer({
    iam,
    edges,
    watcher,
    placer,
    ids: new SandboxIdCodec(secret),
    logger: options.logRequests ?? false,
    imagesList: () => store.listLayers(),
  });
  // Every connection, so that close() can cut the ones still open after the drain:
  // upgraded ones (terminals) are no longer the HTTP server's to close.
  const sockets = new Set<Socket>();
  app.server.on('connection', (socket: Socket) => {
    sockets.add(socket);
    socket.once('close', () => sockets.delete(socket));
  });
  // A burst of a thousand clients connecting at once overflows Node's default
  // accept queue (511); the dropped handshakes come back seconds later and
  // meet the headers timeout (408). 4096 is the kernel's default somaxconn.
  await app.listen({
    port: options.port ?? 7420,
    host: options.host ?? '127.0.0.1',
    backlog: 4096,
  });
  const address = app.server.address() as AddressInfo;
  const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;

  return {
    url: `http://${host}:${address.port}`,
    adminKey,
    edge,
    store,
    iam,
    buildLayer: (input) => buildLayer(store, input),
    async close(closeOptions = {}) {
      const closed = app.close();
      const cut = setTimeout(() => {
        app.server.closeAllConnections();
        for (const socket of sockets) socket.destroy();
      }, closeOptions.drainMs ?? 2000);
      try {
        await closed;
      } finally {
        clearTimeout(cut);
      }
      watcher.stop();
      if (closeOptions.stopSandboxes) {
        // A few at a time: each stop waits on its runtime, and a node may hold thousands.
        const queue = await edge.listSandboxes({});
        const worker = async () => {
          for (let sb = queue.pop(); sb; sb = queue.pop())
            await edge.stopSandbox(sb.id).catch(() => undefined);
        };
        await Promise.all(Array.from({ length: 16 }, worker));
      }
      await edge.close();
      iam.close();
    },
  };
}

async function readOrCreate(file: string, make: () => string): Promise<string> {
  try {
    return (await readFile(file, 'utf8')).trim();
  } catch {
    const value = make();
    await writeFile(file, value + '\n', { mode: 0o600, flag: 'wx' }).catch(() => undefined);
    return (await readFile(file, 'utf8')).trim();
  }
}
