import { InvalidArgumentError, type Command } from 'commander';
import type { VolumeInfo } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { formatBytes, formatRelative, formatTable } from '../format.js';
import { parseInteger } from '../parse.js';

/** `dsec volume create|ls|get|rm` (docs/volumes.md). */
export function register(program: Command): void {
  const volume = program
    .command('volume')
    .description("the project's named volumes (mounted with `sandbox create --volume NAME:/path`)");

  volume
    .command('create')
    .description('create a volume of --size-mb MiB on one edge and print its name')
    .argument('<name>', 'lower-case letters, digits, . _ - (at most 63)')
    .requiredOption('--size-mb <n>', 'size limit in MiB (16 to 1048576)', parseInteger)
    .option('--project <id>', "project it belongs to (default: the key's)")
    .action(async (name: string, opts: { sizeMb: number; project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const v = await ctx.client().createVolume(name, {
        sizeMb: opts.sizeMb,
        ...(opts.project !== undefined ? { projectId: opts.project } : {}),
        signal: ctx.signal,
      });
      if (ctx.json) ctx.printJson(v);
      else ctx.out(v.name);
    });

  volume
    .command('ls')
    .description("list the project's volumes")
    .option('--project <id>', "project (default: the key's)")
    .action(async (opts: { project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const list = await ctx.client().listVolumes({
        ...(opts.project !== undefined ? { projectId: opts.project } : {}),
        signal: ctx.signal,
      });
      if (ctx.json) {
        ctx.printJson({ volumes: list });
        return;
      }
      ctx.out(
        formatTable(
          ['NAME', 'SIZE', 'EDGE', 'STATE', 'CREATED'],
          list.map((v) => row(v)),
        ),
      );
    });

  volume
    .command('get')
    .description('show one volume, with the bytes in use and the sandboxes that mount it')
    .argument('<name>', 'volume name')
    .option('--project <id>', "project (default: the key's)")
    .action(async (name: string, opts: { project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const v = await ctx.client().getVolume(name, {
        ...(opts.project !== undefined ? { projectId: opts.project } : {}),
        signal: ctx.signal,
      });
      if (ctx.json) {
        ctx.printJson(v);
        return;
      }
      const lines: [string, string][] = [
        ['name', v.name],
        ['project', v.projectId],
        ['size', formatBytes(v.sizeMb * 2 ** 20)],
        ['used', v.usedBytes === undefined ? '-' : formatBytes(v.usedBytes)],
        ['edge', v.edgeId],
        ['state', v.state],
        ['mounted by', v.mountedBy?.length ? v.mountedBy.join(', ') : '-'],
        ['created', v.createdAt],
      ];
      ctx.out(lines.map(([k, x]) => `${k.padEnd(11)}${x}`).join('\n'));
    });

  volume
    .command('rm')
    .description('delete volumes and their bytes (refused while a sandbox mounts one)')
    .argument('<names...>', 'volume names')
    .option('--project <id>', "project (default: the key's)")
    .action(async (names: string[], opts: { project?: string }, command: Command) => {
      const ctx = contextOf(command);
      const removed: string[] = [];
      for (const name of names) {
        await ctx.client().deleteVolume(name, {
          ...(opts.project !== undefined ? { projectId: opts.project } : {}),
          signal: ctx.signal,
        });
        removed.push(name);
        if (!ctx.json) ctx.out(name);
      }
      if (ctx.json) ctx.printJson({ removed });
    });
}

function row(v: VolumeInfo): string[] {
  return [v.name, formatBytes(v.sizeMb * 2 ** 20), v.edgeId, v.state, formatRelative(v.createdAt)];
}

/** `--volume NAME:/path` of `sandbox create` (repeatable). */
export function collectVolume(
  value: string,
  previous: { name: string; path: string }[] = [],
): { name: string; path: string }[] {
  const colon = value.indexOf(':');
  if (colon <= 0 || !value.slice(colon + 1).startsWith('/'))
    throw new InvalidArgumentError('want NAME:/path (an absolute path in the sandbox)');
  return [...previous, { name: value.slice(0, colon), path: value.slice(colon + 1) }];
}
