import { join } from 'node:path';
import {
  DEFAULT_IMAGE_BUILD_LIMITS,
  type ImageBuilder,
  type ImageBuildRequest,
} from '@dsec/apiserver';
import { DsecError, isDsecError, type ImageStore, type LayerInfo } from '@dsec/core';
import { LinuxNetwork, type EdgeNetworkOptions, type NetworkOptions } from '@dsec/edge';
import {
  buildDockerfile,
  buildPullHosts,
  egressBuildNetwork,
  type BuildNetwork,
  type RegistrySettings,
} from '@dsec/images';
import { mountErofs, unmount } from '@dsec/native';

export interface NodeImageBuilderOptions {
  store: ImageStore;
  /** The node's state directory: buildah's storage at `buildah/`, scratch at `build-api/`. */
  stateDir: string;
  registries: RegistrySettings;
  /**
   * The node's sandbox network settings: `RUN` steps get the node's egress
   * machinery with them (Debian's mirrors and the configured registries),
   * never the host's network; mode `none`, `network: false` or a node not
   * run as root gives them none at all.
   */
  network?: EdgeNetworkOptions | false | undefined;
  /**
   * Builds that may run at once, each in a buildah storage root of its own
   * (`buildah-api/N/`): a build holds its root's lock from the first pull to
   * the import, so with one shared root one tenant's two-hour build held up
   * every other tenant's. Default: the API's `maxBuilds`.
   */
  concurrency?: number | undefined;
}

/**
 * The Dockerfile builder `POST /v1/images/builds` runs on a node that holds
 * the image store (`dsec up`): `buildDockerfile` as `dsec image build
 * --dockerfile` runs it, with the result stored in the caller's project's
 * namespace (`kind: base`), `RUN` steps under the node's egress policy, and
 * the build's output lines handed to the API's log tail.
 */
export function nodeImageBuilder(options: NodeImageBuilderOptions): ImageBuilder {
  const { store, stateDir } = options;
  const concurrency = options.concurrency ?? DEFAULT_IMAGE_BUILD_LIMITS.maxBuilds;
  const slots = new StorageSlots(concurrency);
  // Per slot, too: a build network's table and address range belong to its state directory.
  let networks: BuildNetwork[] | undefined;
  if (options.network !== false && options.network?.mode !== 'none' && process.getuid?.() === 0) {
    const { mode: _mode, ...netOptions } = options.network ?? {};
    networks = Array.from({ length: concurrency }, (_, i) =>
      nodeBuildNetwork(join(stateDir, 'build', String(i)), netOptions),
    );
  }
  const buildIn = async (
    slot: number,
    request: ImageBuildRequest,
  ): Promise<{ layer: LayerInfo; cached: boolean }> => {
    const result = await buildDockerfile(store, {
      project: request.project,
      name: request.name,
      version: request.version,
      kind: 'base',
      contextDir: request.contextDir,
      ...(request.dockerfile !== undefined ? { dockerfile: request.dockerfile } : {}),
      buildArgs: request.buildArgs,
      ...(request.target !== undefined ? { target: request.target } : {}),
      ...(request.storeBases ? { storeBases: request.storeBases } : {}),
      registries: options.registries,
      mounter: { mountErofs, unmount },
      network: networks?.[slot],
      timeoutMs: request.timeoutMs,
      buildahRoot: join(stateDir, 'buildah-api', String(slot)),
      // The node's own credentials for registries; nothing of the caller's environment.
      env: process.env,
      // The tenant wrote the Dockerfile: the node's DSEC_REGISTRY_USERNAME/PASSWORD go only
      // to the registries the node's config names, never to a host a FROM picks.
      credentialHosts: credentialHosts(options.registries),
      // And its FROM pulls run on the node: only from registries the node's config allows.
      pullHosts: buildPullHosts(options.registries),
      signal: request.signal,
      onProgress: (p) => {
        if (p.phase === 'step' || p.phase === 'output') request.onLog(p.message ?? '');
      },
    });
    return { layer: result.layer, cached: result.cached };
  };
  return {
    workDir: join(stateDir, 'build-api'),
    async build(request) {
      const slot = await slots.take(request.signal);
      try {
        return await buildIn(slot, request);
      } finally {
        slots.give(slot);
      }
    },
    remove: async (ref, project) => await store.removeLayer(ref, { project }),
    async tag(project, from, to) {
      const source = await store.getLayer(from, { project });
      const [name, version] = to.split(':') as [string, string];
      await store.removeLayer(to, { project }).catch((err: unknown) => {
        if (!isDsecError(err, 'image_not_found')) throw err;
      });
      await store.putLayer({ ...source, name, version, createdAt: new Date().toISOString() });
      return await store.getLayer(to, { project });
    },
  };
}

/**
 * A fixed set of numbered slots handed out one build each, first come first
 * served; `take` waits for a slot given back (or the build's signal).
 */
export class StorageSlots {
  private readonly free: number[];
  private readonly waiting: Array<(slot: number) => void> = [];

  constructor(count: number) {
    if (!Number.isInteger(count) || count < 1) throw new RangeError(`slots: ${count}`);
    this.free = Array.from({ length: count }, (_, i) => i);
  }

  async take(signal?: AbortSignal): Promise<number> {
    const slot = this.free.shift();
    if (slot !== undefined) return slot;
    return await new Promise<number>((resolve, reject) => {
      const onAbort = () => {
        const i = this.waiting.indexOf(grant);
        if (i >= 0) this.waiting.splice(i, 1);
        reject(new DsecError('aborted', 'the build was cancelled while it waited for a slot'));
      };
      const grant = (s: number) => {
        signal?.removeEventListener('abort', onAbort);
        resolve(s);
      };
      if (signal?.aborted) return onAbort();
      signal?.addEventListener('abort', onAbort, { once: true });
      this.waiting.push(grant);
    });
  }

  give(slot: number): void {
    const next = this.waiting.shift();
    if (next) next(slot);
    else this.free.push(slot);
  }
}

/**
 * The registry hosts the node's config names (insecure registries, mirrored
 * registries and their mirrors): the only ones an API build's `FROM` gets
 * the node's environment credentials for. (A `REGISTRY_AUTH_FILE` names its
 * hosts itself.)
 */
export function credentialHosts(registries: RegistrySettings): string[] {
  const hosts = new Set<string>(registries.insecure.map((h) => h.toLowerCase()));
  for (const [registry, mirrors] of Object.entries(registries.mirrors)) {
    hosts.add(registry.toLowerCase());
    for (const m of mirrors) hosts.add(m.split('/')[0]!.toLowerCase());
  }
  return [...hosts];
}

/**
 * The node's egress machinery for one build, opened only when a build runs
 * (a cached build costs nothing): a `LinuxNetwork` with a table and address
 * range of its own under `stateDir`, so a running edge's sandboxes and the
 * build never share a slot; closed (table and range given back) with the
 * build's namespace. (The same as the CLI's `dsec image build`.)
 */
export function nodeBuildNetwork(
  stateDir: string,
  options: Omit<NetworkOptions, 'stateDir'>,
): BuildNetwork {
  return {
    async open(request) {
      const manager = await LinuxNetwork.open({ ...options, stateDir });
      const close = async (): Promise<void> => {
        // The manager waits for the kernel to drop the build's veth on unref'd timers.
        const hold = setInterval(() => undefined, 1000);
        try {
          await manager.close();
        } finally {
          clearInterval(hold);
        }
      };
      try {
        const handle = await egressBuildNetwork(manager, { first: 0, count: 1 }).open(request);
        return {
          nsPath: handle.nsPath,
          nameserver: handle.nameserver,
          close: async () => {
            try {
              await handle.close();
            } finally {
              await close();
            }
          },
        };
      } catch (err) {
        await close();
        throw err;
      }
    },
  };
}
