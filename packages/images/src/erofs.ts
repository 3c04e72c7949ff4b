import { stat } from 'node:fs/promises';
import { DsecError } from '@dsec/core';
import { runTool } from './util/run-tool.js';

export interface BuildErofsOptions {
  /** The tree to pack. Ownership, modes, xattrs and hard links are kept as they are. */
  sourceDir: string;
  /** The image to write (the metadata image when `blobDevice` is set). */
  output: string;
  /**
   * How file data is compressed (default `lz4hc`; `true` is `lz4hc`, `false`
   * is `none`). Ignored with `blobDevice`: erofs-utils 1.5 stores chunk-based
   * files uncompressed.
   */
  compress?: boolean | ErofsCompression;
  /** Write file data to this separate blob (`--blobdev`); `output` then holds only metadata. */
  blobDevice?: string;
  /** Chunk size for the split layout; a power of two ≥ 4096 (default 65536). */
  chunkSizeBytes?: number;
  /** The timestamp every inode and the superblock get (default 0, the epoch). */
  timestampSec?: number;
  /** Filesystem UUID (default all zeros). */
  uuid?: string;
  /** Path to the `mkfs.erofs` binary (default from PATH). */
  mkfsPath?: string;
  signal?: AbortSignal;
}

export interface BuildErofsResult {
  output: string;
  sizeBytes: number;
  blobDevice?: string;
  blobSizeBytes?: number;
}

/**
 * `lz4hc` packs tightest and costs the most to build: on incompressible data
 * erofs-utils 1.5 tries every cluster before storing it raw (about 1 s per
 * MiB on a busy host). `lz4` is within about 12 % of its size on source
 * trees at a fifth of the build time, and 30 × faster on incompressible
 * data; `none` only copies (docs/adr/0018-registry-import.md).
 */
export type ErofsCompression = 'lz4hc' | 'lz4' | 'none';
export const EROFS_COMPRESSIONS: readonly ErofsCompression[] = ['lz4', 'lz4hc', 'none'];

/** `true`/`false` (the older boolean form) or a name, as `mkfs.erofs` takes it; `invalid_argument` else. */
export function erofsCompression(
  value: boolean | string | undefined,
  fallback: ErofsCompression = 'lz4hc',
  field = 'compress',
): ErofsCompression {
  if (value === undefined) return fallback;
  if (value === true) return 'lz4hc';
  if (value === false) return 'none';
  if ((EROFS_COMPRESSIONS as readonly string[]).includes(value)) return value as ErofsCompression;
  throw new DsecError(
    'invalid_argument',
    `${field}: want one of ${EROFS_COMPRESSIONS.join(', ')}, got ${JSON.stringify(value)}`,
    { field },
  );
}

export const DEFAULT_CHUNK_SIZE_BYTES = 65536;
export const ZERO_UUID = '00000000-0000-0000-0000-000000000000';
const UUID_PATTERN = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/**
 * The `mkfs.erofs` argument list. Determinism comes from `-U` (else a random
 * UUID) and `-T` (else the build time lands in the superblock and in every
 * inode newer than it); with both, the bytes depend only on names, contents,
 * modes, owners, xattrs and link structure — not on mtimes, readdir order or
 * the filesystem the tree sits on (checked by experiment on ext4 and tmpfs).
 */
export function erofsArgs(options: BuildErofsOptions): string[] {
  const timestamp = options.timestampSec ?? 0;
  if (!Number.isSafeInteger(timestamp) || timestamp < 0) {
    throw new DsecError('invalid_argument', 'timestampSec must be a non-negative integer', {
      field: 'timestampSec',
    });
  }
  const uuid = options.uuid ?? ZERO_UUID;
  if (!UUID_PATTERN.test(uuid)) {
    throw new DsecError('invalid_argument', 'uuid must be a UUID', { field: 'uuid' });
  }
  const args = ['--quiet', `-U${uuid}`, `-T${timestamp}`];
  if (options.blobDevice !== undefined) {
    const chunk = options.chunkSizeBytes ?? DEFAULT_CHUNK_SIZE_BYTES;
    if (!Number.isSafeInteger(chunk) || chunk < 4096 || (chunk & (chunk - 1)) !== 0) {
      throw new DsecError('invalid_argument', 'chunkSizeBytes must be a power of two ≥ 4096', {
        field: 'chunkSizeBytes',
      });
    }
    args.push(`--chunksize=${chunk}`, `--blobdev=${options.blobDevice}`);
  } else {
    const compression = erofsCompression(options.compress);
    if (compression !== 'none') args.push(`-z${compression}`);
  }
  args.push(options.output, options.sourceDir);
  return args;
}

/** Packs a directory into an EROFS image with `mkfs.erofs`; same tree → same bytes. */
export async function buildErofs(options: BuildErofsOptions): Promise<BuildErofsResult> {
  const args = erofsArgs(options);
  const src = await stat(options.sourceDir).catch(() => undefined);
  if (!src?.isDirectory()) {
    throw new DsecError('invalid_argument', `${options.sourceDir} is not a directory`, {
      field: 'sourceDir',
    });
  }
  // SOURCE_DATE_EPOCH would also steer the timestamps; -T is explicit, so drop it.
  const env = { ...process.env };
  delete env['SOURCE_DATE_EPOCH'];
  await runTool(options.mkfsPath ?? 'mkfs.erofs', args, { env, signal: options.signal });
  const result: BuildErofsResult = {
    output: options.output,
    sizeBytes: (await stat(options.output)).size,
  };
  if (options.blobDevice !== undefined) {
    result.blobDevice = options.blobDevice;
    result.blobSizeBytes = (await stat(options.blobDevice)).size;
  }
  return result;
}
