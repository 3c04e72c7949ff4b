import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { Command } from 'commander';
import { DsecError, parseLayerRef } from '@dsec/core';
import type { LayerKind } from '@dsec/core';
import {
  buildFromDebs,
  buildLayer,
  importOci,
  makeBusyboxRootfs,
  makeDebianRootfs,
} from '@dsec/images';
import { contextOf } from '../context.js';
import { imageCommand } from './image.js';
import { localStore } from '../stores.js';
import { phaseProgress, printLayer, register as registerManage } from './image-manage.js';

interface BuildOptions {
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
      'build an image layer (EROFS) from a directory, a tarball, an OCI image, busybox or debootstrap',
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
          'give exactly one of --from-dir, --from-tar, --from-oci, --from-busybox, --from-debootstrap, --from-debs',
          {
            field: 'from',
          },
        );
      }
      const store = localStore(ctx);
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
