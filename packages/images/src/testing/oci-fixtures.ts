import { createHash } from 'node:crypto';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { runTool } from '../util/run-tool.js';

/** One image layer for a hand-made test image: path → content (`null` = directory). */
export type LayerFiles = Record<string, string | null>;

export interface TestImageConfig {
  Env?: string[];
  Cmd?: string[];
  WorkingDir?: string;
  User?: string;
}

async function layerTar(
  work: string,
  files: LayerFiles,
  i: number,
  gzip: boolean,
): Promise<string> {
  const dir = join(work, `src-${i}`);
  await mkdir(dir, { recursive: true });
  for (const [path, content] of Object.entries(files)) {
    const abs = join(dir, path);
    if (content === null) await mkdir(abs, { recursive: true });
    else {
      await mkdir(dirname(abs), { recursive: true });
      await writeFile(abs, content);
    }
  }
  const out = join(work, `layer-${i}.tar${gzip ? '.gz' : ''}`);
  await runTool('tar', [
    '--create',
    ...(gzip ? ['--gzip'] : []),
    `--file=${out}`,
    '--sort=name',
    '--numeric-owner',
    '--owner=0',
    '--group=0',
    '--mtime=@0',
    `--directory=${dir}`,
    '.',
  ]);
  await rm(dir, { recursive: true, force: true });
  return out;
}

function sha256(buf: Buffer): string {
  return createHash('sha256').update(buf).digest('hex');
}

function configJson(config: TestImageConfig, diffIds: string[]): Buffer {
  return Buffer.from(
    JSON.stringify({
      architecture: 'amd64',
      os: 'linux',
      config,
      rootfs: { type: 'layers', diff_ids: diffIds },
    }),
  );
}

/**
 * Writes an OCI image layout directory (`oci-layout`, `index.json`,
 * `blobs/sha256/…`) with gzipped layers, as `skopeo copy … oci:DIR` does.
 */
export async function makeOciLayout(
  dir: string,
  layers: LayerFiles[],
  config: TestImageConfig = {},
  tag = 'latest',
): Promise<void> {
  const blobs = join(dir, 'blobs', 'sha256');
  await mkdir(blobs, { recursive: true });
  const put = async (buf: Buffer): Promise<{ digest: string; size: number }> => {
    const hex = sha256(buf);
    await writeFile(join(blobs, hex), buf);
    return { digest: `sha256:${hex}`, size: buf.length };
  };
  const work = join(dir, '..', `.work-${Date.now()}`);
  const layerDescs = [];
  const diffIds = [];
  for (const [i, files] of layers.entries()) {
    const tarGz = await readFile(await layerTar(work, files, i, true));
    const { stdout } = await runTool('sh', [
      '-c',
      `gzip -dc '${join(work, `layer-${i}.tar.gz`)}' | sha256sum`,
    ]);
    diffIds.push(`sha256:${stdout.split(' ')[0]}`);
    layerDescs.push({
      mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip',
      ...(await put(tarGz)),
    });
  }
  await rm(work, { recursive: true, force: true });
  const cfg = await put(configJson(config, diffIds));
  const manifest = await put(
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: 'application/vnd.oci.image.manifest.v1+json',
        config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...cfg },
        layers: layerDescs,
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
}

/** Writes a docker-archive tar (`manifest.json`, `<id>/layer.tar`, config), as `podman save` does. */
export async function makeDockerArchive(
  file: string,
  layers: LayerFiles[],
  config: TestImageConfig = {},
  repoTag = 'localhost/test:latest',
): Promise<void> {
  const dir = `${file}.d`;
  const work = `${file}.work`;
  await mkdir(dir, { recursive: true });
  const layerPaths = [];
  const diffIds = [];
  for (const [i, files] of layers.entries()) {
    const tar = await readFile(await layerTar(work, files, i, false));
    const hex = sha256(tar);
    await mkdir(join(dir, hex), { recursive: true });
    await writeFile(join(dir, hex, 'layer.tar'), tar);
    layerPaths.push(`${hex}/layer.tar`);
    diffIds.push(`sha256:${hex}`);
  }
  const cfg = configJson(config, diffIds);
  const cfgName = `${sha256(cfg)}.json`;
  await writeFile(join(dir, cfgName), cfg);
  await writeFile(
    join(dir, 'manifest.json'),
    JSON.stringify([{ Config: cfgName, RepoTags: [repoTag], Layers: layerPaths }]),
  );
  await runTool('tar', ['--create', `--file=${file}`, `--directory=${dir}`, '.']);
  await rm(dir, { recursive: true, force: true });
  await rm(work, { recursive: true, force: true });
}
