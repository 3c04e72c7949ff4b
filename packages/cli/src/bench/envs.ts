import { execFile } from 'node:child_process';
import { createCipheriv, createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import {
  chmod,
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
import { loadavg } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';
import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { DsecError, isDsecError, throwIfAborted } from '@dsec/core';
import {
  buildLayer,
  DirImageStore,
  makeDebianRootfs,
  openImageStore,
  transferLayer,
} from '@dsec/images';
import { startLocalRegistry } from '@dsec/images/testing/registry';
import { startS3Server } from '@dsec/images/testing/s3';
import { DSecClient } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { formatBytes } from '../format.js';
import { parseInteger } from '../parse.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { dropCaches, pool, prng } from './layers.js';
import { ThrottledLink } from './link.js';

const execFileAsync = promisify(execFile);

/** Where the environments are built once and kept between runs. */
export const ENVS_CACHE_DIR = '/var/cache/dsec/bench-envs';
/** Bumped whenever what an environment holds changes: older caches are rebuilt. */
const ENVS_CACHE_VERSION = 'v1';
/** What the shared base is: Debian 12 minbase plus what the gold run needs. */
const BASE_PACKAGES = ['python3', 'patch'];
const BASE_MARKER = `bookworm minbase: ${BASE_PACKAGES.join(' ')}\n`;
/** The base's size as built here (used to size toolkits so environments land in 300–600 MiB). */
const NOMINAL_BASE_BYTES = 160 * 2 ** 20;
const MAX_ENVS = 64;
const TARGET_SPEEDUP = 3;
const TARGET_WRITE_REDUCTION = 5;
/**
 * Share of each toolkit's bytes the tests read: a run imports a part of
 * its environment's libraries. Fixed, since the workspace records the
 * choice (a cached environment is built for it).
 */
export const READ_FRACTION = 0.15;

/** The options as the CLI takes them, validated (the pure part: see `envsBenchOptions`). */
export interface EnvsBenchOptions {
  /** Distinct task environments (default 16). */
  envs: number;
  /** Gold runs in all, spread round-robin over the environments (default 64). */
  runs: number;
  /** Runs in flight at once, for both systems (default 16). */
  concurrency: number;
  cacheDir: string;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

/**
 * Checks the CLI's flags (strings or numbers) and fills the defaults: a
 * bad value is `invalid_argument` naming the flag.
 */
export function envsBenchOptions(flags: {
  envs?: number | string | undefined;
  runs?: number | string | undefined;
  concurrency?: number | string | undefined;
  cacheDir?: string | undefined;
}): Omit<EnvsBenchOptions, 'onProgress' | 'signal'> {
  const int = (field: string, value: number | string | undefined, def: number, max: number) => {
    const n = value === undefined ? def : Number(value);
    if (!Number.isInteger(n) || n < 1 || n > max) {
      throw new DsecError(
        'invalid_argument',
        `--${field} must be an integer from 1 to ${max}, got ${JSON.stringify(value)}`,
        { field },
      );
    }
    return n;
  };
  const envs = int('envs', flags.envs, 16, MAX_ENVS);
  const runs = int('runs', flags.runs, 64, 10_000);
  const concurrency = int('concurrency', flags.concurrency, 16, 256);
  const cacheDir = flags.cacheDir ?? ENVS_CACHE_DIR;
  if (!cacheDir.startsWith('/')) {
    throw new DsecError('invalid_argument', '--cache-dir must be an absolute path', {
      field: 'cache-dir',
    });
  }
  return { envs, runs, concurrency, cacheDir };
}

/**
 * Environment `i`'s sizes, the same whatever the run's `--envs` (so a
 * scaled-down run reuses the full run's cache): 320–560 MiB in all, the
 * base shared, toolkit and workspace its own.
 */
export function envSizes(i: number): {
  totalBytes: number;
  toolkitBytes: number;
  workspaceBytes: number;
} {
  const MiB = 2 ** 20;
  const totalBytes = (320 + ((i * 7) % 16) * 16) * MiB;
  const workspaceBytes = (32 + (i % 4) * 8) * MiB;
  return {
    totalBytes,
    workspaceBytes,
    toolkitBytes: totalBytes - NOMINAL_BASE_BYTES - workspaceBytes,
  };
}

/** What one system did: the JSON contract of issue 25 plus the counts that show the runs were real. */
export interface EnvsSide {
  /** From the first run's start to the last run's result, in seconds. */
  secondsToLastResult: number;
  /** Bytes the store (s3rver) or registry sent to the node, HTTP framing included. */
  bytesDownloaded: number;
  /** Sectors written to the node's disk (its own loop device), synced, × 512. */
  bytesWritten: number;
  /** Runs whose tests all passed after the gold patch. */
  passed: number;
  failed: number;
  /** loadavg (1 min) when the side started, to show how busy the shared machine was. */
  loadAverage: number;
  /**
   * Where a run's time went, over all runs (the profile): `prepare` is
   * dsec's runContainer (layers mounted, sandbox started) or podman's
   * `podman pull`; `run` is the script through runShell, or `podman run
   * --rm` (create, start, script, remove).
   */
  phasesMs?: { prepare: PhaseSummary; run: PhaseSummary };
}

export interface PhaseSummary {
  medianMs: number;
  maxMs: number;
  /** Summed over runs: with `concurrency` in flight, up to that many × the wall time. */
  totalMs: number;
}

/** Median, max and sum of phase durations (pure). */
export function summarizePhase(samples: number[]): PhaseSummary {
  if (samples.length === 0) return { medianMs: 0, maxMs: 0, totalMs: 0 };
  const sorted = [...samples].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  const median = sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
  return {
    medianMs: Math.round(median),
    maxMs: Math.round(sorted[sorted.length - 1]!),
    totalMs: Math.round(sorted.reduce((a, b) => a + b, 0)),
  };
}

export interface EnvsRatios {
  /** podman's time to the last result ÷ dsec's (above 1: dsec is faster). */
  speedupToLastResult: number;
  /** dsec's bytes written ÷ podman's (below 1: dsec writes less). */
  bytesWritten: number;
  /** dsec's bytes downloaded ÷ podman's. */
  bytesDownloaded: number;
}

const round4 = (n: number): number => Math.round(n * 10_000) / 10_000;

/** The ratios of issue 25's contract; a zero denominator gives 0 (nothing to compare). */
export function envsRatios(dsec: EnvsSide, podman: EnvsSide): EnvsRatios {
  const r = (a: number, b: number) => (b > 0 ? round4(a / b) : 0);
  return {
    speedupToLastResult: r(podman.secondsToLastResult, dsec.secondsToLastResult),
    bytesWritten: r(dsec.bytesWritten, podman.bytesWritten),
    bytesDownloaded: r(dsec.bytesDownloaded, podman.bytesDownloaded),
  };
}

export interface EnvsBenchReport {
  benchmark: 'envs';
  envs: number;
  runs: number;
  concurrency: number;
  readFraction: number;
  environments: {
    index: number;
    bytes: number;
    baseBytes: number;
    toolkitBytes: number;
    workspaceBytes: number;
    registryBytes: number;
  }[];
  results: { dsec: EnvsSide; podman: EnvsSide & { storageDriver: string } };
  ratios: EnvsRatios;
  /** The issue's targets: ≥ 3 × faster to the last result, ≥ 5 × fewer bytes written. */
  targets: { speedupToLastResult: number; bytesWrittenReduction: number; met: boolean };
  method: string;
  limitations: string;
  machine: Record<string, unknown>;
}

/** Assembles the report around both sides (pure: the shape the tests check). */
export function envsReport(
  options: Pick<EnvsBenchOptions, 'envs' | 'runs' | 'concurrency'>,
  environments: EnvsBenchReport['environments'],
  dsec: EnvsSide,
  podman: EnvsSide & { storageDriver: string },
  machine: Record<string, unknown>,
): EnvsBenchReport {
  const ratios = envsRatios(dsec, podman);
  return {
    benchmark: 'envs',
    envs: options.envs,
    runs: options.runs,
    concurrency: options.concurrency,
    readFraction: READ_FRACTION,
    environments,
    results: { dsec, podman },
    ratios,
    targets: {
      speedupToLastResult: TARGET_SPEEDUP,
      bytesWrittenReduction: TARGET_WRITE_REDUCTION,
      met:
        ratios.speedupToLastResult >= TARGET_SPEEDUP &&
        ratios.bytesWritten > 0 &&
        ratios.bytesWritten <= 1 / TARGET_WRITE_REDUCTION &&
        dsec.failed === 0 &&
        podman.failed === 0,
    },
    method:
      `${options.envs} task environments (a shared Debian 12 minbase with python3 and patch, from debootstrap; per ` +
      'environment a toolkit of generated library files under /opt/toolkit-N, ~45 % incompressible and the rest ' +
      'text, and a workspace: a generated Python repository with unittest tests and a reference patch). ' +
      `${options.runs} gold runs, round-robin over the environments, ${options.concurrency} at a time, per system in ` +
      'turn on a cold node. A gold run: `patch -p1` of the reference patch in /workspace/repo, then ' +
      '`python3 -B -m unittest discover`: the tests import every module of the repository, check the patched ' +
      `function and hash ${Math.round(READ_FRACTION * 100)} % of the toolkit's bytes against recorded ` +
      'digests; the same script for both. dsec: the node starts with an empty state dir and reads split EROFS ' +
      'layers (metadata image + data blob) from an S3 store (s3rver on loopback), data chunks on demand; each run ' +
      'is runContainer(base, toolkit, workspace) → runShell(script) → stop through the SDK. podman: the same three ' +
      'layers as an OCI image (gzip) in a docker-registry on loopback; each run is `podman pull` then `podman run ' +
      '--rm` of the script (what SWE-bench’s harness does with docker), with a private, empty storage root. ' +
      'bytesDownloaded: what a counting TCP proxy in front of s3rver or the registry carried to the node. ' +
      'bytesWritten: sectors written (/sys/block/loopN/stat, field 7, × 512) on a loop-mounted ext4 that holds ' +
      "everything the node writes (dsec's state dir with its chunk cache and writable layers; podman's --root, " +
      '--runroot and TMPDIR), synced; the same counter for both. Page cache dropped before each side.',
    limitations:
      'One machine shared with other work: the store, the registry, the proxy and the node share its cores and ' +
      'disk (loadAverage says how busy it was); loopback has no bandwidth limit or latency, which favours the peer ' +
      '(it downloads everything). Toolkits are generated files, not Debian packages: realistic in size and ' +
      'compressibility, not in layout.',
    machine,
  };
}

// ---------------------------------------------------------------------------
// Building the environments (once, cached).

/** Incompressible, deterministic bytes: AES-256-CTR of zeros under a seeded key. */
function randomBytes(bytes: number, seed: number): Buffer {
  const key = Buffer.alloc(32);
  key.writeUInt32LE(seed >>> 0, 0);
  key.writeUInt32LE(0x656e7673, 4);
  return createCipheriv('aes-256-ctr', key, Buffer.alloc(16)).update(Buffer.alloc(bytes));
}

const WORDS = (
  'def class return import self None True False lambda yield async await value result index ' +
  'buffer parser module config request response handler token stream error state node layer ' +
  'cache array matrix vector tensor float int str dict list tuple set len range sum map filter ' +
  'open read write close path file data name type kind size count offset length begin end'
).split(' ');

/** About `bytes` of text from a seeded vocabulary (compresses like source code and docs, ~3–4×). */
function textPool(bytes: number, seed: number): Buffer {
  const rand = prng(seed);
  const parts: string[] = [];
  let n = 0;
  while (n < bytes) {
    const line =
      ' '.repeat(4 * Math.floor(rand() * 3)) +
      Array.from({ length: 3 + Math.floor(rand() * 9) }, () => {
        const w = WORDS[Math.floor(rand() * WORDS.length)]!;
        return rand() < 0.2 ? `${w}_${Math.floor(rand() * 1000)}` : w;
      }).join(' ') +
      '\n';
    parts.push(line);
    n += line.length;
  }
  return Buffer.from(parts.join(''), 'utf8');
}

function sha256(buf: Buffer): string {
  return createHash('sha256').update(buf).digest('hex');
}

/**
 * Toolkit `i` under `root/opt/toolkit-i`: library-like files of 4 KiB–8 MiB,
 * about 45 % of them incompressible (shared objects, compressed data) and
 * the rest text. Returns the files the tests read (`readFraction` of the
 * bytes, a seeded choice) with their digests.
 */
async function makeToolkit(
  root: string,
  i: number,
  bytes: number,
  readFraction: number,
): Promise<{ path: string; sha256: string }[]> {
  const rand = prng(1000 + i);
  const pool = textPool(8 * 2 ** 20, 2000 + i);
  const files: { path: string; size: number; digest: string }[] = [];
  let total = 0;
  let k = 0;
  while (total < bytes) {
    const r = rand();
    const size = Math.min(
      bytes - total,
      r < 0.55
        ? 4096 + Math.floor(rand() * 60 * 1024)
        : r < 0.92
          ? 65_536 + Math.floor(rand() * 960 * 1024)
          : 2 ** 20 + Math.floor(rand() * 7 * 2 ** 20),
    );
    const binary = rand() < 0.45;
    let buf: Buffer;
    if (binary) buf = randomBytes(size, i * 1_000_003 + k);
    else {
      // Slices of the pool at random offsets: text-like within a file, never a repeat a compressor's window sees.
      const parts: Buffer[] = [];
      let n = 0;
      while (n < size) {
        const len = Math.min(size - n, 4096);
        const at = Math.floor(rand() * (pool.length - len));
        parts.push(pool.subarray(at, at + len));
        n += len;
      }
      buf = Buffer.concat(parts);
    }
    const rel = `opt/toolkit-${i}/lib/pkg${k % 40}/${binary ? `_mod${k}.so` : `mod${k}.py`}`;
    await mkdir(join(root, rel, '..'), { recursive: true });
    await writeFile(join(root, rel), buf);
    files.push({ path: `/${rel}`, size, digest: sha256(buf) });
    total += size;
    k++;
  }
  // The files the tests read: a seeded shuffle, taken until readFraction of the bytes.
  const order = files.map((_, j) => j);
  for (let j = order.length - 1; j > 0; j--) {
    const s = Math.floor(rand() * (j + 1));
    [order[j], order[s]] = [order[s]!, order[j]!];
  }
  const picked: { path: string; sha256: string }[] = [];
  let read = 0;
  for (const j of order) {
    if (read >= bytes * readFraction) break;
    picked.push({ path: files[j]!.path, sha256: files[j]!.digest });
    read += files[j]!.size;
  }
  return picked;
}

const CORE_BUGGY = 'def add(a, b):\n    return a - b\n';
const GOLD_PATCH =
  '--- a/pkg/core.py\n+++ b/pkg/core.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n';

/**
 * Workspace `i` under `root/workspace`: a Python repository (a package of
 * generated modules, data fixtures, unittest tests) at `repo/` whose
 * `pkg.core.add` is wrong, and the reference patch that fixes it at
 * `gold.diff`. Its tests need the patch, import every module, check the
 * fixtures and hash the toolkit files listed in `tests/toolkit_files.txt`.
 */
async function makeWorkspace(
  root: string,
  i: number,
  bytes: number,
  toolkitFiles: { path: string; sha256: string }[],
): Promise<void> {
  const rand = prng(3000 + i);
  const repo = join(root, 'workspace', 'repo');
  await mkdir(join(repo, 'pkg'), { recursive: true });
  await mkdir(join(repo, 'tests'), { recursive: true });
  await mkdir(join(repo, 'data'), { recursive: true });
  await writeFile(join(repo, 'pkg', '__init__.py'), `"""Project ${i}."""\n`);
  await writeFile(join(repo, 'pkg', 'core.py'), CORE_BUGGY);
  await writeFile(join(root, 'workspace', 'gold.diff'), GOLD_PATCH);
  let total = 0;
  // Source: a quarter of the bytes, modules of ~20–60 KiB of small functions.
  const modules: string[] = [];
  while (total < bytes / 4) {
    const name = `m${modules.length}`;
    const lines: string[] = [`"""Module ${name} of project ${i}."""\n`];
    const fns = 400 + Math.floor(rand() * 800);
    for (let f = 0; f < fns; f++) {
      lines.push(
        `def f_${f}(x, y=${Math.floor(rand() * 100)}):\n    """Scale ${f}."""\n    return x * ${f} + y - ${Math.floor(rand() * 1000)}\n`,
      );
    }
    lines.push(`\nCHECK = f_0(1) + ${fns}\n`);
    const text = lines.join('\n');
    await writeFile(join(repo, 'pkg', `${name}.py`), text);
    modules.push(name);
    total += text.length;
  }
  // Fixtures: the rest, text and binary, each with its digest.
  const fixtures: string[] = [];
  const pool = textPool(4 * 2 ** 20, 4000 + i);
  let d = 0;
  while (total < bytes) {
    const size = Math.min(bytes - total, 256 * 1024 + Math.floor(rand() * 768 * 1024));
    const buf =
      d % 2 === 0
        ? randomBytes(size, 7_000_000 + i * 1000 + d)
        : pool.subarray(0, Math.min(size, pool.length));
    await writeFile(join(repo, 'data', `fixture${d}.bin`), buf);
    fixtures.push(`data/fixture${d}.bin ${sha256(buf)}`);
    total += buf.length;
    d++;
  }
  await writeFile(join(repo, 'tests', '__init__.py'), '');
  await writeFile(join(repo, 'tests', 'fixtures.txt'), fixtures.join('\n') + '\n');
  await writeFile(
    join(repo, 'tests', 'toolkit_files.txt'),
    toolkitFiles.map((f) => `${f.path} ${f.sha256}`).join('\n') + '\n',
  );
  await writeFile(
    join(repo, 'tests', 'test_core.py'),
    'import unittest\nfrom pkg.core import add\n\n\nclass TestCore(unittest.TestCase):\n' +
      '    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n',
  );
  await writeFile(
    join(repo, 'tests', 'test_modules.py'),
    'import importlib\nimport unittest\n\n' +
      `MODULES = ${JSON.stringify(modules)}\n\n\nclass TestModules(unittest.TestCase):\n` +
      '    def test_import_all(self):\n        for name in MODULES:\n' +
      "            mod = importlib.import_module('pkg.' + name)\n" +
      '            self.assertIsInstance(mod.CHECK, int)\n',
  );
  const digestTest =
    '    def check(self, listing, base):\n        with open(listing) as f:\n            for line in f:\n' +
    '                path, digest = line.split()\n' +
    "                with open(os.path.join(base, path), 'rb') as g:\n" +
    '                    self.assertEqual(hashlib.sha256(g.read()).hexdigest(), digest, path)\n';
  await writeFile(
    join(repo, 'tests', 'test_files.py'),
    'import hashlib\nimport os\nimport unittest\n\nHERE = os.path.dirname(__file__)\n\n\n' +
      'class TestFiles(unittest.TestCase):\n' +
      digestTest +
      '\n    def test_fixtures(self):\n' +
      "        self.check(os.path.join(HERE, 'fixtures.txt'), os.path.dirname(HERE))\n" +
      '\n    def test_toolkit(self):\n' +
      "        self.check(os.path.join(HERE, 'toolkit_files.txt'), '/')\n",
  );
}

/**
 * The script of a gold run, the same for both systems. Tools by full path:
 * a DSec sandbox's PATH also holds the platform's busybox applets, whose
 * `patch` is not GNU patch.
 */
export const GOLD_RUN_SCRIPT =
  'cd /workspace/repo && /usr/bin/patch -p1 -s -i /workspace/gold.diff && ' +
  '/usr/bin/python3 -B -m unittest discover -q -s tests -t .';

/** `tar` of a directory into a gzipped layer blob (what `docker build` pushes), streamed; its digests. */
async function gzipLayer(
  src: string,
  out: string,
): Promise<{ digest: string; diffId: string; size: number }> {
  const tar = `${out}.tar`;
  await execFileAsync('tar', [
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
  const diffId = await fileDigest(tar);
  await execFileAsync('gzip', ['-n', '-f', tar]);
  await rename(`${tar}.gz`, out);
  return { digest: await fileDigest(out), diffId, size: (await stat(out)).size };
}

async function fileDigest(path: string): Promise<string> {
  const h = createHash('sha256');
  for await (const chunk of createReadStream(path)) h.update(chunk as Buffer);
  return `sha256:${h.digest('hex')}`;
}

/** An OCI layout of gzipped layers (bottom first), tag `v1`, for skopeo to push. */
async function writeOciLayout(
  dir: string,
  layers: { path: string; digest: string; diffId: string; size: number }[],
): Promise<void> {
  const blobs = join(dir, 'blobs', 'sha256');
  await mkdir(blobs, { recursive: true });
  const put = async (buf: Buffer) => {
    const hex = sha256(buf);
    await writeFile(join(blobs, hex), buf);
    return { digest: `sha256:${hex}`, size: buf.length };
  };
  for (const l of layers) {
    // A hard link: the cached blob is not copied.
    await execFileAsync('ln', ['-f', l.path, join(blobs, l.digest.slice(7))]);
  }
  const config = await put(
    Buffer.from(
      JSON.stringify({
        architecture: 'amd64',
        os: 'linux',
        config: { Cmd: ['/bin/sh'], WorkingDir: '/workspace/repo' },
        rootfs: { type: 'layers', diff_ids: layers.map((l) => l.diffId) },
      }),
    ),
  );
  const manifest = await put(
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: 'application/vnd.oci.image.manifest.v1+json',
        config: { mediaType: 'application/vnd.oci.image.config.v1+json', ...config },
        layers: layers.map((l) => ({
          mediaType: 'application/vnd.oci.image.layer.v1.tar+gzip',
          digest: l.digest,
          size: l.size,
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
          annotations: { 'org.opencontainers.image.ref.name': 'v1' },
        },
      ],
    }),
  );
}

interface EnvRecord {
  index: number;
  baseBytes: number;
  toolkitBytes: number;
  workspaceBytes: number;
  /** The gzipped toolkit + workspace layers (the base's is shared). */
  registryBytes: number;
}

async function duBytes(dir: string): Promise<number> {
  const { stdout } = await execFileAsync('du', ['-s', '-B1', '--apparent-size', '--', dir]);
  return Number(stdout.split('\t')[0]);
}

/**
 * Makes sure the cache holds the base and environments `0..envs-1`: DSec's
 * split layers in a directory store, the same trees as OCI images in a
 * docker-registry's storage. What is there is reused; a half-built
 * environment has no marker and is built again.
 */
async function ensureEnvironments(
  options: EnvsBenchOptions,
  log: (line: string) => void,
): Promise<EnvRecord[]> {
  const cache = join(options.cacheDir, ENVS_CACHE_VERSION);
  await mkdir(cache, { recursive: true });
  const rootfs = join(options.cacheDir, 'base-rootfs');
  const marker = `${rootfs}.complete`;
  if ((await readFile(marker, 'utf8').catch(() => '')) !== BASE_MARKER) {
    log('building the Debian base with debootstrap (minutes)');
    await rm(marker, { force: true });
    await makeDebianRootfs(rootfs, {
      packages: BASE_PACKAGES,
      ...(options.signal ? { signal: options.signal } : {}),
    });
    await writeFile(marker, BASE_MARKER);
  }
  // Scratch of an interrupted build (a run killed mid-way): never live, since runs do not share a cache.
  for (const entry of await readdir(cache))
    if (entry.startsWith('build-')) await rm(join(cache, entry), { recursive: true, force: true });
  const store = new DirImageStore(join(cache, 'store'));
  const blobs = join(cache, 'oci-blobs');
  await mkdir(blobs, { recursive: true });
  const baseBytes = await duBytes(rootfs);
  const baseLayerFile = join(blobs, 'base.json');
  let baseLayer = JSON.parse(await readFile(baseLayerFile, 'utf8').catch(() => 'null')) as {
    path: string;
    digest: string;
    diffId: string;
    size: number;
  } | null;
  if (!baseLayer) {
    log('packing the base layer');
    await buildLayer(store, {
      name: 'envs-base',
      kind: 'base',
      from: { dir: rootfs },
      split: true,
    });
    const path = join(blobs, 'base.tar.gz');
    baseLayer = { path, ...(await gzipLayer(rootfs, path)) };
    await writeFile(baseLayerFile, JSON.stringify(baseLayer));
  }
  const registry = await startLocalRegistry({ dir: join(cache, 'registry') });
  const records: EnvRecord[] = [];
  try {
    for (let i = 0; i < options.envs; i++) {
      throwIfAborted(options.signal);
      const done = join(cache, `env-${i}.json`);
      const have = await readFile(done, 'utf8').catch(() => undefined);
      if (have !== undefined) {
        records.push(JSON.parse(have) as EnvRecord);
        continue;
      }
      log(`building environment ${i + 1} of ${options.envs}`);
      const sizes = envSizes(i);
      const scratch = await mkdtemp(join(cache, `build-${i}-`));
      try {
        const tk = join(scratch, 'toolkit');
        const ws = join(scratch, 'workspace');
        const read = await makeToolkit(tk, i, sizes.toolkitBytes, READ_FRACTION);
        await makeWorkspace(ws, i, sizes.workspaceBytes, read);
        await buildLayer(store, {
          name: `envs-tk-${i}`,
          kind: 'toolkit',
          from: { dir: tk },
          split: true,
        });
        await buildLayer(store, {
          name: `envs-ws-${i}`,
          kind: 'workspace',
          from: { dir: ws },
          split: true,
        });
        const tkLayer = { path: join(scratch, 'tk.tar.gz') };
        const wsLayer = { path: join(scratch, 'ws.tar.gz') };
        const tkGz = { ...tkLayer, ...(await gzipLayer(tk, tkLayer.path)) };
        const wsGz = { ...wsLayer, ...(await gzipLayer(ws, wsLayer.path)) };
        const layout = join(scratch, 'layout');
        await writeOciLayout(layout, [baseLayer, tkGz, wsGz]);
        await execFileAsync('skopeo', [
          'copy',
          '--quiet',
          '--dest-tls-verify=false',
          `oci:${layout}:v1`,
          `docker://${registry.host}/bench-envs/env-${i}:v1`,
        ]);
        const record: EnvRecord = {
          index: i,
          baseBytes,
          toolkitBytes: await duBytes(tk),
          workspaceBytes: await duBytes(ws),
          registryBytes: tkGz.size + wsGz.size,
        };
        await writeFile(done, JSON.stringify(record));
        records.push(record);
      } finally {
        await rm(scratch, { recursive: true, force: true });
      }
    }
  } finally {
    await registry.close();
  }
  return records;
}

// ---------------------------------------------------------------------------
// The node's disk: a loop-mounted ext4 of its own, so its sectors-written counter is the node's alone.

interface NodeDisk {
  mnt: string;
  written(): Promise<number>;
  close(): Promise<void>;
}

async function makeNodeDisk(work: string, bytes: number): Promise<NodeDisk> {
  const file = join(work, 'node-disk.img');
  const mnt = join(work, 'node');
  await mkdir(mnt, { recursive: true });
  await execFileAsync('truncate', ['-s', String(bytes), file]);
  // Inode tables and journal written now, not by ext4lazyinit during the measurement.
  await execFileAsync('mkfs.ext4', [
    '-q',
    '-F',
    '-E',
    'lazy_itable_init=0,lazy_journal_init=0',
    file,
  ]);
  const dev = (await execFileAsync('losetup', ['--find', '--show', file])).stdout.trim();
  try {
    await execFileAsync('mount', ['-t', 'ext4', dev, mnt]);
  } catch (err) {
    await execFileAsync('losetup', ['-d', dev]).catch(() => undefined);
    throw err;
  }
  const statFile = `/sys/block/${dev.replace('/dev/', '')}/stat`;
  return {
    mnt,
    written: async () => {
      await execFileAsync('sync', ['-f', mnt]);
      const fields = (await readFile(statFile, 'utf8')).trim().split(/\s+/);
      return Number(fields[6]) * 512;
    },
    close: async () => {
      await execFileAsync('umount', [mnt]).catch(() => execFileAsync('umount', ['-l', mnt]));
      await execFileAsync('losetup', ['-d', dev]).catch(() => undefined);
      await rm(file, { force: true });
    },
  };
}

// ---------------------------------------------------------------------------
// The benchmark.

/**
 * `dsec bench envs`: `runs` gold runs over `envs` distinct environments at
 * `concurrency`, on a cold node, DSec (layers on demand from an S3 store)
 * against podman (`podman pull` + `podman run` per run from a registry).
 * Builds the environments first if the cache lacks them.
 */
export async function benchEnvs(
  options: EnvsBenchOptions,
  log: (line: string) => void = () => undefined,
): Promise<EnvsBenchReport> {
  const records = await ensureEnvironments(options, log);
  const cache = join(options.cacheDir, ENVS_CACHE_VERSION);
  const work = await mkdtemp(join('/var/tmp', 'dsec-bench-envs-'));
  await chmod(work, 0o711);
  // The node's trees (sandboxes' writable layers among them) go with the loop device, never by
  // a recursive removal here: the work dir is emptied of what this process made, then removed.
  const cleanups: (() => Promise<unknown>)[] = [
    async () => {
      await rm(join(work, 'upload-cache'), { recursive: true, force: true });
      await rm(join(work, 'node-disk.img'), { force: true });
      await rmdir(join(work, 'node')).catch(() => undefined);
      await rmdir(work);
    },
  ];
  const total = 2 * options.runs;
  let ticks = 0;
  const tick = () => options.onProgress?.(++ticks, total);
  try {
    const saved = { ...process.env };
    cleanups.push(async () => {
      for (const k of ['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_EC2_METADATA_DISABLED'])
        if (saved[k] === undefined) delete process.env[k];
        else process.env[k] = saved[k];
    });
    process.env.AWS_ACCESS_KEY_ID = 'S3RVER';
    process.env.AWS_SECRET_ACCESS_KEY = 'S3RVER';
    process.env.AWS_EC2_METADATA_DISABLED = 'true';

    // podman's storage unpacks every image: room for all of them twice over.
    const need = records.reduce((s, r) => s + r.toolkitBytes + r.workspaceBytes, 0) * 2.5;
    const disk = await makeNodeDisk(
      work,
      Math.max(8 * 2 ** 30, Math.ceil(need / 2 ** 30) * 2 ** 30 + 4 * 2 ** 30),
    );
    cleanups.unshift(() => disk.close());

    const dsec = await dsecSide(options, cache, records, disk, cleanups, tick, log);
    const podman = await podmanSide(options, cache, disk, cleanups, tick, log);
    const environments = records.map((r) => ({
      index: r.index,
      bytes: r.baseBytes + r.toolkitBytes + r.workspaceBytes,
      baseBytes: r.baseBytes,
      toolkitBytes: r.toolkitBytes,
      workspaceBytes: r.workspaceBytes,
      registryBytes: r.registryBytes,
    }));
    return envsReport(options, environments, dsec, podman, await describeMachine());
  } finally {
    for (const c of cleanups) await c().catch(() => undefined);
  }
}

/**
 * Retries `create` while the node answers `capacity_exhausted` (its
 * admission goes by measured use, which other work on a shared machine
 * takes up): a harness waits for room, it does not drop the task. The wait
 * counts in the time to the last result. Gives up after ten minutes.
 */
async function withCapacityRetry<T>(create: () => Promise<T>, signal?: AbortSignal): Promise<T> {
  const deadline = performance.now() + 600_000;
  for (let delayMs = 250; ; delayMs = Math.min(delayMs * 2, 5000)) {
    try {
      return await create();
    } catch (err) {
      if (!isDsecError(err) || err.code !== 'capacity_exhausted' || performance.now() > deadline)
        throw err;
    }
    throwIfAborted(signal);
    await sleep(delayMs);
  }
}

/** Which environment run `k` uses: round-robin, so every wave holds distinct environments. */
export function envOfRun(k: number, envs: number): number {
  return k % envs;
}

async function dsecSide(
  options: EnvsBenchOptions,
  cache: string,
  records: EnvRecord[],
  disk: NodeDisk,
  cleanups: (() => Promise<unknown>)[],
  tick: () => void,
  log: (line: string) => void,
): Promise<EnvsSide> {
  const s3 = await startS3Server({ bucket: 'dsec-bench-envs' });
  let closeS3: (() => Promise<unknown>) | undefined = () => s3.close();
  cleanups.unshift(async () => closeS3?.());
  log('uploading the layers to the S3 store');
  const local = new DirImageStore(join(cache, 'store'));
  const upload = openImageStore(s3.location('envs/'), {
    cacheDir: join(disk.mnt, '..', 'upload-cache'),
  });
  const refs = [
    'envs-base',
    ...records.flatMap((r) => [`envs-tk-${r.index}`, `envs-ws-${r.index}`]),
  ];
  for (const ref of refs) await transferLayer(local, upload, ref);
  const link = await ThrottledLink.open(
    { host: '127.0.0.1', port: Number(new URL(s3.endpoint).port) },
    Number.POSITIVE_INFINITY,
  );
  cleanups.unshift(() => link.close());
  const location = `s3://${s3.bucket}/envs/?${new URLSearchParams({ endpoint: link.url, region: 'us-east-1' }).toString()}`;
  const node = await startSingleNode({
    stateDir: join(disk.mnt, 'dsec-state'),
    port: 0,
    network: { mode: 'none' },
    imageStore: location,
    capacity: { sandboxes: options.concurrency * 2 + 8, cpuCores: options.concurrency * 2 },
  });
  let closeNode: (() => Promise<unknown>) | undefined = () => node.close({ stopSandboxes: true });
  cleanups.unshift(async () => closeNode?.());
  const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
  await client.open();
  try {
    await dropCaches();
    const load = loadavg()[0]!;
    const before = await disk.written();
    link.resetCounters();
    log('dsec: running');
    const prepare: number[] = [];
    const run: number[] = [];
    const t0 = performance.now();
    const outcomes = await pool(
      Array.from({ length: options.runs }, (_, k) => envOfRun(k, options.envs)),
      options.concurrency,
      async (i) => {
        // Ctrl-C: no new runs; the ones in flight finish, then everything is cleaned up.
        throwIfAborted(options.signal);
        let ok = false;
        try {
          const p0 = performance.now();
          const sb = await withCapacityRetry(
            () =>
              client.runContainer({
                image: 'envs-base',
                toolkits: [`envs-tk-${i}`],
                workspace: `envs-ws-${i}`,
                memoryLimitMb: 512,
                cpuCoresLimit: 1,
              }),
            options.signal,
          );
          const r0 = performance.now();
          prepare.push(r0 - p0);
          try {
            const r = await sb.runShell(GOLD_RUN_SCRIPT, { timeoutMs: 1_800_000 });
            run.push(performance.now() - r0);
            ok = r.exitCode === 0;
            if (!ok) log(`dsec run on env ${i} failed (${r.exitCode}): ${r.stderr.slice(-400)}`);
          } finally {
            await sb.stop();
          }
        } catch (err) {
          log(`dsec run on env ${i} failed: ${(err as Error).message}`);
        }
        tick();
        return ok;
      },
    );
    const seconds = (performance.now() - t0) / 1000;
    const bytesDownloaded = link.bytesDown;
    const bytesWritten = (await disk.written()) - before;
    return {
      secondsToLastResult: Math.round(seconds * 100) / 100,
      bytesDownloaded,
      bytesWritten,
      passed: outcomes.filter(Boolean).length,
      failed: outcomes.filter((o) => !o).length,
      loadAverage: load,
      phasesMs: { prepare: summarizePhase(prepare), run: summarizePhase(run) },
    };
  } finally {
    client.close();
    await node.close({ stopSandboxes: true }).catch(() => undefined);
    closeNode = undefined;
    await link.close().catch(() => undefined);
    await s3.close().catch(() => undefined);
    closeS3 = undefined;
  }
}

async function podmanSide(
  options: EnvsBenchOptions,
  cache: string,
  disk: NodeDisk,
  cleanups: (() => Promise<unknown>)[],
  tick: () => void,
  log: (line: string) => void,
): Promise<EnvsSide & { storageDriver: string }> {
  const registry = await startLocalRegistry({ dir: join(cache, 'registry') });
  cleanups.unshift(() => registry.close());
  const link = await ThrottledLink.open(
    { host: '127.0.0.1', port: registry.port },
    Number.POSITIVE_INFINITY,
  );
  cleanups.unshift(() => link.close());
  const host = link.url.replace('http://', '');
  const root = join(disk.mnt, 'podman');
  const tmp = join(root, 'tmp');
  await mkdir(tmp, { recursive: true });
  const global = [
    '--root',
    join(root, 'storage'),
    '--runroot',
    join(root, 'run'),
    '--tmpdir',
    join(root, 'libpod-tmp'),
    '--storage-driver',
    'overlay',
    '--events-backend',
    'none',
  ];
  // Big-file staging of image pulls goes to TMPDIR: on the node's disk, like the rest.
  const env = { ...process.env, TMPDIR: tmp };
  const podman = (args: string[]) =>
    execFileAsync('podman', [...global, ...args], { env, maxBuffer: 64 << 20 });
  cleanups.unshift(async () => {
    await podman(['rm', '--all', '--force']).catch(() => undefined);
    await podman(['system', 'reset', '--force']).catch(() => undefined);
  });
  await dropCaches();
  const load = loadavg()[0]!;
  const before = await disk.written();
  link.resetCounters();
  log('podman: running');
  const prepare: number[] = [];
  const run: number[] = [];
  const t0 = performance.now();
  const outcomes = await pool(
    Array.from({ length: options.runs }, (_, k) => envOfRun(k, options.envs)),
    options.concurrency,
    async (i) => {
      throwIfAborted(options.signal);
      const image = `${host}/bench-envs/env-${i}:v1`;
      let ok = false;
      try {
        const p0 = performance.now();
        await podman(['pull', '--quiet', '--tls-verify=false', image]);
        const r0 = performance.now();
        prepare.push(r0 - p0);
        await podman([
          'run',
          '--rm',
          '--runtime',
          'runc',
          '--network',
          'none',
          // Root here lacks CAP_SYS_RESOURCE: podman's default rlimits (above the hard limits) would fail.
          '--ulimit',
          'nofile=1024:1024',
          '--ulimit',
          'nproc=1024:1024',
          '--memory',
          '512m',
          '--cpus',
          '1',
          image,
          '/bin/sh',
          '-c',
          GOLD_RUN_SCRIPT,
        ]);
        run.push(performance.now() - r0);
        ok = true;
      } catch (err) {
        log(`podman run on env ${i} failed: ${(err as Error).message.slice(-400)}`);
      }
      tick();
      return ok;
    },
  );
  const seconds = (performance.now() - t0) / 1000;
  const bytesDownloaded = link.bytesDown;
  const bytesWritten = (await disk.written()) - before;
  return {
    secondsToLastResult: Math.round(seconds * 100) / 100,
    bytesDownloaded,
    bytesWritten,
    passed: outcomes.filter(Boolean).length,
    failed: outcomes.filter((o) => !o).length,
    loadAverage: load,
    phasesMs: { prepare: summarizePhase(prepare), run: summarizePhase(run) },
    storageDriver: 'overlay',
  };
}

/** `dsec bench envs`: wired here so that bench.ts only lists it. */
export function registerEnvsBench(bench: Command): void {
  bench
    .command('envs')
    .description(
      '64 gold runs over 16 distinct 300–600 MiB environments at concurrency 16 on a cold node: layers on demand from S3 vs `podman pull` + `podman run` from a registry',
    )
    .option('--envs <n>', 'distinct task environments', parseInteger, 16)
    .option('--runs <n>', 'gold runs in all (round-robin over the environments)', parseInteger, 64)
    .option('--concurrency <n>', 'runs in flight at once (both systems)', parseInteger, 16)
    .option('--cache-dir <dir>', 'where the environments are built once and kept', ENVS_CACHE_DIR)
    .action(
      async (
        opts: { envs: number; runs: number; concurrency: number; cacheDir: string },
        command: Command,
      ) => {
        const ctx = contextOf(command);
        const checked = envsBenchOptions(opts);
        const progress = createProgress({
          label: 'bench envs',
          total: 2 * checked.runs,
          enabled: !ctx.json,
        });
        const report = await benchEnvs(
          {
            ...checked,
            onProgress: (done) => progress.update(done),
            ...(ctx.signal ? { signal: ctx.signal } : {}),
          },
          (line) => process.stderr.write(`bench envs: ${line}\n`),
        );
        progress.done();
        if (ctx.json) {
          ctx.out(JSON.stringify(report, null, 2));
          return;
        }
        const { dsec, podman } = report.results;
        const line = (name: string, s: EnvsSide) =>
          `${name.padEnd(7)} ${s.secondsToLastResult.toFixed(1)} s to the last result  downloaded ${formatBytes(s.bytesDownloaded)}  written ${formatBytes(s.bytesWritten)}  passed ${s.passed}/${report.runs}`;
        ctx.out(
          `${report.runs} gold runs over ${report.envs} environments at concurrency ${report.concurrency}`,
        );
        ctx.out(line('dsec', dsec));
        ctx.out(line('podman', podman));
        ctx.out(`ratios: ${JSON.stringify(report.ratios)}  targets met: ${report.targets.met}`);
      },
    );
}
