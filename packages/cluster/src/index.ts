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
import { chmod, mkdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { AddressInfo } from 'node:net';
import { buildApiServer } from '@dsec/apiserver';
import { SandboxIdCodec } from '@dsec/core';
import type { EdgeApi, ImageStore, LayerInfo } from '@dsec/core';
import {
  openContainerEdge,
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
  /** Stops serving. Sandboxes keep running (an edge restart adopts them) unless `stopSandboxes`. */
  close(options?: { stopSandboxes?: boolean }): Promise<void>;
}

export async function startSingleNode(options: SingleNodeOptions): Promise<SingleNode> {
  const { stateDir } = options;
  // 0711: the sandboxes' mapped root must traverse down to their rootfs; nobody may list.
  await mkdir(stateDir, { recursive: true });
  await chmod(stateDir, 0o711);
  const secret = await readOrCreate(join(stateDir, 'cluster.secret'), () =>
    randomBytes(32).toString('hex'),
  );
  const store = options.imageStore
    ? openImageStore(options.imageStore, { cacheDir: join(stateDir, 'image-cache') })
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
      capacity: options.capacity,
      ttlSweepMs: options.ttlSweepMs,
      network: options.network,
      cgroupParent: options.cgroupParent,
      blobCacheBytes: options.blobCacheBytes,
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
  await app.listen({ port: options.port ?? 7420, host: options.host ?? '127.0.0.1' });
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
      await app.close();
      watcher.stop();
      if (closeOptions.stopSandboxes) {
        for (const sb of await edge.listSandboxes({}))
          await edge.stopSandbox(sb.id).catch(() => undefined);
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
