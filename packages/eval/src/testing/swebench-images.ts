/**
 * Test images of SWE-bench's shape, pushed to a local `docker-registry`
 * (`startLocalRegistry`) as `swebench/sweb.eval.x86_64.<key>:latest`, for
 * the tests of `--image docker://…{id}` and of SWE-bench grading.
 *
 * The shape follows SWE-bench's harness images (swebench/harness/dockerfiles:
 * a base image with Miniconda at `/opt/miniconda3` and
 * `ENV PATH=/opt/miniconda3/bin:$PATH`, an environment image with a conda
 * environment `testbed`, an instance image with the repository at
 * `/testbed` and `WORKDIR /testbed/`; its eval scripts start with
 * `source /opt/miniconda3/bin/activate` and `conda activate testbed`),
 * built from this host's Debian packages instead of Ubuntu and conda:
 *
 * - layer 0 (shared by every instance): busybox, Debian's python3 with
 *   pytest, git and bash (`makeToolchainRootfs`);
 * - layer 1 (shared): `/opt/miniconda3/bin/activate` (and
 *   `etc/profile.d/conda.sh`) defining a `conda` shell function whose
 *   `conda activate testbed` puts `/opt/miniconda3/envs/testbed/bin` first
 *   in PATH, and that environment: a python3 venv with
 *   `include-system-site-packages = true`, laid out as `python3 -m venv
 *   --system-site-packages --without-pip` lays it out;
 * - layer 2 (per instance): a git repository at `/testbed` at its base commit.
 *
 * The shared layers' blobs are built once per host and cached (keyed by the
 * host's package versions), so a test pays for the per-instance layer only.
 *
 * @example
 * ```ts
 * const registry = await startLocalRegistry({ dir: join(dir, 'registry') });
 * const { template, images } = await pushSwebenchImages({
 *   registry: registry.host, dir: join(dir, 'images'),
 *   instances: [{ instanceId: 'demo__demo-1', files: { 'calc.py': 'def add(a, b):\n    return a - b\n' } }],
 * });
 * // dsec eval run DATASET --dataset swebench --image '<template>' (DSEC_INSECURE_REGISTRIES=<registry.host>)
 * ```
 */
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import {
  chmod,
  link,
  mkdir,
  mkdtemp,
  readFile,
  rename,
  rm,
  stat,
  symlink,
  writeFile,
} from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { pushToRegistry } from '@dsec/images/testing/registry';
import { swebenchImageKey } from '../task-images.js';
import { makeToolchainRootfs } from './toolchain.js';

const execFileAsync = promisify(execFile);

/** Bumped when the shared layers change, so stale caches are not reused. */
const FIXTURE_VERSION = 'swebench-images-v1';
const EXTRA_PACKAGES = ['git', 'bash'];

/** The image config of every fixture image: SWE-bench's conda PATH and WORKDIR. */
export const SWEBENCH_IMAGE_CONFIG = {
  Env: [
    'PATH=/opt/miniconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
    'TZ=Etc/UTC',
  ],
  WorkingDir: '/testbed/',
  Cmd: ['/bin/bash'],
} as const;

/** Where `conda activate testbed` points PATH. */
export const TESTBED_ENV_BIN = '/opt/miniconda3/envs/testbed/bin';

export interface SwebenchFixtureInstance {
  /** The dataset's `instance_id` (`owner__repo-number`). */
  instanceId: string;
  /** The repository's files at the base commit (relative paths → content). */
  files: Record<string, string>;
}

export interface PushedSwebenchImages {
  /** `docker://HOST/swebench/sweb.eval.x86_64.{id}:latest` for `--image`. */
  template: string;
  /** Per instance ID: its image reference and the base commit at `/testbed`. */
  images: Map<string, { ref: string; baseCommit: string }>;
  /** The diff IDs of the two shared layers (every image's bottom two). */
  sharedDiffIds: string[];
}

export interface PushSwebenchImagesOptions {
  /** The registry's `host:port` (plain HTTP, as `startLocalRegistry` serves). */
  registry: string;
  /** Scratch space for layouts (the caller removes it). */
  dir: string;
  instances: SwebenchFixtureInstance[];
  /** Where the shared layers' blobs are kept between runs (default `DSEC_TEST_CACHE` or /var/tmp/dsec-test-cache). */
  cacheDir?: string;
}

interface Blob {
  /** The gzipped tar, named by its digest. */
  path: string;
  digest: string;
  diffId: string;
  size: number;
}

/** Builds (or reuses) the shared layers, then writes and pushes one image per instance. */
export async function pushSwebenchImages(
  options: PushSwebenchImagesOptions,
): Promise<PushedSwebenchImages> {
  const cacheRoot =
    options.cacheDir ?? (process.env['DSEC_TEST_CACHE'] || '/var/tmp/dsec-test-cache');
  const shared = await sharedLayers(cacheRoot);
  await mkdir(options.dir, { recursive: true });
  const images = new Map<string, { ref: string; baseCommit: string }>();
  for (const inst of options.instances) {
    const key = swebenchImageKey(inst.instanceId);
    const work = await mkdtemp(join(options.dir, `${key}-`));
    const root = join(work, 'root');
    const baseCommit = await makeTestbed(join(root, 'testbed'), inst.files);
    const top = await tarLayer(root, work);
    const layout = join(work, 'layout');
    await writeLayout(layout, [...shared, top], SWEBENCH_IMAGE_CONFIG);
    const ref = `docker://${options.registry}/swebench/sweb.eval.x86_64.${key}:latest`;
    await pushToRegistry(layout, 'latest', ref);
    images.set(inst.instanceId, { ref, baseCommit });
  }
  return {
    template: `docker://${options.registry}/swebench/sweb.eval.x86_64.{id}:latest`,
    images,
    sharedDiffIds: shared.map((b) => b.diffId),
  };
}

/** The two shared layers, from the cache when this host's packages have not changed. */
async function sharedLayers(cacheRoot: string): Promise<Blob[]> {
  const { stdout } = await execFileAsync('dpkg-query', [
    '-W',
    '-f',
    '${Package}=${Version}\\n',
    'python3-minimal',
    'python3-pytest',
    'busybox-static',
    ...EXTRA_PACKAGES,
  ]);
  const key = createHash('sha256')
    .update(`${FIXTURE_VERSION}\n${stdout}`)
    .digest('hex')
    .slice(0, 16);
  const dir = join(cacheRoot, `${FIXTURE_VERSION}-${key}`);
  const index = join(dir, 'blobs.json');
  const cached = await readFile(index, 'utf8').then(
    (t) => JSON.parse(t) as Blob[],
    () => undefined,
  );
  if (cached && (await Promise.all(cached.map((b) => exists(b.path)))).every(Boolean))
    return cached;

  await mkdir(cacheRoot, { recursive: true, mode: 0o755 });
  // Built beside the cache and renamed into place: a concurrent builder
  // (another test file) either sees the whole cache or builds its own.
  const work = await mkdtemp(join(cacheRoot, `.${FIXTURE_VERSION}-`));
  try {
    const base = join(work, 'l0');
    await makeToolchainRootfs(base, { python: true, node: false, packages: EXTRA_PACKAGES });
    const conda = join(work, 'l1');
    await makeConda(conda);
    const blobs = [await tarLayer(base, work), await tarLayer(conda, work)];
    const final = blobs.map((b) => ({ ...b, path: join(dir, b.digest.slice('sha256:'.length)) }));
    const staged = join(work, 'out');
    await mkdir(staged);
    for (const [i, b] of blobs.entries())
      await rename(b.path, join(staged, final[i]!.digest.slice(7)));
    await writeFile(join(staged, 'blobs.json'), JSON.stringify(final));
    await rename(staged, dir).catch(async (err: NodeJS.ErrnoException) => {
      // Someone else finished first: theirs is the same content.
      if (err.code !== 'ENOTEMPTY' && err.code !== 'EEXIST') throw err;
    });
    return JSON.parse(await readFile(index, 'utf8')) as Blob[];
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

/** Miniconda's activation, as far as SWE-bench's scripts use it, and the `testbed` environment. */
async function makeConda(root: string): Promise<void> {
  const prefix = join(root, 'opt/miniconda3');
  const activate = [
    "# A stand-in for Miniconda's activate in DSec's test images (packages/eval/src/testing/swebench-images.ts):",
    "# `conda activate ENV` puts the environment's bin first in PATH, as conda does.",
    'conda() {',
    '  case "$1" in',
    '    activate)',
    '      _dsec_env="${2:-base}"',
    '      if [ "$_dsec_env" = base ]; then _dsec_prefix=/opt/miniconda3; else _dsec_prefix="/opt/miniconda3/envs/$_dsec_env"; fi',
    '      if [ ! -d "$_dsec_prefix/bin" ]; then echo "EnvironmentNameNotFound: Could not find conda environment: $_dsec_env" >&2; return 1; fi',
    '      PATH="$_dsec_prefix/bin:$PATH"',
    '      CONDA_DEFAULT_ENV="$_dsec_env"',
    '      CONDA_PREFIX="$_dsec_prefix"',
    '      export PATH CONDA_DEFAULT_ENV CONDA_PREFIX',
    '      ;;',
    '    deactivate)',
    '      if [ -n "${CONDA_PREFIX:-}" ]; then PATH=$(printf %s "$PATH" | sed "s#^$CONDA_PREFIX/bin:##"); export PATH; fi',
    '      unset CONDA_DEFAULT_ENV CONDA_PREFIX',
    '      ;;',
    '    *) echo "conda: this test image knows activate and deactivate only" >&2; return 1 ;;',
    '  esac',
    '}',
    'CONDA_SHLVL=1',
    'export CONDA_SHLVL',
    '',
  ].join('\n');
  await mkdir(join(prefix, 'bin'), { recursive: true });
  await mkdir(join(prefix, 'etc/profile.d'), { recursive: true });
  await writeFile(join(prefix, 'bin/activate'), activate, { mode: 0o644 });
  await writeFile(join(prefix, 'etc/profile.d/conda.sh'), activate, { mode: 0o644 });

  // What `python3 -m venv --system-site-packages --without-pip` writes.
  const env = join(prefix, 'envs/testbed');
  const { stdout } = await execFileAsync('/usr/bin/python3', [
    '-c',
    'import sys; print("%d.%d %d.%d.%d" % (sys.version_info[:2] + sys.version_info[:3]))',
  ]);
  const [short, full] = stdout.trim().split(' ') as [string, string];
  await mkdir(join(env, 'bin'), { recursive: true });
  await mkdir(join(env, `lib/python${short}/site-packages`), { recursive: true });
  await mkdir(join(env, 'include'), { recursive: true });
  await symlink('lib', join(env, 'lib64'));
  await symlink(`/usr/bin/python${short}`, join(env, 'bin/python3'));
  await symlink('python3', join(env, 'bin/python'));
  await symlink('python3', join(env, `bin/python${short}`));
  await writeFile(
    join(env, 'pyvenv.cfg'),
    `home = /usr/bin\ninclude-system-site-packages = true\nversion = ${full}\n`,
  );
  const pytest = `#!${TESTBED_ENV_BIN}/python3\nimport sys\nfrom pytest import console_main\nsys.exit(console_main())\n`;
  await writeFile(join(env, 'bin/pytest'), pytest);
  await chmod(join(env, 'bin/pytest'), 0o755);
  // Marks the environment: `import dsec_testbed_env` works only inside it.
  await writeFile(
    join(env, `lib/python${short}/site-packages/dsec_testbed_env.py`),
    'NAME = "testbed"\n',
  );
}

/** A git repository with `files` committed at a fixed date: the same files give the same commit. */
async function makeTestbed(dir: string, files: Record<string, string>): Promise<string> {
  await mkdir(dir, { recursive: true });
  for (const [rel, content] of Object.entries(files)) {
    if (rel.startsWith('/') || rel.split('/').includes('..')) throw new Error(`bad path ${rel}`);
    await mkdir(join(dir, rel, '..'), { recursive: true });
    await writeFile(join(dir, rel), content);
  }
  const env = {
    ...process.env,
    GIT_AUTHOR_NAME: 'fixture',
    GIT_AUTHOR_EMAIL: 'fixture@localhost',
    GIT_COMMITTER_NAME: 'fixture',
    GIT_COMMITTER_EMAIL: 'fixture@localhost',
    GIT_AUTHOR_DATE: '2020-01-01T00:00:00Z',
    GIT_COMMITTER_DATE: '2020-01-01T00:00:00Z',
    GIT_CONFIG_NOSYSTEM: '1',
    HOME: dir,
  };
  const git = (...args: string[]) => execFileAsync('git', ['-C', dir, ...args], { env });
  await git('init', '-q', '-b', 'main');
  await git('add', '-A');
  await git('commit', '-q', '-m', 'base');
  return (await git('rev-parse', 'HEAD')).stdout.trim();
}

/** A layer tree as a gzipped tar, reproducible (sorted, owner 0, mtime 0, no gzip name or time). */
async function tarLayer(root: string, work: string): Promise<Blob> {
  const tar = join(
    work,
    `layer-${createHash('sha256').update(root).digest('hex').slice(0, 8)}.tar`,
  );
  await execFileAsync('tar', [
    '--create',
    `--file=${tar}`,
    '--sort=name',
    '--numeric-owner',
    '--owner=0',
    '--group=0',
    '--mtime=@0',
    `--directory=${root}`,
    '.',
  ]);
  const diffId = `sha256:${await sha256File(tar)}`;
  await execFileAsync('gzip', ['-n', '-f', tar]);
  const gz = `${tar}.gz`;
  const hex = await sha256File(gz);
  const size = (await stat(gz)).size;
  return { path: gz, digest: `sha256:${hex}`, diffId, size };
}

/** An OCI image layout of these blobs (bottom first) and `config`, tagged `latest`. */
async function writeLayout(dir: string, blobs: Blob[], config: object): Promise<void> {
  const store = join(dir, 'blobs', 'sha256');
  await mkdir(store, { recursive: true });
  const put = async (buf: Buffer) => {
    const hex = createHash('sha256').update(buf).digest('hex');
    await writeFile(join(store, hex), buf);
    return { digest: `sha256:${hex}`, size: buf.length };
  };
  for (const b of blobs) {
    // Hard links where the cache shares the filesystem; the blobs are read only.
    await link(b.path, join(store, b.digest.slice(7))).catch(async () =>
      writeFile(join(store, b.digest.slice(7)), await readFile(b.path)),
    );
  }
  const cfg = await put(
    Buffer.from(
      JSON.stringify({
        architecture: { x64: 'amd64', arm64: 'arm64' }[process.arch as string] ?? process.arch,
        os: 'linux',
        config,
        rootfs: { type: 'layers', diff_ids: blobs.map((b) => b.diffId) },
      }),
    ),
  );
  const manifest = await put(
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: 'application/vnd.oci.image.manifest.v1+json',
        config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...cfg },
        layers: blobs.map((b) => ({
          mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip',
          digest: b.digest,
          size: b.size,
        })),
      }),
    ),
  );
  await writeFile(join(dir, 'oci-layout'), JSON.stringify({ imageLayoutVersion: '1.0.0' }));
  await writeFile(
    join(dir, 'index.json'),
    JSON.stringify({
      schemaVersion: 2,
      manifests: [
        {
          mediaType: 'application/vnd.oci.image.manifest.v1+json',
          ...manifest,
          annotations: { 'org.opencontainers.image.ref.name': 'latest' },
        },
      ],
    }),
  );
}

async function sha256File(path: string): Promise<string> {
  const { stdout } = await execFileAsync('sha256sum', ['--', path]);
  return stdout.slice(0, 64);
}

async function exists(path: string): Promise<boolean> {
  return await stat(path).then(
    () => true,
    () => false,
  );
}
