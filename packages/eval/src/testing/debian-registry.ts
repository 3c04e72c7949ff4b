/**
 * A Debian image in a registry on loopback, for Harbor-format tasks whose
 * Dockerfiles say `FROM ${DEBIAN_IMAGE}` (tests, the demo, a fresh machine
 * without Docker Hub): a bookworm root made with the images tooling
 * (`makeDebianRootfs`, debootstrap minbase, cached under /var/cache/dsec),
 * packed once as an OCI layout, and pushed with skopeo to Debian's
 * `docker-registry` started on 127.0.0.1 at a free port. The caller sets
 * `DSEC_INSECURE_REGISTRIES` to `host` (`registryEnv`) so builds, imports
 * and evaluations reach it over plain HTTP; it also holds
 * `library/debian:SUITE`, so with `DSEC_REGISTRY_MIRRORS=docker.io=HOST` an
 * unedited `FROM debian:bookworm` finds it.
 */
import { existsSync } from 'node:fs';
import { mkdir, rename, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { makeDebianRootfs } from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
  type LocalRegistry,
} from '@dsec/images/testing/registry';

/** Where the root and its OCI layout are kept between runs. */
export const DEFAULT_DEBIAN_CACHE_DIR = '/var/cache/dsec/debian-image';
/** The repository and tag pushed: `HOST/debian:bookworm`. */
export const DEBIAN_REPOSITORY = 'debian';

const SUITE_PATTERN = /^[a-z][a-z0-9-]*$/;

export interface DebianRegistryOptions {
  /** The registry's storage and config (the caller's; removed by nobody here). */
  dir: string;
  /** Root filesystem and OCI layout cache (default DEFAULT_DEBIAN_CACHE_DIR). */
  cacheDir?: string | undefined;
  /** Debian suite (default bookworm); also the tag. */
  suite?: string | undefined;
  signal?: AbortSignal | undefined;
  onProgress?: ((line: string) => void) | undefined;
}

export interface DebianRegistry extends LocalRegistry {
  /** `HOST/debian:SUITE`, what a Dockerfile's `FROM` names. */
  image: string;
  /** The environment a build or an evaluation needs to reach the registry without TLS. */
  env: Record<string, string>;
}

/**
 * The OCI layout of a Debian root (`SUITE` tag), built on first use: the
 * root by debootstrap minbase (minutes; needs root and Debian's mirror),
 * then one gzipped layer. Later calls find both in `cacheDir` and do
 * nothing. A half-made root or layout is never taken for a finished one
 * (each is built beside and renamed into place).
 */
export async function ensureDebianLayout(
  options: Omit<DebianRegistryOptions, 'dir'> = {},
): Promise<{ layout: string; tag: string }> {
  const suite = options.suite ?? 'bookworm';
  if (!SUITE_PATTERN.test(suite)) throw new Error(`bad Debian suite ${JSON.stringify(suite)}`);
  const cache = join(options.cacheDir ?? DEFAULT_DEBIAN_CACHE_DIR, suite);
  const root = join(cache, 'rootfs');
  const layout = join(cache, 'oci');
  await mkdir(cache, { recursive: true, mode: 0o755 });
  if (!existsSync(join(root, 'etc/os-release'))) {
    options.onProgress?.(`debootstrap ${suite} (minbase) into ${root}`);
    const tmp = `${root}.part`;
    await rm(tmp, { recursive: true, force: true });
    await makeDebianRootfs(tmp, {
      suite,
      packages: [],
      ...(options.signal ? { signal: options.signal } : {}),
    });
    await rm(root, { recursive: true, force: true });
    await rename(tmp, root);
  }
  if (!existsSync(join(layout, 'index.json'))) {
    options.onProgress?.(`packing ${root} as an OCI image`);
    const tmp = `${layout}.part`;
    await rm(tmp, { recursive: true, force: true });
    await makeOciLayoutFromDirs(
      tmp,
      [root],
      {
        Env: ['PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'],
        Cmd: ['bash'],
      },
      suite,
    );
    await rm(layout, { recursive: true, force: true });
    await rename(tmp, layout);
  }
  return { layout, tag: suite };
}

/**
 * Starts a `docker-registry` on loopback (a free port) holding
 * `debian:SUITE`. `close()` stops the registry; its storage in `dir` stays
 * for the caller to remove.
 */
export async function startDebianRegistry(options: DebianRegistryOptions): Promise<DebianRegistry> {
  const { layout, tag } = await ensureDebianLayout(options);
  await mkdir(options.dir, { recursive: true });
  const registry = await startLocalRegistry({ dir: options.dir });
  try {
    const image = `${registry.host}/${DEBIAN_REPOSITORY}:${tag}`;
    options.onProgress?.(`pushing ${image}`);
    await pushToRegistry(layout, tag, `docker://${image}`);
    // Docker Hub's name for it too, so an unedited `FROM debian:bookworm` finds it through the mirror.
    await pushToRegistry(
      layout,
      tag,
      `docker://${registry.host}/library/${DEBIAN_REPOSITORY}:${tag}`,
    );
    return { ...registry, image, env: registryEnv(registry.host) };
  } catch (err) {
    await registry.close();
    throw err;
  }
}

/**
 * `DSEC_INSECURE_REGISTRIES` with `host` added to what `env` already names,
 * and `DSEC_REGISTRY_MIRRORS` with `host` as a mirror of docker.io (after
 * any the environment names), so `FROM debian:bookworm` resolves here.
 */
export function registryEnv(
  host: string,
  env: NodeJS.ProcessEnv = process.env,
): Record<string, string> {
  const list = (v: string | undefined) =>
    (v ?? '')
      .split(',')
      .map((h) => h.trim())
      .filter((h) => h !== '');
  const insecure = list(env['DSEC_INSECURE_REGISTRIES']).filter((h) => h !== host);
  const mirrors = list(env['DSEC_REGISTRY_MIRRORS']);
  return {
    DSEC_INSECURE_REGISTRIES: [...insecure, host].join(','),
    DSEC_REGISTRY_MIRRORS: [...mirrors, `docker.io=${host}`].join(','),
  };
}

/** Writes `KEY=VALUE` lines a shell can source (`set -a; . FILE`). */
export async function writeEnvFile(path: string, values: Record<string, string>): Promise<void> {
  const lines = Object.entries(values).map(([k, v]) => `${k}='${v.replace(/'/g, `'\\''`)}'`);
  await writeFile(path, lines.join('\n') + '\n');
}
