import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import {
  chmod,
  lstat,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  rename,
  rm,
  rmdir,
  stat,
  writeFile,
} from 'node:fs/promises';
import { basename, join, resolve } from 'node:path';
import {
  DEFAULT_LAYER_VERSION,
  DsecError,
  formatLayerRef,
  isDsecError,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
  type LayerKind,
} from '@dsec/core';
import { buildLayer, type BuildProgress } from './build.js';
import {
  installedFromStatus,
  packagesFromIndex,
  resolveDebClosure,
  type DebClosure,
  type DebPackage,
} from './debs-resolve.js';
import { DEFAULT_DEBIAN_MIRROR, hostAptMirror } from './rootfs/debian.js';
import { assertLayerKind, assertLayerName, assertLayerVersion } from './store/validate.js';
import {
  baseReleaseOfTree,
  chooseDebianSuite,
  readFileInRoot,
  type BaseRelease,
} from './debs-suite.js';
import { compilePythonBytecode } from './python-bytecode.js';
import { withLockFile } from './util/lock-file.js';
import { runTool } from './util/run-tool.js';

/**
 * Toolkit layers from Debian packages, without running a package manager in
 * a sandbox: apt on the host resolves and downloads (into a private apt state
 * under the cache directory, so the host's own sources and pins play no
 * part), `dpkg-deb -x` unpacks, and the tree becomes an EROFS layer meant to
 * sit on a Debian base. Maintainer scripts never run, so a package that
 * needs its postinst to work (alternatives, generated caches) needs a
 * workaround here; interpreters and test tools do not.
 */

export interface DebsAptOptions {
  /** Holds the private apt state (`apt/`), downloaded .debs (`debs/`) and base statuses (`base-status/`). */
  cacheDir: string;
  /**
   * Default: the base's suite (its /etc/os-release, else its apt sources:
   * `debs-suite.ts`), else `bookworm`. One that contradicts the base's is
   * `invalid_argument`.
   */
  suite?: string;
  /** Suites to index (default just `suite`, as debootstrap installs the base from it). */
  suites?: string[];
  /** Default: the host's apt source for `suite`, else deb.debian.org. */
  mirror?: string;
  /** Default `['main']`. */
  components?: string[];
  /** Default: `dpkg --print-architecture`. */
  architecture?: string;
  /** Re-run `apt-get update` even when an index is cached. */
  refreshIndex?: boolean;
  signal?: AbortSignal;
}

export interface BuildFromDebsOptions extends DebsAptOptions {
  name: string;
  version?: string;
  /** Default `toolkit`. */
  kind?: LayerKind;
  /** Package names, or `name=version` pins. */
  packages: string[];
  /**
   * The base image the layer goes on (`name[:version]` in `store`): what its
   * dpkg status lists is left out. Without it nothing is left out.
   */
  base?: string;
  /** Keep `/usr/share/doc` (beyond copyright files), man and info pages (default false). */
  keepDocs?: boolean;
  split?: boolean;
  /** Phases `index`, `resolve`, `download`, `unpack`, then `buildLayer`'s. */
  onProgress?(p: BuildProgress): void;
}

/** What a debs layer holds, pinned: written into the layer and returned. */
export interface DebsManifest {
  name: string;
  version: string;
  kind: LayerKind;
  suite: string;
  architecture: string;
  requested: string[];
  base?: { ref: string; digest: string } | undefined;
  /** Extracted packages, sorted by name. */
  packages: { name: string; version: string; architecture: string; sha256: string }[];
  /** Needed packages the base already had. */
  fromBase: string[];
}

export interface BuildFromDebsResult {
  layer: LayerInfo;
  manifest: DebsManifest;
}

const DEBIAN_KEYRING = '/usr/share/keyrings/debian-archive-keyring.gpg';
const PACKAGE_SPEC = /^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?$/;
const SUITE_PATTERN = /^[a-z][a-z0-9-]*$/;
/** A dpkg status larger than this is not a base we can read (a full desktop's is ~10 MiB). */
const MAX_STATUS_BYTES = 64 * 1024 * 1024;
/** Directories merged-/usr Debian keeps as symlinks into /usr: a real one in a layer would hide the base's. */
const MERGED_USR_DIRS = ['bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32'];
/** Where a layer's manifest lives inside it, so a sandbox can tell what it runs on. */
export const DEBS_MANIFEST_DIR = 'usr/share/dsec/layers';
/** Fields of an archive stanza that describe the download, not the installed package. */
const DOWNLOAD_FIELDS = new Set([
  'Filename',
  'Size',
  'MD5sum',
  'SHA1',
  'SHA256',
  'SHA512',
  'Description-md5',
]);

/**
 * Builds a layer (a toolkit by default) from Debian packages: resolves the
 * dependency closure of `packages` against the archive, leaves out what the
 * base already has, downloads the rest (cached by file name and checked
 * against the index's SHA256), unpacks each with `dpkg-deb -x`, folds
 * `/bin`, `/lib`… into `/usr` (merged-/usr bases keep those as symlinks),
 * records each package in `/var/lib/dpkg/status.d/` (as distroless images do,
 * so scanners see them; the base's status file is left alone) and the
 * manifest in `/usr/share/dsec/layers/NAME.json`, and stores the layer.
 *
 * @throws DsecError `invalid_argument` for a bad name, package or unsatisfiable
 *   dependency; `image_not_found` for an unknown base; `internal` when apt or
 *   dpkg-deb fails (the mirror unreachable, a download that does not match).
 */
export async function buildFromDebs(
  store: ImageStore,
  options: BuildFromDebsOptions,
): Promise<BuildFromDebsResult> {
  const version = options.version ?? DEFAULT_LAYER_VERSION;
  const kind = options.kind ?? 'toolkit';
  assertLayerName(options.name);
  assertLayerVersion(version);
  assertLayerKind(kind);
  if (options.packages.length === 0) {
    throw new DsecError('invalid_argument', 'name at least one package', { field: 'packages' });
  }
  options.packages.forEach((p, i) => {
    if (!PACKAGE_SPEC.test(p)) {
      throw new DsecError('invalid_argument', `bad package ${JSON.stringify(p)}`, {
        field: `packages.${i}`,
      });
    }
  });
  const { signal } = options;
  const progress = (p: BuildProgress): void => options.onProgress?.(p);
  const cacheDir = resolve(options.cacheDir);
  await mkdir(cacheDir, { recursive: true, mode: 0o700 });

  let base:
    { ref: string; digest: string; installed: DebPackage[]; release: BaseRelease } | undefined;
  if (options.base !== undefined) {
    const layer = await store.getLayer(options.base);
    const facts = await baseFacts(store, layer, cacheDir, signal);
    base = {
      ref: formatLayerRef(layer),
      digest: layer.digest,
      installed: installedFromStatus(facts.status),
      release: facts.release,
    };
  }
  // The base's suite, unless the caller names one (which must agree with it).
  const suite = chooseDebianSuite(options.suite, base?.release);
  options.suites?.forEach((s, i) => chooseDebianSuite(s, base?.release, `suites.${i}`));

  const apt = await openAptIndex({ ...options, suite, cacheDir }, progress);
  progress({ phase: 'resolve' });
  let closure: DebClosure;
  try {
    closure = resolveDebClosure({
      available: await apt.available(),
      installed: base?.installed ?? [],
      wanted: options.packages,
    });
  } catch (err) {
    // A package or pin newer than the cached index: fetch the index again, once.
    if (!isDsecError(err, 'invalid_argument') || apt.fresh) throw err;
    await apt.update(progress);
    closure = resolveDebClosure({
      available: await apt.available(),
      installed: base?.installed ?? [],
      wanted: options.packages,
    });
  }

  const debs = await apt.download(closure.install, progress);
  const manifest: DebsManifest = {
    name: options.name,
    version,
    kind,
    suite: apt.suite,
    architecture: apt.architecture,
    requested: [...options.packages],
    ...(base ? { base: { ref: base.ref, digest: base.digest } } : {}),
    packages: closure.install.map((p) => ({
      name: p.name,
      version: p.version,
      architecture: p.architecture,
      sha256: p.fields['SHA256'] ?? '',
    })),
    fromBase: closure.fromBase,
  };

  await mkdir(join(cacheDir, 'work'), { recursive: true, mode: 0o700 });
  const work = await mkdtemp(join(cacheDir, 'work', 'debs-'));
  try {
    const tree = join(work, 'tree');
    await mkdir(tree, { mode: 0o755 });
    await chmod(tree, 0o755);
    for (const [i, deb] of debs.entries()) {
      throwIfAborted(signal);
      progress({ phase: 'unpack', done: i, total: debs.length });
      await runTool('dpkg-deb', ['-x', deb, tree], { signal });
    }
    progress({ phase: 'unpack', done: debs.length, total: debs.length });
    for (const dir of MERGED_USR_DIRS) await foldIntoUsr(tree, dir);
    if (options.keepDocs !== true) await dropDocs(tree);
    // What the packages' postinst would do (py3compile): else every sandbox compiles them again.
    progress({ phase: 'bytecode' });
    await compilePythonBytecode(tree, { signal });
    await writeStatusDir(tree, closure.install);
    const manifestDir = join(tree, DEBS_MANIFEST_DIR);
    await mkdir(manifestDir, { recursive: true, mode: 0o755 });
    await writeFile(
      join(manifestDir, `${options.name}.json`),
      `${JSON.stringify(manifest, null, 2)}\n`,
      {
        mode: 0o644,
      },
    );
    const layer = await buildLayer(store, {
      name: options.name,
      version,
      kind,
      from: { dir: tree },
      source: 'debs',
      ...(options.split !== undefined ? { split: options.split } : {}),
      workDir: work,
      ...(signal ? { signal } : {}),
      onProgress: progress,
    });
    return { layer, manifest };
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

/** Keeps a base's dpkg status (and release) by its digest, so debs layers built on it need not unpack it. */
export async function rememberBaseStatus(
  cacheDir: string,
  digest: string,
  statusText: string,
  release?: BaseRelease,
): Promise<void> {
  const dir = join(cacheDir, 'base-status');
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const file = join(dir, digest.replace(/^sha256:/, ''));
  await writeFile(`${file}.tmp${process.pid}`, statusText);
  await rename(`${file}.tmp${process.pid}`, file);
  if (release !== undefined) {
    await writeFile(`${file}.release.tmp${process.pid}`, JSON.stringify(release));
    await rename(`${file}.release.tmp${process.pid}`, `${file}.release.json`);
  }
}

/** What debs layers need to know of their base: its installed packages and its Debian release. */
export interface BaseFacts {
  status: string;
  release: BaseRelease;
}

/**
 * The dpkg status file of a base layer: from the cache, or read out of the
 * layer with `fsck.erofs --extract` (the layer is not mounted) and cached.
 */
export async function baseDpkgStatus(
  store: ImageStore,
  layer: LayerInfo,
  cacheDir: string,
  signal?: AbortSignal,
): Promise<string> {
  return (await baseFacts(store, layer, cacheDir, signal)).status;
}

/**
 * The dpkg status and Debian release (`debs-suite.ts`) of a base layer, from
 * the cache, or read out of the layer with `fsck.erofs --extract` into a
 * private work tree (the layer is not mounted) and cached by its digest.
 * Both files are read with their symlinks resolved inside that tree, never
 * on the host (`readFileInRoot`): an imported base is whatever its image
 * holds.
 */
export async function baseFacts(
  store: ImageStore,
  layer: LayerInfo,
  cacheDir: string,
  signal?: AbortSignal,
): Promise<BaseFacts> {
  const cached = join(cacheDir, 'base-status', layer.digest.replace(/^sha256:/, ''));
  const hit = await readFile(cached, 'utf8').catch(() => undefined);
  const hitRelease = await readFile(`${cached}.release.json`, 'utf8')
    .then((t) => JSON.parse(t) as BaseRelease)
    .catch(() => undefined);
  if (hit !== undefined && hitRelease !== undefined) return { status: hit, release: hitRelease };
  await mkdir(join(cacheDir, 'work'), { recursive: true, mode: 0o700 });
  const work = await mkdtemp(join(cacheDir, 'work', 'status-'));
  try {
    const image = await store.blobPath(layer.digest, signal ? { signal } : {});
    const args = [`--extract=${join(work, 'root')}`];
    if (layer.blobDigest !== undefined) {
      args.push(`--device=${await store.blobPath(layer.blobDigest, signal ? { signal } : {})}`);
    }
    args.push(image);
    await runTool('fsck.erofs', args, { signal });
    const root = join(work, 'root');
    const text = await readFileInRoot(root, 'var/lib/dpkg/status', MAX_STATUS_BYTES);
    if (text === undefined) {
      throw new DsecError(
        'invalid_argument',
        `${formatLayerRef(layer)} has no dpkg status: not a Debian base`,
        {
          field: 'base',
        },
      );
    }
    const release = await baseReleaseOfTree(root);
    await rememberBaseStatus(cacheDir, layer.digest, text, release);
    return { status: text, release };
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

/**
 * The private apt state directory for one set of sources (under
 * `cacheDir/apt/<hash of architecture and sources>`), and those sources.
 * Exported for tests that seed an index there.
 */
export async function aptStateDir(
  cacheDir: string,
  o: { suites: string[]; mirror: string; components: string[]; architecture: string },
): Promise<{ sources: string; dir: string }> {
  const keyring = (await stat(DEBIAN_KEYRING).catch(() => undefined))
    ? `[signed-by=${DEBIAN_KEYRING}] `
    : '';
  const sources = o.suites
    .map((s) => `deb ${keyring}${o.mirror} ${s} ${o.components.join(' ')}\n`)
    .join('');
  const id = createHash('sha256')
    .update(`${o.architecture}\n${sources}`)
    .digest('hex')
    .slice(0, 16);
  return { sources, dir: join(resolve(cacheDir), 'apt', id) };
}

interface AptIndex {
  suite: string;
  architecture: string;
  /** True when this call already ran `apt-get update`. */
  fresh: boolean;
  available(): Promise<DebPackage[]>;
  update(progress: (p: BuildProgress) => void): Promise<void>;
  /** The cached .deb of each package, downloading what is missing; in the given order. */
  download(pkgs: DebPackage[], progress: (p: BuildProgress) => void): Promise<string[]>;
}

/**
 * A private apt configuration under `cacheDir/apt/<sources hash>`: its own
 * sources, lists, empty dpkg status and no host configuration parts, so
 * resolution sees the Debian archive only.
 */
async function openAptIndex(
  options: DebsAptOptions & { cacheDir: string },
  progress: (p: BuildProgress) => void,
): Promise<AptIndex> {
  const { signal, cacheDir } = options;
  const suite = options.suite ?? 'bookworm';
  const suites = options.suites ?? [suite];
  for (const [i, s] of suites.entries()) {
    if (!SUITE_PATTERN.test(s)) {
      throw new DsecError('invalid_argument', `bad suite ${JSON.stringify(s)}`, {
        field: `suites.${i}`,
      });
    }
  }
  const mirror = options.mirror ?? (await hostAptMirror(suite)) ?? DEFAULT_DEBIAN_MIRROR;
  if (!/^(https?|file):\/\/[^\s\]]+$/.test(mirror)) {
    throw new DsecError('invalid_argument', 'mirror must be an http(s) or file URL', {
      field: 'mirror',
    });
  }
  const components = options.components ?? ['main'];
  components.forEach((c, i) => {
    if (!SUITE_PATTERN.test(c)) {
      throw new DsecError('invalid_argument', `bad component ${JSON.stringify(c)}`, {
        field: `components.${i}`,
      });
    }
  });
  const architecture =
    options.architecture ??
    (await runTool('dpkg', ['--print-architecture'], { signal })).stdout.trim();
  const { sources, dir } = await aptStateDir(cacheDir, {
    suites,
    mirror,
    components,
    architecture,
  });
  const debsDir = join(cacheDir, 'debs');
  const lock = join(cacheDir, 'apt.lock');
  await mkdir(join(dir, 'empty.d'), { recursive: true, mode: 0o700 });
  await mkdir(join(dir, 'state/lists/partial'), { recursive: true });
  await mkdir(join(dir, 'cache/archives/partial'), { recursive: true });
  await mkdir(join(dir, 'log'), { recursive: true });
  await mkdir(debsDir, { recursive: true, mode: 0o700 });
  await writeFile(join(dir, 'sources.list'), sources);
  await writeFile(join(dir, 'status'), '');
  const conf = [
    `Dir::State "${dir}/state/";`,
    `Dir::State::status "${dir}/status";`,
    `Dir::Cache "${dir}/cache/";`,
    `Dir::Log "${dir}/log/";`,
    `Dir::Etc::main "/dev/null";`,
    `Dir::Etc::Parts "${dir}/empty.d/";`,
    `Dir::Etc::SourceList "${dir}/sources.list";`,
    `Dir::Etc::SourceParts "${dir}/empty.d/";`,
    `Dir::Etc::Preferences "/dev/null";`,
    `Dir::Etc::PreferencesParts "${dir}/empty.d/";`,
    `APT::Architecture "${architecture}";`,
    `APT::Architectures { "${architecture}"; };`,
    // Uncompressed lists: we read them ourselves.
    'Acquire::GzipIndexes "false";',
    'Acquire::Languages "none";',
    'Acquire::Retries "3";',
    // The cache dir is root's alone; apt's download user could not write to it.
    'APT::Sandbox::User "root";',
    '',
  ].join('\n');
  await writeFile(join(dir, 'apt.conf'), conf);
  const env = { ...process.env, APT_CONFIG: join(dir, 'apt.conf'), LC_ALL: 'C' };
  const listsDir = join(dir, 'state/lists');
  const indexFiles = async (): Promise<string[]> =>
    (await readdir(listsDir)).filter((f) => f.endsWith('_Packages')).map((f) => join(listsDir, f));

  const index: AptIndex = {
    suite,
    architecture,
    fresh: false,
    async available() {
      const out: DebPackage[] = [];
      for (const f of (await indexFiles()).sort())
        out.push(...packagesFromIndex(await readFile(f, 'utf8'), architecture));
      return out;
    },
    async update(progressFn) {
      progressFn({ phase: 'index' });
      await withLockFile(lock, () => runTool('apt-get', ['-q', 'update'], { env, signal }), signal);
      index.fresh = true;
      if ((await indexFiles()).length === 0) {
        throw new DsecError('internal', `apt-get update fetched no Packages index from ${mirror}`);
      }
    },
    async download(pkgs, progressFn) {
      return await withLockFile(
        lock,
        () => downloadDebs(pkgs, debsDir, env, progressFn, signal),
        signal,
      );
    },
  };
  if (options.refreshIndex === true || (await indexFiles()).length === 0)
    await index.update(progress);
  return index;
}

async function sha256File(path: string): Promise<string> {
  const hash = createHash('sha256');
  for await (const chunk of createReadStream(path)) hash.update(chunk as Buffer);
  return hash.digest('hex');
}

async function downloadDebs(
  pkgs: DebPackage[],
  debsDir: string,
  env: NodeJS.ProcessEnv,
  progress: (p: BuildProgress) => void,
  signal: AbortSignal | undefined,
): Promise<string[]> {
  const fileOf = (p: DebPackage): string => {
    const name = basename(p.fields['Filename'] ?? '');
    if (
      !/^[A-Za-z0-9][A-Za-z0-9+.~%_-]*\.deb$/.test(name) ||
      !/^[0-9a-f]{64}$/.test(p.fields['SHA256'] ?? '')
    ) {
      throw new DsecError('internal', `the index gives ${p.name} no usable Filename and SHA256`);
    }
    return join(debsDir, name);
  };
  const missing: DebPackage[] = [];
  for (const p of pkgs) {
    const file = fileOf(p);
    const ok =
      (await stat(file).catch(() => undefined)) && (await sha256File(file)) === p.fields['SHA256'];
    if (!ok) missing.push(p);
  }
  progress({ phase: 'download', done: pkgs.length - missing.length, total: pkgs.length });
  if (missing.length > 0) {
    const tmp = await mkdtemp(join(debsDir, '.download-'));
    try {
      let done = pkgs.length - missing.length;
      await runTool(
        'apt-get',
        ['-q', 'download', ...missing.map((p) => `${p.name}=${p.version}`)],
        {
          cwd: tmp,
          env,
          signal,
          onLine: (line) => {
            if (/^Get:\d+/.test(line))
              progress({ phase: 'download', done: ++done, total: pkgs.length });
          },
        },
      );
      const bySha = new Map(missing.map((p) => [p.fields['SHA256']!, p]));
      for (const f of await readdir(tmp)) {
        const p = bySha.get(await sha256File(join(tmp, f)));
        if (p) {
          await rename(join(tmp, f), fileOf(p));
          bySha.delete(p.fields['SHA256']!);
        }
      }
      if (bySha.size > 0) {
        const names = [...bySha.values()].map((p) => `${p.name}=${p.version}`).join(', ');
        throw new DsecError(
          'internal',
          `apt-get download gave no file matching the index for ${names}`,
        );
      }
    } finally {
      await rm(tmp, { recursive: true, force: true });
    }
  }
  progress({ phase: 'download', done: pkgs.length, total: pkgs.length });
  return pkgs.map(fileOf);
}

/** Moves `tree/dir` (a real directory unpacked from some package) into `tree/usr/dir`. */
async function foldIntoUsr(tree: string, dir: string): Promise<void> {
  const src = join(tree, dir);
  const st = await lstat(src).catch(() => undefined);
  if (!st?.isDirectory()) return;
  await mkdir(join(tree, 'usr'), { recursive: true, mode: 0o755 });
  await mergeDir(src, join(tree, 'usr', dir));
}

async function mergeDir(src: string, dst: string): Promise<void> {
  const dstStat = await lstat(dst).catch(() => undefined);
  if (!dstStat) {
    await rename(src, dst);
    return;
  }
  if (!dstStat.isDirectory()) {
    await rm(dst, { force: true });
    await rename(src, dst);
    return;
  }
  for (const entry of await readdir(src)) {
    const s = join(src, entry);
    const sStat = await lstat(s);
    if (sStat.isDirectory()) await mergeDir(s, join(dst, entry));
    else {
      // Same path from two places: the later package wins, as dpkg would overwrite it.
      await rm(join(dst, entry), { recursive: true, force: true });
      await rename(s, join(dst, entry));
    }
  }
  await rmdir(src);
}

/** Documentation nobody in a sandbox reads; copyright files stay (the licences ask for them). */
async function dropDocs(tree: string): Promise<void> {
  for (const sub of ['usr/share/man', 'usr/share/info', 'usr/share/lintian']) {
    await rm(join(tree, sub), { recursive: true, force: true });
  }
  const doc = join(tree, 'usr/share/doc');
  for (const pkg of await readdir(doc).catch(() => [] as string[])) {
    const dir = join(doc, pkg);
    const st = await lstat(dir);
    if (!st.isDirectory()) continue;
    for (const entry of await readdir(dir)) {
      if (entry !== 'copyright') await rm(join(dir, entry), { recursive: true, force: true });
    }
  }
}

async function writeStatusDir(tree: string, pkgs: DebPackage[]): Promise<void> {
  const dir = join(tree, 'var/lib/dpkg/status.d');
  await mkdir(dir, { recursive: true, mode: 0o755 });
  for (const p of pkgs) {
    const lines: string[] = [];
    for (const [k, v] of Object.entries(p.fields)) {
      if (DOWNLOAD_FIELDS.has(k)) continue;
      lines.push(`${k}: ${v}`);
      if (k === 'Package') lines.push('Status: install ok installed');
    }
    await writeFile(join(dir, p.name), `${lines.join('\n')}\n`, { mode: 0o644 });
  }
}
