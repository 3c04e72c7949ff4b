import { spawn } from 'node:child_process';
import { DsecError } from '@dsec/core';

/**
 * Runs a host tool (`ip`, `nft`, `sh`) to completion with optional stdin;
 * rejects with its stderr. Bounded in time so a wedged tool cannot hang a
 * sandbox's create or stop.
 */
export function runTool(
  cmd: string,
  args: string[],
  options: { stdin?: string; timeoutMs?: number } = {},
): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, {
      stdio: [options.stdin === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
      timeout: options.timeoutMs ?? 15_000,
      killSignal: 'SIGKILL',
    });
    let out = '';
    let err = '';
    child.stdout?.setEncoding('utf8').on('data', (s: string) => (out += s));
    child.stderr?.setEncoding('utf8').on('data', (s: string) => {
      if (err.length < 16_384) err += s;
    });
    child.on('error', (e) =>
      reject(new DsecError('internal', `${cmd}: ${e.message}`, { cause: e })),
    );
    child.on('close', (code, signal) => {
      if (code === 0) resolve(out);
      else
        reject(
          new DsecError(
            'internal',
            `${cmd} ${args.slice(0, 3).join(' ')}: ${err.trim() || `exit ${signal ?? code}`}`,
            {
              details: { exitCode: code },
            },
          ),
        );
    });
    if (options.stdin !== undefined) child.stdin?.end(options.stdin);
  });
}

/** Applies an nftables script atomically (`nft -f -`): all of it or none. */
export function nft(script: string): Promise<string> {
  return runTool('nft', ['-f', '-'], { stdin: script });
}
