/**
 * Processes of a real multi-node cluster for integration tests: `dsec serve …`
 * children started from the CLI source, optionally inside a network
 * namespace the test creates (joined with `nsenter --net` only, so the edge
 * keeps the host's mounts and cgroups), and the namespaces themselves.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { readdir, rmdir } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';
import { promisify } from 'node:util';

const execFileAsync = promisify(execFile);

/** Runs the CLI from source, as `dsec up --edges` does when the bundle is not built. */
export const DSEC = [
  process.execPath,
  '--conditions=dsec-source',
  '--import',
  'tsx',
  fileURLToPath(new URL('../../../cli/src/run.ts', import.meta.url)),
];

export interface Served {
  proc: ChildProcess;
  /** What the process printed after `ready`. */
  url: string;
  /** Everything it wrote to stderr, for failure messages. */
  stderr(): string;
  kill(signal?: NodeJS.Signals): Promise<void>;
}

/** Starts `dsec serve ROLE --config FILE` (in `netns` when given) and waits for `ready`. */
export async function serve(
  role: 'edge' | 'apiserver' | 'watcher',
  configFile: string,
  options: { netns?: string; timeoutMs?: number } = {},
): Promise<Served> {
  const argv = [...DSEC, 'serve', role, '--config', configFile];
  const [cmd, ...args] = options.netns
    ? ['nsenter', `--net=/run/netns/${options.netns}`, '--', ...argv]
    : argv;
  const proc = spawn(cmd!, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  proc.stderr.on('data', (c: Buffer) => {
    err = (err + c.toString()).slice(-8000);
  });
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`${role} not ready in time; stderr:\n${err}`)),
      options.timeoutMs ?? 60_000,
    );
    createInterface({ input: proc.stdout }).on('line', (line) => {
      const m = /^ready (\S+)/.exec(line);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]!);
      }
    });
    proc.once('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${role} exited (${signal ?? code}) before ready; stderr:\n${err}`));
    });
  });
  return {
    proc,
    url,
    stderr: () => err,
    async kill(signal = 'SIGTERM') {
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      proc.kill(signal);
      const force = setTimeout(() => proc.kill('SIGKILL'), 20_000);
      await exited;
      clearTimeout(force);
    },
  };
}

/** A network namespace joined to the host by a veth: host `hostAddr`, inside `innerAddr` (/30). */
export async function makeNetns(
  name: string,
  veth: string,
  hostAddr: string,
  innerAddr: string,
): Promise<void> {
  const ip = (...a: string[]) => execFileAsync('ip', a);
  await ip('netns', 'add', name);
  await ip('link', 'add', `${veth}h`, 'type', 'veth', 'peer', 'name', `${veth}n`);
  await ip('link', 'set', `${veth}n`, 'netns', name);
  await ip('addr', 'add', `${hostAddr}/30`, 'dev', `${veth}h`);
  await ip('link', 'set', `${veth}h`, 'up');
  await ip('-n', name, 'addr', 'add', `${innerAddr}/30`, 'dev', `${veth}n`);
  await ip('-n', name, 'link', 'set', `${veth}n`, 'up');
  await ip('-n', name, 'link', 'set', 'lo', 'up');
}

export async function removeNetns(name: string, veth: string): Promise<void> {
  await execFileAsync('ip', ['link', 'del', `${veth}h`]).catch(() => undefined);
  await execFileAsync('ip', ['netns', 'del', name]).catch(() => undefined);
}

/** Removes a test's cgroup parent in every hierarchy (after its sandboxes are gone). */
export async function removeCgroupParent(parent: string): Promise<void> {
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${parent}`).catch(() => undefined);
}

/** Runs `fn` over `items` with at most `n` at once. */
export async function pool<T, R>(
  items: readonly T[],
  n: number,
  fn: (item: T, index: number) => Promise<R>,
): Promise<PromiseSettledResult<R>[]> {
  const out: PromiseSettledResult<R>[] = new Array(items.length);
  let next = 0;
  await Promise.all(
    Array.from({ length: Math.min(n, items.length) }, async () => {
      for (let i = next++; i < items.length; i = next++) {
        try {
          out[i] = { status: 'fulfilled', value: await fn(items[i]!, i) };
        } catch (reason) {
          out[i] = { status: 'rejected', reason };
        }
      }
    }),
  );
  return out;
}
