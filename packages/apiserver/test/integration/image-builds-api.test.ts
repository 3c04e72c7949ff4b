import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { chmod, mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs, registrySettings } from '@dsec/images';
import {
  makeOciLayoutFromDirs,
  pushToRegistry,
  startLocalRegistry,
  type LocalRegistry,
} from '@dsec/images/testing/registry';
import { DSecClient, isDsecError } from '@dsec/sdk';

// `POST /v1/images/builds` end to end on `startSingleNode` (what `dsec up`
// runs): a real buildah build of a tiny Dockerfile FROM a busybox image in
// Debian's docker-registry on loopback, the layer owned by the caller's
// project, charged to its quota, invisible to another project, and run in a
// sandbox. RUN steps get no network here (`imageBuilds.network: false`): the
// tests reach nothing but loopback. Needs root, buildah, runc, skopeo and
// docker-registry.

interface BuildInfo {
  id: string;
  name: string;
  image: string;
  status: 'building' | 'ready' | 'failed';
  error?: string;
  errorCode?: string;
  errorDetails?: Record<string, unknown>;
  log?: string;
  cached?: boolean;
  sizeBytes?: number;
}

void describe('image builds over the API', { timeout: 10 * 60_000 }, () => {
  let dir: string;
  let node: SingleNode;
  let registry: LocalRegistry;
  let baseRef: string;
  /** Keys of two sibling projects and one with a tiny imageBytes quota. */
  const keys: Record<'a' | 'b' | 'small', string> = { a: '', b: '', small: '' };
  const projects: Record<'a' | 'b' | 'small', string> = { a: '', b: '', small: '' };

  const api = async (
    key: string,
    method: string,
    path: string,
    body?: Buffer,
    type = 'application/x-tar',
  ): Promise<{ status: number; json: Record<string, unknown> }> => {
    const res = await fetch(`${node.url}${path}`, {
      method,
      headers: {
        ...(key ? { authorization: `Bearer ${key}` } : {}),
        ...(body ? { 'content-type': type } : {}),
      },
      ...(body ? { body } : {}),
    });
    const text = await res.text();
    return { status: res.status, json: text ? (JSON.parse(text) as Record<string, unknown>) : {} };
  };

  /** A tar of `files` as tar(1) writes it. */
  const context = async (name: string, files: Record<string, string>): Promise<Buffer> => {
    const ctx = join(dir, 'contexts', name);
    for (const [p, content] of Object.entries(files)) {
      await mkdir(join(ctx, p, '..'), { recursive: true });
      await writeFile(join(ctx, p), content);
    }
    const r = spawnSync('tar', ['-C', ctx, '-cf', '-', '.'], { maxBuffer: 64 * 2 ** 20 });
    assert.equal(r.status, 0, String(r.stderr));
    return r.stdout;
  };

  const waitBuild = async (key: string, id: string): Promise<BuildInfo> => {
    for (;;) {
      const r = await api(key, 'GET', `/v1/images/builds/${id}`);
      assert.equal(r.status, 200, JSON.stringify(r.json));
      const info = r.json as unknown as BuildInfo;
      if (info.status !== 'building') return info;
      await sleep(200);
    }
  };

  const build = async (
    key: string,
    query: string,
    tar: Buffer,
  ): Promise<{ status: number; json: Record<string, unknown> }> =>
    await api(key, 'POST', `/v1/images/builds?${query}`, tar);

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-build-api-'));
    await chmod(dir, 0o711);
    registry = await startLocalRegistry({ dir: join(dir, 'registry') });
    const root = join(dir, 'busybox');
    await makeBusyboxRootfs(root);
    await makeOciLayoutFromDirs(join(dir, 'layout'), [root], { Env: ['PATH=/bin:/usr/bin'] }, 'v1');
    baseRef = `${registry.host}/base/busybox:v1`;
    await pushToRegistry(join(dir, 'layout'), 'v1', `docker://${baseRef}`);
    node = await startSingleNode({
      stateDir: join(dir, 'state'),
      port: 0,
      edgeId: 'build-api',
      cgroupParent: `dsec-test-build-api`,
      registries: registrySettings({}, { DSEC_INSECURE_REGISTRIES: registry.host }),
      imageBuilds: { network: false, limits: { maxBuildsPerProject: 1 } },
    });
    for (const [which, quota] of [
      ['a', {}],
      ['b', {}],
      ['small', { imageBytes: 4096 }],
    ] as const) {
      const p = await api(
        node.adminKey,
        'POST',
        '/v1/projects',
        Buffer.from(JSON.stringify({ name: `builds-${which}`, quota })),
        'application/json',
      );
      assert.equal(p.status, 201, JSON.stringify(p.json));
      projects[which] = p.json['id'] as string;
      const k = await api(
        node.adminKey,
        'POST',
        '/v1/keys',
        Buffer.from(JSON.stringify({ projectId: projects[which], role: 'admin' })),
        'application/json',
      );
      assert.equal(k.status, 201, JSON.stringify(k.json));
      keys[which] = k.json['key'] as string;
    }
  });

  after(async () => {
    await node?.close({ stopSandboxes: true });
    await registry?.close();
    await rm(dir, { recursive: true, force: true });
  });

  test('a Dockerfile builds into a layer of the project, runs there, and nowhere else', async () => {
    const tar = await context('hello', {
      Dockerfile: `FROM ${baseRef}\nARG WHO=nobody\nCOPY data.txt /data.txt\nRUN echo "built for $WHO" > /hello.txt\n`,
      'data.txt': 'from the context\n',
    });
    const started = await build(keys.a, 'name=hello&buildArg=WHO=tests', tar);
    assert.equal(started.status, 202, JSON.stringify(started.json));
    assert.equal(started.json['status'], 'building');
    assert.equal(started.json['name'], 'hello');
    const id = started.json['id'] as string;
    // Another project cannot see the build.
    assert.equal((await api(keys.b, 'GET', `/v1/images/builds/${id}`)).status, 404);
    const done = await waitBuild(keys.a, id);
    assert.equal(done.status, 'ready', JSON.stringify(done));
    assert.equal(done.image, 'hello:latest');
    assert.match(done.log ?? '', /STEP \d\/\d: RUN/);
    assert.ok((done.sizeBytes ?? 0) > 0);
    const listed = await api(keys.a, 'GET', '/v1/images/builds');
    assert.deepEqual(
      (listed.json['builds'] as BuildInfo[]).map((b) => b.id),
      [id],
    );

    // The project's own layer, charged to its quota; not in project b's view.
    const mine = (await api(keys.a, 'GET', '/v1/images')).json['layers'] as {
      name: string;
      project?: string;
    }[];
    assert.ok(mine.some((l) => l.name === 'hello' && l.project === projects.a));
    const theirs = (await api(keys.b, 'GET', '/v1/images')).json['layers'] as { name: string }[];
    assert.ok(!theirs.some((l) => l.name === 'hello'));
    const usage = node.iam.usage(projects.a);
    assert.equal((await usage).imageBytes, done.sizeBytes);

    const a = new DSecClient({ url: node.url, apiKey: keys.a });
    const b = new DSecClient({ url: node.url, apiKey: keys.b });
    try {
      const sb = await a.runContainer({ image: 'hello', memoryLimitMb: 128 });
      try {
        const r = await sb.commands.run('cat /hello.txt /data.txt');
        assert.equal(r.stdout, 'built for tests\nfrom the context\n');
      } finally {
        await sb.stop();
      }
      await assert.rejects(b.runContainer({ image: 'hello', memoryLimitMb: 128 }), (err: unknown) =>
        isDsecError(err, 'image_not_found'),
      );
    } finally {
      a.close();
      b.close();
    }

    // Project b builds its own `hello`: its namespace, no clash with a's.
    const theirsBuilt = await build(keys.b, 'name=hello', tar);
    assert.equal(theirsBuilt.status, 202);
    assert.equal((await waitBuild(keys.b, theirsBuilt.json['id'] as string)).status, 'ready');

    // The same context again is the cached layer; another one under the same name is refused.
    const again = await build(keys.a, 'name=hello&buildArg=WHO=tests', tar);
    const cached = await waitBuild(keys.a, again.json['id'] as string);
    assert.equal(cached.status, 'ready');
    assert.equal(cached.cached, true);
    const changed = await build(keys.a, 'name=hello&buildArg=WHO=others', tar);
    const refused = await waitBuild(keys.a, changed.json['id'] as string);
    assert.equal(refused.status, 'failed');
    assert.equal(refused.errorCode, 'conflict');
  });

  test('attack: FROM and COPY --from of a registry the node does not allow fail before any pull: no request reaches the host', async () => {
    // A "registry" on the node's loopback that only counts what reaches it.
    let hits = 0;
    const trap = createServer((_req, res) => res.writeHead(404).end());
    // Connections, not requests: a registry client's TLS hello is no HTTP request.
    trap.on('connection', () => hits++);
    await new Promise<void>((r) => trap.listen(0, '127.0.0.1', r));
    const trapPort = (trap.address() as AddressInfo).port;
    const registryPort = registry.host.split(':')[1]!;
    try {
      for (const dockerfile of [
        `FROM 127.0.0.1:${trapPort}/x:1\n`,
        // The allowed registry under another name is another host.
        `FROM localhost:${registryPort}/base/busybox:v1\n`,
        `FROM ${baseRef}\nCOPY --from=127.0.0.1:${trapPort}/y:1 /a /a\n`,
      ]) {
        const tar = await context('trap', { Dockerfile: dockerfile });
        const started = await build(keys.a, 'name=trap', tar);
        assert.equal(started.status, 202, JSON.stringify(started.json));
        const done = await waitBuild(keys.a, started.json['id'] as string);
        assert.equal(done.status, 'failed', dockerfile);
        assert.equal(done.errorCode, 'permission_denied', dockerfile);
        assert.equal(done.errorDetails?.['reason'], 'from_registry', dockerfile);
      }
      assert.equal(hits, 0, 'the build reached the host it was refused');
    } finally {
      await new Promise<void>((r) => trap.close(() => r()));
    }
  });

  test('a failing step fails the build with its instruction, line and output', async () => {
    const tar = await context('fails', {
      Dockerfile: `FROM ${baseRef}\nRUN echo about to fail && false\n`,
    });
    const started = await build(keys.a, 'name=fails', tar);
    assert.equal(started.status, 202, JSON.stringify(started.json));
    // One build of the project at a time here (`maxBuildsPerProject: 1`).
    const second = await build(keys.a, 'name=other', tar);
    assert.equal(second.status, 429, JSON.stringify(second.json));
    assert.equal((second.json['error'] as { code: string }).code, 'quota_exceeded');
    const done = await waitBuild(keys.a, started.json['id'] as string);
    assert.equal(done.status, 'failed');
    assert.equal(done.errorCode, 'invalid_argument');
    assert.equal(done.errorDetails?.['reason'], 'build_step_failed');
    assert.equal(done.errorDetails?.['line'], 2);
    assert.match(done.log ?? '', /about to fail/);
  });

  test('a build over the imageBytes quota is refused and its layer removed', async () => {
    const tar = await context('big', {
      Dockerfile: `FROM ${baseRef}\nRUN dd if=/dev/urandom of=/blob bs=1024 count=256\n`,
    });
    const started = await build(keys.small, 'name=big', tar);
    assert.equal(started.status, 202, JSON.stringify(started.json));
    const done = await waitBuild(keys.small, started.json['id'] as string);
    assert.equal(done.status, 'failed');
    assert.equal(done.errorCode, 'quota_exceeded');
    const layers = (await api(keys.small, 'GET', '/v1/images')).json['layers'] as {
      name: string;
    }[];
    assert.ok(!layers.some((l) => l.name === 'big'));
    assert.equal((await node.iam.usage(projects.small)).imageBytes, 0);
  });

  test('bad requests: no key, no body, bad names, hostile archives, shadowing names', async () => {
    const tar = await context('ok', { Dockerfile: `FROM ${baseRef}\n` });
    assert.equal((await build('', 'name=x', tar)).status, 401);
    const noBody = await api(keys.a, 'POST', '/v1/images/builds?name=x');
    assert.equal(noBody.status, 400);
    for (const name of ['UPPER', '../x', 'a/b', '', 'x:../y']) {
      const r = await build(keys.a, `name=${encodeURIComponent(name)}`, tar);
      assert.equal(r.status, 400, name);
    }
    const escape = spawnSync(
      'tar',
      ['-C', join(dir, 'contexts', 'ok'), '-cf', '-', '--transform', 's,^,../../,', 'Dockerfile'],
      { maxBuffer: 2 ** 20 },
    ).stdout;
    const r = await build(keys.a, 'name=escape', escape);
    assert.equal(r.status, 400, JSON.stringify(r.json));
    assert.equal(
      ((r.json['error'] as { details: { reason: string } }).details ?? {}).reason,
      'tar_path',
    );
    // A Dockerfile named through a symlink of the archive is not followed.
    const linkCtx = join(dir, 'contexts', 'link');
    await mkdir(linkCtx, { recursive: true });
    spawnSync('ln', ['-s', '/etc/hostname', join(linkCtx, 'Dockerfile')]);
    const viaLink = await build(
      keys.a,
      'name=vialink',
      spawnSync('tar', ['-C', linkCtx, '-cf', '-', '.']).stdout,
    );
    assert.equal(viaLink.status, 400);
    assert.equal((viaLink.json['error'] as { field: string }).field, 'dockerfile');
    const up = await build(keys.a, 'name=x&dockerfile=../Dockerfile', tar);
    assert.equal(up.status, 400);
    // A name the platform holds would be shadowed: refused.
    const rootfs = join(dir, 'platform-rootfs');
    await makeBusyboxRootfs(rootfs);
    await node.buildLayer({ name: 'platform-base', kind: 'base', from: { dir: rootfs } });
    const shadow = await build(keys.a, 'name=platform-base', tar);
    assert.equal(shadow.status, 409, JSON.stringify(shadow.json));
    // Unknown builds and query fields.
    assert.equal((await api(keys.a, 'GET', '/v1/images/builds/bld-nope')).status, 404);
    assert.equal((await build(keys.a, 'name=x&bogus=1', tar)).status, 400);
    // Nothing of the refused uploads is left in the scratch space.
    const scratch = await readdir(join(dir, 'state', 'build-api')).catch(() => [] as string[]);
    assert.deepEqual(scratch, []);
  });

  test("a build is cancelled with DELETE; while one tenant's build runs, another tenant's runs to the end beside it", async () => {
    const tar = await context('slow', {
      Dockerfile: `FROM ${baseRef}\nRUN sleep 120\n`,
    });
    const started = await build(keys.b, 'name=slow', tar);
    assert.equal(started.status, 202, JSON.stringify(started.json));
    const id = started.json['id'] as string;
    // Wait until the RUN step started, then cancel.
    for (;;) {
      const info = (await api(keys.b, 'GET', `/v1/images/builds/${id}`))
        .json as unknown as BuildInfo;
      if ((info.log ?? '').includes('RUN sleep')) break;
      assert.equal(info.status, 'building', JSON.stringify(info));
      await sleep(200);
    }
    // Each build has a storage root of its own: b's two-minute step holds up nobody else's.
    const beside = await build(
      keys.a,
      'name=beside',
      await context('beside', { Dockerfile: `FROM ${baseRef}\nRUN echo beside > /b.txt\n` }),
    );
    assert.equal(beside.status, 202, JSON.stringify(beside.json));
    assert.equal((await waitBuild(keys.a, beside.json['id'] as string)).status, 'ready');
    const slowNow = (await api(keys.b, 'GET', `/v1/images/builds/${id}`)).json;
    assert.equal(slowNow['status'], 'building', 'the slow build is still running');
    assert.equal((await api(keys.a, 'DELETE', `/v1/images/builds/${id}`)).status, 404);
    const cancelled = await api(keys.b, 'DELETE', `/v1/images/builds/${id}`);
    assert.equal(cancelled.status, 200);
    assert.equal(cancelled.json['status'], 'failed');
    assert.equal(cancelled.json['errorCode'], 'aborted');
  });
});
