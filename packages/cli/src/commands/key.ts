import type { Command } from 'commander';
import { e2bKeyForm } from '@dsec/cluster';
import { contextOf } from '../context.js';
import { collect, parseRole } from '../parse.js';

/** `dsec key create|rm`. */
export function register(program: Command): void {
  const key = program.command('key').description('API keys');

  key
    .command('create')
    .description('create an API key and print it (it is shown only once)')
    .requiredOption('--project <id>', 'project the key acts for')
    .option('--role <role>', 'member or admin (default member)', parseRole)
    .option('--name <name>', 'a note to recognise the key by')
    .option(
      '--scope <scope>',
      'limit the key (repeatable): sandboxes:snapshot, fncall:run, volumes:use, metrics:read, images:run:<pattern>; default unscoped',
      collect,
    )
    .option(
      '--e2b',
      "print the key in E2B's format (e2b_ + hex): the same secret, for E2B_API_KEY, which E2B's SDKs then take without E2B_VALIDATE_API_KEY=false",
    )
    .action(
      async (
        opts: {
          project: string;
          role?: 'admin' | 'member';
          name?: string;
          scope?: string[];
          e2b?: boolean;
        },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const created = await ctx.client().createKey({
          projectId: opts.project,
          role: opts.role,
          name: opts.name,
          scopes: opts.scope,
          signal: ctx.signal,
        });
        const e2bKey = opts.e2b ? e2bKeyForm(created.key) : undefined;
        if (ctx.json) {
          ctx.printJson(e2bKey !== undefined ? { ...created, e2bKey } : created);
          return;
        }
        // The secret alone on stdout so `KEY=$(dsec key create ...)` works.
        ctx.out(e2bKey ?? created.key);
        ctx.err(
          `key ${created.id} (${created.role} of ${created.projectId}); store it now, it is not shown again`,
        );
      },
    );

  key
    .command('rm')
    .description('revoke an API key')
    .argument('<id>', 'key ID (not the secret)')
    .action(async (id: string, _opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      await ctx.client().deleteKey(id, { signal: ctx.signal });
      if (ctx.json) ctx.printJson({ removed: [id] });
      else ctx.out(id);
    });
}
