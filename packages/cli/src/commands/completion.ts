import type { Command } from 'commander';
import { DsecError } from '@dsec/core';
import { bashCompletion, zshCompletion } from '../completion.js';
import { contextOf } from '../context.js';

/** `dsec completion bash|zsh`: a completion script generated from this program's commands. */
export function register(program: Command): void {
  program
    .command('completion <shell>')
    .description('print a bash or zsh completion script (e.g. `source <(dsec completion bash)`)')
    .action((shell: string, _opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      if (shell === 'bash') ctx.io.stdout.write(bashCompletion(ctx.program));
      else if (shell === 'zsh') ctx.io.stdout.write(zshCompletion(ctx.program));
      else
        throw new DsecError('invalid_argument', `completion: want bash or zsh, got ${shell}`, {
          field: 'shell',
        });
    });
}
