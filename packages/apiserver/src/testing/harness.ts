import { randomBytes } from 'node:crypto';
import type { FastifyInstance } from 'fastify';
import { SandboxIdCodec } from '@dsec/core';
import { openControlDb } from '@dsec/iam';
import type { ControlDbOptions, Iam } from '@dsec/iam';
import { PowerOfKPlacer } from '@dsec/placement';
import type { Placer } from '@dsec/placement';
import { Watcher } from '@dsec/watcher';
import { buildApiServer } from '../server.js';
import type { ApiServerOptions } from '../server.js';

type TransportOption =
  | 'headersTimeoutMs'
  | 'requestTimeoutMs'
  | 'connectionTimeoutMs'
  | 'keepAliveTimeoutMs'
  | 'maxConnections';
import { FakeEdge } from './fake-edge.js';

export interface TestApi {
  app: FastifyInstance;
  iam: Iam;
  /** The bootstrap admin key of the root project. */
  rootKey: string;
  rootProjectId: string;
  edges: Map<string, FakeEdge>;
  watcher: Watcher;
  ids: SandboxIdCodec;
  close(): Promise<void>;
}

/**
 * An apiserver over fake edges with a fresh IAM, ready for `app.inject()`.
 * The watcher has probed once; call `watcher.refresh()` after changing edges.
 */
export async function createTestApi(
  options: {
    edges?: FakeEdge[];
    /** The control database: a SQLite file, a `postgres://` URL, or (default) `:memory:`. */
    iamPath?: string;
    /** How long IAM trusts a key it looked up (`IamOptions.authCacheTtlMs`; default 1000). */
    authCacheTtlMs?: number;
    placer?: (watcher: Watcher) => Placer;
    /** The fleet view the apiserver reads (default the watcher's own). */
    fleet?: (watcher: Watcher) => ApiServerOptions['watcher'];
    logger?: boolean;
    /** Transport limits (timeouts, connection cap) passed to `buildApiServer`. */
    transport?: Partial<Pick<ApiServerOptions, TransportOption>>;
    /** Per-caller bounds (`ApiServerOptions.limits`). */
    limits?: ApiServerOptions['limits'];
    /** Host names the server answers besides loopback and IP literals. */
    allowedHosts?: ApiServerOptions['allowedHosts'];
    /** IAM settings (clock, failed-authentication limits, audit retention). */
    iamOptions?: ControlDbOptions;
    imagesList?: ApiServerOptions['imagesList'];
    imagesRemove?: ApiServerOptions['imagesRemove'];
  } = {},
): Promise<TestApi> {
  const db = await openControlDb(options.iamPath ?? ':memory:', {
    ...options.iamOptions,
    ...(options.authCacheTtlMs === undefined ? {} : { authCacheTtlMs: options.authCacheTtlMs }),
  });
  const { iam } = db;
  const boot = await iam.bootstrap();
  const edges = new Map(
    (options.edges ?? [new FakeEdge({ edgeId: 'edge-a' })]).map((e) => [e.edgeId, e]),
  );
  const watcher = new Watcher({ edges });
  await watcher.refresh();
  const placer = options.placer?.(watcher) ?? new PowerOfKPlacer({ view: () => watcher.view() });
  const ids = new SandboxIdCodec(randomBytes(32));
  const app = buildApiServer({
    iam,
    edges,
    watcher: options.fleet?.(watcher) ?? watcher,
    placer,
    ids,
    logger: options.logger,
    imagesList: options.imagesList,
    imagesRemove: options.imagesRemove,
    limits: options.limits,
    allowedHosts: options.allowedHosts,
    ...options.transport,
  });
  return {
    app,
    iam,
    rootKey: boot.key ?? '',
    rootProjectId: boot.projectId,
    edges,
    watcher,
    ids,
    close: async () => {
      await app.close();
      await db.close();
    },
  };
}
