import { spawn } from 'node:child_process';
import { createInterface } from 'node:readline';

/**
 * The runner: reads one JSON argv per line, runs it, answers `{ ms }` (its
 * own timing of the spawn to the exit) or `{ error }`. CommonJS, for `node -e`.
 */
const RUNNER = `
const { execFile } = require('node:child_process');
require('node:readline').createInterface({ input: process.stdin }).on('line', (line) => {
  const argv = JSON.parse(line);
  const t0 = process.hrtime.bigint();
  execFile(argv[0], argv.slice(1), (err) => {
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    process.stdout.write(JSON.stringify(err ? { error: err.message } : { ms }) + '\\n');
  });
});
`;

export interface PeerRunner {
  /** Runs `argv` in the runner and resolves with the runner's own timing of it, in ms. */
  time(argv: string[]): Promise<number>;
  close(): void;
}

/**
 * Runs a peer's commands from a Node process of its own and times them
 * there. Spawned from the process that hosts the node under test, each peer
 * would fork that process: every page it then writes takes a copy-on-write
 * fault, and the next DSec call pays for the peer's spawn. Calls are serial.
 */
export function startPeerRunner(): PeerRunner {
  const child = spawn(process.execPath, ['-e', RUNNER], { stdio: ['pipe', 'pipe', 'inherit'] });
  const waiting: { resolve: (ms: number) => void; reject: (err: Error) => void }[] = [];
  createInterface({ input: child.stdout }).on('line', (line) => {
    const answer = JSON.parse(line) as { ms?: number; error?: string };
    const next = waiting.shift();
    if (answer.error !== undefined) next?.reject(new Error(answer.error));
    else next?.resolve(answer.ms!);
  });
  child.on('exit', () => {
    for (const w of waiting.splice(0)) w.reject(new Error('the peer runner exited'));
  });
  return {
    time: (argv) =>
      new Promise((resolve, reject) => {
        waiting.push({ resolve, reject });
        child.stdin.write(JSON.stringify(argv) + '\n');
      }),
    close: () => void child.kill(),
  };
}
