/**
 * A throwaway container registry on loopback for tests and benchmarks:
 * Debian's `docker-registry` (distribution 2.x) with filesystem storage in a
 * directory of the caller's, plain HTTP on 127.0.0.1 and a free port
 * (clients use `--insecure` / `--tls-verify=false`), optionally behind
 * htpasswd basic auth. Plus helpers to make test images: an OCI layout from
 * layer directories, and a push with skopeo.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { runTool } from '../util/run-tool.js';

export interface LocalRegistry {
  /** `127.0.0.1:PORT`, the host part of `docker://` references. */
  host: string;
  port: number;
  /** Stops the registry (its storage directory stays; it is the caller's). */
  close(): Promise<void>;
}

export interface LocalRegistryOptions {
  /** Storage and config live here. */
  dir: string;
  /** Basic auth for one user (htpasswd, bcrypt). */
  auth?: { username: string; password: string };
  binary?: string;
}

async function freePort(): Promise<number> {
  return await new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const addr = srv.address();
      srv.close(() => {
        if (addr && typeof addr === 'object') resolve(addr.port);
        else reject(new Error('no port'));
      });
    });
  });
}

/** A bcrypt hash for htpasswd via Debian's python3 (crypt module; no npm dependency). */
async function bcryptHash(password: string): Promise<string> {
  const { stdout } = await runTool('/usr/bin/python3', [
    '-W',
    'ignore',
    '-c',
    'import crypt,sys; print(crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH)))',
    password,
  ]);
  // Go's bcrypt reads the 2a form; 2b differs only in a C implementation bug fix.
  return stdout.trim().replace(/^\$2b\$/, '$2a$');
}

export async function startLocalRegistry(options: LocalRegistryOptions): Promise<LocalRegistry> {
  const storage = join(options.dir, 'storage');
  await mkdir(storage, { recursive: true });
  const port = await freePort();
  const lines = [
    'version: 0.1',
    'log:',
    '  level: error',
    '  accesslog:',
    '    disabled: true',
    'storage:',
    '  filesystem:',
    `    rootdirectory: ${storage}`,
    '  delete:',
    '    enabled: true',
    'http:',
    `  addr: 127.0.0.1:${port}`,
  ];
  if (options.auth) {
    const htpasswd = join(options.dir, 'htpasswd');
    await writeFile(
      htpasswd,
      `${options.auth.username}:${await bcryptHash(options.auth.password)}\n`,
      { mode: 0o600 },
    );
    lines.push('auth:', '  htpasswd:', '    realm: dsec-test', `    path: ${htpasswd}`);
  }
  const config = join(options.dir, 'config.yml');
  await writeFile(config, `${lines.join('\n')}\n`);
  const child: ChildProcess = spawn(
    options.binary ?? '/usr/bin/docker-registry',
    ['serve', config],
    {
      stdio: ['ignore', 'ignore', 'pipe'],
    },
  );
  let stderr = '';
  child.stderr?.setEncoding('utf8').on('data', (c: string) => {
    stderr = (stderr + c).slice(-4000);
  });
  let exited = false;
  const exit = new Promise<void>((resolve) =>
    child.once('exit', () => {
      exited = true;
      resolve();
    }),
  );
  const close = async (): Promise<void> => {
    if (!exited) child.kill('SIGTERM');
    await Promise.race([exit, new Promise((r) => setTimeout(r, 5000))]);
    if (!exited) child.kill('SIGKILL');
    await exit;
  };
  const deadline = Date.now() + 15_000;
  for (;;) {
    if (exited) throw new Error(`docker-registry exited at start: ${stderr}`);
    const status = await fetch(`http://127.0.0.1:${port}/v2/`)
      .then((r) => r.status)
      .catch(() => 0);
    if (status === 200 || status === 401) break;
    if (Date.now() > deadline) {
      await close();
      throw new Error(`docker-registry did not answer on 127.0.0.1:${port}: ${stderr}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { host: `127.0.0.1:${port}`, port, close };
}

/**
 * Writes an OCI image layout from layer directories, bottom first, each
 * packed as a gzipped tar exactly as it is on disk: OCI whiteouts are plain
 * empty files named `.wh.NAME`, an opaque directory holds `.wh..wh..opq`.
 */
export async function makeOciLayoutFromDirs(
  dir: string,
  layerDirs: string[],
  config: Record<string, unknown> = {},
  tag = 'latest',
  options: { layerMediaType?: string } = {},
): Promise<{ diffIds: string[] }> {
  const blobs = join(dir, 'blobs', 'sha256');
  await mkdir(blobs, { recursive: true });
  const put = async (buf: Buffer): Promise<{ digest: string; size: number }> => {
    const hex = createHash('sha256').update(buf).digest('hex');
    await writeFile(join(blobs, hex), buf);
    return { digest: `sha256:${hex}`, size: buf.length };
  };
  const layers = [];
  const diffIds: string[] = [];
  for (const [i, src] of layerDirs.entries()) {
    const tar = join(dir, `.layer-${i}.tar`);
    await runTool('tar', [
      '--create',
      `--file=${tar}`,
      '--sort=name',
      '--numeric-owner',
      '--owner=0',
      '--group=0',
      '--mtime=@0',
      `--directory=${src}`,
      '.',
    ]);
    const plain = await readFile(tar);
    diffIds.push(`sha256:${createHash('sha256').update(plain).digest('hex')}`);
    // -n: no name or time in the gzip header, so the same tree gives the same blob.
    await runTool('gzip', ['-n', '-f', tar]);
    const gz = await readFile(`${tar}.gz`);
    await rm(`${tar}.gz`, { force: true });
    layers.push({
      mediaType: options.layerMediaType ?? 'application/vnd.oci.image.layer.v1.tar+gzip',
      ...(await put(gz)),
    });
  }
  const cfg = await put(
    Buffer.from(
      JSON.stringify({
        architecture: { x64: 'amd64', arm64: 'arm64' }[process.arch as string] ?? process.arch,
        os: 'linux',
        config,
        rootfs: { type: 'layers', diff_ids: diffIds },
      }),
    ),
  );
  const manifest = await put(
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: 'application/vnd.oci.image.manifest.v1+json',
        config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...cfg },
        layers,
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
          annotations: { 'org.opencontainers.image.ref.name': tag },
        },
      ],
    }),
  );
  return { diffIds };
}

/** Pushes `oci:LAYOUT:TAG` to `docker://HOST/REPO:TAG` over plain HTTP with skopeo. */
export async function pushToRegistry(
  layout: string,
  tag: string,
  dest: string,
  auth?: { username: string; password: string },
): Promise<void> {
  await runTool('skopeo', [
    'copy',
    '--quiet',
    '--dest-tls-verify=false',
    ...(auth ? [`--dest-creds=${auth.username}:${auth.password}`] : []),
    `oci:${layout}:${tag}`,
    dest,
  ]);
}
