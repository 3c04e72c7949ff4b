import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, test } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { isDsecError } from '@dsec/core';
import { prepareFnCallImages } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';

// The keyless SandboxFusion listener of `dsec up` (docs/fncall.md): bound to
// one project, checked at start, its calls counted in that project's quota.
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';

let dir: string;
let cgroupParent: string;
let node: SingleNode | undefined;
let projectId: string;

before(async () => {
  const storeDir = join(IMAGES_DIR, 'images');
  await prepareFnCallImages(new DirImageStore(storeDir), { cacheDir: join(IMAGES_DIR, 'cache') });
  dir = await mkdtemp(join(tmpdir(), 'dsec-sf-listener-'));
  await chmod(dir, 0o711);
  cgroupParent = `dsec-test-${basename(dir)}`;
  const common = { stateDir: join(dir, 'state'), port: 0, cgroupParent, imageStore: storeDir };
  // A project to bind it to exists only once a node has made it: make it, then restart.
  const first = await startSingleNode(common);
  const root = await first.iam.authenticate(first.adminKey);
  projectId = (
    await first.iam.createProject(root, { name: 'rl-team', quota: { fncallsPerSecond: 1 } })
  ).id;
  await first.close();
  await assert.rejects(
    startSingleNode({
      ...common,
      sandboxFusion: { host: '127.0.0.1', port: 0, projectId: 'nope' },
    }),
    (e) => isDsecError(e, 'invalid_argument'),
  );
  node = await startSingleNode({
    ...common,
    sandboxFusion: { host: '127.0.0.1', port: 0, projectId },
  });
});

after(async () => {
  await node?.close({ stopSandboxes: true });
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
});

test('the listener runs calls without a key, in its project and its quota', async () => {
  const url = node!.sandboxFusionUrl!;
  assert.ok(url);
  const post = (body: unknown) =>
    fetch(`${url}/run_code`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
  const ok = await post({ language: 'python', code: 'print(int(input()) * 2)', stdin: '21\n' });
  assert.equal(ok.status, 200);
  const r = (await ok.json()) as { status: string; run_result: { stdout: string } };
  assert.equal(r.status, 'Success', JSON.stringify(r));
  assert.equal(r.run_result.stdout, '42\n');
  // One call per second, a burst of one: of five sent at once, the project's quota refuses some.
  const burst = await Promise.all(
    Array.from({ length: 5 }, () => post({ language: 'python', code: 'print(1)' })),
  );
  const refused = burst.filter((res) => res.status === 429);
  assert.ok(refused.length >= 1, burst.map((res) => res.status).join(' '));
  assert.equal(
    ((await refused[0]!.json()) as { error: { code: string } }).error.code,
    'quota_exceeded',
  );
  // The DSec API is not there.
  assert.equal((await fetch(`${url}/v1/sandboxes`)).status, 404);
  assert.equal(await (await fetch(`${url}/v1/ping`)).json(), 'pong');
});
