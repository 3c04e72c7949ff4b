import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import type { Command } from 'commander';
import {
  DsecError,
  formatLayerRef,
  isDsecError,
  parseLayerKey,
  parseLayerRef,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import {
  collapseLayers,
  DirImageStore,
  erofsCompression,
  importFromRegistry,
  importOci,
  openImageStore,
  REGISTRY_DEFAULT_COMPRESSION,
  transferLayer,
  buildLayer,
  type BuildProgress,
} from '@dsec/images';
import { erofsMountFromEnv, hostErofsMounter } from '@dsec/edge';
import type { CliContext } from '../context.js';
import { contextOf } from '../context.js';
import { formatBytes } from '../format.js';
import { createProgress, type Progress } from '../progress.js';
import { imageCommand } from './image.js';
import { localStore } from '../stores.js';
import { cliRegistrySettings } from '../registries.js';

export function parseRefOrThrow(text: string, field = 'name'): { name: string; version: string } {
  const ref = parseLayerRef(text);
  if (!ref) {
    throw new DsecError('invalid_argument', `invalid image name ${JSON.stringify(text)}`, {
      field,
    });
  }
  return ref;
}

export function parseKind(kind: string): LayerKind {
  if (!['base', 'workspace', 'toolkit'].includes(kind)) {
    throw new DsecError('invalid_argument', '--kind must be base, workspace or toolkit', {
      field: 'kind',
    });
  }
  return kind as LayerKind;
}

/** A progress bar that restarts with the phase in its label (extract → merge → mkfs → store). */
export function phaseProgress(
  ctx: CliContext,
  label: string,
): {
  onProgress: (p: BuildProgress) => void;
  done: () => void;
} {
  let phase: string | undefined;
  let bar: Progress | undefined;
  return {
    onProgress: (p) => {
      if (p.phase === 'done') return;
      if (p.phase !== phase) {
        bar?.done();
        phase = p.phase;
        bar = createProgress({
          label: `${label}: ${p.phase}`,
          total: p.total,
          enabled: !ctx.json,
          // The registry pull counts bytes; the other phases count files or layers.
          ...(p.phase === 'pull' ? { format: formatBytes } : {}),
        });
      }
      bar?.update(p.done ?? 0, p.total);
    },
    done: () => {
      bar?.done();
    },
  };
}

export function printLayer(ctx: CliContext, layer: LayerInfo): void {
  if (ctx.json) ctx.out(JSON.stringify(layer));
  else
    ctx.out(
      `${layer.name}:${layer.version} ${layer.kind} ${layer.digest} (${layer.fileCount} files, ${formatBytes(layer.sizeBytes)})`,
    );
}

interface ImportOptions {
  fromOci?: string;
  fromTar?: string;
  fromRegistry?: string;
  insecure?: boolean;
  authfile?: string;
  config?: string;
  ref?: string;
  kind: string;
  split?: boolean;
  compress?: string;
  keepWhiteouts?: boolean;
}

/**
 * `dsec image import|inspect|rm|push|pull|collapse` — all on the local image
 * store (`<state-dir>/images`), so they work with or without a running
 * cluster. push/pull copy layers to or from another store: a directory (such
 * as a mount of a distributed filesystem shared by many nodes) or an S3
 * bucket (`s3://bucket/prefix?endpoint=…&region=…`, credentials from the
 * environment).
 */
/** `PROJECT/NAME[:VERSION]`, or a ref with `--project`: the namespace a command acts on. */
function ownedRef(text: string, flag: string | undefined): { ref: string; project?: string } {
  const key = parseLayerKey(text);
  if (!key) {
    throw new DsecError(
      'invalid_argument',
      `${JSON.stringify(text)} is not NAME[:VERSION] or PROJECT/NAME[:VERSION]`,
      { field: 'ref' },
    );
  }
  if (key.project !== undefined && flag !== undefined && key.project !== flag) {
    throw new DsecError('invalid_argument', `${text} names another project than --project`, {
      field: 'project',
    });
  }
  const project = key.project ?? flag;
  return { ref: formatLayerRef(key), ...(project !== undefined ? { project } : {}) };
}

export function register(program: Command): void {
  const image = imageCommand(program);

  image
    .command('import <ref>')
    .description(
      'import an OCI image (layout dir, OCI or docker-archive tar) or a tarball as a layer',
    )
    .option(
      '--from-oci <path>',
      'an OCI image layout directory, or a tar of one, or a docker-archive (podman save)',
    )
    .option('--from-tar <file>', 'a root filesystem tarball (plain, .gz, .xz, .zst)')
    .option(
      '--from-registry <ref>',
      'pull docker://HOST/REPO:TAG with skopeo (layers already converted are reused)',
    )
    .option(
      '--insecure',
      'with --from-registry: plain HTTP or an unverified TLS certificate for every host (not needed for a host in DSEC_INSECURE_REGISTRIES or the config file’s registries.insecure)',
    )
    .option(
      '--config <file>',
      'with --from-registry: a cluster config file whose `registries` section applies (default DSEC_CONFIG)',
    )
    .option(
      '--authfile <file>',
      'with --from-registry: a containers auth.json (default REGISTRY_AUTH_FILE, then $XDG_RUNTIME_DIR/containers/auth.json; or DSEC_REGISTRY_USERNAME/DSEC_REGISTRY_PASSWORD)',
    )
    .option('--ref <tag>', 'with --from-oci: which image, when the archive holds several')
    .option('--kind <kind>', 'base, workspace or toolkit', 'base')
    .option('--split', 'store metadata and data separately (data read on demand)')
    .option(
      '--compress <how>',
      `lz4, lz4hc or none, when not split (default ${REGISTRY_DEFAULT_COMPRESSION} for --from-registry, else lz4hc)`,
    )
    .option(
      '--keep-whiteouts',
      'keep OCI whiteouts as overlay whiteouts (default for workspace/toolkit)',
    )
    .action(async (refText: string, opts: ImportOptions, command: Command) => {
      const ctx = contextOf(command);
      const ref = parseRefOrThrow(refText);
      const kind = parseKind(opts.kind);
      if ([opts.fromOci, opts.fromTar, opts.fromRegistry].filter(Boolean).length !== 1) {
        throw new DsecError(
          'invalid_argument',
          'give exactly one of --from-oci, --from-tar, --from-registry',
          { field: 'from' },
        );
      }
      const progress = phaseProgress(ctx, `importing ${ref.name}:${ref.version}`);
      const compress =
        opts.compress === undefined
          ? undefined
          : erofsCompression(opts.compress, REGISTRY_DEFAULT_COMPRESSION, 'compress');
      const common = {
        name: ref.name,
        version: ref.version,
        kind,
        split: opts.split === true,
        ...(compress !== undefined ? { compress } : {}),
        signal: ctx.signal,
        onProgress: progress.onProgress,
      };
      if (opts.fromRegistry) {
        const registries = await cliRegistrySettings(ctx, opts.config);
        const result = await importFromRegistry(localStore(ctx), {
          ...common,
          source: opts.fromRegistry,
          registries,
          ...(opts.insecure ? { insecure: true } : {}),
          ...(opts.authfile !== undefined ? { authFile: opts.authfile } : {}),
          env: ctx.io.env,
          mounter: layerMounter(ctx),
          ...(opts.keepWhiteouts ? { keepWhiteouts: true } : {}),
        });
        progress.done();
        if (ctx.json) {
          ctx.out(
            JSON.stringify({
              ...result.layer,
              layers: result.layers,
              pulledBytes: result.pulledBytes,
              pulledFrom: result.pulledFrom,
            }),
          );
        } else {
          printLayer(ctx, result.layer);
          const reused = result.layers.filter((l) => l.reused).length;
          ctx.out(
            `${result.layers.length} image layers: ${reused} reused, ${result.layers.length - reused} converted; ${formatBytes(result.pulledBytes)} pulled`,
          );
        }
        return;
      }
      const layer = opts.fromOci
        ? await importOci(localStore(ctx), {
            ...common,
            path: opts.fromOci,
            ...(opts.ref !== undefined ? { ref: opts.ref } : {}),
            ...(opts.keepWhiteouts ? { keepWhiteouts: true } : {}),
          })
        : await buildLayer(localStore(ctx), { ...common, from: { tar: opts.fromTar! } });
      progress.done();
      printLayer(ctx, layer);
    });

  image
    .command('inspect <ref>')
    .description(
      'show a layer record: digests, sizes, kind, source, owner, image config (a project’s: PROJECT/NAME[:VERSION] or --project)',
    )
    .option('--project <id>', 'the layer of this project (default: the platform’s)')
    .action(async (refText: string, opts: { project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const { ref, project } = ownedRef(refText, opts.project);
      const layer = await localStore(ctx).getLayer(ref, { project });
      if (ctx.json) {
        ctx.printJson(layer);
        return;
      }
      const rows: [string, string | undefined][] = [
        ['name', `${layer.name}:${layer.version}`],
        ['kind', layer.kind],
        ['digest', layer.digest],
        ['data blob', layer.blobDigest],
        ['size', `${formatBytes(layer.sizeBytes)} (${layer.sizeBytes} bytes)`],
        ['content', `${formatBytes(layer.contentBytes)} in ${layer.fileCount} entries`],
        ['created', layer.createdAt],
        ['source', layer.source],
        ['owner', layer.project ?? 'platform'],
        ['parents', layer.parents?.join(' ')],
        ['env', layer.config?.env?.join(' ')],
        ['cmd', layer.config?.cmd && JSON.stringify(layer.config.cmd)],
        ['entrypoint', layer.config?.entrypoint && JSON.stringify(layer.config.entrypoint)],
        ['workdir', layer.config?.workingDir],
        ['user', layer.config?.user],
      ];
      for (const [k, v] of rows) if (v !== undefined) ctx.out(`${k.padEnd(11)}${v}`);
    });

  image
    .command('rm <ref...>')
    .description(
      'remove layers (blobs no other layer uses are deleted): the platform’s from the local store; a project’s (PROJECT/NAME[:VERSION] or --project) through the API, which gives its bytes back to the project’s quota',
    )
    .option('--project <id>', 'layers of this project (default: the platform’s)')
    .action(async (refs: string[], opts: { project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const store = localStore(ctx);
      for (const text of refs) {
        const { ref, project } = ownedRef(text, opts.project);
        if (project === undefined) await store.removeLayer(ref);
        else {
          await ctx
            .client()
            .deleteImage(ref, { projectId: project, signal: ctx.signal })
            .catch(async (err: unknown) => {
              if (!isDsecError(err, 'unavailable')) throw err;
              // No cluster to ask: the store alone. Its quota ledger is IAM's, updated at the next charge.
              await store.removeLayer(ref, { project });
              ctx.io.stderr.write(
                `warning: no DSec server answered; removed ${text} from the store only, so its bytes still count against the project's imageBytes quota\n`,
              );
            });
        }
        if (!ctx.json) ctx.out(`removed ${text}`);
      }
      if (ctx.json) ctx.out(JSON.stringify({ removed: refs }));
    });

  const transfer =
    (verb: 'push' | 'pull') =>
    async (refs: string[], opts: { to?: string; from?: string }, command: Command) => {
      const ctx = contextOf(command);
      const where = verb === 'push' ? opts.to : opts.from;
      if (!where) {
        throw new DsecError(
          'invalid_argument',
          `${verb} needs ${verb === 'push' ? '--to' : '--from'} STORE`,
          { field: verb === 'push' ? 'to' : 'from' },
        );
      }
      const local = localStore(ctx);
      // A remote store's blobPath downloads whole copies: keep them beside the
      // local store (same filesystem) only for as long as this command runs.
      let cacheDir: string | undefined;
      try {
        const scratch = join(ctx.options.stateDir, 'tmp');
        const remote = await openTransferStore(where, verb === 'push' ? 'to' : 'from', async () => {
          await mkdir(scratch, { recursive: true, mode: 0o700 });
          cacheDir = await mkdtemp(join(scratch, 'remote-cache-'));
          return cacheDir;
        });
        const results = [];
        for (const ref of refs) {
          const bar = createProgress({
            label: `${verb} ${ref}`,
            enabled: !ctx.json,
            format: formatBytes,
          });
          const r = await transferLayer(
            verb === 'push' ? local : remote,
            verb === 'push' ? remote : local,
            ref,
            {
              ...(ctx.signal ? { signal: ctx.signal } : {}),
              onProgress: (p) => bar.update(p.bytesDone, p.bytesTotal),
            },
          );
          bar.done();
          results.push({ ...r.layer, bytesCopied: r.bytesCopied });
          if (!ctx.json)
            ctx.out(
              `${verb === 'push' ? 'pushed' : 'pulled'} ${r.layer.name}:${r.layer.version} (${formatBytes(r.bytesCopied)} copied)`,
            );
        }
        if (ctx.json) ctx.out(JSON.stringify(results));
      } finally {
        if (cacheDir !== undefined) await rm(cacheDir, { recursive: true, force: true });
      }
    };
  const storeHelp =
    'a directory (e.g. a mounted distributed filesystem) or s3://BUCKET/PREFIX?endpoint=URL&region=REGION ' +
    '(credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)';
  image
    .command('push <ref...>')
    .description('copy layers (blobs, then record) from the local store to another store')
    .requiredOption('--to <store>', `the target store: ${storeHelp}`)
    .action(transfer('push'));
  image
    .command('pull <ref...>')
    .description('copy layers (blobs, then record) from another store to the local store')
    .requiredOption('--from <store>', `the source store: ${storeHelp}`)
    .action(transfer('pull'));

  image
    .command('collapse <refs...>')
    .description('merge consecutive layers (bottom first) into one, keeping whiteout semantics')
    .requiredOption('--name <ref>', 'NAME[:VERSION] of the collapsed layer')
    .option('--kind <kind>', 'default: base if the bottom is a base, else the top layer’s kind')
    .option('--split', 'store metadata and data separately (default: when an input is split)')
    .option('--max-bytes <n>', 'refuse above this much content (default 3 GiB)')
    .action(
      async (
        refs: string[],
        opts: { name: string; kind?: string; split?: boolean; maxBytes?: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const ref = parseRefOrThrow(opts.name);
        const progress = phaseProgress(ctx, `collapsing into ${ref.name}:${ref.version}`);
        const maxBytes = opts.maxBytes === undefined ? undefined : Number(opts.maxBytes);
        if (maxBytes !== undefined && !(Number.isSafeInteger(maxBytes) && maxBytes > 0)) {
          throw new DsecError('invalid_argument', '--max-bytes must be a positive integer', {
            field: 'maxBytes',
          });
        }
        const layer = await collapseLayers(localStore(ctx), {
          refs,
          name: ref.name,
          version: ref.version,
          ...(opts.kind !== undefined ? { kind: parseKind(opts.kind) } : {}),
          ...(opts.split ? { split: true } : {}),
          ...(maxBytes !== undefined ? { maxContentBytes: maxBytes } : {}),
          mounter: layerMounter(ctx),
          ...(ctx.signal ? { signal: ctx.signal } : {}),
          onProgress: progress.onProgress,
        });
        progress.done();
        printLayer(ctx, layer);
      },
    );
}

/**
 * Mounts stored layers to copy them out (a reused registry layer, a collapse):
 * file-backed where the kernel has it, else through loop devices, probed on
 * the state dir's filesystem (where the layers are) unless `DSEC_EROFS_MOUNT`
 * says which.
 */
export function layerMounter(ctx: CliContext): ReturnType<typeof hostErofsMounter> {
  return hostErofsMounter({
    probeDir: join(ctx.options.stateDir, 'tmp', `erofs-probe-${process.pid}`),
    setting: erofsMountFromEnv(ctx.io.env),
  });
}

/**
 * The other side of a push or pull: `s3://…` or `dir:/abs` through
 * openImageStore, anything else a directory path (relative to the cwd).
 */
async function openTransferStore(
  where: string,
  field: 'to' | 'from',
  makeCacheDir: () => Promise<string>,
): Promise<ImageStore> {
  if (!/^(s3|dir):/.test(where)) return new DirImageStore(resolve(where));
  try {
    return openImageStore(where, where.startsWith('s3:') ? { cacheDir: await makeCacheDir() } : {});
  } catch (err) {
    if (err instanceof DsecError && err.code === 'invalid_argument') {
      throw new DsecError('invalid_argument', `--${field}: ${err.message}`, {
        field,
        cause: err,
        ...(err.field !== undefined ? { details: { option: err.field } } : {}),
      });
    }
    throw err;
  }
}
