import type { Command } from 'commander';
import { contextOf } from '../context.js';
import { formatBytes, formatRelative, formatTable } from '../format.js';

/** `dsec image ls`. (`dsec image build` lives in image-build.ts.) */
export function register(program: Command): void {
  const image = imageCommand(program);
  image
    .command('ls')
    .description('list image layers (base, workspace, toolkit)')
    .action(async (_opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      const layers = await ctx.client().listImages({ signal: ctx.signal });
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
    program.command('image').description('list and build image layers')
  );
}
