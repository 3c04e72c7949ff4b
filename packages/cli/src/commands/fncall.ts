import { createReadStream, createWriteStream } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import type { Command } from 'commander';
import { DsecError } from '@dsec/core';
import { prepareFnCallImages } from '@dsec/edge';
import type { FnCallMapItem, FnCallRequest } from '@dsec/sdk';
import { contextOf, type CliContext } from '../context.js';
import { collect, collectKeyValue, parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { localStore } from '../stores.js';

/**
 * `dsec fncall`: stateless function calls in warm pools (issue 14;
 * docs/fncall.md). `run` runs one program and exits with its exit code;
 * `map` runs a JSONL file of calls and writes one JSONL result per call;
 * `prepare` builds the runtime images of the default runtimes.
 */
export function register(program: Command): void {
  const fncall = program
    .command('fncall')
    .description('stateless function calls in warm pools (python, node, bash)');

  fncall
    .command('run')
    .description(
      "run one program and print its stdout and stderr; exits with the program's exit code " +
        '(124 on timeout; with --json prints the FnCallResult and exits 0)',
    )
    .argument('<file>', 'the program, after -- (`-` reads it from stdin)')
    .requiredOption('--language <name>', 'runtime: python, node, bash, or one an operator added')
    .option('--stdin <text>', "the program's whole stdin")
    .option('--stdin-file <file>', "read the program's stdin from this file")
    .option('--arg <a>', 'an argument after the program (repeatable)', collect)
    .option('--env <K=V>', 'environment variable (repeatable)', collectKeyValue)
    .option('--file <path=local>', 'a file beside the program (repeatable)', collectKeyValue)
    .option('--timeout-ms <n>', 'wall-clock limit (default 10000, at most 300000)', parseInteger)
    .option('--memory-mb <n>', 'memory limit (default: the runtime’s)', parseInteger)
    .option('--max-output-bytes <n>', 'cap per stream (default 1 MiB)', parseInteger)
    .option('--network', 'allow egress (default: no network)')
    .action(async (file: string, opts: RunOptions, command: Command) => {
      const ctx = contextOf(command);
      await runOne(ctx, file, opts);
    });

  fncall
    .command('map')
    .description(
      'run every call of a JSONL file (one FnCallRequest per line) and write one JSONL line per call ' +
        'as it finishes: {"index","result"} or {"index","error"}',
    )
    .argument('<calls>', 'JSONL file of calls (`-` for stdin)')
    .option('--concurrency <n>', 'calls in flight at once (1–256)', parseInteger, 16)
    .option('--out <file>', 'write results here (default stdout)')
    .action(
      async (calls: string, opts: { concurrency: number; out?: string }, command: Command) => {
        const ctx = contextOf(command);
        await mapFile(ctx, calls, opts);
      },
    );

  fncall
    .command('prepare')
    .description(
      'build the images of the default runtimes (python, node, bash) into the local image store ' +
        '(needs root and the Debian mirror the first time; a second run builds nothing)',
    )
    .option('--cache-dir <dir>', 'downloads and build records (default <state-dir>/fncall-cache)')
    .option(
      '--image <name>',
      "also build this image: a SandboxFusion toolkit (fncall-sf-gcc, fncall-sf-go, …) or 'sandboxfusion' for all of them (docs/fncall.md); repeatable",
      (v: string, prev: string[] = []) => [...prev, v],
    )
    .action(async (opts: { cacheDir?: string; image?: string[] }, command: Command) => {
      const ctx = contextOf(command);
      await prepare(ctx, opts);
    });
}

interface RunOptions {
  language: string;
  stdin?: string;
  stdinFile?: string;
  arg?: string[];
  env?: Record<string, string>;
  file?: Record<string, string>;
  timeoutMs?: number;
  memoryMb?: number;
  maxOutputBytes?: number;
  network?: boolean;
}

/** Exit status for a call the platform timed out, as `timeout(1)` and `sandbox exec` use. */
const EXIT_TIMEOUT = 124;

async function runOne(ctx: CliContext, file: string, opts: RunOptions): Promise<void> {
  if (opts.stdin !== undefined && opts.stdinFile !== undefined) {
    throw new DsecError('invalid_argument', 'give --stdin or --stdin-file, not both', {
      field: 'stdin',
    });
  }
  const code = file === '-' ? await readStdin() : await readFile(file, 'utf8');
  const stdin =
    opts.stdinFile !== undefined
      ? await readFile(opts.stdinFile, 'utf8')
      : opts.stdin !== undefined
        ? opts.stdin
        : undefined;
  const files: Record<string, string> = {};
  for (const [path, local] of Object.entries(opts.file ?? {})) {
    files[path] = await readFile(local, 'utf8');
  }
  const req: FnCallRequest = {
    language: opts.language,
    code,
    ...(stdin !== undefined ? { stdin } : {}),
    ...(opts.arg ? { args: opts.arg } : {}),
    ...(opts.env ? { env: opts.env } : {}),
    ...(Object.keys(files).length > 0 ? { files } : {}),
    ...(opts.timeoutMs !== undefined ? { timeoutMs: opts.timeoutMs } : {}),
    ...(opts.memoryMb !== undefined ? { memoryMb: opts.memoryMb } : {}),
    ...(opts.maxOutputBytes !== undefined ? { maxOutputBytes: opts.maxOutputBytes } : {}),
    ...(opts.network ? { network: true } : {}),
  };
  const result = await ctx.client().fncall.run(req, { signal: ctx.signal });
  if (ctx.json) {
    ctx.printJson(result);
    return;
  }
  ctx.io.stdout.write(result.stdout);
  ctx.io.stderr.write(result.stderr);
  if (result.outcome !== 'ok') {
    ctx.err(
      `dsec: the call ended with ${result.outcome}${result.reason ? ` (${result.reason})` : ''}` +
        `${result.truncated ? ', output truncated' : ''}`,
    );
  }
  ctx.exitCode =
    result.outcome === 'timeout' ? EXIT_TIMEOUT : result.exitCode < 0 ? 1 : result.exitCode;
}

async function mapFile(
  ctx: CliContext,
  path: string,
  opts: { concurrency: number; out?: string },
): Promise<void> {
  const calls: FnCallRequest[] = [];
  const input = path === '-' ? process.stdin : createReadStream(path, 'utf8');
  let lineNo = 0;
  for await (const line of createInterface({ input, crlfDelay: Infinity })) {
    lineNo++;
    if (line.trim() === '') continue;
    try {
      calls.push(JSON.parse(line) as FnCallRequest);
    } catch (cause) {
      throw new DsecError('invalid_argument', `${path}:${lineNo}: not a JSON object`, { cause });
    }
  }
  const out = opts.out ? createWriteStream(resolve(opts.out)) : undefined;
  const write = (text: string) => (out ? out.write(text) : ctx.io.stdout.write(text));
  const progress = createProgress({
    label: 'fncall map',
    total: calls.length,
    // Results on stdout would interleave with the bar; it is drawn only when they go to a file.
    enabled: out !== undefined && !ctx.json,
  });
  const tally = { ok: 0, nonzero: 0, failed: 0 };
  let done = 0;
  try {
    for await (const item of ctx
      .client()
      .fncall.map(calls, { concurrency: opts.concurrency, signal: ctx.signal })) {
      write(`${JSON.stringify(wireItem(item))}\n`);
      if (item.error) tally.failed++;
      else if (item.result.exitCode === 0 && item.result.outcome === 'ok') tally.ok++;
      else tally.nonzero++;
      progress.update(++done);
    }
  } finally {
    progress.done();
    if (out)
      await new Promise<void>((r, j) => out.end((err?: Error | null) => (err ? j(err) : r())));
  }
  if (out) {
    ctx.err(
      `${calls.length} calls: ${tally.ok} exited 0, ${tally.nonzero} exited otherwise, ${tally.failed} failed` +
        ` → ${opts.out}`,
    );
  }
  // Programs that fail are results; a call the platform failed is an error of the run.
  if (tally.failed > 0) ctx.exitCode = 1;
}

/** The line `map` writes: the wire form of `POST /v1/fncall/batch`. */
function wireItem(item: FnCallMapItem): unknown {
  return item.error
    ? { index: item.index, error: { code: item.error.code, message: item.error.message } }
    : { index: item.index, result: item.result };
}

async function prepare(
  ctx: CliContext,
  opts: { cacheDir?: string; image?: string[] },
): Promise<void> {
  const store = localStore(ctx);
  const progress = createProgress({ label: 'fncall prepare', enabled: !ctx.json });
  let steps = 0;
  const r = await prepareFnCallImages(store, {
    cacheDir: resolve(opts.cacheDir ?? join(ctx.options.stateDir, 'fncall-cache')),
    // The default runtimes' images, and the ones asked for.
    ...(opts.image ? { images: ['fncall-node', ...opts.image] } : {}),
    signal: ctx.signal,
    onProgress: () => progress.update(++steps),
  });
  progress.done();
  if (ctx.json) {
    ctx.printJson(r);
    return;
  }
  for (const l of r.layers) {
    ctx.out(`${l.name}:${l.version}  ${r.built.includes(l.name) ? 'built' : 'already there'}`);
  }
}

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of process.stdin) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}
