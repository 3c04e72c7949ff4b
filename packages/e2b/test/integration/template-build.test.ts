import assert from 'node:assert/strict';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { BuildError, Sandbox, Template } from 'e2b';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs, registrySettings } from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
  type LocalRegistry,
} from '@dsec/images/testing/registry';
import { useE2b } from './e2b-node.js';

// E2B's own JS SDK (`Template.build`, `Template.exists`, tags) against a
// real single node: the SDK uploads the COPY files by hash, sends its steps,
// polls the build; DSec builds them with buildah FROM a busybox image in
// Debian's docker-registry on loopback (RUN steps without network) and the
// SDK's `Sandbox.create` starts the template. Needs root, buildah, runc,
// skopeo, docker-registry.

void describe('E2B Template.build on DSec', { timeout: 10 * 60_000 }, () => {
  let dir: string;
  let node: SingleNode;
  let registry: LocalRegistry;
  let baseRef: string;
  let ctx: string;
  let cgroupParent: string;

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-e2b-tmpl-'));
    await chmod(dir, 0o711);
    cgroupParent = `dsec-test-${basename(dir)}`;
    registry = await startLocalRegistry({ dir: join(dir, 'registry') });
    const root = join(dir, 'busybox');
    await makeBusyboxRootfs(root);
    await makeOciLayoutFromDirs(
      join(dir, 'layout'),
      [root],
      { Env: ['PATH=/bin:/usr/bin:/sbin:/usr/sbin'] },
      'v1',
    );
    baseRef = `${registry.host}/base/busybox:v1`;
    await pushToRegistry(join(dir, 'layout'), 'v1', `docker://${baseRef}`);
    node = await startSingleNode({
      stateDir: join(dir, 'state'),
      port: 0,
      cgroupParent,
      registries: registrySettings({}, { DSEC_INSECURE_REGISTRIES: registry.host }),
      imageBuilds: { network: false },
      e2b: {},
    });
    ctx = join(dir, 'ctx');
    await mkdir(join(ctx, 'app'), { recursive: true });
    await writeFile(join(ctx, 'app', 'hello.txt'), 'hello from the context\n');
    useE2b(node.url, node.adminKey);
  });

  after(async () => {
    await node?.close({ stopSandboxes: true });
    await registry?.close();
    await rm(dir, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [] as string[]))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
  });

  const template = (marker: string) =>
    Template({ fileContextPath: ctx })
      .fromImage(baseRef)
      .copy('app/hello.txt', '/home/user/hello.txt')
      .setEnvs({ GREETING: 'hi there' })
      .runCmd(`echo ${marker} > /home/user/built.txt && echo "$GREETING" > /home/user/env.txt`)
      .runCmd('id -u > /uid-root.txt', { user: 'root' })
      .setWorkdir('/home/user');

  test('Template.build, then Sandbox.create starts it; exists; tags', async () => {
    const logs: string[] = [];
    const info = await Template.build(template('first'), 'tmpl-hello', {
      onBuildLogs: (e) => logs.push(e.message),
    });
    assert.equal(info.name, 'tmpl-hello');
    assert.equal(info.templateId, 'tmpl-hello');
    assert.ok(
      logs.some((l) => /STEP \d+\/\d+: RUN/.test(l)),
      logs.join('\n'),
    );
    assert.equal(await Template.exists('tmpl-hello'), true);
    assert.equal(await Template.exists('tmpl-missing'), false);

    const sbx = await Sandbox.create('tmpl-hello');
    try {
      const r = await sbx.commands.run(
        'cat /home/user/hello.txt /home/user/built.txt /home/user/env.txt /uid-root.txt; stat -c %U /home/user/hello.txt /home/user/built.txt',
        { user: 'root' },
      );
      assert.equal(r.stdout, 'hello from the context\nfirst\nhi there\n0\nuser\nuser\n');
    } finally {
      await sbx.kill();
    }

    // A second build under a tag; the default stays the first until rebuilt.
    await Template.build(template('second'), 'tmpl-hello:v2');
    const v2 = await Sandbox.create('tmpl-hello:v2');
    try {
      assert.equal(
        (await v2.commands.run('cat /home/user/built.txt', { user: 'root' })).stdout,
        'second\n',
      );
    } finally {
      await v2.kill();
    }
    const tags = (await Template.getTags('tmpl-hello')).map((t) => t.tag).sort();
    assert.deepEqual(tags, ['default', 'v2']);
    const assigned = await Template.assignTags('tmpl-hello:v2', ['prod']);
    assert.deepEqual(assigned.tags, ['prod']);
    assert.ok(assigned.buildId.length > 0);
    const prod = await Sandbox.create('tmpl-hello:prod');
    try {
      assert.equal(
        (await prod.commands.run('cat /home/user/built.txt', { user: 'root' })).stdout,
        'second\n',
      );
    } finally {
      await prod.kill();
    }
    await Template.removeTags('tmpl-hello', ['prod']);
    assert.deepEqual((await Template.getTags('tmpl-hello')).map((t) => t.tag).sort(), [
      'default',
      'v2',
    ]);

    // The same files again: the upload is skipped (present by hash).
    const again: string[] = [];
    await Template.build(template('third'), 'tmpl-hello', {
      onBuildLogs: (e) => again.push(e.message),
    });
    assert.ok(
      again.some((l) => /already cached/.test(l)),
      again.join('\n'),
    );
    const third = await Sandbox.create('tmpl-hello');
    try {
      assert.equal(
        (await third.commands.run('cat /home/user/built.txt', { user: 'root' })).stdout,
        'third\n',
      );
    } finally {
      await third.kill();
    }
  });

  test('a failing step is a BuildError; another project sees no template', async () => {
    const failing = Template({ fileContextPath: ctx })
      .fromImage(baseRef)
      .runCmd('echo ok')
      .runCmd('echo failing on purpose; exit 3');
    await assert.rejects(Template.build(failing, 'tmpl-fails'), (err: unknown) => {
      assert.ok(err instanceof BuildError, String(err));
      assert.match(String(err.message), /exit 3|failed/);
      return true;
    });
    // Names DSec images cannot have are refused up front, and so is a name the platform holds
    // (the platform's layer would shadow the template's).
    await assert.rejects(Template.build(failing, 'Bad Name'));
    await node.buildLayer({
      name: 'tmpl-platform',
      kind: 'base',
      from: { dir: join(dir, 'busybox') },
    });
    await assert.rejects(Template.build(failing, 'tmpl-platform'), /platform/);

    const res = await fetch(`${node.url}/v1/projects`, {
      method: 'POST',
      headers: { authorization: `Bearer ${node.adminKey}`, 'content-type': 'application/json' },
      body: JSON.stringify({ name: 'tmpl-other' }),
    });
    const project = (await res.json()) as { id: string };
    const keyRes = await fetch(`${node.url}/v1/keys`, {
      method: 'POST',
      headers: { authorization: `Bearer ${node.adminKey}`, 'content-type': 'application/json' },
      body: JSON.stringify({ projectId: project.id, role: 'admin' }),
    });
    const { key } = (await keyRes.json()) as { key: string };
    // A child project sees its ancestors' layers by design; a sibling would not. The root's
    // template is visible here, but this project's own tag list is empty.
    await assert.rejects(Template.getTags('tmpl-hello', { apiKey: key }));
    // An upload link is bound to its project, template and hash.
    const forged = await fetch(
      `${node.url}/templates/tmpl-hello/files/${'a'.repeat(64)}?project=${project.id}&token=1.${'A'.repeat(43)}`,
      { method: 'PUT', body: 'x' },
    );
    assert.equal(forged.status, 403);
  });
});
