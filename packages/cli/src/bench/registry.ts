import { execFile } from 'node:child_process';
import { createCipheriv } from 'node:crypto';
import { chmod, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import type { Command } from 'commander';
import {
  DirImageStore,
  erofsCompression,
  importFromRegistry,
  makeBusyboxRootfs,
  REGISTRY_DEFAULT_COMPRESSION,
  type ErofsCompression,
} from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
} from '@dsec/images/testing/registry';
import { hostErofsMounter } from '@dsec/edge';
import { contextOf } from '../context.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { dropCaches } from './layers.js';

const execFileAsync = promisify(execFile);

export interface RegistryBenchOptions {
  /** Size of the image's data layers in MiB, all together (default 192). */
  imageMb?: number;
  /** Data layers above the busybox base (default 4). */
  layers?: number;
  /** The `dsec` side's compression (default: the import's, `lz4`); `lz4hc` is what imports used before ADR 0018. */
  compress?: ErofsCompression;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

interface Pull {
  ms: number;
  /** Bytes the store holds after this pull (allocated blocks, `du -B1`). */
  bytesOnDisk: number;
}

interface SideResult {
  /** First image into an empty store. */
  cold: Pull;
  /** A second image sharing every layer but the top one, into the same store. */
  shared: Pull & { addedBytes: number };
}

export interface RegistryBenchReport {
  benchmark: 'registry';
  image: { layers: number; dataBytes: number; registryBytes: number };
  results: {
    /** `dsec image import --from-registry` as it runs by default: the merged layer lz4-compressed (or as `compress` says). */
    dsec: SideResult & { layersReused: number; compress: ErofsCompression };
    /** The same with `--split` (metadata + uncompressed data blob, the form edges read on demand). */
    dsecSplit: SideResult & { layersReused: number };
    podman: (SideResult & { storageDriver: string }) | { available: false; reason: string };
  };
  /** dsec ÷ podman; absent when podman is not there. */
  ratios?: { coldMs: number; sharedMs: number; coldBytesOnDisk: number };
  method: string;
  limitations: string;
  machine: Record<string, unknown>;
}

/** Incompressible, deterministic bytes (AES-256-CTR of zeros under a seeded key). */
async function writeRandomFile(path: string, bytes: number, seed: number): Promise<void> {
  const key = Buffer.alloc(32);
  key.writeUInt32LE(seed, 0);
  const cipher = createCipheriv('aes-256-ctr', key, Buffer.alloc(16));
  await writeFile(path, cipher.update(Buffer.alloc(bytes)));
}

async function duBytes(dir: string): Promise<number> {
  const { stdout } = await execFileAsync('du', ['-s', '-B1', '--', dir]);
  return Number(stdout.split('\t')[0]);
}

const ms = (t0: bigint): number => Math.round(Number(process.hrtime.bigint() - t0) / 1e6);

/**
 * Pull + convert from a registry on loopback: `importFromRegistry` (skopeo
 * copy into a layout, per-layer EROFS conversion keyed by diff ID, merge)
 * against `podman pull` (its containers-storage, unpacked layers) from the
 * same registry, for an image and then a second one sharing all but its top
 * layer.
 */
export async function benchRegistry(
  options: RegistryBenchOptions = {},
): Promise<RegistryBenchReport> {
  const layerCount = Math.max(1, options.layers ?? 4);
  const compress = options.compress ?? REGISTRY_DEFAULT_COMPRESSION;
  const dataBytes = Math.max(1, options.imageMb ?? 192) * 2 ** 20;
  const fileBytes = 4 * 2 ** 20;
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-registry-'));
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  let n = 0;
  const step = (): void => options.onProgress?.(++n, 6);
  try {
    const registry = await startLocalRegistry({ dir: join(work, 'registry') });
    cleanups.unshift(() => registry.close());

    // Image a: busybox + data layers (the second deletes a file of the first and
    // makes a directory opaque); image b: the same lower layers, another top.
    const dirs: string[] = [];
    const base = join(work, 'src', 'base');
    await makeBusyboxRootfs(base);
    dirs.push(base);
    const perLayer = Math.max(1, Math.round(dataBytes / fileBytes / layerCount));
    for (let l = 0; l < layerCount; l++) {
      const d = join(work, 'src', `l${l}`, 'opt', `layer${l}`);
      await mkdir(d, { recursive: true });
      for (let f = 0; f < perLayer; f++)
        await writeRandomFile(join(d, `part-${f}.bin`), fileBytes, l * 1000 + f + 1);
      if (l === 1) {
        await writeFile(join(d, '..', '.wh.layer0'), '');
        await writeFile(join(d, '.wh..wh..opq'), '');
      }
      dirs.push(join(work, 'src', `l${l}`));
    }
    const topB = join(work, 'src', 'top-b', 'opt', 'b');
    await mkdir(topB, { recursive: true });
    await writeRandomFile(join(topB, 'part.bin'), fileBytes, 99_999);
    const config = { Cmd: ['/bin/sh'] };
    await makeOciLayoutFromDirs(join(work, 'layout-a'), dirs, config, 'v1');
    await makeOciLayoutFromDirs(
      join(work, 'layout-b'),
      [...dirs.slice(0, -1), join(work, 'src', 'top-b')],
      config,
      'v1',
    );
    await rm(join(work, 'src'), { recursive: true, force: true });
    const refA = `docker://${registry.host}/bench/a:v1`;
    const refB = `docker://${registry.host}/bench/b:v1`;
    await pushToRegistry(join(work, 'layout-a'), 'v1', refA);
    await pushToRegistry(join(work, 'layout-b'), 'v1', refB);
    await rm(join(work, 'layout-a'), { recursive: true, force: true });
    await rm(join(work, 'layout-b'), { recursive: true, force: true });
    const registryBytes = await duBytes(join(work, 'registry', 'storage'));
    step();

    // dsec: a fresh directory store each; its scratch space is left out of the count.
    const mounter = hostErofsMounter();
    const dsecSide = async (split: boolean) => {
      const storeDir = join(work, split ? 'dsec-store-split' : 'dsec-store');
      const store = new DirImageStore(storeDir);
      const storeBytes = async (): Promise<number> =>
        (await duBytes(storeDir)) - (await duBytes(store.tmpDir).catch(() => 0));
      const importOne = async (ref: string, name: string) => {
        await dropCaches();
        const t0 = process.hrtime.bigint();
        const r = await importFromRegistry(store, {
          source: ref,
          name,
          kind: 'base',
          insecure: true,
          split,
          ...(split ? {} : { compress }),
          env: {},
          mounter,
          ...(options.signal ? { signal: options.signal } : {}),
        });
        return { ms: ms(t0), result: r };
      };
      const a = await importOne(refA, 'bench-a');
      const cold = { ms: a.ms, bytesOnDisk: await storeBytes() };
      const b = await importOne(refB, 'bench-b');
      const afterB = await storeBytes();
      const result = {
        cold,
        shared: { ms: b.ms, bytesOnDisk: afterB, addedBytes: afterB - cold.bytesOnDisk },
        layersReused: b.result.layers.filter((l) => l.reused).length,
      };
      await rm(storeDir, { recursive: true, force: true });
      return result;
    };
    const dsec = { ...(await dsecSide(false)), compress };
    step();
    const dsecSplit = await dsecSide(true);
    step();

    const podman = await podmanSide(work, registry.host, cleanups);
    step();
    step();
    const r = (x: number, y: number) => (y > 0 ? Math.round((x / y) * 10000) / 10000 : 0);
    step();
    return {
      benchmark: 'registry',
      image: {
        layers: layerCount + 1,
        dataBytes: perLayer * layerCount * fileBytes,
        registryBytes,
      },
      results: { dsec, dsecSplit, podman },
      ...('cold' in podman
        ? {
            ratios: {
              coldMs: r(dsec.cold.ms, podman.cold.ms),
              sharedMs: r(dsec.shared.ms, podman.shared.ms),
              coldBytesOnDisk: r(dsec.cold.bytesOnDisk, podman.cold.bytesOnDisk),
            },
          }
        : {}),
      method:
        'A docker-registry (distribution 2.8, Debian) on 127.0.0.1 over plain HTTP holds two images pushed with ' +
        `skopeo: a busybox base plus ${layerCount} layers of incompressible 4 MiB files (one layer deletes a directory ` +
        'of the one below and makes its own opaque), and a second image with the same lower layers and another top. ' +
        'dsec: importFromRegistry (what `dsec image import --from-registry` runs: skopeo copy into an OCI layout, each ' +
        'layer checked against its diff ID and converted to EROFS unless already converted, then merged into one base ' +
        `layer, ${compress}-compressed) into an empty directory store, then the second image into the same store; ` +
        'dsecSplit: the same with split: true (metadata image + uncompressed data blob + chunk table). podman: `podman pull ' +
        '--tls-verify=false` into an empty containers-storage (its own --root), then the second image. Time is wall ' +
        'clock per pull; bytesOnDisk is `du -B1` of the store afterwards (dsec without its scratch dir). Page cache ' +
        'dropped before each pull.',
      limitations:
        'One machine, registry on loopback: no network latency or bandwidth limit, so the times are dominated by ' +
        'decompression, unpacking and (dsec) mkfs.erofs, not transfer. The data is incompressible, the worst case for ' +
        'compression in mkfs.erofs (erofs-utils 1.5 tries every cluster and stores it raw). dsec stores each layer once more ' +
        'as its own uncompressed EROFS (the diff-ID cache) besides the merged image, so its bytes on disk include both.',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

async function podmanSide(
  work: string,
  host: string,
  cleanups: (() => Promise<unknown>)[],
): Promise<RegistryBenchReport['results']['podman']> {
  const version = await execFileAsync('podman', ['--version']).catch((err: unknown) => err);
  if (version instanceof Error) {
    return {
      available: false,
      reason:
        'podman is not installed (install it with DSEC_EXTRA_PACKAGES=podman bash scripts/install-deps.sh)',
    };
  }
  const root = join(work, 'podman-root');
  const args = (driver: string) => [
    '--root',
    root,
    '--runroot',
    join(work, 'podman-run'),
    '--tmpdir',
    join(work, 'podman-tmp'),
    '--storage-driver',
    driver,
    '--events-backend',
    'none',
  ];
  cleanups.unshift(() => rm(join(work, 'podman-run'), { recursive: true, force: true }));
  const pull = async (driver: string, image: string): Promise<number> => {
    await dropCaches();
    const t0 = process.hrtime.bigint();
    await execFileAsync(
      'podman',
      [...args(driver), 'pull', '--quiet', '--tls-verify=false', `${host}/${image}`],
      { maxBuffer: 16 << 20 },
    );
    return ms(t0);
  };
  // overlay where the scratch filesystem allows it (podman's default), else vfs.
  let driver = 'overlay';
  let coldMs: number;
  try {
    coldMs = await pull(driver, 'bench/a:v1');
  } catch {
    await rm(root, { recursive: true, force: true });
    driver = 'vfs';
    try {
      coldMs = await pull(driver, 'bench/a:v1');
    } catch (err) {
      return { available: false, reason: `podman pull failed: ${(err as Error).message}` };
    }
  }
  const cold = { ms: coldMs, bytesOnDisk: await duBytes(root) };
  const sharedMs = await pull(driver, 'bench/b:v1');
  const afterB = await duBytes(root);
  // Storage may hold overlay mounts of its own: let podman undo them before the files go.
  await execFileAsync('podman', [...args(driver), 'system', 'reset', '--force']).catch(
    () => undefined,
  );
  return {
    storageDriver: driver,
    cold,
    shared: { ms: sharedMs, bytesOnDisk: afterB, addedBytes: afterB - cold.bytesOnDisk },
  };
}

export function registerRegistryBench(bench: Command): void {
  bench
    .command('registry')
    .description(
      'pull + convert from a loopback registry vs `podman pull`: time and bytes on disk, then a second image sharing layers',
    )
    .option('--image-mb <n>', 'size of the data layers together', '192')
    .option('--layers <n>', 'data layers above the busybox base', '4')
    .option(
      '--compress <how>',
      `the dsec import's compression: lz4, lz4hc or none (default ${REGISTRY_DEFAULT_COMPRESSION})`,
    )
    .action(
      async (opts: { imageMb: string; layers: string; compress?: string }, command: Command) => {
        const ctx = contextOf(command);
        const progress = createProgress({ label: 'bench registry', total: 6, enabled: !ctx.json });
        const report = await benchRegistry({
          imageMb: Number(opts.imageMb),
          layers: Number(opts.layers),
          ...(opts.compress !== undefined
            ? {
                compress: erofsCompression(opts.compress, REGISTRY_DEFAULT_COMPRESSION, 'compress'),
              }
            : {}),
          onProgress: (done) => progress.update(done),
          ...(ctx.signal ? { signal: ctx.signal } : {}),
        });
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const mib = (b: number) => `${(b / 2 ** 20).toFixed(1)} MiB`;
        const { dsec, podman } = report.results;
        ctx.out(
          `dsec    cold ${(dsec.cold.ms / 1000).toFixed(2)} s ${mib(dsec.cold.bytesOnDisk)}   shared ${(dsec.shared.ms / 1000).toFixed(2)} s +${mib(dsec.shared.addedBytes)} (${dsec.layersReused} layers reused)`,
        );
        const sp = report.results.dsecSplit;
        ctx.out(
          `split   cold ${(sp.cold.ms / 1000).toFixed(2)} s ${mib(sp.cold.bytesOnDisk)}   shared ${(sp.shared.ms / 1000).toFixed(2)} s +${mib(sp.shared.addedBytes)} (${sp.layersReused} layers reused)`,
        );
        if ('cold' in podman) {
          ctx.out(
            `podman  cold ${(podman.cold.ms / 1000).toFixed(2)} s ${mib(podman.cold.bytesOnDisk)}   shared ${(podman.shared.ms / 1000).toFixed(2)} s +${mib(podman.shared.addedBytes)} (${podman.storageDriver})`,
          );
          ctx.out(`ratios (dsec ÷ podman): ${JSON.stringify(report.ratios)}`);
        } else ctx.out(`podman  not measured: ${podman.reason}`);
      },
    );
}
