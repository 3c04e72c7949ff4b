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
    .description(
      'list image layers: the platform’s, and the snapshots of your project and its ancestors',
    )
    .option('--all', 'also list the per-layer records registry imports keep (oci-diff:*)')
    .option('--project <id>', 'what this project (yours or a descendant) sees')
    .action(async (opts: { all?: boolean; project?: string }, command: Command) => {
      const ctx = contextOf(command);
      // No cluster running: the local store is what `dsec up` would serve (every owner's layers).
      const all = await ctx
        .client()
        .listImages({
          signal: ctx.signal,
          all: true,
          ...(opts.project !== undefined ? { projectId: opts.project } : {}),
        })
        .catch(async (err: unknown) => {
          if (!isDsecError(err, 'unavailable')) throw err;
          const layers = await localStore(ctx).listLayers();
          return opts.project === undefined
            ? layers
            : layers.filter((l) => l.project === undefined || l.project === opts.project);
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
        l.project ?? 'platform',
      ]);
      ctx.io.stdout.write(
        formatTable(['IMAGE', 'KIND', 'SIZE', 'FILES', 'CREATED', 'DIGEST', 'OWNER'], rows),
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
