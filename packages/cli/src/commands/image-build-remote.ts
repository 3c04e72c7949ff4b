import { spawn } from 'node:child_process';
import { stat } from 'node:fs/promises';
import { Readable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError, isErrorCode } from '@dsec/core';
import type { CliContext } from '../context.js';

export interface RemoteBuildOptions {
  dockerfile: string;
  file?: string | undefined;
  buildArg: string[];
  target?: string | undefined;
  timeout?: string | undefined;
  networkAllow: string[];
  cache: boolean;
}

interface BuildInfo {
  id: string;
  image: string;
  status: 'building' | 'ready' | 'failed';
  error?: string;
  errorCode?: string;
  errorDetails?: Record<string, unknown>;
  log?: string;
  cached?: boolean;
  digest?: string;
  sizeBytes?: number;
}

/** How often the build is asked after. */
const POLL_MS = 1000;

/**
 * `dsec image build NAME --dockerfile DIR --remote`: the context sent as a
 * tar (tar(1): symlinks as links, owners as root) to `POST
 * /v1/images/builds` of `--url` with the key, then polled; the build runs
 * on the node that holds the image store, into the key's project. Prints
 * the log lines as they come (stderr) and the image (`--json`: the build).
 * `--network-allow` and `--no-cache` are the local builder's: refused here.
 */
export async function remoteDockerfileBuild(
  ctx: CliContext,
  name: string,
  opts: RemoteBuildOptions,
): Promise<void> {
  if (opts.networkAllow.length > 0 || !opts.cache) {
    throw new DsecError(
      'invalid_argument',
      '--network-allow and --no-cache are not for --remote: the node builds under its own egress policy and cache',
      { field: 'remote' },
    );
  }
  if (!(await stat(opts.dockerfile).catch(() => undefined))?.isDirectory()) {
    throw new DsecError('invalid_argument', `${opts.dockerfile} is not a directory`, {
      field: 'dockerfile',
    });
  }
  const params = new URLSearchParams({ name });
  if (opts.file !== undefined) params.set('dockerfile', opts.file);
  for (const a of opts.buildArg) params.append('buildArg', a);
  if (opts.target !== undefined) params.set('target', opts.target);
  if (opts.timeout !== undefined) params.set('timeout', String(Math.ceil(Number(opts.timeout))));
  const { url, apiKey } = ctx.options;
  const headers = { authorization: `Bearer ${apiKey ?? ''}` };
  const tar = spawn(
    'tar',
    ['-C', opts.dockerfile, '--owner=0', '--group=0', '--numeric-owner', '-cf', '-', '.'],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  let tarErr = '';
  tar.stderr.setEncoding('utf8').on('data', (s: string) => (tarErr += s.slice(0, 4096)));
  const tarDone = new Promise<number | null>((res) => tar.once('close', res));
  let res: Response;
  try {
    res = await fetch(`${url}/v1/images/builds?${params.toString()}`, {
      method: 'POST',
      headers: { ...headers, 'content-type': 'application/x-tar' },
      body: Readable.toWeb(tar.stdout) as ReadableStream,
      duplex: 'half',
      ...(ctx.signal ? { signal: ctx.signal } : {}),
    });
  } catch (err) {
    tar.kill();
    throw new DsecError('unavailable', `cannot reach ${url}: ${String(err)}`, { cause: err });
  }
  if ((await tarDone) !== 0) throw new DsecError('invalid_argument', `tar failed: ${tarErr}`);
  let info = await answer(res);
  let printed = 0;
  const show = (log: string | undefined): void => {
    const lines = (log ?? '').split('\n').filter((l) => l !== '');
    // The log is a tail: print what is new since the last look.
    for (const l of lines.slice(Math.min(printed, lines.length))) if (!ctx.json) ctx.err(l);
    printed = lines.length;
  };
  while (info.status === 'building') {
    await sleep(POLL_MS, undefined, ctx.signal ? { signal: ctx.signal } : {});
    info = await answer(
      await fetch(`${url}/v1/images/builds/${encodeURIComponent(info.id)}`, { headers }),
    );
    show(info.log);
  }
  if (info.status === 'failed') {
    const code = info.errorCode && isErrorCode(info.errorCode) ? info.errorCode : 'internal';
    throw new DsecError(code, info.error ?? 'the build failed', {
      ...(info.errorDetails ? { details: info.errorDetails } : {}),
    });
  }
  if (ctx.json) ctx.out(JSON.stringify(info));
  else ctx.out(`${info.image}${info.cached ? ' (cached)' : ''} ${info.digest ?? ''}`.trim());
}

async function answer(res: Response): Promise<BuildInfo> {
  const text = await res.text();
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    throw new DsecError('unavailable', `the server answered ${res.status} without JSON`);
  }
  if (!res.ok) {
    const e =
      (
        body as {
          error?: {
            code?: string;
            message?: string;
            field?: string;
            details?: Record<string, unknown>;
          };
        }
      ).error ?? {};
    const code = e.code && isErrorCode(e.code) ? e.code : 'internal';
    throw new DsecError(code, e.message ?? `HTTP ${res.status}`, {
      ...(e.field ? { field: e.field } : {}),
      ...(e.details ? { details: e.details } : {}),
    });
  }
  return body as BuildInfo;
}
