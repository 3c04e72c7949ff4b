import { readdir, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError, throwIfAborted } from '@dsec/core';
import type { BuildProgress } from '../build.js';
import { runTool } from '../util/run-tool.js';
import { prepareEmptyDir } from './prepare-dir.js';

export interface DebianRootfsOptions {
  suite?: string;
  /** Default: the host's apt source for `suite`, else deb.debian.org. */
  mirror?: string;
  /** Extra packages on top of minbase (default `['python3']`). */
  packages?: string[];
  signal?: AbortSignal;
  /** Phases `download`, `extract`, `install`, `configure`, `cleanup`. */
  onProgress?(p: BuildProgress): void;
}

export const DEFAULT_DEBIAN_MIRROR = 'http://deb.debian.org/debian';
const PACKAGE_PATTERN = /^[a-z0-9][a-z0-9+.-]+$/;
const SUITE_PATTERN = /^[a-z][a-z0-9-]*$/;

/**
 * Bootstraps a Debian root filesystem into `dir` (created, or empty) with
 * `debootstrap --variant=minbase`, then drops apt's caches so the layer only
 * holds the installed system. Needs root and the mirror; takes minutes. On
 * failure `dir` is left for the caller to inspect and remove.
 */
export async function makeDebianRootfs(
  dir: string,
  options: DebianRootfsOptions = {},
): Promise<void> {
  const suite = options.suite ?? 'bookworm';
  if (!SUITE_PATTERN.test(suite)) {
    throw new DsecError('invalid_argument', `bad suite ${JSON.stringify(suite)}`, {
      field: 'suite',
    });
  }
  const packages = options.packages ?? ['python3'];
  for (const [i, p] of packages.entries()) {
    if (!PACKAGE_PATTERN.test(p)) {
      throw new DsecError('invalid_argument', `bad package name ${JSON.stringify(p)}`, {
        field: `packages.${i}`,
      });
    }
  }
  const mirror = options.mirror ?? (await hostAptMirror(suite)) ?? DEFAULT_DEBIAN_MIRROR;
  if (!/^(https?|file):\/\//.test(mirror)) {
    throw new DsecError('invalid_argument', `mirror must be an http(s) or file URL`, {
      field: 'mirror',
    });
  }
  await prepareEmptyDir(dir);
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const args = ['--variant=minbase'];
  if (packages.length > 0) args.push(`--include=${packages.join(',')}`);
  args.push(suite, dir, mirror);
  let last = '';
  await runTool('debootstrap', args, {
    signal: options.signal,
    // debootstrap mounts /proc and /sys in the target; its exit trap unmounts them.
    killSignal: 'SIGTERM',
    onLine: (line) => {
      const phase = debootstrapPhase(line);
      if (phase !== undefined && phase !== last) progress({ phase });
      if (phase !== undefined) last = phase;
    },
  });
  throwIfAborted(options.signal);
  progress({ phase: 'cleanup' });
  for (const sub of ['var/cache/apt/archives', 'var/lib/apt/lists']) {
    const path = join(dir, sub);
    for (const entry of await readdir(path).catch(() => [] as string[])) {
      if (entry === 'partial' || entry === 'lock') continue;
      await rm(join(path, entry), { recursive: true, force: true });
    }
  }
  await rm(join(dir, 'var/cache/apt/pkgcache.bin'), { force: true });
  await rm(join(dir, 'var/cache/apt/srcpkgcache.bin'), { force: true });
}

function debootstrapPhase(line: string): string | undefined {
  if (!line.startsWith('I: ')) return undefined;
  const msg = line.slice(3);
  if (/^(Retrieving|Validating|Checking|Resolving|Found)/.test(msg)) return 'download';
  if (/^Extracting/.test(msg)) return 'extract';
  if (/^(Installing|Unpacking)/.test(msg)) return 'install';
  if (/^Configuring/.test(msg)) return 'configure';
  return undefined;
}

/**
 * The first `deb` URI the host's apt sources give for `suite` (one-line
 * `.list` files and deb822 `.sources` files), or undefined.
 */
export async function hostAptMirror(
  suite: string,
  aptDir = '/etc/apt',
): Promise<string | undefined> {
  const files = [join(aptDir, 'sources.list')];
  const d = join(aptDir, 'sources.list.d');
  for (const f of (await readdir(d).catch(() => [] as string[])).sort()) files.push(join(d, f));
  for (const file of files) {
    const text = await readFile(file, 'utf8').catch(() => undefined);
    if (text === undefined) continue;
    const found = file.endsWith('.sources')
      ? mirrorFromDeb822(text, suite)
      : mirrorFromList(text, suite);
    if (found !== undefined) return found;
  }
  return undefined;
}

export function mirrorFromList(text: string, suite: string): string | undefined {
  for (const raw of text.split('\n')) {
    const line = raw.replace(/#.*/, '').trim();
    // deb [ options ] uri suite component...
    const m = /^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)/.exec(line);
    if (m && m[2] === suite) return m[1];
  }
  return undefined;
}

export function mirrorFromDeb822(text: string, suite: string): string | undefined {
  for (const stanza of text.split(/\n\s*\n/)) {
    const fields = new Map<string, string>();
    let key = '';
    for (const raw of stanza.split('\n')) {
      if (raw.startsWith('#')) continue;
      if (/^\s/.test(raw) && key !== '') {
        fields.set(key, `${fields.get(key) ?? ''} ${raw.trim()}`);
        continue;
      }
      const i = raw.indexOf(':');
      if (i < 0) continue;
      key = raw.slice(0, i).trim().toLowerCase();
      fields.set(key, raw.slice(i + 1).trim());
    }
    const words = (k: string): string[] => (fields.get(k) ?? '').split(/\s+/).filter(Boolean);
    if (fields.get('enabled')?.toLowerCase() === 'no') continue;
    if (!words('types').includes('deb') || !words('suites').includes(suite)) continue;
    const uri = words('uris')[0];
    if (uri !== undefined) return uri;
  }
  return undefined;
}
