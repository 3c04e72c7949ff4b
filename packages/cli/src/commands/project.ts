import type { Command } from 'commander';
import { contextOf } from '../context.js';
import { formatBytes, formatTable } from '../format.js';
import { parseInteger, parseNumber } from '../parse.js';

/** `dsec project create|ls`. */
export function register(program: Command): void {
  const project = program.command('project').description('projects own sandboxes, quotas and keys');

  project
    .command('create')
    .description('create a project (under yours unless --parent) and print its ID')
    .argument('<name>', 'project name')
    .option('--parent <id>', 'parent project')
    .option('--max-sandboxes <n>', 'quota: live sandboxes', parseInteger)
    .option('--max-memory-mb <n>', 'quota: memory of live sandboxes, MiB', parseInteger)
    .option('--max-cpus <n>', 'quota: CPU cores of live sandboxes', parseNumber)
    .option(
      '--max-fncalls-per-second <n>',
      'quota: function calls started per second',
      parseInteger,
    )
    .option(
      '--max-image-bytes <n>',
      'quota: bytes of the layers (snapshots, forks) the project and its children own',
      parseInteger,
    )
    .option(
      '--max-volume-bytes <n>',
      'quota: bytes of volumes (their sizes) the project and its children hold',
      parseInteger,
    )
    .action(async (name: string, opts: CreateProjectOptions, command: Command) => {
      const ctx = contextOf(command);
      const quota = {
        sandboxes: opts.maxSandboxes,
        memoryMb: opts.maxMemoryMb,
        cpuCores: opts.maxCpus,
        fncallsPerSecond: opts.maxFncallsPerSecond,
        imageBytes: opts.maxImageBytes,
        volumeBytes: opts.maxVolumeBytes,
      };
      const hasQuota = Object.values(quota).some((v) => v !== undefined);
      const created = await ctx.client().createProject({
        name,
        parentId: opts.parent,
        quota: hasQuota ? quota : undefined,
        signal: ctx.signal,
      });
      if (ctx.json) ctx.printJson(created);
      else ctx.out(created.id);
    });

  project
    .command('ls')
    .description('list your project and its descendants')
    .action(async (_opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      const projects = await ctx.client().listProjects({ signal: ctx.signal });
      if (ctx.json) {
        ctx.printJson(projects);
        return;
      }
      const limit = (v: number | undefined, unit = '') => (v === undefined ? '-' : `${v}${unit}`);
      const rows = projects.map((p) => [
        p.id,
        p.name,
        p.parentId ?? '-',
        limit(p.quota?.sandboxes),
        limit(p.quota?.memoryMb, ' MiB'),
        limit(p.quota?.cpuCores),
        limit(p.quota?.fncallsPerSecond, '/s'),
        p.quota?.imageBytes === undefined ? '-' : formatBytes(p.quota.imageBytes),
      ]);
      ctx.io.stdout.write(
        formatTable(
          [
            'ID',
            'NAME',
            'PARENT',
            'MAX SANDBOXES',
            'MAX MEMORY',
            'MAX CPUS',
            'MAX CALLS',
            'MAX IMAGES',
          ],
          rows,
        ),
      );
    });
}

interface CreateProjectOptions {
  parent?: string;
  maxSandboxes?: number;
  maxMemoryMb?: number;
  maxCpus?: number;
  maxFncallsPerSecond?: number;
  maxImageBytes?: number;
  maxVolumeBytes?: number;
}
