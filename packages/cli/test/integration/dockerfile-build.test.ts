import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import {
  chmod,
  copyFile,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  rm,
  rmdir,
  stat,
  symlink,
  truncate,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { LinuxNetwork } from '@dsec/edge';
import {
  buildDockerfile,
  buildLayer,
  DirImageStore,
  egressBuildNetwork,
  makeBusyboxRootfs,
  registrySettings,
  type BuildNetwork,
  type DockerfileBuildOptions,
} from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
  type LocalRegistry,
} from '@dsec/images/testing/registry';
import { mountErofs, unmount } from '@dsec/native';
import { DSecClient } from '@dsec/sdk';
import {
  startFakeInternet,
  type FakeInternet,
} from '../../../edge/test/integration/fake-internet.js';
import { main } from '../../src/main.js';

// `buildDockerfile` and `dsec image build --dockerfile` against Debian's
// docker-registry on loopback (a busybox base pushed here, reached through
// DSEC_INSECURE_REGISTRIES) with RUN steps on the edge's egress machinery
// behind the tests' fake internet (never an outside address). One shared
// fixture; the base is tiny, so the file stays well under a minute.
// Needs root, buildah, runc, skopeo and docker-registry.

void describe('Dockerfile builds', { timeout: 10 * 60_000 }, () => {
  let dir: string;
  let stateDir: string;
  let registry: LocalRegistry;
  let fake: FakeInternet;
  let net: LinuxNetwork;
  let network: BuildNetwork;
  let store: DirImageStore;
  let node: SingleNode | undefined;
  let baseRef: string;
  const cgroupParent = (): string => `dsec-test-${basename(dir)}`;

  const options = (
    contextDir: string,
    extra: Partial<DockerfileBuildOptions> = {},
  ): DockerfileBuildOptions => ({
    name: 'df',
    contextDir,
    registries: registrySettings({}, { DSEC_INSECURE_REGISTRIES: registry.host }),
    mounter: { mountErofs, unmount },
    network,
    buildahRoot: join(stateDir, 'buildah'),
    ...extra,
  });

  const context = async (
    name: string,
    dockerfile: string,
    files: Record<string, string> = {},
  ): Promise<string> => {
    const ctx = join(dir, 'contexts', name);
    await mkdir(ctx, { recursive: true });
    await writeFile(join(ctx, 'Dockerfile'), dockerfile);
    for (const [p, content] of Object.entries(files)) {
      await mkdir(join(ctx, p, '..'), { recursive: true });
      await writeFile(join(ctx, p), content);
    }
    return ctx;
  };

  /** The layer's tree, unpacked by erofs-utils (no mount). */
  const unpack = async (digest: string, name: string): Promise<string> => {
    const out = join(dir, 'unpacked', name);
    await mkdir(join(out, '..'), { recursive: true });
    const r = spawnSync('fsck.erofs', [`--extract=${out}`, await store.blobPath(digest)], {
      encoding: 'utf8',
    });
    assert.equal(r.status, 0, r.stderr);
    return out;
  };

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-dockerfile-'));
    await chmod(dir, 0o711);
    stateDir = join(dir, 'state');
    store = new DirImageStore(join(stateDir, 'images'));
    registry = await startLocalRegistry({ dir: join(dir, 'registry') });
    const root = join(dir, 'busybox');
    await makeBusyboxRootfs(root);
    // setfattr/getfattr (with the libraries they load) so a RUN step can give
    // a file a capability; a file and a directory for RUN steps to delete.
    for (const tool of ['/usr/bin/setfattr', '/usr/bin/getfattr']) {
      const ldd = spawnSync('ldd', [tool], { encoding: 'utf8' }).stdout;
      for (const file of [tool, ...[...ldd.matchAll(/(\/\S+) \(0x/g)].map((m) => m[1]!)]) {
        await mkdir(join(root, file, '..'), { recursive: true });
        await copyFile(file, join(root, file));
        await chmod(join(root, file), 0o755);
      }
    }
    await mkdir(join(root, 'opt/olddir'), { recursive: true });
    await writeFile(join(root, 'opt/olddir/a'), 'a\n');
    await writeFile(join(root, 'etc/gone.txt'), 'gone\n');
    await makeOciLayoutFromDirs(join(dir, 'layout'), [root], { Env: ['PATH=/bin:/usr/bin'] }, 'v1');
    baseRef = `${registry.host}/base/busybox:v1`;
    await pushToRegistry(join(dir, 'layout'), 'v1', `docker://${baseRef}`);
    fake = await startFakeInternet();
    net = await LinuxNetwork.open({
      stateDir: join(dir, 'net'),
      upstream: [fake.dns],
      uplinks: [fake.uplink],
      publicRanges: fake.publicRanges,
    });
    fake.guard({
      subnet4: `${net.subnet4.address}/${net.subnet4.prefix}`,
      subnet6: net.subnet6 && `${net.subnet6.address}/${net.subnet6.prefix}`,
    });
    network = egressBuildNetwork(net, { first: 0, count: 4 });
  });

  after(async () => {
    await node?.close({ stopSandboxes: true }).catch(() => undefined);
    const table = net?.table;
    await net?.close();
    await fake?.close();
    await registry?.close();
    // No mount of the builds is left (buildah's storage home, working containers).
    const mounts = (await readFile('/proc/mounts', 'utf8'))
      .split('\n')
      .filter((l) => dir && l.includes(dir));
    if (dir) {
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent()}`).catch(() => undefined);
    }
    if (table) assert.notEqual(spawnSync('nft', ['list', 'table', 'inet', table]).status, 0);
    assert.deepEqual(mounts, []);
  });

  void test('FROM an insecure registry, ARG, RUN under the egress policy, COPY, --target; cached; base shared by diff ID; a sandbox sees it', async () => {
    const ctx = await context(
      'main',
      [
        `FROM ${baseRef} AS tools`,
        'ARG GREETING=hello',
        'RUN echo "$GREETING" > /greeting \\',
        '  && mkdir -p /opt/app',
        'COPY app/ /opt/app/',
        // The policy: allowed.test (--network-allow) answers; denied.test does not resolve.
        'RUN (wget -q -O- http://allowed.test/ > /allowed.txt; echo "allowed=$?") > /net.txt; \\',
        '  (wget -q -O- http://denied.test/ >/dev/null 2>&1; echo "denied=$?") >> /net.txt',
        // Sandbox-made: a device node, a set-id file.
        'RUN mknod /dev/evil c 1 1 && touch /suid && chmod 6755 /suid',
        // A whiteout, an opaque directory, a file capability (cap_net_raw+ep).
        'RUN rm /etc/gone.txt && rm -rf /opt/olddir && mkdir /opt/olddir && echo new > /opt/olddir/b \\',
        '  && echo c > /capfile && setfattr -n user.kept -v yes /capfile \\',
        '  && setfattr -n security.capability -v 0sAQAAAgAgAAAAAAAAAAAAAAAAAAA= /capfile \\',
        '  && getfattr -n security.capability /capfile',
        '',
        'FROM tools AS final',
        'RUN echo final > /final',
      ].join('\n'),
      { 'app/main.sh': 'echo app\n', 'app/lib/x.txt': 'x\n' },
    );
    const steps: string[] = [];
    const first = await buildDockerfile(
      store,
      options(ctx, {
        name: 'df-main',
        buildArgs: { GREETING: 'hi there' },
        target: 'tools',
        networkAllow: ['allowed.test'],
        onProgress: (p) => {
          if (p.phase === 'step' && p.message) steps.push(p.message);
        },
      }),
    );
    assert.equal(first.cached, false);
    assert.deepEqual(steps, first.steps);
    assert.equal(first.steps.length, 7); // the tools stage only
    assert.match(first.steps[2]!, /^STEP 3\/7: RUN echo "\$GREETING"/);
    assert.equal(first.layers.length, 2);
    assert.match(first.layers[0]!.ref, /^oci-diff:/);
    assert.equal(first.layers[1]!.ref, ''); // made by the build: never recorded by diff ID
    const tree = await unpack(first.layer.digest, 'main');
    assert.equal(await readFile(join(tree, 'greeting'), 'utf8'), 'hi there\n');
    assert.equal(await readFile(join(tree, 'opt/app/lib/x.txt'), 'utf8'), 'x\n');
    assert.equal(await readFile(join(tree, 'net.txt'), 'utf8'), 'allowed=0\ndenied=1\n');
    assert.match(await readFile(join(tree, 'allowed.txt'), 'utf8'), /^hello from /);
    await assert.rejects(stat(join(tree, 'final')));
    await assert.rejects(stat(join(tree, 'dev/evil')));
    assert.equal((await stat(join(tree, 'suid'))).mode & 0o7777, 0o755);
    await assert.rejects(stat(join(tree, 'etc/gone.txt')));
    assert.deepEqual(await readdir(join(tree, 'opt/olddir')), ['b']);
    assert.equal(await readFile(join(tree, 'capfile'), 'utf8'), 'c\n');
    // Only the allowed name reached the fake internet's web servers.
    const hits = (await fake.log()).filter((e) => e.kind === 'http');
    assert.ok(
      hits.length > 0 && hits.every((e) => [fake.allowedIp, fake.allowedIp6].includes(e.server)),
      JSON.stringify(hits),
    );

    // The same inputs again, through the CLI: nothing is built.
    const run = { stdout: '', stderr: '' };
    const code = await main(
      [
        '--json',
        'image',
        'build',
        'df-main',
        '--dockerfile',
        ctx,
        '--build-arg',
        'GREETING=hi there',
        '--target',
        'tools',
        '--network-allow',
        'allowed.test',
      ],
      {
        stdout: { write: (s: string) => (run.stdout += s) },
        stderr: { write: (s: string) => (run.stderr += s) },
        env: { DSEC_STATE_DIR: stateDir, DSEC_INSECURE_REGISTRIES: registry.host },
      },
    );
    assert.equal(code, 0, run.stderr);
    const cached = JSON.parse(run.stdout) as {
      cached: boolean;
      layer: { digest: string };
      steps: string[];
    };
    assert.equal(cached.cached, true);
    assert.equal(cached.layer.digest, first.layer.digest);
    assert.deepEqual(cached.steps, []);

    // Another Dockerfile on the same base: the base's conversion is reused.
    const otherPhases = new Set<string>();
    const other = await buildDockerfile(
      store,
      // The base in buildah's storage is as pulled: building df-main (whose
      // merge hard-links the base's files) changed none of them.
      options(
        await context(
          'other',
          `FROM ${baseRef}\nRUN test "$(cat /etc/gone.txt /opt/olddir/a)" = "$(printf 'gone\\na')" && echo other > /other\n`,
        ),
        // The other way in: pushed to an OCI layout and unpacked.
        {
          name: 'df-other',
          fromStorage: false,
          onProgress: (p) => otherPhases.add(p.phase),
        },
      ),
    );
    assert.equal(other.layers[0]!.diffId, first.layers[0]!.diffId);
    assert.equal(other.layers[0]!.reused, true);
    assert.ok(otherPhases.has('read'), [...otherPhases].join()); // the OCI layout was read
    const otherTree = await unpack(other.layer.digest, 'other');
    assert.equal(await readFile(join(otherTree, 'other'), 'utf8'), 'other\n');
    assert.equal(await readFile(join(otherTree, 'etc/gone.txt'), 'utf8'), 'gone\n');
    // Finished builds leave no working container in buildah's storage.
    const storageRoot = join(stateDir, 'buildah', 'root');
    const listed = spawnSync(
      'buildah',
      [
        '--root',
        storageRoot,
        '--runroot',
        join(stateDir, 'buildah', 'run'),
        '--storage-driver',
        'overlay',
        'containers',
        '--json',
      ],
      { encoding: 'utf8' },
    );
    spawnSync('umount', [join(storageRoot, 'overlay')]);
    assert.equal(listed.status, 0, listed.stderr);
    assert.deepEqual((JSON.parse(listed.stdout || 'null') as unknown[] | null) ?? [], []); // buildah prints null for none

    // A sandbox starts from the result and sees the files.
    node = await startSingleNode({
      stateDir,
      port: 0,
      network: { mode: 'none' },
      cgroupParent: cgroupParent(),
    });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    const sb = await client.runContainer(
      { image: 'df-main', memoryLimitMb: 256, cpuCoresLimit: 1 },
      { timeoutMs: 120_000 },
    );
    try {
      const r = await sb.runShell(
        'cat /greeting /opt/app/main.sh; [ -e /final ] || echo no-final; ' +
          'getfattr --only-values -n user.kept /capfile; echo; ' +
          'getfattr -n security.capability /capfile >/dev/null 2>&1 && echo cap || echo no-cap',
      );
      assert.equal(r.exitCode, 0, r.stderr);
      assert.equal(r.stdout, 'hi there\necho app\nno-final\nyes\nno-cap\n');
    } finally {
      await sb.stop();
      client.close();
    }
  });

  void test('a failing RUN names its instruction, its line and the tail of its output', async () => {
    const ctx = await context(
      'fail',
      `# a comment\nFROM ${baseRef}\n\nRUN echo ok\nRUN echo "the step says why" \\\n  && exit 7\n`,
    );
    await assert.rejects(
      buildDockerfile(store, options(ctx, { name: 'df-fail' })),
      (err: unknown) => {
        assert.ok(isDsecError(err, 'invalid_argument'), String(err));
        assert.equal(err.details?.['reason'], 'build_step_failed');
        assert.equal(err.details?.['line'], 5);
        assert.match(String(err.details?.['instruction']), /^RUN echo "the step says why"/);
        assert.match(String(err.details?.['outputTail']), /the step says why/);
        assert.match(err.message, /Dockerfile line 5: RUN echo/);
        return true;
      },
    );
    await assert.rejects(store.getLayer('df-fail:latest'), (e: unknown) =>
      isDsecError(e, 'image_not_found'),
    );
  });

  void test('a hostile context: links out of it stay links, special files and huge sparse files are refused, bounds hold', async () => {
    const secret = join(dir, 'host-secret');
    await writeFile(secret, 'host secret\n');
    const ctx = await context(
      'hostile',
      `FROM ${baseRef}\nCOPY . /ctx/\nRUN cat /ctx/abs /ctx/rel > /read.txt 2>&1 || true\n`,
    );
    await symlink(secret, join(ctx, 'abs'));
    await symlink('../../host-secret', join(ctx, 'rel'));
    const built = await buildDockerfile(store, options(ctx, { name: 'df-hostile' }));
    const tree = await unpack(built.layer.digest, 'hostile');
    const { readlink } = await import('node:fs/promises');
    assert.equal(await readlink(join(tree, 'ctx/abs')), secret);
    assert.equal(await readlink(join(tree, 'ctx/rel')), '../../host-secret');
    assert.doesNotMatch(await readFile(join(tree, 'read.txt'), 'utf8'), /host secret/);

    const fifo = await context('fifo', `FROM ${baseRef}\n`);
    spawnSync('mkfifo', [join(fifo, 'pipe')]);
    await assert.rejects(
      buildDockerfile(store, options(fifo, { name: 'df-fifo' })),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'special_file',
    );
    const sparse = await context('sparse', `FROM ${baseRef}\n`);
    await writeFile(join(sparse, 'huge'), '');
    await truncate(join(sparse, 'huge'), 2 ** 40); // 1 TiB, no block written
    await assert.rejects(
      buildDockerfile(store, options(sparse, { name: 'df-sparse', maxContextBytes: 2 ** 30 })),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'context_too_large',
    );
    const many = await context('many', `FROM ${baseRef}\n${'RUN true\n'.repeat(20)}`);
    await assert.rejects(
      buildDockerfile(store, options(many, { name: 'df-many', maxInstructions: 10 })),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'too_many_instructions',
    );
    const remote = await context('remote', `FROM ${baseRef}\nADD http://allowed.test/x /x\n`);
    await assert.rejects(
      buildDockerfile(store, options(remote, { name: 'df-remote' })),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') &&
        e.details?.['reason'] === 'remote_add' &&
        e.details['line'] === 2,
    );
    // RUN steps writing without end are stopped at the build's disk bound.
    const disk = await context(
      'disk',
      `FROM ${baseRef}\nRUN i=0; while [ $i -lt 64 ]; do dd if=/dev/zero of=/big$i bs=1M count=8 2>/dev/null; i=$((i+1)); done\n`,
    );
    await assert.rejects(
      buildDockerfile(store, options(disk, { name: 'df-disk', maxBuildBytes: 32 * 2 ** 20 })),
      (e: unknown) =>
        isDsecError(e, 'resource_exhausted') &&
        e.details?.['reason'] === 'build_disk' &&
        e.details['line'] === 2,
    );
    const mount = await context(
      'mount',
      `FROM ${baseRef}\nRUN --mount=type=bind,source=/,target=/host cat /host/etc/shadow\n`,
    );
    await assert.rejects(
      buildDockerfile(store, options(mount, { name: 'df-mount' })),
      (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'run_flag',
    );
  });

  void test("a hostile registry's base with ONBUILD ADD of a URL is refused before buildah fetches it on the host", async () => {
    // A loopback server of the test's stands for a host outside the egress policy.
    const { createServer } = await import('node:http');
    let hits = 0;
    const server = createServer((_req, res) => {
      hits++;
      res.end('internal\n');
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const port = (server.address() as { port: number }).port;
    const s = ['--root', join(dir, 'evil', 'root'), '--runroot', join(dir, 'evil', 'run')];
    const evilRef = `${registry.host}/base/onbuild:v1`;
    const buildah = (...args: string[]): string => {
      const r = spawnSync('buildah', [...s, '--storage-driver', 'vfs', ...args], {
        encoding: 'utf8',
      });
      assert.equal(r.status, 0, r.stderr);
      return r.stdout.trim();
    };
    try {
      const c = buildah('from', '--quiet', '--tls-verify=false', `docker://${baseRef}`);
      buildah('config', '--onbuild', `ADD http://127.0.0.1:${port}/onbuild /got`, c);
      buildah('commit', '--quiet', '--format', 'docker', c, 'localhost/evil');
      buildah('push', '--quiet', '--tls-verify=false', 'localhost/evil', `docker://${evilRef}`);
      buildah('rm', '--all');
      buildah('rmi', '--all', '--force');
      // Named directly and through a global ARG with a --build-arg.
      for (const [name, text, buildArgs] of [
        ['onbuild', `FROM ${evilRef}\nRUN true\n`, {}],
        ['onbuild-arg', 'ARG BASE=scratch\nFROM ${BASE}\nRUN true\n', { BASE: evilRef }],
      ] as const) {
        const ctx = await context(name, text);
        await assert.rejects(
          buildDockerfile(store, options(ctx, { name: `df-${name}`, buildArgs })),
          (e: unknown) => {
            assert.ok(isDsecError(e, 'invalid_argument'), String(e));
            assert.equal(e.details?.['reason'], 'onbuild_base');
            return true;
          },
        );
      }
      const unresolved = await context('from-var', 'FROM ${NOWHERE}\nRUN true\n');
      await assert.rejects(
        buildDockerfile(store, options(unresolved, { name: 'df-from-var' })),
        (e: unknown) =>
          isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'from_variable',
      );
      assert.equal(hits, 0, 'buildah fetched the trigger URL on the host');
    } finally {
      await new Promise((r) => server.close(r));
    }
  });

  void test('a base (or COPY --from image) is resolved at its registry on every build: the copy in the shared storage is not reused', async () => {
    // A copy another build pulled (perhaps with another tenant's credentials) must not serve a
    // build that cannot reach the image itself: here the registry is gone.
    const other = await startLocalRegistry({ dir: join(dir, 'registry-gone') });
    const ref = `${other.host}/base/busybox:v1`;
    let open = true;
    try {
      await pushToRegistry(join(dir, 'layout'), 'v1', `docker://${ref}`);
      const regs = registrySettings(
        {},
        { DSEC_INSECURE_REGISTRIES: `${registry.host},${other.host}` },
      );
      const ctx = await context('gone', `FROM ${ref}\nRUN echo built > /built\n`);
      const copy = await context(
        'gone-copy',
        `FROM ${baseRef}\nCOPY --from=${ref} /bin/busybox /bb\n`,
      );
      await buildDockerfile(store, options(ctx, { name: 'df-gone', registries: regs }));
      await buildDockerfile(store, options(copy, { name: 'df-gone-copy', registries: regs }));
      await other.close();
      open = false;
      for (const [c, name] of [
        [ctx, 'df-gone'],
        [copy, 'df-gone-copy'],
      ] as const) {
        await assert.rejects(
          buildDockerfile(store, options(c, { name, registries: regs, noCache: true })),
          (e: unknown) =>
            isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'from_pull',
        );
      }
    } finally {
      if (open) await other.close();
    }
  });

  void test('FROM a store base: built on the layer, never pulled; a project layer stays sandbox-made; a replaced record and DSec names are refused', async () => {
    const root = join(dir, 'store-base');
    await makeBusyboxRootfs(root);
    await writeFile(join(root, 'etc/marker'), 'from the store\n');
    const platform = await buildLayer(store, {
      name: 'sb-base',
      version: '1',
      kind: 'base',
      from: { dir: root },
      config: { env: ['PATH=/bin:/usr/bin', 'FROM_STORE=yes'] },
    });
    const own = await buildLayer(store, {
      name: 'sb-own',
      version: '1',
      kind: 'base',
      from: { dir: root },
      project: 'proj-sb',
    });
    // No registry knows e2bdev/base (and the Dockerfile names it): only the store can serve it.
    const ctx = await context(
      'store-base',
      'FROM e2bdev/base\nRUN cat /etc/marker > /built && echo "$FROM_STORE" >> /built\n',
    );
    const built = await buildDockerfile(
      store,
      options(ctx, {
        name: 'sb-built',
        storeBases: { 'e2bdev/base': { ref: 'sb-base:1', digest: platform.digest } },
      }),
    );
    const tree = await unpack(built.layer.digest, 'sb-built');
    assert.equal(await readFile(join(tree, 'built'), 'utf8'), 'from the store\nyes\n');
    // The platform's base is imported as a pulled base is (recorded by diff ID, its set-id
    // bits kept); the build's own step is not.
    assert.match(built.layers[0]!.ref, /^oci-diff:/);
    assert.equal(built.layers.at(-1)!.ref, '');
    // A project's layer is that project's own making: no set-id bit survives.
    const mine = await buildDockerfile(
      store,
      options(ctx, {
        name: 'sb-mine',
        project: 'proj-sb',
        storeBases: {
          'e2bdev/base': { ref: 'sb-own:1', project: 'proj-sb', digest: own.digest },
        },
      }),
    );
    const mineTree = await unpack(mine.layer.digest, 'sb-mine');
    assert.equal(await readFile(join(mineTree, 'built'), 'utf8'), 'from the store\n\n');
    assert.deepEqual(
      mine.layers.map((l) => l.ref),
      mine.layers.map(() => ''),
    );
    // The base's digest is in the cache key: the same build on another base runs again.
    assert.notEqual(mine.inputDigest, built.inputDigest);
    // A record replaced since it was resolved is not built on.
    await assert.rejects(
      buildDockerfile(
        store,
        options(ctx, {
          name: 'sb-stale',
          noCache: true,
          storeBases: { 'e2bdev/base': { ref: 'sb-base:1', digest: `sha256:${'0'.repeat(64)}` } },
        }),
      ),
      (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'store_base',
    );
    // The local copies are gone, and no Dockerfile can name one of DSec's own images.
    const images = spawnSync(
      'buildah',
      [
        '--root',
        join(stateDir, 'buildah', 'root'),
        '--runroot',
        join(stateDir, 'buildah', 'run'),
        'images',
        '--json',
      ],
      { encoding: 'utf8' },
    ).stdout;
    assert.ok(!images.includes('dsec-store-base-'), images);
    const named = await context(
      'store-base-named',
      'FROM localhost/dsec-store-base-0123456789abcdef-0\n',
    );
    await assert.rejects(
      buildDockerfile(store, options(named, { name: 'sb-named' })),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'reserved_image_name',
    );
  });
});
