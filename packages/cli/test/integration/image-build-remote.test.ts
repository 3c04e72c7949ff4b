import assert from 'node:assert/strict';
import { chmod, copyFile, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { main } from '../../src/main.js';

// `dsec image build NAME --dockerfile DIR --remote` against a real single
// node: the context goes up as a tar, the node builds it (`FROM scratch`
// with the host's static busybox copied in: no registry, no network), and
// the layer is the key's project's. Needs root, buildah and runc.

void describe('dsec image build --remote', { timeout: 5 * 60_000 }, () => {
  let dir: string;
  let node: SingleNode;

  const cli = async (args: string[]) => {
    const out = { stdout: '', stderr: '' };
    const code = await main(['--url', node.url, '--api-key', node.adminKey, ...args], {
      stdout: { write: (s: string) => (out.stdout += s) },
      stderr: { write: (s: string) => (out.stderr += s) },
      env: {},
    });
    return { code, ...out };
  };

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-remote-build-'));
    await chmod(dir, 0o711);
    node = await startSingleNode({
      stateDir: join(dir, 'state'),
      port: 0,
      cgroupParent: 'dsec-test-remote-build',
      imageBuilds: { network: false },
    });
  });

  after(async () => {
    await node?.close({ stopSandboxes: true });
    await rm(dir, { recursive: true, force: true });
  });

  test('builds on the node, prints the build; a failing build exits non-zero with its error', async () => {
    const ctx = join(dir, 'ctx');
    await mkdir(join(ctx, 'sub'), { recursive: true });
    await copyFile('/bin/busybox', join(ctx, 'busybox'));
    await writeFile(join(ctx, 'sub', 'hello.txt'), 'remote\n');
    await writeFile(
      join(ctx, 'Custom.dockerfile'),
      'FROM scratch\nCOPY busybox /bin/busybox\nCOPY sub/hello.txt /hello.txt\n',
    );
    const ok = await cli([
      '--json',
      'image',
      'build',
      'remote-img:v1',
      '--dockerfile',
      ctx,
      '--file',
      'Custom.dockerfile',
      '--remote',
    ]);
    assert.equal(ok.code, 0, ok.stderr);
    const info = JSON.parse(ok.stdout) as { status: string; image: string };
    assert.equal(info.status, 'ready');
    assert.equal(info.image, 'remote-img:v1');
    const layers = (await node.store.listLayers()).filter((l) => l.name === 'remote-img');
    assert.equal(layers.length, 1);
    assert.ok(layers[0]!.project, 'owned by the key’s project');

    await writeFile(join(ctx, 'Dockerfile'), 'FROM scratch\nRUN /bin/false\n');
    const failed = await cli(['image', 'build', 'remote-bad', '--dockerfile', ctx, '--remote']);
    assert.notEqual(failed.code, 0);
    assert.match(failed.stderr, /RUN \/bin\/false/);
    const local = await cli([
      'image',
      'build',
      'x',
      '--dockerfile',
      ctx,
      '--remote',
      '--network-allow',
      'example.com',
    ]);
    assert.notEqual(local.code, 0);
    assert.match(local.stderr, /not for --remote/);
  });
});
