import { chown, chmod, lstat, mkdir, readdir, rm } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { DsecError, throwIfAborted } from '@dsec/core';
import { erofsArgs } from './erofs.js';
import { isWhiteout, makeWhiteout, setOpaque } from './overlay/marks.js';
import { runTool } from './util/run-tool.js';

/**
 * Packing an overlay writable layer (a sandbox's upper directory) into an
 * EROFS layer, for snapshots (paper 6.1, pack_diff). The upper directory is
 * already in overlayfs format — a deletion is a 0:0 character device, a
 * directory replaced as a whole carries `trusted.overlay.opaque=y` — and
 * `mkfs.erofs` keeps both, so a file deleted in the sandbox stays deleted
 * when the layer is stacked on the same parents.
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

/**
 * Which patterns name something the layers below show (`lowerDirs`: their
 * mounted roots). Leaving those out of the captured layer is not enough —
 * the lower copy would show through — so they need a whiteout (a path) or
 * an opaque directory (`DIR/**`) in the new layer. Conservative: present in
 * any lower layer counts, even where an upper one hides it.
 */
export async function patternsShadowingLowers(
  patterns: readonly ScrubPattern[],
  lowerDirs: readonly string[],
): Promise<ScrubPattern[]> {
  const out: ScrubPattern[] = [];
  for (const p of patterns) {
    for (const dir of lowerDirs) {
      const st = await lstat(join(dir, p.rel)).catch(() => undefined);
      if (!st || (st.isCharacterDevice() && st.rdev === 0)) continue;
      if (p.subtree && (!st.isDirectory() || (await readdir(join(dir, p.rel))).length === 0))
        continue;
      out.push(p);
      break;
    }
  }
  return out;
}

/**
 * Applies scrub patterns to a private copy of an upper directory: removes
 * what they name, then hides what the lower layers would still show (a
 * whiteout for a path, the opaque mark for `DIR/**`). Directories it must
 * create take the attributes of the lower directory they stand over, with
 * ids in the sandbox's host range (`hostId`), like the rest of the copy.
 */
export async function scrubCopy(
  dir: string,
  patterns: readonly ScrubPattern[],
  options: { lowerDirs: readonly string[]; hostId: number; signal?: AbortSignal | undefined },
): Promise<void> {
  const shadowing = new Set(await patternsShadowingLowers(patterns, options.lowerDirs));
  for (const p of patterns) {
    throwIfAborted(options.signal);
    const target = join(dir, p.rel);
    if (p.subtree) {
      const names = await readdir(target).catch(() => [] as string[]);
      const st = await lstat(target).catch(() => undefined);
      if (st && !st.isDirectory()) continue; // not a directory here: nothing under it
      for (const name of names) await rm(join(target, name), { recursive: true, force: true });
      if (shadowing.has(p)) {
        await ensureDirLike(dir, p.rel, options);
        await setOpaque(target, options.signal);
      }
    } else {
      await rm(target, { recursive: true, force: true });
      if (shadowing.has(p)) {
        const parent = dirname(p.rel) === '.' ? '' : dirname(p.rel);
        await ensureDirLike(dir, parent, options);
        await makeWhiteout(target, options.signal);
        await chown(target, options.hostId, options.hostId);
      }
    }
  }
}

/** Makes `rel` (and its parents) in `dir` as the lower layers show them. */
async function ensureDirLike(
  dir: string,
  rel: string,
  options: { lowerDirs: readonly string[]; hostId: number },
): Promise<void> {
  if (rel === '') return;
  const path = join(dir, rel);
  const st = await lstat(path).catch(() => undefined);
  if (st?.isDirectory()) return;
  if (st && (!st.isCharacterDevice() || st.rdev !== 0 || !(await isWhiteout(path)))) return;
  await ensureDirLike(dir, dirname(rel) === '.' ? '' : dirname(rel), options);
  let lower: Awaited<ReturnType<typeof lstat>> | undefined;
  for (const l of options.lowerDirs) {
    lower = await lstat(join(l, rel)).catch(() => undefined);
    if (lower?.isDirectory()) break;
    lower = undefined;
  }
  await mkdir(path);
  await chmod(path, lower ? Number(lower.mode) & 0o7777 : 0o755);
  await chown(
    path,
    options.hostId + Number(lower?.uid ?? 0),
    options.hostId + Number(lower?.gid ?? 0),
  );
}

export interface PackUpperOptions {
  /** The tree to pack: the upper directory itself, or a scrubbed copy of it. */
  sourceDir: string;
  output: string;
  /** Left out of the layer (`scrubExcludeArgs`); only for a build from the upper itself. */
  exclude?: readonly ScrubPattern[] | undefined;
  /**
   * Runs `mkfs.erofs` behind this command prefix (the source given as `$1`
   * to a wrapper script, say, to mount the sandbox's disk-quota image in a
   * private mount namespace first).
   */
  commandPrefix?: string[] | undefined;
  signal?: AbortSignal | undefined;
}

/**
 * `mkfs.erofs` of a writable layer: uncompressed (lz4hc takes minutes per
 * GiB, and this runs while the sandbox is frozen), fixed UUID and times so
 * the same tree gives the same bytes. Owners are still host ids: shift them
 * with `shiftErofsIds`.
 */
export async function packUpperDir(options: PackUpperOptions): Promise<void> {
  const args = [
    ...scrubExcludeArgs(options.exclude ?? []),
    ...erofsArgs({ sourceDir: options.sourceDir, output: options.output, compress: false }),
  ];
  const env = { ...process.env };
  delete env['SOURCE_DATE_EPOCH'];
  const [cmd, ...rest] = [...(options.commandPrefix ?? []), 'mkfs.erofs', ...args];
  await runTool(cmd!, rest, { env, signal: options.signal });
}

/**
 * Copies an upper directory keeping whiteouts, xattrs (the opaque marks),
 * owners and hard links, sharing blocks where the filesystem can (reflinks on
 * XFS and btrfs; a plain copy on ext4). `commandPrefix` as for `packUpperDir`.
 */
export async function copyUpperDir(
  sourceDir: string,
  dest: string,
  options: { commandPrefix?: string[] | undefined; signal?: AbortSignal | undefined } = {},
): Promise<void> {
  const cp = ['cp', '-a', '--reflink=auto', '--', `${sourceDir}/.`, `${dest}/`];
  const [cmd, ...args] = [...(options.commandPrefix ?? []), ...cp];
  await runTool(cmd!, args, { signal: options.signal });
}

function escapeRegex(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}
