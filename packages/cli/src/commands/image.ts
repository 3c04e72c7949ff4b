import type { Command } from 'commander';
import { isDsecError } from '@dsec/core';
import { isOciDiffLayer } from '@dsec/images';
import { contextOf } from '../context.js';
import { formatBytes, formatRelative, formatTable } from '../format.js';
import { localStore } from '../stores.js';

/** `dsec image ls`. (build: image-build.ts; import/inspect/rm/push/pull/collapse: image-manage.ts.) */
export function register(program: Command): void {
  const image = imageCommand(program);
  image
    .command('ls')
    .description('list image layers (base, workspace, toolkit)')
    .option('--all', 'also list the per-layer records registry imports keep (oci-diff:*)')
    .action(async (opts: { all?: boolean }, command: Command) => {
      const ctx = contextOf(command);
      // No cluster running: the local store is what `dsec up` would serve.
      const all = await ctx
        .client()
        .listImages({ signal: ctx.signal, all: true })
        .catch(async (err: unknown) => {
          if (!isDsecError(err, 'unavailable')) throw err;
          return await localStore(ctx).listLayers();
        });
      const layers = opts.all ? all : all.filter((l) => !isOciDiffLayer(l));
      if (ctx.json) {
        ctx.printJson(layers);
        return;
      }
      const now = Date.now();
      const rows = layers.map((l) => [
        `${l.name}:${l.version}`,
        l.kind,
        formatBytes(l.sizeBytes),
        String(l.fileCount),
        formatRelative(l.createdAt, now),
        l.digest.slice(0, 'sha256:'.length + 12),
      ]);
      ctx.io.stdout.write(
        formatTable(['IMAGE', 'KIND', 'SIZE', 'FILES', 'CREATED', 'DIGEST'], rows),
      );
    });
}

/**
 * The `image` noun, made once per program: other files (image-build.ts) call
 * this too and add their verbs to the same command.
 */
export function imageCommand(program: Command): Command {
  return (
    program.commands.find((c) => c.name() === 'image') ??
    program.command('image').description('build, import, list, move and collapse image layers')
  );
}
