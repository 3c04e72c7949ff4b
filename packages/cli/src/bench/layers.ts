import { execFile } from 'node:child_process';
import { chmod, mkdir, mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { startSingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { describeMachine } from './create.js';

const execFileAsync = promisify(execFile);

export interface LayersBenchOptions {
  /** Sandboxes per system (default 64). */
  count: number;
  /** Synthetic workspace size in MiB (default 40). */
  workspaceMb?: number;
  /** Sandboxes created at a time, for both systems (default 8). */
  concurrency?: number;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

export interface SystemResult {
  bytesWritten: number;
  timeToReadyMs: number;
}

export interface LayersBenchReport {
  benchmark: 'layers';
  count: number;
  workspace: { files: number; bytes: number; tarGzBytes: number };
  toolkit: { files: number; bytes: number; tarGzBytes: number };
  device: string;
  results: { dsec: SystemResult; tar: SystemResult };
  ratios: { bytesWritten: number; timeToReady: number };
  method: string;
  machine: Record<string, unknown>;
}

/** A small seeded PRNG (mulberry32): the same seed always gives the same tree. */
export function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = (
  'self return import from def class if else elif for while in not and or None True False ' +
  'value result data items config path name index count error response request client ' +
  'parse load save update handle process build test assert yield async await with as try except'
).split(' ');

/**
 * A synthetic Python-like repository: packages of modules, tests, docs and a
 * few binary blobs (wheels, .so), deterministic from the seed. Returns the
 * number of files and bytes written.
 */
export async function makeSyntheticRepo(
  root: string,
  options: { seed: number; targetBytes: number; prefix: string },
): Promise<{ files: number; bytes: number }> {
  const rand = prng(options.seed);
  let bytes = 0;
  let files = 0;
  const line = () => {
    const n = 3 + Math.floor(rand() * 9);
    const indent = '    '.repeat(Math.floor(rand() * 3));
    const words = Array.from({ length: n }, () => WORDS[Math.floor(rand() * WORDS.length)]!);
    return `${indent}${words.join(' ')}${rand() < 0.3 ? `(${Math.floor(rand() * 1000)})` : ''}`;
  };
  const binaryBudget = Math.floor(options.targetBytes * 0.2);
  let pkg = 0;
  while (bytes < options.targetBytes) {
    const dir = join(root, options.prefix, `pkg${pkg}`, pkg % 3 === 0 ? 'tests' : 'src');
    await mkdir(dir, { recursive: true });
    const modules = 10 + Math.floor(rand() * 20);
    for (let m = 0; m < modules && bytes < options.targetBytes; m++) {
      let content: Buffer;
      let name: string;
      if (bytes < binaryBudget && rand() < 0.02) {
        const size = (128 * 1024 + Math.floor(rand() * 512 * 1024)) & ~3;
        content = Buffer.alloc(size);
        for (let i = 0; i < size; i += 4) content.writeUInt32LE(Math.floor(rand() * 2 ** 32), i);
        name = `_native${m}.cpython-311-x86_64-linux-gnu.so`;
      } else {
        const lines = 20 + Math.floor(rand() * 400);
        content = Buffer.from(Array.from({ length: lines }, line).join('\n') + '\n');
        name = `module_${m}.py`;
      }
      await writeFile(join(dir, name), content);
      bytes += content.length;
      files++;
    }
    await writeFile(join(dir, '__init__.py'), `# package ${pkg}\n`);
    files++;
    pkg++;
  }
  return { files, bytes };
}

/** The block device under `path` and its sectors-written counter (`/sys/dev/block/M:m/stat`, field 7). */
export async function blockDeviceOf(path: string): Promise<{ name: string; statFile: string }> {
  const dev = (await stat(path)).dev;
  const major = Math.floor(dev / 256) & 0xfff;
  const minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
  const statFile = `/sys/dev/block/${major}:${minor}/stat`;
  await readFile(statFile, 'utf8').catch(() => {
    throw new Error(
      `${path} is not on a block device (${major}:${minor}); run the bench on a disk-backed state dir`,
    );
  });
  const uevent = await readFile(`/sys/dev/block/${major}:${minor}/uevent`, 'utf8').catch(() => '');
  const name = /DEVNAME=(\S+)/.exec(uevent)?.[1] ?? `${major}:${minor}`;
  return { name, statFile };
}

export async function bytesWrittenSoFar(statFile: string): Promise<number> {
  await execFileAsync('sync');
  const fields = (await readFile(statFile, 'utf8')).trim().split(/\s+/);
  return Number(fields[6]) * 512;
}

export async function dropCaches(): Promise<void> {
  await execFileAsync('sync');
  await writeFile('/proc/sys/vm/drop_caches', '3').catch(() => undefined);
}

/** Stops sandboxes one at a time, outside the measurement (a stop racing others is not what is measured). */
async function stopAll(sandboxes: Sandbox[]): Promise<void> {
  for (const sb of sandboxes) await sb.stop().catch(() => undefined);
}

/** Runs `fn` over `items` with at most `limit` in flight. */
export async function pool<T, R>(
  items: T[],
  limit: number,
  fn: (item: T, i: number) => Promise<R>,
): Promise<R[]> {
  const out: R[] = new Array<R>(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i]!, i);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

/**
 * N sandboxes that all need the same workspace and toolkit: DSec composes
 * them from shared EROFS layers (nothing extracted), the peer extracts the
 * same files from tar.gz archives into each sandbox's writable layer with
 * `tar` inside the sandbox (the archives are shipped in its base layer, so
 * the peer pays no download). Both run through the full path (SDK →
 * apiserver → edge → runc), the same burst concurrency, caches dropped before
 * each phase; bytes are the state disk's sectors-written counter, synced.
 */
export async function benchLayers(options: LayersBenchOptions): Promise<LayersBenchReport> {
  const count = options.count;
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-layers-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  try {
    const stateDir = join(work, 'state');
    const node = await startSingleNode({
      stateDir,
      port: 0,
      capacity: { sandboxes: count * 2 + 8, cpuCores: count * 2 },
    });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const device = await blockDeviceOf(stateDir);

    const wsDir = join(work, 'ws');
    const tkDir = join(work, 'tk');
    const targetBytes = (options.workspaceMb ?? 40) * 2 ** 20;
    const ws = await makeSyntheticRepo(wsDir, { seed: 42, targetBytes, prefix: 'workspace/repo' });
    const tk = await makeSyntheticRepo(tkDir, {
      seed: 7,
      targetBytes: Math.floor(targetBytes / 8),
      prefix: 'opt/harness',
    });
    const baseDir = join(work, 'base');
    await makeBusyboxRootfs(baseDir);
    await node.buildLayer({ name: 'bench-base', kind: 'base', from: { dir: baseDir } });
    await node.buildLayer({ name: 'bench-ws', kind: 'workspace', from: { dir: wsDir } });
    await node.buildLayer({ name: 'bench-tk', kind: 'toolkit', from: { dir: tkDir } });
    // The peer's base: the same busybox plus the two archives to extract.
    await mkdir(join(baseDir, 'opt/dist'), { recursive: true });
    const wsTar = join(baseDir, 'opt/dist/ws.tar.gz');
    const tkTar = join(baseDir, 'opt/dist/tk.tar.gz');
    await execFileAsync('tar', ['-czf', wsTar, '--numeric-owner', '-C', wsDir, '.']);
    await execFileAsync('tar', ['-czf', tkTar, '--numeric-owner', '-C', tkDir, '.']);
    const tarSizes = [(await stat(wsTar)).size, (await stat(tkTar)).size] as const;
    await node.buildLayer({ name: 'bench-base-tar', kind: 'base', from: { dir: baseDir } });
    await rm(baseDir, { recursive: true, force: true });
    await rm(wsDir, { recursive: true, force: true });
    await rm(tkDir, { recursive: true, force: true });

    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    cleanups.unshift(async () => client.close());
    const total = 2 * count;
    let done = 0;
    const concurrency = options.concurrency ?? 8;

    const phase = async (
      create: () => Promise<Sandbox>,
      ready: (sb: Sandbox) => Promise<void>,
    ): Promise<{ result: SystemResult; sandboxes: Sandbox[] }> => {
      await dropCaches();
      const before = await bytesWrittenSoFar(device.statFile);
      const t0 = process.hrtime.bigint();
      const sandboxes = await pool(Array.from({ length: count }), concurrency, async () => {
        if (options.signal?.aborted) throw new Error('benchmark aborted');
        const sb = await create();
        await ready(sb);
        options.onProgress?.(++done, total);
        return sb;
      });
      const timeToReadyMs = Number(process.hrtime.bigint() - t0) / 1e6;
      const bytesWritten = (await bytesWrittenSoFar(device.statFile)) - before;
      return { result: { bytesWritten, timeToReadyMs: Math.round(timeToReadyMs) }, sandboxes };
    };
    const spec = { memoryLimitMb: 256, cpuCoresLimit: 0.5, ttlSeconds: 1800 };
    const check = async (sb: Sandbox, cmd: string) => {
      const r = await sb.runShell(cmd, { timeoutMs: 600_000 });
      if (r.exitCode !== 0) throw new Error(`${cmd} exited ${r.exitCode}: ${r.stderr}`);
    };
    const READY = 'test -f /workspace/repo/pkg0/tests/__init__.py && test -d /opt/harness';

    const ours = await phase(
      () =>
        client.runContainer({
          ...spec,
          image: 'bench-base',
          workspace: 'bench-ws',
          toolkits: ['bench-tk'],
        }),
      (sb) => check(sb, READY),
    );
    await stopAll(ours.sandboxes);
    const peer = await phase(
      () => client.runContainer({ ...spec, image: 'bench-base-tar' }),
      (sb) =>
        check(
          sb,
          `tar -xzf /opt/dist/ws.tar.gz -C / && tar -xzf /opt/dist/tk.tar.gz -C / && ${READY}`,
        ),
    );
    await stopAll(peer.sandboxes);

    const r = (a: number, b: number) => (b > 0 ? Math.round((a / b) * 10000) / 10000 : 0);
    return {
      benchmark: 'layers',
      count,
      workspace: { ...ws, tarGzBytes: tarSizes[0] },
      toolkit: { ...tk, tarGzBytes: tarSizes[1] },
      device: device.name,
      results: { dsec: ours.result, tar: peer.result },
      ratios: {
        bytesWritten: r(ours.result.bytesWritten, peer.result.bytesWritten),
        timeToReady: r(ours.result.timeToReadyMs, peer.result.timeToReadyMs),
      },
      method:
        `${count} sandboxes per system, ${concurrency} created at a time, through SDK → apiserver → edge → runc. ` +
        'dsec: base + workspace + toolkit EROFS layers composed by overlayfs; ready = a command sees the files. ' +
        'tar: base only, then `tar -xzf` of the workspace and toolkit archives inside the sandbox into its writable layer ' +
        '(archives shipped in the base layer: no download counted). Bytes: sectors written on the state disk, after sync; caches dropped before each phase.',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}
