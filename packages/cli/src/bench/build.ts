import { execFile } from 'node:child_process';
import { chmod, cp, mkdir, mkdtemp, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import type { Command } from 'commander';
import { startSingleNode } from '@dsec/cluster';
import { hostErofsMounter, LinuxNetwork } from '@dsec/edge';
import {
  buildDockerfile,
  DirImageStore,
  egressBuildNetwork,
  makeDebianRootfs,
  registrySettings,
} from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
} from '@dsec/images/testing/registry';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { createProgress } from '../progress.js';
import { describeMachine } from './create.js';
import { dropCaches } from './layers.js';

const execFileAsync = promisify(execFile);

export interface BuildBenchOptions {
  /** Sandboxes started from the built image (default 16). */
  sandboxes?: number;
  /** The repository copied into the context (default: this DSec checkout's `packages/`). */
  repoDir?: string;
  /** Where the Debian base's OCI layout is kept between runs (debootstrap takes minutes). */
  cacheDir: string;
  onProgress?: (done: number, total: number) => void;
  signal?: AbortSignal;
}

interface Side {
  totalSeconds: number;
  buildSeconds: number;
  startSeconds: number;
}

export interface BuildBenchReport {
  benchmark: 'build';
  dockerfile: string;
  context: { files: number; bytes: number };
  sandboxes: number;
  results: {
    /** `phaseSeconds`: the build's time by `buildDockerfile` progress phase (`step`: buildah bud). */
    dsec: Side & { layers: number; phaseSeconds: Record<string, number> };
    podman: Side | { available: false; reason: string };
  };
  /** dsec ÷ podman (target: `totalSeconds` ≤ 1.2). */
  ratios?: { totalSeconds: number; buildSeconds: number; startSeconds: number };
  method: string;
  limitations: string;
  machine: Record<string, unknown>;
}

/** Three RUN steps that need no network (the build is timed, not the mirror) and a COPY of a repository. */
function dockerfileFor(base: string): string {
  return [
    `FROM ${base}`,
    'RUN useradd --create-home --shell /bin/bash agent && mkdir -p /opt/tools',
    'RUN for i in $(seq 1 500); do echo "tool $i" > /opt/tools/t$i; done && tar -C /opt -czf /opt/tools.tgz tools',
    'COPY repo/ /workspace/repo/',
    'RUN chown -R agent:agent /workspace && find /workspace -type f | wc -l > /workspace/files.txt',
    'WORKDIR /workspace',
    '',
  ].join('\n');
}

const secs = (t0: bigint): number => Number(process.hrtime.bigint() - t0) / 1e9;
const round = (x: number): number => Math.round(x * 1000) / 1000;

/**
 * `dsec bench build`: one realistic Dockerfile (a Debian bookworm minbase
 * from a loopback registry, three RUN steps, a COPY of a source
 * repository) built, then `sandboxes` sandboxes started from the result at
 * once and each running one command; against `buildah bud` of the same
 * Dockerfile and as many `podman run`s. Both sides start cold: an empty
 * store (DSec: image store and buildah root; podman: containers-storage)
 * and dropped page cache.
 */
export async function benchBuild(options: BuildBenchOptions): Promise<BuildBenchReport> {
  const count = options.sandboxes ?? 16;
  const { signal } = options;
  const work = await mkdtemp(join(tmpdir(), 'dsec-bench-build-'));
  // Sandboxes of the node under it reach their root filesystem through it.
  await chmod(work, 0o711);
  const cleanups: (() => Promise<unknown>)[] = [() => rm(work, { recursive: true, force: true })];
  let done = 0;
  const step = (): void => options.onProgress?.(++done, 5);
  try {
    const layout = join(options.cacheDir, 'debian-bookworm-layout');
    if (!(await stat(join(layout, 'index.json')).catch(() => undefined))) {
      const root = join(work, 'debian');
      await makeDebianRootfs(root, { packages: [], ...(signal ? { signal } : {}) });
      await rm(layout, { recursive: true, force: true });
      await mkdir(options.cacheDir, { recursive: true });
      await makeOciLayoutFromDirs(
        layout,
        [root],
        { Env: ['PATH=/usr/sbin:/usr/bin:/sbin:/bin'] },
        'v1',
      );
      await rm(root, { recursive: true, force: true });
    }
    step();
    const registry = await startLocalRegistry({ dir: join(work, 'registry') });
    cleanups.unshift(() => registry.close());
    const base = `${registry.host}/bench/debian:bookworm`;
    await pushToRegistry(layout, 'v1', `docker://${base}`);

    const ctxDir = join(work, 'context');
    await mkdir(ctxDir);
    const repo = options.repoDir ?? new URL('../../../', import.meta.url).pathname;
    await cp(repo, join(ctxDir, 'repo'), {
      recursive: true,
      filter: (src) => !/\/(node_modules|dist|\.git)(\/|$)/.test(src),
    });
    const dockerfile = dockerfileFor(base);
    await writeFile(join(ctxDir, 'Dockerfile'), dockerfile);
    const { stdout: du } = await execFileAsync('du', ['-s', '-b', join(ctxDir, 'repo')]);
    const { stdout: nfiles } = await execFileAsync('sh', [
      '-c',
      `find "$1" -type f | wc -l`,
      'sh',
      join(ctxDir, 'repo'),
    ]);
    step();

    // DSec: the node is up (a service), its store and buildah's root empty.
    const stateDir = join(work, 'state');
    const node = await startSingleNode({ stateDir, port: 0, network: { mode: 'none' } });
    cleanups.unshift(() => node.close({ stopSandboxes: true }));
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    cleanups.unshift(async () => client.close());
    const net = await LinuxNetwork.open({ stateDir: join(work, 'build-net') });
    cleanups.unshift(() => net.close());
    await dropCaches();
    const t0 = process.hrtime.bigint();
    const phases: Record<string, number> = {};
    let phase = 'start';
    let phaseT = t0;
    const built = await buildDockerfile(new DirImageStore(join(stateDir, 'images')), {
      name: 'bench-build',
      contextDir: ctxDir,
      registries: registrySettings({}, { DSEC_INSECURE_REGISTRIES: registry.host }),
      mounter: hostErofsMounter(),
      network: egressBuildNetwork(net, { first: 0, count: 1 }),
      buildahRoot: join(work, 'buildah'),
      onProgress: (p) => {
        const name = p.phase === 'output' ? 'step' : p.phase;
        if (name === phase) return;
        phases[phase] = round((phases[phase] ?? 0) + secs(phaseT));
        phase = name;
        phaseT = process.hrtime.bigint();
      },
      ...(signal ? { signal } : {}),
    });
    phases[phase] = round((phases[phase] ?? 0) + secs(phaseT));
    const buildSeconds = secs(t0);
    // Each sandbox created, its command run, and removed: what `podman run --rm` does.
    const t1 = process.hrtime.bigint();
    const sandboxes: Sandbox[] = [];
    cleanups.unshift(async () => {
      for (const sb of sandboxes) await sb.stop().catch(() => undefined);
    });
    await Promise.all(
      Array.from({ length: count }, async () => {
        const sb = await client.runContainer({ image: 'bench-build' }, { timeoutMs: 300_000 });
        sandboxes.push(sb);
        const r = await sb.runShell('cat /workspace/files.txt >/dev/null');
        if (r.exitCode !== 0) throw new Error(`a sandbox command failed: ${r.stderr}`);
        await sb.stop();
      }),
    );
    const startSeconds = secs(t1);
    const dsec = {
      totalSeconds: round(buildSeconds + startSeconds),
      buildSeconds: round(buildSeconds),
      startSeconds: round(startSeconds),
      layers: built.layers.length,
      phaseSeconds: phases,
    };
    step();

    const podman = await podmanSide(work, ctxDir, registry.host, count);
    step();
    const r = (x: number, y: number) => (y > 0 ? Math.round((x / y) * 10000) / 10000 : 0);
    step();
    return {
      benchmark: 'build',
      dockerfile,
      context: { files: Number(nfiles.trim()), bytes: Number(du.split('\t')[0]) },
      sandboxes: count,
      results: { dsec, podman },
      ...('totalSeconds' in podman
        ? {
            ratios: {
              totalSeconds: r(dsec.totalSeconds, podman.totalSeconds),
              buildSeconds: r(dsec.buildSeconds, podman.buildSeconds),
              startSeconds: r(dsec.startSeconds, podman.startSeconds),
            },
          }
        : {}),
      method:
        'A docker-registry on 127.0.0.1 holds a Debian bookworm minbase (debootstrap, one layer). The Dockerfile has ' +
        'three RUN steps and a COPY of a source repository (this checkout without node_modules, dist, .git). dsec: ' +
        'buildDockerfile (what `dsec image build --dockerfile` runs: context staged and hashed, buildah bud with runc ' +
        'isolation in a private storage root, RUN steps on an egress-policed network namespace, the image pushed to ' +
        'an OCI layout and imported layer by layer into EROFS) into the empty store of a running single node, then ' +
        `${count} sandboxes created at once, each running one command and removed. podman: \`buildah bud --isolation oci ` +
        `--runtime runc --network host\` into an empty containers-storage, then ${count} \`podman run --rm --runtime ` +
        'runc --network none IMAGE cmd` at once from that storage. Page cache dropped before each build; node start-up ' +
        'is not timed (a service).',
      limitations:
        'One machine, registry on loopback. The RUN steps need no network, so neither side waits on a mirror; ' +
        "DSec's RUN steps still get their namespace, veth and firewall elements. A second, cached build costs DSec " +
        'only the context hash and is not part of these numbers.',
      machine: await describeMachine(),
    };
  } finally {
    for (const cleanup of cleanups) await cleanup().catch(() => undefined);
  }
}

async function podmanSide(
  work: string,
  ctxDir: string,
  host: string,
  count: number,
): Promise<Side | { available: false; reason: string }> {
  const version = await execFileAsync('podman', ['--version']).catch((err: unknown) => err);
  if (version instanceof Error) return { available: false, reason: 'podman is not installed' };
  const root = join(work, 'podman-root');
  const storage = [
    '--root',
    root,
    '--runroot',
    join(work, 'podman-run'),
    '--storage-driver',
    'overlay',
  ];
  const conf = join(work, 'peer-registries.conf');
  await writeFile(
    conf,
    `unqualified-search-registries = []\n[[registry]]\nlocation = "${host}"\ninsecure = true\n`,
  );
  const env = { ...process.env, CONTAINERS_REGISTRIES_CONF: conf };
  const run = (cmd: string, args: string[]) =>
    execFileAsync(cmd, args, { env, maxBuffer: 64 << 20 });
  try {
    await dropCaches();
    const t0 = process.hrtime.bigint();
    await run('buildah', [
      ...storage,
      'bud',
      '--isolation',
      'oci',
      '--runtime',
      'runc',
      '--network',
      'host',
      '-t',
      'localhost/bench-build',
      ctxDir,
    ]);
    const buildSeconds = secs(t0);
    const t1 = process.hrtime.bigint();
    await Promise.all(
      Array.from({ length: count }, () =>
        run('podman', [
          ...storage,
          '--events-backend',
          'none',
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
          'localhost/bench-build',
          'cat',
          '/workspace/files.txt',
        ]),
      ),
    );
    const startSeconds = secs(t1);
    return {
      totalSeconds: round(buildSeconds + startSeconds),
      buildSeconds: round(buildSeconds),
      startSeconds: round(startSeconds),
    };
  } catch (err) {
    return {
      available: false,
      reason: `the peer failed: ${(err as Error).message.slice(0, 2000)}`,
    };
  } finally {
    await run('podman', [...storage, 'system', 'reset', '--force']).catch(() => undefined);
    for (const d of await readdir(work).catch(() => [] as string[]))
      if (d.startsWith('podman-')) await rm(join(work, d), { recursive: true, force: true });
  }
}

export function registerBuildBench(bench: Command): void {
  bench
    .command('build')
    .description(
      'a Dockerfile (Debian base, three RUN, a COPY of a repository) built and 16 sandboxes started from it, vs buildah bud + podman run',
    )
    .option('--sandboxes <n>', 'sandboxes started from the image', '16')
    .option('--repo <dir>', 'the repository copied into the context (default: this checkout)')
    .action(async (opts: { sandboxes: string; repo?: string }, command: Command) => {
      const ctx = contextOf(command);
      const progress = createProgress({ label: 'bench build', total: 5, enabled: !ctx.json });
      const report = await benchBuild({
        sandboxes: Number(opts.sandboxes),
        ...(opts.repo !== undefined ? { repoDir: opts.repo } : {}),
        cacheDir: join(ctx.options.stateDir, 'cache', 'bench-build'),
        onProgress: (d) => progress.update(d),
        ...(ctx.signal ? { signal: ctx.signal } : {}),
      });
      progress.done();
      if (ctx.json) {
        ctx.out(JSON.stringify(report, null, 2));
        return;
      }
      const { dsec, podman } = report.results;
      ctx.out(
        `dsec    total ${dsec.totalSeconds} s (build ${dsec.buildSeconds} s, start ${dsec.startSeconds} s)`,
      );
      if ('totalSeconds' in podman)
        ctx.out(
          `podman  total ${podman.totalSeconds} s (build ${podman.buildSeconds} s, start ${podman.startSeconds} s)\nratios (dsec ÷ podman): ${JSON.stringify(report.ratios)}`,
        );
      else ctx.out(`podman  not measured: ${podman.reason}`);
    });
}
