import assert from 'node:assert/strict';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
  type LocalRegistry,
} from '@dsec/images/testing/registry';
import { DSecClient } from '@dsec/sdk';
import { main } from '../../src/main.js';

// `dsec image import --from-registry` against Debian's docker-registry on
// loopback: a multi-layer image with whiteouts, built and pushed here, is
// imported through the CLI, run in a sandbox; a second image sharing two of
// its layers reuses their conversions. Needs root, skopeo and docker-registry.

const AUTH = { username: 'tester', password: 'pa55-word' };

async function files(dir: string, entries: Record<string, string | null>): Promise<string> {
  for (const [path, content] of Object.entries(entries)) {
    const abs = join(dir, path);
    if (content === null) await mkdir(abs, { recursive: true });
    else {
      await mkdir(join(abs, '..'), { recursive: true });
      await writeFile(abs, content);
    }
  }
  return dir;
}

void describe('image import --from-registry', { timeout: 10 * 60_000 }, () => {
  let dir: string;
  let stateDir: string;
  let registry: LocalRegistry;
  let authRegistry: LocalRegistry;
  let node: SingleNode | undefined;
  const layerDirs: Record<string, string> = {};
  const cgroupParent = (): string => `dsec-test-${basename(dir)}`;

  const dsec = async (
    args: string[],
    env: Record<string, string | undefined> = {},
  ): Promise<{ code: number; stdout: string; stderr: string }> => {
    const run = { code: -1, stdout: '', stderr: '' };
    run.code = await main(args, {
      stdout: { write: (s: string) => (run.stdout += s) },
      stderr: { write: (s: string) => (run.stderr += s) },
      env: { DSEC_STATE_DIR: stateDir, ...env },
    });
    return run;
  };

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-registry-'));
    await chmod(dir, 0o711);
    stateDir = join(dir, 'state');
    registry = await startLocalRegistry({ dir: join(dir, 'registry') });
    authRegistry = await startLocalRegistry({ dir: join(dir, 'registry-auth'), auth: AUTH });

    // Bottom: busybox plus content the upper layers delete or hide.
    const l0 = join(dir, 'l0');
    await makeBusyboxRootfs(l0);
    await files(l0, {
      'data/a': 'a0\n',
      'data/b': 'b0\n',
      'opt/dir/x': 'x0\n',
      'opt/dir/sub/y': 'y0\n',
      'gone/inner': 'inner0\n',
    });
    layerDirs['l0'] = l0;
    // OCI whiteouts as they travel in a layer tar: empty files with .wh. names.
    layerDirs['l1'] = await files(join(dir, 'l1'), {
      'data/.wh.a': '',
      'opt/dir/.wh..wh..opq': '',
      'opt/dir/z': 'z1\n',
      '.wh.gone': '',
      'etc/motd': 'layer one\n',
    });
    layerDirs['l2'] = await files(join(dir, 'l2'), { 'data/c': 'c2\n' });
    layerDirs['l3'] = await files(join(dir, 'l3'), {
      'only-b': 'b3\n',
      'data/.wh.b': '',
    });
    const config = { Env: ['PATH=/bin:/usr/bin'], Cmd: ['/bin/sh'] };
    await makeOciLayoutFromDirs(
      join(dir, 'layout-a'),
      [layerDirs['l0'], layerDirs['l1'], layerDirs['l2']],
      config,
      'v1',
    );
    await makeOciLayoutFromDirs(
      join(dir, 'layout-b'),
      [layerDirs['l0'], layerDirs['l1'], layerDirs['l3']],
      config,
      'v1',
    );
    await makeOciLayoutFromDirs(join(dir, 'layout-odd'), [layerDirs['l2']], {}, 'v1', {
      layerMediaType: 'application/vnd.example.data.v1.tar+gzip',
    });
    await pushToRegistry(join(dir, 'layout-a'), 'v1', `docker://${registry.host}/test/a:v1`);
    await pushToRegistry(join(dir, 'layout-b'), 'v1', `docker://${registry.host}/test/b:v1`);
    await pushToRegistry(join(dir, 'layout-odd'), 'v1', `docker://${registry.host}/test/odd:v1`);
    await pushToRegistry(
      join(dir, 'layout-a'),
      'v1',
      `docker://${authRegistry.host}/private/a:v1`,
      AUTH,
    );
  });

  after(async () => {
    await node?.close({ stopSandboxes: true }).catch(() => undefined);
    await registry?.close();
    await authRegistry?.close();
    if (dir) {
      await rm(dir, { recursive: true, force: true });
      // The node's cgroup parent, in every hierarchy (empty once its sandboxes stopped).
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent()}`).catch(() => undefined);
    }
  });

  void test('imports a multi-layer image; whiteouts and an opaque dir take effect in a sandbox; shared layers are reused', async () => {
    const a = await dsec([
      'image',
      'import',
      'reg-a:v1',
      '--from-registry',
      `docker://${registry.host}/test/a:v1`,
      '--insecure',
      '--json',
    ]);
    assert.equal(a.code, 0, a.stderr);
    const ra = JSON.parse(a.stdout) as {
      name: string;
      source: string;
      parents: string[];
      layers: { diffId: string; reused: boolean }[];
      config: { cmd?: string[] };
    };
    assert.equal(ra.source, 'registry');
    assert.deepEqual(
      ra.layers.map((l) => l.reused),
      [false, false, false],
    );
    assert.equal(ra.parents.length, 3);
    assert.deepEqual(ra.config.cmd, ['/bin/sh']);

    const b = await dsec([
      'image',
      'import',
      'reg-b:v1',
      '--from-registry',
      `docker://${registry.host}/test/b:v1`,
      '--insecure',
      '--json',
    ]);
    assert.equal(b.code, 0, b.stderr);
    const rb = JSON.parse(b.stdout) as typeof ra;
    assert.deepEqual(
      rb.layers.map((l) => l.reused),
      [true, true, false],
    );
    assert.deepEqual(rb.parents.slice(0, 2), ra.parents.slice(0, 2));

    // The per-layer records are plumbing: listed with --all only (4 distinct diff IDs).
    const names = async (args: string[]) =>
      (
        JSON.parse(
          (await dsec(['image', 'ls', '--json', ...args], { DSEC_URL: 'http://127.0.0.1:1' }))
            .stdout,
        ) as { name: string }[]
      )
        .map((l) => l.name)
        .sort();
    assert.deepEqual(await names([]), ['reg-a', 'reg-b']);
    assert.deepEqual(await names(['--all']), [
      'oci-diff',
      'oci-diff',
      'oci-diff',
      'oci-diff',
      'reg-a',
      'reg-b',
    ]);

    // --compress: lz4 by default; none stores the same tree larger, lz4hc is still there.
    const sizes: Record<string, number> = {};
    for (const how of ['none', 'lz4hc']) {
      const r = await dsec([
        'image',
        'import',
        `reg-a:${how}`,
        '--from-registry',
        `docker://${registry.host}/test/a:v1`,
        '--insecure',
        '--compress',
        how,
        '--json',
      ]);
      assert.equal(r.code, 0, r.stderr);
      const info = JSON.parse(r.stdout) as typeof ra & {
        sizeBytes: number;
        digest: string;
        pulledBytes: number;
      };
      assert.ok(info.layers.every((l) => l.reused));
      // Every layer is already converted: only the manifest and config were read.
      assert.equal(info.pulledBytes, 0);
      sizes[how] = info.sizeBytes;
    }
    const dflt = JSON.parse((await dsec(['image', 'inspect', 'reg-a:v1', '--json'])).stdout) as {
      sizeBytes: number;
    };
    assert.ok(dflt.sizeBytes < sizes['none']!, JSON.stringify({ lz4: dflt.sizeBytes, ...sizes }));
    assert.ok(sizes['lz4hc']! <= dflt.sizeBytes, JSON.stringify({ lz4: dflt.sizeBytes, ...sizes }));
    const bad = await dsec([
      'image',
      'import',
      'x',
      '--from-registry',
      `docker://${registry.host}/test/a:v1`,
      '--compress',
      'zstd',
    ]);
    assert.match(bad.stderr, /compress: want one of lz4, lz4hc, none.*\[invalid_argument\]/);

    node = await startSingleNode({
      stateDir,
      port: 0,
      network: { mode: 'none' },
      cgroupParent: cgroupParent(),
    });
    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    try {
      const check = async (image: string): Promise<string> => {
        const sb = await client.runContainer(
          { image, memoryLimitMb: 256, cpuCoresLimit: 1 },
          { timeoutMs: 120_000 },
        );
        try {
          const run = await sb.runShell(
            'for p in /data/a /data/b /data/c /opt/dir/x /opt/dir/sub /opt/dir/z /gone /etc/motd /only-b; do ' +
              'if [ -e "$p" ]; then echo "$p=yes"; else echo "$p=no"; fi; done; ls -A /opt/dir | tr "\\n" " "',
          );
          assert.equal(run.exitCode, 0, run.stderr);
          return run.stdout.trim();
        } finally {
          await sb.stop();
        }
      };
      assert.equal(
        await check('reg-a:v1'),
        [
          '/data/a=no',
          '/data/b=yes',
          '/data/c=yes',
          '/opt/dir/x=no',
          '/opt/dir/sub=no',
          '/opt/dir/z=yes',
          '/gone=no',
          '/etc/motd=yes',
          '/only-b=no',
          'z',
        ].join('\n'),
      );
      // B's lower layers came out of the stored per-layer images (reused), not a fresh extract.
      assert.equal(
        await check('reg-b:v1'),
        [
          '/data/a=no',
          '/data/b=no',
          '/data/c=no',
          '/opt/dir/x=no',
          '/opt/dir/sub=no',
          '/opt/dir/z=yes',
          '/gone=no',
          '/etc/motd=yes',
          '/only-b=yes',
          'z',
        ].join('\n'),
      );
    } finally {
      client.close();
    }
  });

  void test('credentials: refused without them, accepted from the environment or an auth file', async () => {
    const src = `docker://${authRegistry.host}/private/a:v1`;
    const denied = await dsec(['image', 'import', 'priv', '--from-registry', src, '--insecure']);
    assert.equal(denied.code, 1);
    assert.match(denied.stderr, /\[permission_denied\]/);
    assert.match(denied.stderr, /DSEC_REGISTRY_USERNAME/);

    const wrong = await dsec(['image', 'import', 'priv', '--from-registry', src, '--insecure'], {
      DSEC_REGISTRY_USERNAME: AUTH.username,
      DSEC_REGISTRY_PASSWORD: 'not-it',
    });
    assert.match(wrong.stderr, /\[permission_denied\]/);

    const ok = await dsec(
      ['image', 'import', 'priv:env', '--from-registry', src, '--insecure', '--json'],
      { DSEC_REGISTRY_USERNAME: AUTH.username, DSEC_REGISTRY_PASSWORD: AUTH.password },
    );
    assert.equal(ok.code, 0, ok.stderr);
    // Same layers as reg-a: every one reused, nothing pulled (the credentials reached the config).
    const okInfo = JSON.parse(ok.stdout) as { layers: { reused: boolean }[]; pulledBytes: number };
    assert.ok(okInfo.layers.every((l) => l.reused));
    assert.equal(okInfo.pulledBytes, 0);

    const authFile = join(dir, 'auth.json');
    const token = Buffer.from(`${AUTH.username}:${AUTH.password}`).toString('base64');
    await writeFile(authFile, JSON.stringify({ auths: { [authRegistry.host]: { auth: token } } }));
    const viaFile = await dsec(
      [
        'image',
        'import',
        'priv:file',
        '--from-registry',
        src,
        '--insecure',
        '--authfile',
        authFile,
      ],
      {},
    );
    assert.equal(viaFile.code, 0, viaFile.stderr);
    const viaEnvFile = await dsec(
      ['image', 'import', 'priv:envfile', '--from-registry', src, '--insecure'],
      { REGISTRY_AUTH_FILE: authFile },
    );
    assert.equal(viaEnvFile.code, 0, viaEnvFile.stderr);
  });

  void test('stable error codes: unknown tag, unreachable registry, unsupported media type, bad reference', async () => {
    const unknown = await dsec([
      'image',
      'import',
      'x',
      '--from-registry',
      `docker://${registry.host}/test/a:nope`,
      '--insecure',
    ]);
    assert.match(unknown.stderr, /\[image_not_found\]/);

    // A port nothing listens on: the registry is started and stopped for it.
    const gone = await startLocalRegistry({ dir: join(dir, 'registry-gone') });
    await gone.close();
    const unreachable = await dsec([
      'image',
      'import',
      'x',
      '--from-registry',
      `docker://${gone.host}/test/a:v1`,
      '--insecure',
    ]);
    assert.match(unreachable.stderr, /\[unavailable\]/);
    assert.match(unreachable.stderr, /--insecure/);

    // Without --insecure the client wants TLS, which a plain-HTTP registry cannot give.
    const tls = await dsec([
      'image',
      'import',
      'x',
      '--from-registry',
      `docker://${registry.host}/test/a:v1`,
    ]);
    assert.match(tls.stderr, /\[unavailable\]/);

    const odd = await dsec([
      'image',
      'import',
      'x',
      '--from-registry',
      `docker://${registry.host}/test/odd:v1`,
      '--insecure',
    ]);
    assert.match(odd.stderr, /\[invalid_argument\]/);
    assert.match(odd.stderr, /unsupported layer media type application\/vnd\.example/);

    const bad = await dsec(['image', 'import', 'x', '--from-registry', 'busybox:latest']);
    assert.match(bad.stderr, /\[invalid_argument\]/);
  });
  void test('registries set once: insecure hosts and mirrors from the environment or the config file, no --insecure', async () => {
    // The origin is a port nothing listens on; its mirror has the image.
    const gone = await startLocalRegistry({ dir: join(dir, 'registry-origin') });
    await gone.close();
    const viaEnv = await dsec(
      [
        'image',
        'import',
        'mirrored:v1',
        '--from-registry',
        `docker://${gone.host}/test/a:v1`,
        '--json',
      ],
      {
        DSEC_REGISTRY_MIRRORS: `${gone.host}=${registry.host}`,
        DSEC_INSECURE_REGISTRIES: `${gone.host},${registry.host}`,
      },
    );
    assert.equal(viaEnv.code, 0, viaEnv.stderr);
    assert.equal(
      (JSON.parse(viaEnv.stdout) as { pulledFrom: string }).pulledFrom,
      `docker://${registry.host}/test/a:v1`,
    );

    const config = join(dir, 'dsec.json');
    await writeFile(config, JSON.stringify({ registries: { insecure: [registry.host] } }));
    const viaConfig = await dsec([
      'image',
      'import',
      'configured:v1',
      '--from-registry',
      `docker://${registry.host}/test/a:v1`,
      '--config',
      config,
    ]);
    assert.equal(viaConfig.code, 0, viaConfig.stderr);
    const viaDsecConfig = await dsec(
      [
        'image',
        'import',
        'configured:v2',
        '--from-registry',
        `docker://${registry.host}/test/a:v1`,
      ],
      { DSEC_CONFIG: config },
    );
    assert.equal(viaDsecConfig.code, 0, viaDsecConfig.stderr);

    // A malformed entry names where it came from.
    const bad = await dsec(
      ['image', 'import', 'x', '--from-registry', `docker://${registry.host}/test/a:v1`],
      { DSEC_INSECURE_REGISTRIES: 'not a host' },
    );
    assert.match(bad.stderr, /DSEC_INSECURE_REGISTRIES.*\[invalid_argument\]/);
  });
});
