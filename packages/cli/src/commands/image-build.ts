import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { Command } from 'commander';
import { DsecError, parseLayerRef } from '@dsec/core';
import type { ImageStore, LayerKind, LayerRef } from '@dsec/core';
import { loadClusterConfig, nodeBuildNetwork, nodeRegistrySettings } from '@dsec/cluster';
import { mountErofs, unmount } from '@dsec/native';
import {
  buildDockerfile,
  buildFromDebs,
  buildLayer,
  importOci,
  makeBusyboxRootfs,
  makeDebianRootfs,
} from '@dsec/images';
import { contextOf, type CliContext } from '../context.js';
import { imageCommand } from './image.js';
import { localStore } from '../stores.js';
import { phaseProgress, printLayer, register as registerManage } from './image-manage.js';
import { remoteDockerfileBuild } from './image-build-remote.js';

interface BuildOptions extends DockerfileCliOptions {
  remote?: boolean;
  fromDir?: string;
  fromTar?: string;
  fromOci?: string;
  ref?: string;
  fromBusybox?: boolean;
  fromDebootstrap?: boolean;
  kind: string;
  split?: boolean;
  packages?: string;
  fromDebs?: string;
  base?: string;
}

/**
 * `dsec image build NAME[:VERSION]`: builds an EROFS layer into the image
 * store under the state directory (no cluster needed; a running one sees it
 * at once).
 */
export function register(program: Command): void {
  registerBuild(program);
  registerManage(program);
}

function registerBuild(program: Command): void {
  imageCommand(program)
    .command('build <ref>')
    .description(
      'build an image layer (EROFS) from a Dockerfile, a directory, a tarball, an OCI image, busybox or debootstrap',
    )
    .option(
      '--dockerfile <dir>',
      'a Dockerfile build context (buildah; RUN steps under an egress policy)',
    )
    .option('--file <path>', 'with --dockerfile: the Dockerfile (default DIR/Dockerfile)')
    .option(
      '--build-arg <k=v>',
      'with --dockerfile: a build argument (repeatable)',
      (v: string, acc: string[]) => [...acc, v],
      [] as string[],
    )
    .option('--target <stage>', 'with --dockerfile: build up to this stage')
    .option(
      '--network-allow <domain>',
      "with --dockerfile: a domain RUN steps may reach besides Debian's mirrors and the configured registries (repeatable)",
      (v: string, acc: string[]) => [...acc, v],
      [] as string[],
    )
    .option('--no-cache', 'with --dockerfile: build even when an identical build is stored')
    .option(
      '--config <file>',
      "with --dockerfile: the node's config file (its registries section, and up.network or edge.network for RUN steps' egress)",
    )
    .option('--timeout <seconds>', 'with --dockerfile: stop a build running longer (default 3600)')
    .option(
      '--remote',
      "with --dockerfile: build on the apiserver's node (POST /v1/images/builds, --url and the key), into the key's project",
    )
    .option('--from-dir <dir>', 'a directory tree')
    .option('--from-tar <file>', 'a tarball (plain, .gz, .xz, .zst)')
    .option('--from-oci <path>', 'an OCI image: layout dir, or a tar of one, or a docker-archive')
    .option('--ref <tag>', 'with --from-oci: which image, when the archive holds several')
    .option('--from-busybox', "a minimal root filesystem from the host's static busybox")
    .option('--from-debootstrap', 'Debian bookworm (minbase) from the Debian mirror')
    .option('--packages <list>', 'with --from-debootstrap: comma-separated packages', 'python3')
    .option(
      '--from-debs <list>',
      'Debian packages (comma-separated) and their dependencies, unpacked without a package manager',
    )
    .option(
      '--base <image>',
      'with --from-debs: the Debian base it goes on (its packages are left out)',
    )
    .option('--kind <kind>', 'base, workspace or toolkit', 'base')
    .option('--split', 'store metadata and data separately (data read on demand)')
    .action(async (refText: string, opts: BuildOptions, command: Command) => {
      const ctx = contextOf(command);
      const ref = parseLayerRef(refText);
      if (!ref)
        throw new DsecError('invalid_argument', `invalid image name ${JSON.stringify(refText)}`, {
          field: 'name',
        });
      if (!['base', 'workspace', 'toolkit'].includes(opts.kind)) {
        throw new DsecError('invalid_argument', `--kind must be base, workspace or toolkit`, {
          field: 'kind',
        });
      }
      const sources = [
        opts.dockerfile,
        opts.fromDir,
        opts.fromTar,
        opts.fromOci,
        opts.fromBusybox,
        opts.fromDebootstrap,
        opts.fromDebs,
      ].filter(Boolean);
      if (sources.length !== 1) {
        throw new DsecError(
          'invalid_argument',
          'give exactly one of --dockerfile, --from-dir, --from-tar, --from-oci, --from-busybox, --from-debootstrap, --from-debs',
          {
            field: 'from',
          },
        );
      }
      if (opts.remote) {
        if (!opts.dockerfile)
          throw new DsecError('invalid_argument', '--remote builds a --dockerfile DIR', {
            field: 'remote',
          });
        await remoteDockerfileBuild(ctx, refText, { ...opts, dockerfile: opts.dockerfile });
        return;
      }
      const store = localStore(ctx);
      if (opts.dockerfile) {
        await buildFromDockerfile(ctx, store, ref, opts.kind as LayerKind, opts);
        return;
      }
      const progress = phaseProgress(ctx, `building ${ref.name}:${ref.version}`);
      let scratch: string | undefined;
      try {
        if (opts.fromOci) {
          const layer = await importOci(store, {
            path: opts.fromOci,
            name: ref.name,
            version: ref.version,
            kind: opts.kind as LayerKind,
            split: opts.split === true,
            ...(opts.ref !== undefined ? { ref: opts.ref } : {}),
            ...(ctx.signal ? { signal: ctx.signal } : {}),
            onProgress: progress.onProgress,
          });
          progress.done();
          printLayer(ctx, layer);
          return;
        }
        if (opts.fromDebs) {
          await mkdir(ctx.options.stateDir, { recursive: true, mode: 0o711 });
          const { layer } = await buildFromDebs(store, {
            name: ref.name,
            version: ref.version,
            kind: opts.kind as LayerKind,
            packages: opts.fromDebs.split(',').filter(Boolean),
            ...(opts.base !== undefined ? { base: opts.base } : {}),
            cacheDir: join(ctx.options.stateDir, 'cache', 'debs'),
            split: opts.split === true,
            ...(ctx.signal ? { signal: ctx.signal } : {}),
            onProgress: progress.onProgress,
          });
          progress.done();
          printLayer(ctx, layer);
          return;
        }
        let from: { dir: string } | { tar: string };
        if (opts.fromTar) from = { tar: opts.fromTar };
        else if (opts.fromDir) from = { dir: opts.fromDir };
        else {
          await mkdir(ctx.options.stateDir, { recursive: true, mode: 0o711 }); // as `dsec up` keeps it
          scratch = await mkdtemp(join(ctx.options.stateDir, 'rootfs-'));
          if (opts.fromBusybox) await makeBusyboxRootfs(scratch);
          else {
            ctx.io.stderr.write('running debootstrap (a few minutes)…\n');
            await makeDebianRootfs(scratch, {
              packages: (opts.packages ?? '').split(',').filter(Boolean),
              signal: ctx.signal,
            });
          }
          from = { dir: scratch };
        }
        const layer = await buildLayer(store, {
          name: ref.name,
          version: ref.version,
          kind: opts.kind as LayerKind,
          from,
          split: opts.split === true,
          source: opts.fromBusybox ? 'busybox' : opts.fromDebootstrap ? 'debootstrap' : undefined,
          signal: ctx.signal,
          onProgress: progress.onProgress,
        });
        progress.done();
        printLayer(ctx, layer);
      } finally {
        if (scratch) await rm(scratch, { recursive: true, force: true });
      }
    });
}

interface DockerfileCliOptions {
  dockerfile?: string;
  file?: string;
  buildArg: string[];
  target?: string;
  networkAllow: string[];
  /** `--no-cache` sets it false. */
  cache: boolean;
  timeout?: string;
  config?: string;
}

/**
 * `dsec image build NAME --dockerfile DIR`: `buildDockerfile` with the
 * node's registry settings (`DSEC_INSECURE_REGISTRIES`,
 * `DSEC_REGISTRY_MIRRORS`, `REGISTRY_AUTH_FILE`), buildah's storage under
 * `<state-dir>/buildah`, and RUN steps on a network namespace of the node's
 * egress machinery (its own nftables table and addresses, under
 * `<state-dir>/build`, removed afterwards). Prints buildah's `STEP` lines on
 * stderr as they come; `--json`: `{ layer, cached, layers, steps }`.
 */
async function buildFromDockerfile(
  ctx: CliContext,
  store: ImageStore,
  ref: LayerRef,
  kind: LayerKind,
  opts: DockerfileCliOptions,
): Promise<void> {
  const buildArgs: Record<string, string> = {};
  for (const a of opts.buildArg) {
    const eq = a.indexOf('=');
    if (eq <= 0) {
      throw new DsecError('invalid_argument', `--build-arg ${JSON.stringify(a)}: give NAME=VALUE`, {
        field: 'buildArgs',
      });
    }
    buildArgs[a.slice(0, eq)] = a.slice(eq + 1);
  }
  let timeoutMs: number | undefined;
  if (opts.timeout !== undefined) {
    const seconds = Number(opts.timeout);
    if (!Number.isFinite(seconds) || seconds <= 0) {
      throw new DsecError('invalid_argument', '--timeout: seconds, a positive number', {
        field: 'timeoutMs',
      });
    }
    timeoutMs = Math.ceil(seconds * 1000);
  }
  // The same file `dsec up` reads (`--config`, else `DSEC_CONFIG`): its registries and its network.
  const configFile = opts.config ?? (ctx.io.env.DSEC_CONFIG || undefined);
  const config = configFile !== undefined ? await loadClusterConfig(configFile) : undefined;
  const registries = nodeRegistrySettings(config, ctx.io.env);
  // The node's egress settings (upstream resolvers, public and protected ranges), not its mode.
  const { mode: _mode, ...netOptions } = config?.up?.network ?? config?.edge?.network ?? {};
  const { stateDir } = ctx.options;
  await mkdir(stateDir, { recursive: true, mode: 0o711 });
  // The node's egress machinery with a table and addresses of its own, so a
  // running edge's sandboxes and this build never share a slot.
  const network =
    process.getuid?.() === 0 ? nodeBuildNetwork(join(stateDir, 'build'), netOptions) : undefined;
  if (!network) ctx.err('note: not root, so no isolated network: RUN steps get none');
  const progress = phaseProgress(ctx, `building ${ref.name}:${ref.version}`);
  try {
    const result = await buildDockerfile(store, {
      name: ref.name,
      version: ref.version,
      kind,
      contextDir: opts.dockerfile!,
      ...(opts.file !== undefined ? { dockerfile: opts.file } : {}),
      buildArgs,
      ...(opts.target !== undefined ? { target: opts.target } : {}),
      networkAllow: opts.networkAllow,
      registries,
      mounter: { mountErofs, unmount },
      network,
      noCache: !opts.cache,
      ...(timeoutMs !== undefined ? { timeoutMs } : {}),
      buildahRoot: join(stateDir, 'buildah'),
      env: ctx.io.env,
      signal: ctx.signal,
      onProgress: (p) => {
        if (p.phase === 'step' || p.phase === 'output') {
          if (!ctx.json) ctx.err(p.phase === 'step' ? (p.message ?? '') : `  ${p.message ?? ''}`);
          return;
        }
        progress.onProgress(p);
      },
    });
    progress.done();
    if (ctx.json) {
      ctx.out(
        JSON.stringify({
          layer: result.layer,
          cached: result.cached,
          layers: result.layers,
          steps: result.steps,
        }),
      );
      return;
    }
    printLayer(ctx, result.layer);
    if (result.cached)
      ctx.out('cached: the same Dockerfile, context, arguments and target were built before');
    else {
      const reused = result.layers.filter((l) => l.reused).length;
      ctx.out(
        `${result.steps.length} steps; ${result.layers.length} image layers, ${reused} reused`,
      );
    }
  } finally {
    progress.done();
  }
}
