import { basename, dirname } from 'node:path';
import { DsecError } from '@dsec/core';
import {
  confinedCommand,
  confinedFailure,
  confinedTreeCommand,
  runConfined,
  runConfinedOk,
  type ConfineOptions,
  type ConfinedTree,
} from '@dsec/native';
import { erofsArgs } from './erofs.js';

/**
 * Packing an overlay writable layer (a sandbox's upper directory) into an
 * EROFS layer, for snapshots (paper 6.1, pack_diff). The upper directory is
 * already in overlayfs format — a deletion is a 0:0 character device, a
 * directory replaced as a whole carries `trusted.overlay.opaque=y` — and
 * `mkfs.erofs` keeps both, so a file deleted in the sandbox stays deleted
 * when the layer is stacked on the same parents.
 *
 * The upper directory (and every copy of it, and every lower layer, which may
 * itself be a snapshot) is a tree the sandbox shaped: every step here runs
 * confined to it (`@dsec/native` confine: a private root holding only the
 * trees, attached nosymfollow, plus the helper's openat2-only tree
 * operations), never as a host path walk (SECURITY.md A9, H35). A scrub
 * pattern names a path in the layer: a symlink in any of its components is
 * never followed, so a pattern through one names nothing there (the link
 * itself already hides whatever a lower layer has below it).
 */

/** One scrub pattern: an absolute path inside the sandbox, or `DIR/**` for everything under DIR. */
export interface ScrubPattern {
  /** As given. */
  pattern: string;
  /** Relative to the layer's root, no leading slash (`''` for the root). */
  rel: string;
  /** `DIR/**`: DIR's contents go, DIR itself stays. */
  subtree: boolean;
}

export const MAX_SCRUB_PATTERNS = 256;

/** Parses scrub patterns; `invalid_argument` naming `scrub.<i>` for a malformed one. */
export function parseScrubPatterns(patterns: readonly string[]): ScrubPattern[] {
  if (patterns.length > MAX_SCRUB_PATTERNS) {
    throw new DsecError('invalid_argument', `at most ${MAX_SCRUB_PATTERNS} scrub patterns`, {
      field: 'scrub',
    });
  }
  return patterns.map((pattern, i) => {
    const field = `scrub.${i}`;
    const subtree = pattern === '/**' || pattern.endsWith('/**');
    const path = subtree ? pattern.slice(0, -3) || '/' : pattern;
    const parts = path.split('/').slice(1);
    const bad =
      typeof pattern !== 'string' ||
      !path.startsWith('/') ||
      pattern.length > 4096 ||
      pattern.includes('\0') ||
      (path !== '/' && parts.some((p) => p === '' || p === '.' || p === '..' || p.includes('*')));
    if (bad) {
      throw new DsecError(
        'invalid_argument',
        `${field} must be an absolute path without . or .. parts (optionally ending in /**)`,
        { field },
      );
    }
    if (path === '/' && !subtree) {
      throw new DsecError('invalid_argument', `${field}: use /** to scrub everything`, { field });
    }
    return { pattern, rel: path === '/' ? '' : parts.join('/'), subtree };
  });
}

/** `mkfs.erofs` exclusion arguments leaving the patterns out of a build from the upper directory. */
export function scrubExcludeArgs(patterns: readonly ScrubPattern[]): string[] {
  return patterns.map((p) =>
    p.subtree
      ? `--exclude-regex=^${p.rel === '' ? '' : escapeRegex(p.rel) + '/'}.`
      : `--exclude-path=${p.rel}`,
  );
}

/** Where a sandbox's writable layer is, as the host reaches it. */
export type UpperSource =
  | { dir: string }
  /**
   * On its disk-quota filesystem: the ext4 loop device serving it (mounted in
   * the sandbox's namespace) and the upper directory's path in that filesystem.
   */
  | { device: string; subdir: string };

/** How a confined step runs: its private root, cgroup and time limit. */
export interface ConfinedRun {
  /** An empty scratch directory of the platform's, on which confined runs mount their root. */
  rootDir: string;
  /** Cgroup directories the step runs in (its CPU and memory limits). */
  cgroupDirs?: readonly string[] | undefined;
  /** Past this the step is killed and the call is `deadline_exceeded`. */
  timeoutMs?: number | undefined;
  signal?: AbortSignal | undefined;
}

/** Trees and names a step sees: the upper at `/src` (or the quota filesystem at `/q`). */
function sourceMount(source: UpperSource): {
  trees: ConfinedTree[];
  ext4?: { device: string; name: string };
  path: string;
} {
  if ('dir' in source) return { trees: [{ path: source.dir, name: 'src' }], path: '/src' };
  return { trees: [], ext4: { device: source.device, name: 'q' }, path: `/q/${source.subdir}` };
}

function confineOptions(run: ConfinedRun, extra: Omit<ConfineOptions, 'rootDir'>): ConfineOptions {
  return { rootDir: run.rootDir, cgroupDirs: run.cgroupDirs, ...extra };
}

/** What `scanUpper` counts (as `shiftErofsIds` counts an image: names, bytes once per inode). */
export interface UpperScan {
  /** Every entry below the root. */
  files: number;
  /** Apparent bytes of regular files (a hard-linked one once). */
  bytes: number;
  /** Of those bytes, how many have no block behind them (holes of sparse files). */
  holeBytes: number;
  /** Deepest directory level. */
  depth: number;
}

export interface ScanCaps {
  maxFiles: number;
  maxBytes: number;
  /** Longest path (bytes, relative to the root) packing can take. */
  maxPathBytes: number;
  maxDepth: number;
}

/** Why a tree is refused: which cap, and its value. */
export type ScanRefusal = { over: 'files' | 'bytes' | 'path' | 'depth'; scan: UpperScan };

/**
 * Counts a writable layer, stopping at the first cap it passes (then
 * `over` names it). Runs confined, on the live tree: a sandbox that grows it
 * afterwards is stopped by the limits on the packing itself.
 */
export async function scanUpper(
  source: UpperSource,
  caps: ScanCaps,
  run: ConfinedRun,
): Promise<UpperScan | ScanRefusal> {
  const m = sourceMount(source);
  const r = await runConfined(
    confinedTreeCommand(confineOptions(run, { trees: m.trees, ext4: m.ext4 }), [
      'scan',
      m.path,
      '--max-files',
      String(caps.maxFiles),
      '--max-bytes',
      String(caps.maxBytes),
      '--max-path',
      String(caps.maxPathBytes),
      '--max-depth',
      String(caps.maxDepth),
    ]),
    run,
  );
  if (r.exitCode !== 0 && r.exitCode !== 3)
    throw confinedFailure(r, 'scanning the writable layer', run.timeoutMs);
  const value = (key: string): number =>
    Number(new RegExp(`^${key} (\\d+)$`, 'm').exec(r.stdout)?.[1] ?? NaN);
  const scan: UpperScan = {
    files: value('files'),
    bytes: value('bytes'),
    holeBytes: value('holes'),
    depth: value('depth'),
  };
  if (Object.values(scan).some((v) => !Number.isSafeInteger(v)))
    throw new DsecError('internal', `unexpected tree scan output: ${r.stdout.slice(0, 200)}`);
  const over = /^over (files|bytes|path|depth)$/m.exec(r.stdout)?.[1];
  return over ? { over: over as ScanRefusal['over'], scan } : scan;
}

/** `tree` pattern arguments, in order. */
function patternArgs(patterns: readonly ScrubPattern[]): string[] {
  return patterns.flatMap((p) => [p.subtree ? '--subtree' : '--path', p.rel]);
}

function lowerTrees(lowerDirs: readonly string[]): ConfinedTree[] {
  return lowerDirs.map((path, i) => ({ path, name: `l${i}` }));
}

function lowerArgs(lowerDirs: readonly string[]): string[] {
  return lowerDirs.flatMap((_, i) => ['--lower', `/l${i}`]);
}

/**
 * Which patterns name something the layers below show (`lowerDirs`: their
 * mounted roots, top first). Leaving those out of the captured layer is not
 * enough — the lower copy would show through — so they need a whiteout (a
 * path) or an opaque directory (`DIR/**`) in the new layer. Conservative:
 * present in any lower layer counts, even where an upper one hides it. Only
 * real directories count: a lower layer that reaches the path through a
 * symlink does not show it (and is not followed).
 */
export async function patternsShadowingLowers(
  patterns: readonly ScrubPattern[],
  lowerDirs: readonly string[],
  run: ConfinedRun,
): Promise<ScrubPattern[]> {
  if (patterns.length === 0 || lowerDirs.length === 0) return [];
  const r = await runConfinedOk(
    confinedTreeCommand(confineOptions(run, { trees: lowerTrees(lowerDirs) }), [
      'shadow',
      ...lowerArgs(lowerDirs),
      ...patternArgs(patterns),
    ]),
    'checking the lower layers',
    run,
  );
  const shown = new Set(r.stdout.split('\n').filter(Boolean).map(Number));
  return patterns.filter((_, i) => shown.has(i));
}

/**
 * Applies scrub patterns to a private copy of an upper directory (`dir`):
 * removes what they name, then hides what the lower layers would still show
 * (a whiteout for a path, the opaque mark for `DIR/**`). Directories it must
 * create take the attributes of the lower directory they stand over, with
 * ids in the sandbox's host range (`hostId`), like the rest of the copy.
 */
export async function scrubCopy(
  dir: string,
  patterns: readonly ScrubPattern[],
  options: { lowerDirs: readonly string[]; hostId: number },
  run: ConfinedRun,
): Promise<void> {
  if (!Number.isSafeInteger(options.hostId) || options.hostId < 0)
    throw new DsecError('invalid_argument', 'hostId must be a non-negative integer');
  await runConfinedOk(
    confinedTreeCommand(
      confineOptions(run, {
        trees: [{ path: dir, name: 't', writable: true }, ...lowerTrees(options.lowerDirs)],
      }),
      [
        'scrub',
        '/t',
        '--host-id',
        String(options.hostId),
        ...lowerArgs(options.lowerDirs),
        ...patternArgs(patterns),
      ],
    ),
    'scrubbing the copy',
    run,
  );
}

export interface PackUpperOptions {
  /** The tree to pack: the upper directory itself, or a scrubbed copy of it. */
  source: UpperSource;
  /** The image to write; its directory is the platform's scratch space. */
  output: string;
  /** Left out of the layer (`scrubExcludeArgs`); only for a build from the upper itself. */
  exclude?: readonly ScrubPattern[] | undefined;
  /**
   * Chunk-based files (`--chunksize`, 4096 here): erofs-utils 1.5 has no holes
   * in plain files (a 1 GiB sparse file is 1 GiB of zeros in the image), but
   * stores each distinct chunk once, so holes cost one zero block and an index
   * entry. Hashing every chunk makes the build several times slower, so it is
   * only used for trees with holes (`UpperScan.holeBytes`).
   */
  chunked?: boolean | undefined;
  /** No image past this (RLIMIT_FSIZE: the build dies of SIGXFSZ). */
  maxImageBytes?: number | undefined;
}

/** Chunk size for trees with holes: one block, so a chunk never drags a hole's neighbours in. */
export const SPARSE_CHUNK_BYTES = 4096;

/**
 * `mkfs.erofs` of a writable layer, confined: uncompressed (lz4hc takes
 * minutes per GiB, and this runs while the sandbox is frozen), fixed UUID and
 * times so the same tree gives the same bytes. Owners are still host ids:
 * shift them with `shiftErofsIds`. mkfs.erofs recurses per directory level
 * with a PATH_MAX buffer on its stack, so it gets a bigger stack than 8 MiB.
 */
export async function packUpperDir(options: PackUpperOptions, run: ConfinedRun): Promise<void> {
  const m = sourceMount(options.source);
  const args = erofsArgs({
    sourceDir: m.path,
    output: `/out/${basename(options.output)}`,
    compress: false,
  });
  const tail = args.splice(-2);
  const program = [
    'mkfs.erofs',
    ...args,
    ...(options.chunked ? [`--chunksize=${SPARSE_CHUNK_BYTES}`] : []),
    ...scrubExcludeArgs(options.exclude ?? []),
    ...tail,
  ];
  await runConfinedOk(
    confinedCommand(
      confineOptions(run, {
        trees: [
          ...m.trees,
          { path: dirname(options.output), name: 'out', writable: true },
          // Chunk-based builds stage the chunk data in a tmpfile(3), which is /tmp's.
          { path: dirname(options.output), name: 'tmp', writable: true },
        ],
        ext4: m.ext4,
        tools: true,
        maxFileBytes: options.maxImageBytes,
        stackBytes: PACK_STACK_BYTES,
      }),
      program,
    ),
    'packing the writable layer (mkfs.erofs)',
    run,
  );
}

/** Enough stack for mkfs.erofs to recurse through the deepest tree the scan lets through. */
const PACK_STACK_BYTES = 256 * 2 ** 20;

/**
 * Copies an upper directory into `dest` (an empty scratch directory) keeping
 * whiteouts, xattrs (the opaque marks), owners, hard links and holes
 * (`cp -a`: `--sparse=auto`), sharing blocks where the filesystem can
 * (reflinks on XFS and btrfs; a plain copy on ext4). Confined: the source is
 * read-only and nosymfollow, the copy too writes only under `dest`.
 */
export async function copyUpperDir(
  source: UpperSource,
  dest: string,
  run: ConfinedRun & { maxFileBytes?: number | undefined },
): Promise<void> {
  const m = sourceMount(source);
  await runConfinedOk(
    confinedCommand(
      confineOptions(run, {
        trees: [...m.trees, { path: dest, name: 'dst', writable: true }],
        ext4: m.ext4,
        tools: true,
        maxFileBytes: run.maxFileBytes,
      }),
      ['cp', '-a', '--reflink=auto', '--', `${m.path}/.`, '/dst/'],
    ),
    'copying the writable layer',
    run,
  );
}

function escapeRegex(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}
