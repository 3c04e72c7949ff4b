import { createReadStream, statSync } from 'node:fs';
import { basename, join } from 'node:path';
import { pipeline } from 'node:stream/promises';
import type { Command } from 'commander';
import { DsecError } from '@dsec/sdk';
import { contextOf } from '../context.js';
import type { CliContext } from '../context.js';
import { parseInteger } from '../parse.js';

/** `ID:/path` → the sandbox and the path in it; anything else is a local path. */
export function parseRemote(arg: string): { sandboxId: string; path: string } | undefined {
  const m = /^(sb-[A-Za-z0-9_-]+):(.*)$/.exec(arg);
  if (!m) return undefined;
  return { sandboxId: m[1] ?? '', path: m[2] || '.' };
}

/** `dsec sandbox cp` and `dsec sandbox shell`. */
export function registerSandboxIo(sandbox: Command): void {
  sandbox
    .command('cp')
    .description(
      'copy a file into or out of a sandbox, streamed (any size): `cp ./a ID:/tmp/a`, `cp ID:/tmp/a ./a`;\n' +
        '`-` is stdin or stdout',
    )
    .argument('<src>', 'local path, `-`, or ID:/path')
    .argument('<dst>', 'local path, `-`, or ID:/path')
    .option('--mode <octal>', 'permission bits of an uploaded file, e.g. 755')
    .action(async (src: string, dst: string, opts: { mode?: string }, command: Command) => {
      await copy(contextOf(command), src, dst, opts);
    });

  sandbox
    .command('shell')
    .description('an interactive shell in the sandbox (needs a terminal); exits with its exit code')
    .argument('<id>', 'sandbox ID')
    .option(
      '--shell <path>',
      "the sandbox's own shell, e.g. /bin/bash (default: the platform's sh)",
    )
    .option('--user <user>', 'user to run as')
    .option('--rows <n>', 'terminal rows (default: this terminal)', parseInteger)
    .option('--cols <n>', 'terminal columns (default: this terminal)', parseInteger)
    .action(async (id: string, opts: ShellOptions, command: Command) => {
      await shell(contextOf(command), id, opts);
    });
}

async function copy(ctx: CliContext, src: string, dst: string, opts: { mode?: string }) {
  const from = parseRemote(src);
  const to = parseRemote(dst);
  if ((from === undefined) === (to === undefined)) {
    throw new DsecError('invalid_argument', 'exactly one of SRC and DST must be ID:/path', {
      field: from ? 'dst' : 'src',
    });
  }
  const client = ctx.client();
  if (to) {
    let mode: number | undefined;
    if (opts.mode !== undefined) {
      if (!/^[0-7]{1,4}$/.test(opts.mode)) {
        throw new DsecError('invalid_argument', '--mode must be octal, e.g. 644', {
          field: 'mode',
        });
      }
      mode = parseInt(opts.mode, 8);
    }
    const path = to.path.endsWith('/') && src !== '-' ? to.path + basename(src) : to.path;
    const files = client.sandbox(to.sandboxId).files;
    const info =
      src === '-'
        ? await files.writeStream(path, process.stdin, { mode, signal: ctx.signal })
        : await files.writeStream(path, localFile(src), { mode, signal: ctx.signal });
    if (ctx.json) ctx.printJson(info);
    return;
  }
  const remote = from!;
  const files = client.sandbox(remote.sandboxId).files;
  if (dst === '-') {
    const stream = await files.readStream(remote.path, { signal: ctx.signal });
    await pipeline(stream, process.stdout, { end: false });
    return;
  }
  let local = dst;
  try {
    if (statSync(dst).isDirectory()) local = join(dst, basename(remote.path));
  } catch {
    // a new file
  }
  const { bytes } = await files.download(remote.path, local, { signal: ctx.signal });
  if (ctx.json) ctx.printJson({ path: local, bytes });
}

function localFile(path: string) {
  const st = statSync(path, { throwIfNoEntry: false });
  if (!st) throw new DsecError('not_found', `${path}: no such file`, { field: 'src' });
  if (!st.isFile()) {
    throw new DsecError(
      'invalid_argument',
      `${path} is not a regular file (directories are not copied)`,
      {
        field: 'src',
      },
    );
  }
  return createReadStream(path);
}

interface ShellOptions {
  shell?: string;
  user?: string;
  rows?: number;
  cols?: number;
}

async function shell(ctx: CliContext, id: string, opts: ShellOptions): Promise<void> {
  const stdin = process.stdin;
  const stdout = process.stdout;
  if (!stdin.isTTY) {
    ctx.err(
      'dsec: `sandbox shell` needs a terminal, and stdin is not one; use `dsec sandbox exec ID -- CMD` (or --session) instead',
    );
    ctx.exitCode = 2;
    return;
  }
  const term = await ctx
    .client()
    .sandbox(id)
    .terminal((chunk) => stdout.write(chunk), {
      rows: opts.rows ?? stdout.rows,
      cols: opts.cols ?? stdout.columns,
      shell: opts.shell,
      user: opts.user,
      term: process.env.TERM,
      signal: ctx.signal,
    });
  const onResize = () => term.resize(stdout.rows, stdout.columns);
  const onData = (d: Buffer) => term.write(d);
  stdin.setRawMode(true);
  stdin.resume();
  stdin.on('data', onData);
  stdout.on('resize', onResize);
  try {
    ctx.exitCode = Math.max(0, await term.exited);
  } finally {
    stdout.off('resize', onResize);
    stdin.off('data', onData);
    stdin.setRawMode(false);
    stdin.pause();
  }
}
