/**
 * blobd: the per-node blob daemon process (started by {@link BlobDaemon}).
 *
 *   blobd-main --mount DIR --cache DIR --store LOCATION
 *              [--cache-bytes N] [--chunk-bytes N] [--readahead-bytes N]
 *              [--prefetch-bytes N]
 *
 * Serves every blob of the image store at LOCATION as the read-only file
 * `DIR/<sha256 hex>` over FUSE, fetching chunks on demand into a bounded
 * cache under `--cache`; `DIR/<sha256 hex>.<chunk table hex>` serves it with
 * every fetched chunk verified against that chunk table. Prints `ready <pid>` once mounted; exits when the
 * mount goes away, or on SIGTERM after lazily unmounting itself. Store
 * credentials come from the environment, never from argv.
 */
import { openSync } from 'node:fs';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { DsecError } from '@dsec/core';
import { openImageStore } from '@dsec/images';
import { mountFuse, unmount } from '@dsec/native';
import { ChunkCache, DEFAULT_CHUNK_BYTES, DEFAULT_READAHEAD_MAX_BYTES } from './chunk-cache.js';
import { BlobFuseServer } from './fuse-server.js';
import { jsonLogger } from '../observability/log.js';

/** JSON lines on stderr, which the starting edge points at `<cacheDir>/blobd.log`. */
const logger = jsonLogger({ name: 'dsec-blobd', destination: process.stderr });

/**
 * libuv sizes its pool from the environment when first used, which module
 * loading may already have done: only the size inherited at exec is certain
 * (BlobDaemon passes 24). Setting it here helps when the pool is not up yet.
 */
const inheritedPoolSize = Number(process.env.UV_THREADPOOL_SIZE) || 4;
process.env.UV_THREADPOOL_SIZE ??= '24';

function byteCount(value: string | undefined, field: string, fallback: number): number {
  if (value === undefined) return fallback;
  const n = Number(value);
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n))
    throw new DsecError('invalid_argument', `--${field} wants a byte count`, { field });
  return n;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    strict: true,
    options: {
      mount: { type: 'string' },
      cache: { type: 'string' },
      store: { type: 'string' },
      'cache-bytes': { type: 'string' },
      'chunk-bytes': { type: 'string' },
      'readahead-bytes': { type: 'string' },
      'prefetch-bytes': { type: 'string' },
    },
  });
  if (!values.mount || !values.cache || !values.store)
    throw new DsecError(
      'invalid_argument',
      'usage: blobd --mount DIR --cache DIR --store LOCATION',
    );
  const mountDir = resolve(values.mount);
  const cacheDir = resolve(values.cache);
  const pidFile = join(cacheDir, 'blobd.pid');
  await mkdir(cacheDir, { recursive: true, mode: 0o700 });
  await mkdir(mountDir, { recursive: true, mode: 0o700 });

  const store = openImageStore(values.store, { cacheDir: join(cacheDir, 'store') });
  const cache = await ChunkCache.open({
    dir: join(cacheDir, 'chunks'),
    source: store,
    log: (line) => logger.warn(line),
    budgetBytes: byteCount(values['cache-bytes'], 'cache-bytes', 10 * 2 ** 30),
    chunkBytes: byteCount(values['chunk-bytes'], 'chunk-bytes', DEFAULT_CHUNK_BYTES),
    readaheadMaxBytes: byteCount(
      values['prefetch-bytes'],
      'prefetch-bytes',
      DEFAULT_READAHEAD_MAX_BYTES,
    ),
  });
  const fd = openSync('/dev/fuse', 'r+');
  const server = new BlobFuseServer({
    fd,
    source: store,
    cache,
    log: (line) => logger.warn(line),
    maxReadaheadBytes: byteCount(values['readahead-bytes'], 'readahead-bytes', 128 << 10),
    // Blocked device reads must leave pool threads for the cache's file I/O.
    readers: Math.max(1, Math.min(4, inheritedPoolSize - 4)),
  });
  await mountFuse(mountDir, fd);

  let exiting = false;
  const exit = async () => {
    if (exiting) return;
    exiting = true;
    // Only our own pid file: a successor may already have written its own.
    const owner = await readFile(pidFile, 'utf8').catch(() => '');
    if (owner.trim() === String(process.pid)) await rm(pidFile, { force: true });
    process.exit(0);
  };
  const onSignal = () => {
    unmount([mountDir], { detach: true })
      .catch((err: Error) => logger.error({ err: err.message }, 'unmount failed'))
      .finally(() => void exit());
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);

  const served = server.serve();
  await writeFile(pidFile, `${process.pid}\n`);
  process.stdout.write(`ready ${process.pid}\n`);
  logger.info({ pid: process.pid, mountDir }, 'blob daemon serving');
  await served;
  await exit();
}

main().catch((err: unknown) => {
  logger.error({ err: err instanceof Error ? err.message : String(err) }, 'blob daemon failed');
  process.exit(1);
});
