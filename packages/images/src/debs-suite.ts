import { constants } from 'node:fs';
import { lstat, open, readlink } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';

/**
 * Which Debian suite a base image is, so a toolkit unpacked from .debs onto
 * it comes from the same suite (issue 25: a toolkit on a Debian 11 base was
 * resolved from bookworm and brought Python 3.11 onto it).
 *
 * The facts come from the base's own `/etc/os-release` (`VERSION_CODENAME`,
 * else `VERSION_ID` for a release, else the codename a testing image spells
 * in `PRETTY_NAME`) and, where that says nothing, its apt sources. They are
 * read out of a tree the platform extracted from the layer, with every
 * symlink resolved *inside* that tree ({@link readFileInRoot}): Debian's
 * `/etc/os-release` is a link to `../usr/lib/os-release`, and an image's
 * absolute link followed on the host would read the host's file (this host
 * is bookworm), the very silent mismatch this module exists to catch.
 */

/** Debian's release numbers and codenames, for an os-release with `VERSION_ID` and no codename. */
const DEBIAN_RELEASES: Record<string, string> = {
  '8': 'jessie',
  '9': 'stretch',
  '10': 'buster',
  '11': 'bullseye',
  '12': 'bookworm',
  '13': 'trixie',
  '14': 'forky',
};

const SUITE_PATTERN = /^[a-z][a-z0-9-]{0,31}$/;

/** What a base says about its release. */
export interface BaseRelease {
  /** `ID` of os-release (`debian`, `ubuntu`…); undefined when the base has none. */
  id?: string | undefined;
  /** The Debian suite (codename) the base is, when it can be told. */
  suite?: string | undefined;
  /** Where the suite came from: `os-release`, `apt-sources`, or undefined when unknown. */
  from?: 'os-release' | 'apt-sources' | undefined;
}

/** Parses an os-release file (`KEY=value`, values optionally quoted); unknown lines are skipped. */
export function parseOsRelease(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const raw of text.split('\n')) {
    const m = /^([A-Z][A-Z0-9_]*)=(.*)$/.exec(raw.trim());
    if (!m) continue;
    let v = m[2]!.trim();
    const q = v[0];
    if ((q === '"' || q === "'") && v.endsWith(q) && v.length >= 2) v = v.slice(1, -1);
    out[m[1]!] = v.replace(/\\(["'$`\\])/g, '$1');
  }
  return out;
}

/**
 * The suites an apt sources text names (one-line `sources.list` or deb822
 * `.sources`), with `-updates`, `-security`, `-backports` folded to their
 * release and `/updates` (Debian 10's security suite) likewise.
 */
export function suitesFromAptSources(text: string, deb822: boolean): string[] {
  const found: string[] = [];
  const add = (s: string): void => {
    const base = s
      .replace(/\/updates$/, '')
      .replace(/-(updates|security|backports|proposed-updates)$/, '');
    if (SUITE_PATTERN.test(base) && !found.includes(base)) found.push(base);
  };
  if (deb822) {
    for (const line of text.split('\n')) {
      const m = /^Suites:\s*(.*)$/i.exec(line.trim());
      if (m) for (const s of m[1]!.split(/\s+/).filter(Boolean)) add(s);
    }
  } else {
    for (const raw of text.split('\n')) {
      const line = raw.replace(/#.*/, '').trim();
      const m = /^deb\s+(?:\[[^\]]*\]\s+)?\S+\s+(\S+)/.exec(line);
      if (m) add(m[1]!);
    }
  }
  return found;
}

/**
 * The base's release from its os-release text and apt sources texts (either
 * may be missing). A Debian os-release decides; apt sources are used only
 * when it gives no codename, and only when they name one release.
 */
export function baseReleaseFrom(
  osRelease: string | undefined,
  aptSources: { text: string; deb822: boolean }[],
): BaseRelease {
  const os = osRelease === undefined ? {} : parseOsRelease(osRelease);
  const id = os['ID']?.toLowerCase();
  let suite: string | undefined = os['VERSION_CODENAME'];
  if (!suite && os['VERSION_ID'] !== undefined)
    suite = DEBIAN_RELEASES[os['VERSION_ID'].split('.')[0]!];
  // Testing and unstable images: "Debian GNU/Linux trixie/sid".
  if (!suite) suite = /\b([a-z]+)\/sid\b/.exec(os['PRETTY_NAME'] ?? '')?.[1];
  if (suite !== undefined && SUITE_PATTERN.test(suite) && (id === undefined || id === 'debian'))
    return { id, suite, from: 'os-release' };
  if (id !== undefined && id !== 'debian') return { id };
  const named = [...new Set(aptSources.flatMap((s) => suitesFromAptSources(s.text, s.deb822)))];
  if (named.length === 1) return { id, suite: named[0], from: 'apt-sources' };
  return { id };
}

/**
 * The suite a debs layer is resolved from: the one the recipe names, checked
 * against the base's, or the base's, or `bookworm` for a base that says
 * nothing (DSec's default base suite).
 *
 * @throws DsecError `invalid_argument` (`field`) when the recipe names a suite
 *   other than the base's (`bookworm-backports` on a bookworm base is the
 *   same release), or the base is not Debian and no suite is named.
 */
export function chooseDebianSuite(
  requested: string | undefined,
  base: BaseRelease | undefined,
  field = 'suite',
): string {
  if (requested !== undefined) {
    const release = requested.replace(/-(updates|security|backports|proposed-updates)$/, '');
    if (base?.suite !== undefined && release !== base.suite) {
      throw new DsecError(
        'invalid_argument',
        `${field}: ${JSON.stringify(requested)} contradicts the base, which is Debian ` +
          `${base.suite} (its ${base.from === 'apt-sources' ? 'apt sources' : '/etc/os-release'}); ` +
          `drop ${field} or set it to ${JSON.stringify(base.suite)}`,
        { field, details: { reason: 'suite_mismatch', requested, base: base.suite } },
      );
    }
    return requested;
  }
  if (base?.suite !== undefined) return base.suite;
  if (base?.id !== undefined && base.id !== 'debian') {
    throw new DsecError(
      'invalid_argument',
      `${field}: the base is ${JSON.stringify(base.id)}, not Debian; name the Debian suite its ` +
        'packages should come from',
      { field, details: { reason: 'not_debian', id: base.id } },
    );
  }
  return 'bookworm';
}

/** How many symlinks one lookup may follow, as the kernel's MAXSYMLINKS. */
const MAX_LINKS = 40;

/**
 * Reads `path` (absolute or relative, inside the image) from `root`, a tree
 * the platform extracted from a layer, resolving every symlink as the image
 * would see it: an absolute target restarts at `root`, `..` stops at `root`,
 * nothing outside `root` is ever opened. The final open is `O_NOFOLLOW` of a
 * path built only from components checked with `lstat`, and the tree is the
 * platform's private copy (no sandbox writes to it while this runs).
 * Undefined when the file is missing, is not a regular file, is larger than
 * `maxBytes`, or the links loop. Anything but a regular file (a device node,
 * a FIFO, a socket) is never opened.
 */
export async function readFileInRoot(
  root: string,
  path: string,
  maxBytes = 64 * 1024,
): Promise<string | undefined> {
  const todo = path.split('/').filter((p) => p !== '' && p !== '.');
  const parts: string[] = [];
  let links = 0;
  while (todo.length > 0) {
    const name = todo.shift()!;
    if (name === '..') {
      parts.pop();
      continue;
    }
    const at = join(root, ...parts, name);
    const st = await lstat(at).catch(() => undefined);
    if (st === undefined) return undefined;
    if (st.isSymbolicLink()) {
      if (++links > MAX_LINKS) return undefined;
      const target = await readlink(at).catch(() => undefined);
      if (target === undefined || target.includes('\0')) return undefined;
      if (target.startsWith('/')) parts.length = 0;
      todo.unshift(...target.split('/').filter((p) => p !== '' && p !== '.'));
      continue;
    }
    if (todo.length > 0 && !st.isDirectory()) return undefined;
    // Only a regular file is ever opened: the tree's device nodes are real nodes on the host
    // (fsck.erofs --extract makes them as root), and opening one opens the host's device.
    if (todo.length === 0 && !st.isFile()) return undefined;
    parts.push(name);
  }
  if (parts.length === 0) return undefined;
  const fh = await open(
    join(root, ...parts),
    constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK | constants.O_NOCTTY,
  ).catch(() => undefined);
  if (fh === undefined) return undefined;
  try {
    const st = await fh.stat();
    if (!st.isFile() || st.size > maxBytes) return undefined;
    const buf = Buffer.alloc(st.size);
    const { bytesRead } = await fh.read(buf, 0, st.size, 0);
    return buf.subarray(0, bytesRead).toString('utf8');
  } finally {
    await fh.close();
  }
}

/** Reads a base's release facts from a tree extracted from it (see {@link readFileInRoot}). */
export async function baseReleaseOfTree(root: string): Promise<BaseRelease> {
  const osRelease =
    (await readFileInRoot(root, 'etc/os-release')) ??
    (await readFileInRoot(root, 'usr/lib/os-release'));
  const sources: { text: string; deb822: boolean }[] = [];
  const list = await readFileInRoot(root, 'etc/apt/sources.list');
  if (list !== undefined) sources.push({ text: list, deb822: false });
  const deb822 = await readFileInRoot(root, 'etc/apt/sources.list.d/debian.sources');
  if (deb822 !== undefined) sources.push({ text: deb822, deb822: true });
  return baseReleaseFrom(osRelease, sources);
}
