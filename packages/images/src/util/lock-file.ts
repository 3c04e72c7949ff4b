import { open, readFile, unlink } from 'node:fs/promises';
import { setTimeout as sleep } from 'node:timers/promises';
import { throwIfAborted } from '@dsec/core';

const POLL_MS = 250;
const inProcess = new Map<string, Promise<unknown>>();

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * Runs `fn` while holding `path` (created exclusively, holding our pid), so
 * two builders sharing a cache directory — two `dsec eval prepare` runs, or
 * two calls in one process — never run apt or a build into it at once. A
 * lock whose holder died is taken over.
 */
export async function withLockFile<T>(
  path: string,
  fn: () => Promise<T>,
  signal?: AbortSignal,
): Promise<T> {
  // Calls in this process queue on a promise: the pid in the file is ours for all of them.
  const before = inProcess.get(path) ?? Promise.resolve();
  const run = before.catch(() => undefined).then(() => lockedRun(path, fn, signal));
  inProcess.set(path, run);
  try {
    return await run;
  } finally {
    if (inProcess.get(path) === run) inProcess.delete(path);
  }
}

async function lockedRun<T>(path: string, fn: () => Promise<T>, signal?: AbortSignal): Promise<T> {
  for (;;) {
    throwIfAborted(signal);
    try {
      const fh = await open(path, 'wx', 0o600);
      await fh.writeFile(`${process.pid}\n`);
      await fh.close();
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      const pid = Number((await readFile(path, 'utf8').catch(() => '')).trim());
      if (Number.isSafeInteger(pid) && pid > 0 && !alive(pid)) {
        await unlink(path).catch(() => undefined);
        continue;
      }
      await sleep(POLL_MS, undefined, signal ? { signal } : {}).catch(() => undefined);
    }
  }
  try {
    return await fn();
  } finally {
    await unlink(path).catch(() => undefined);
  }
}
