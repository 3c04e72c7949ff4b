import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, open, readFile, stat } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { DsecError, throwIfAborted } from '@dsec/core';
import { unmount } from '@dsec/native';
import { mountTypes } from '../layers/mountinfo.js';
import { ensureDir, PRIVATE_DIR_MODE } from '../state/host-state.js';
import type { ChunkCacheStats } from './chunk-cache.js';
import type { BlobFuseCounters } from './fuse-server.js';

export interface BlobDaemonOptions {
  /** Where the blobs appear, as `<mountDir>/<sha256 hex>` (created if missing). */
  mountDir: string;
  /** The daemon's chunk cache (`chunks/`), pid file (`blobd.pid`) and log (`blobd.log`). */
  cacheDir: string;
  /** `ImageStore.location` of the store to serve (`dir:/path`, `s3://…`). */
  storeLocation: string;
  /** Chunk cache budget. Default 10 GiB. */
  cacheBytes?: number;
  /** Chunk size, a power of two ≥ 64 KiB. Default 256 KiB. */
  chunkBytes?: number;
  /** Kernel readahead on blob files. Default 128 KiB. */
  readaheadBytes?: number;
  /** The daemon's own sequential read-ahead, at most this far ahead (0: off). Default 2 MiB. */
  prefetchBytes?: number;
  /** Extra environment of the daemon (store credentials), over this process's. */
  env?: NodeJS.ProcessEnv;
  /** How long a new daemon may take to mount. Default 30 s. */
  startTimeoutMs?: number;
  signal?: AbortSignal;
}

/** What `<mountDir>/.stats` holds. */
export interface BlobDaemonStats {
  cache: ChunkCacheStats;
  daemon: BlobFuseCounters;
}

const FUSE_TYPE = 'fuse.dsec-blobd';
const DIGEST = /^sha256:([0-9a-f]{64})$/;

/**
 * Handle of the node's blob daemon (blobd): a detached process that serves
 * every blob of an image store as `<mountDir>/<sha256 hex>` over FUSE,
 * fetching chunks on demand into a bounded local cache. Split EROFS layers
 * of a remote store mount with `device=<pathFor(blobDigest)>`.
 *
 * The daemon outlives the process that started it, so sandboxes keep reading
 * their layers across an edge restart; the next `start` adopts it.
 */
export class BlobDaemon {
  private constructor(
    /** Absolute mount directory. */
    readonly mountDir: string,
    /** Pid of the daemon process. */
    readonly pid: number,
    /** True when `start` found the daemon already running. */
    readonly adopted: boolean,
  ) {}

  /**
   * Adopts the live daemon mounted at `mountDir`, or starts one: a stale
   * mount (its daemon died) is detached first. Resolves once the mount
   * serves. Throws `unavailable` when the daemon fails to start (its log is
   * `<cacheDir>/blobd.log`), `cancelled`/abort errors on `signal`.
   */
  static async start(options: BlobDaemonOptions): Promise<BlobDaemon> {
    throwIfAborted(options.signal);
    const mountDir = resolve(options.mountDir);
    const cacheDir = resolve(options.cacheDir);
    // Both root's alone (the mount's root directory is 0500 too): chunks are layer content.
    ensureDir(cacheDir, PRIVATE_DIR_MODE);
    await mkdir(mountDir, { recursive: true, mode: PRIVATE_DIR_MODE });

    const pid = await readPid(join(cacheDir, 'blobd.pid'));
    const daemonAlive = pid !== undefined && (await isBlobd(pid, mountDir));
    if (await isFuseMount(mountDir)) {
      if (daemonAlive && (await answers(mountDir))) return new BlobDaemon(mountDir, pid, true);
      await unmount([mountDir], { detach: true }); // its server is gone or not ours
    }
    if (daemonAlive) await terminate(pid, mountDir);
    ensureDir(mountDir, PRIVATE_DIR_MODE); // unmounted now: an older release's 0755 is tightened
    const started = await spawnDaemon(mountDir, cacheDir, options);
    return new BlobDaemon(mountDir, started, false);
  }

  /**
   * `<mountDir>/<hex>` for `sha256:<hex>`; with `chunkTable` (the digest of
   * the blob's chunk table, `encodeChunkTable`) `<mountDir>/<hex>.<tablehex>`,
   * whose chunks the daemon verifies as it fetches them (a corrupt chunk
   * reads as EIO; a table that does not match its digest, the blob size or
   * the daemon's chunk size fails the lookup with EIO). Throws
   * `invalid_argument` for other digests.
   */
  pathFor(digest: string, options: { chunkTable?: string } = {}): string {
    const hex = DIGEST.exec(digest)?.[1];
    if (!hex)
      throw new DsecError('invalid_argument', `malformed digest ${digest}`, { field: 'digest' });
    if (options.chunkTable === undefined) return join(this.mountDir, hex);
    const tableHex = DIGEST.exec(options.chunkTable)?.[1];
    if (!tableHex)
      throw new DsecError(
        'invalid_argument',
        `malformed chunk table digest ${options.chunkTable}`,
        {
          field: 'chunkTable',
        },
      );
    return join(this.mountDir, `${hex}.${tableHex}`);
  }

  /** The daemon's counters and its chunk cache's, read from `.stats`. */
  async stats(): Promise<BlobDaemonStats> {
    return JSON.parse(await readFile(join(this.mountDir, '.stats'), 'utf8')) as BlobDaemonStats;
  }

  /**
   * Unmounts (detached, so blobs EROFS layers still hold stay readable only
   * until the daemon exits: unmount those layers first) and waits for the
   * daemon to exit, terminating it when it lingers.
   */
  async stop(options: { timeoutMs?: number } = {}): Promise<void> {
    await unmount([this.mountDir], { detach: true });
    if (await waitExit(this.pid, 2000)) return;
    await terminate(this.pid, this.mountDir, options.timeoutMs ?? 5000);
  }
}

/** The command that runs blobd-main: bundled JS beside the CLI bundle, or the TS source. */
function daemonCommand(): { argv: string[]; cwd: string } {
  const bundled = fileURLToPath(new URL('./blobd.js', import.meta.url));
  if (existsSync(bundled)) return { argv: [process.execPath, bundled], cwd: '/' };
  const source = fileURLToPath(new URL('./blobd-main.ts', import.meta.url));
  if (!existsSync(source))
    throw new DsecError('internal', 'blobd entry not found (neither blobd.js nor blobd-main.ts)');
  let tsx = 'tsx';
  let cwd = resolve(dirname(source), '../../../..'); // the repo root resolves bare `tsx`
  try {
    tsx = import.meta.resolve('tsx');
    cwd = '/';
  } catch {
    // fall back to resolution from the repo root
  }
  return { argv: [process.execPath, '--conditions=dsec-source', '--import', tsx, source], cwd };
}

async function spawnDaemon(
  mountDir: string,
  cacheDir: string,
  options: BlobDaemonOptions,
): Promise<number> {
  const { argv, cwd } = daemonCommand();
  const args = ['--mount', mountDir, '--cache', cacheDir, '--store', options.storeLocation];
  if (options.cacheBytes !== undefined) args.push('--cache-bytes', String(options.cacheBytes));
  if (options.chunkBytes !== undefined) args.push('--chunk-bytes', String(options.chunkBytes));
  if (options.readaheadBytes !== undefined)
    args.push('--readahead-bytes', String(options.readaheadBytes));
  if (options.prefetchBytes !== undefined)
    args.push('--prefetch-bytes', String(options.prefetchBytes));
  const logPath = join(cacheDir, 'blobd.log');
  const log = await open(logPath, 'a', 0o600);
  let child;
  try {
    child = spawn(argv[0]!, [...argv.slice(1), ...args], {
      cwd,
      detached: true,
      stdio: ['ignore', 'pipe', log.fd],
      env: { ...process.env, ...options.env, UV_THREADPOOL_SIZE: '24' },
    });
  } finally {
    await log.close();
  }
  const stdout = child.stdout;
  if (!stdout) throw new DsecError('internal', 'blob daemon: no stdout pipe');
  let onAbort = () => undefined as void;
  try {
    const pid = await new Promise<number>((resolvePid, reject) => {
      let text = '';
      const timer = setTimeout(
        () => reject(new DsecError('unavailable', 'blob daemon did not become ready in time')),
        options.startTimeoutMs ?? 30_000,
      );
      onAbort = () => reject(abortError(options.signal));
      options.signal?.addEventListener('abort', onAbort, { once: true });
      stdout.setEncoding('utf8').on('data', (s: string) => {
        text += s;
        const m = /^ready (\d+)$/m.exec(text);
        if (m) {
          clearTimeout(timer);
          resolvePid(Number(m[1]));
        }
      });
      child.on('error', (err) => {
        clearTimeout(timer);
        reject(new DsecError('unavailable', `blob daemon: ${err.message}`, { cause: err }));
      });
      child.on('exit', (code, sig) => {
        clearTimeout(timer);
        reject(new DsecError('unavailable', `blob daemon exited with ${sig ?? code}`));
      });
    });
    return pid;
  } catch (err) {
    child.kill('SIGKILL');
    if (await isFuseMount(mountDir))
      await unmount([mountDir], { detach: true }).catch(() => undefined);
    if (err instanceof DsecError) {
      const tail = (await readFile(logPath, 'utf8').catch(() => '')).trim().split('\n').slice(-3);
      throw new DsecError('unavailable', `${err.message}; log ${logPath}: ${tail.join(' | ')}`, {
        cause: err,
      });
    }
    throw err;
  } finally {
    options.signal?.removeEventListener('abort', onAbort);
    stdout.destroy();
    child.removeAllListeners();
    child.unref();
  }
}

async function readPid(file: string): Promise<number | undefined> {
  const text = await readFile(file, 'utf8').catch(() => '');
  const pid = Number(text.trim());
  return Number.isSafeInteger(pid) && pid > 1 ? pid : undefined;
}

/** True when `pid` is a live (not zombie) blobd serving `mountDir`. */
async function isBlobd(pid: number, mountDir: string): Promise<boolean> {
  const [cmdline, statText] = await Promise.all([
    readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => ''),
    readFile(`/proc/${pid}/stat`, 'utf8').catch(() => ''),
  ]);
  if (/\) Z /.test(statText) || cmdline === '') return false;
  const argv = cmdline.split('\0');
  const entry = argv.some((a) => /blobd(-main\.ts|\.js)$/.test(a));
  const at = argv.indexOf('--mount');
  return entry && at >= 0 && argv[at + 1] === mountDir;
}

/** True when a blob daemon's FUSE filesystem is mounted exactly at `dir`. */
async function isFuseMount(dir: string): Promise<boolean> {
  return (await mountTypes()).get(dir) === FUSE_TYPE;
}

/** The mount answers a request its daemon must serve (`.stats` is never cached). */
async function answers(mountDir: string): Promise<boolean> {
  const probe = readFile(join(mountDir, '.stats')).then(
    () => true,
    () => false,
  );
  return Promise.race([probe, sleep(5000, false, { ref: false })]);
}

async function waitExit(pid: number, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const st = await stat(`/proc/${pid}`).catch(() => undefined);
    const statText = st ? await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '') : '';
    if (!st || statText === '' || /\) Z /.test(statText)) return true;
    if (Date.now() >= deadline) return false;
    await sleep(20);
  }
}

/** SIGTERM, then SIGKILL after `timeoutMs`, each only while `pid` is still that daemon. */
async function terminate(pid: number, mountDir: string, timeoutMs = 5000): Promise<void> {
  for (const signal of ['SIGTERM', 'SIGKILL'] as const) {
    if (!(await isBlobd(pid, mountDir))) return;
    try {
      process.kill(pid, signal);
    } catch {
      return;
    }
    if (await waitExit(pid, timeoutMs)) return;
  }
}

function abortError(signal: AbortSignal | undefined): DsecError {
  return new DsecError('aborted', 'operation aborted', { cause: signal?.reason });
}
