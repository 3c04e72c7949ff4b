import { readFile } from 'node:fs/promises';
import { release } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Command } from 'commander';
import { contextOf } from '../context.js';

export interface VersionInfo {
  version: string;
  /** The git commit of the checkout this CLI runs from (env DSEC_COMMIT for packaged builds), or null. */
  commit: string | null;
  node: string;
  kernel: string;
}

/** `dsec version [--json]`: DSec's version, the git commit when known, Node's version and the kernel. */
export function register(program: Command): void {
  program
    .command('version')
    .description('print the DSec version, git commit, Node.js version and kernel')
    .action(async (_opts: unknown, command: Command) => {
      const ctx = contextOf(command);
      const info: VersionInfo = {
        version: ctx.program.version() ?? 'unknown',
        commit:
          ctx.io.env.DSEC_COMMIT || (await gitCommit(dirname(fileURLToPath(import.meta.url)))),
        node: process.version,
        kernel: release(),
      };
      if (ctx.json) ctx.printJson(info);
      else
        ctx.out(
          `dsec ${info.version}${info.commit ? ` (${info.commit.slice(0, 12)})` : ''}\n` +
            `node ${info.node}\nkernel ${info.kernel}`,
        );
    });
}

/**
 * The HEAD commit of the git checkout holding `dir`, read from .git itself
 * (no git binary needed on a server); null outside a checkout.
 */
export async function gitCommit(dir: string): Promise<string | null> {
  for (let d = dir; ; d = dirname(d)) {
    const gitDir = await resolveGitDir(join(d, '.git'));
    if (gitDir) {
      const head = (await readFile(join(gitDir, 'HEAD'), 'utf8').catch(() => '')).trim();
      const ref = /^ref: (.+)$/.exec(head)?.[1];
      if (!ref) return /^[0-9a-f]{40}$/.test(head) ? head : null;
      const common = await commonDir(gitDir);
      const loose = (await readFile(join(common, ref), 'utf8').catch(() => '')).trim();
      if (/^[0-9a-f]{40}$/.test(loose)) return loose;
      const packed = await readFile(join(common, 'packed-refs'), 'utf8').catch(() => '');
      for (const line of packed.split('\n')) {
        const [sha, name] = line.split(' ');
        if (name === ref && sha && /^[0-9a-f]{40}$/.test(sha)) return sha;
      }
      return null;
    }
    if (d === dirname(d)) return null;
  }
}

/** `.git` is a directory, or (worktrees, submodules) a file `gitdir: PATH`. */
async function resolveGitDir(dotGit: string): Promise<string | null> {
  const text = await readFile(dotGit, 'utf8').catch((err: NodeJS.ErrnoException) =>
    err.code === 'EISDIR' ? 'dir' : null,
  );
  if (text === 'dir') return dotGit;
  const target = text && /^gitdir: (.+)$/m.exec(text)?.[1]?.trim();
  return target ? resolve(dirname(dotGit), target) : null;
}

/** A worktree's refs live in the main repository (`commondir`). */
async function commonDir(gitDir: string): Promise<string> {
  const rel = (await readFile(join(gitDir, 'commondir'), 'utf8').catch(() => '')).trim();
  return rel ? join(gitDir, rel) : gitDir;
}
