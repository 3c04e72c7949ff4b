// The lifecycle calls against the real apiserver (over FakeEdge), through HTTP.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { createTestApi } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { DSecClient } from './index.js';

let api: TestApi;
let client: DSecClient;

before(async () => {
  api = await createTestApi();
  const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
  client = new DSecClient({ url, apiKey: api.rootKey });
});
after(async () => {
  client.close();
  await api.close();
});

test('pause, resume and setTimeout update the handle; repeats are no-ops', async () => {
  const sb = await client.runContainer({ image: 'base', ttlSeconds: 60 });
  const paused = await sb.pause();
  assert.equal(paused.state, 'paused');
  assert.equal(sb.info?.state, 'paused');
  assert.equal((await sb.pause()).pausedAt, paused.pausedAt);
  const fresh = await client.getSandbox(sb.id);
  assert.equal(fresh.info?.state, 'paused');
  assert.equal(typeof fresh.info?.memoryBytes, 'number');
  assert.equal((await sb.resume()).state, 'running');
  assert.equal((await sb.resume()).state, 'running');

  const before = Date.now();
  const timed = await sb.setTimeout(3_600_500);
  // Rounded up to whole seconds: 3601 s from now.
  const at = Date.parse(timed.expiresAt);
  assert.ok(at >= before + 3_601_000 && at <= Date.now() + 3_601_000, timed.expiresAt);
  assert.equal(sb.info?.expiresAt, timed.expiresAt);
  await assert.rejects(
    sb.setTimeout(0),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'timeoutMs',
  );
  await sb.stop();
  await assert.rejects(sb.pause(), (e) => isDsecError(e, 'sandbox_not_running'));
  await assert.rejects(sb.resume(), (e) => isDsecError(e, 'sandbox_not_running'));
});

test('snapshot names an image runContainer accepts; fork returns handles to running sandboxes', async () => {
  const sb = await client.runContainer({ image: 'base', labels: { job: 'fork-test' } });
  const snap = await sb.snapshot({ name: 'sdk-snap:v1', scrub: ['/srv/answers/**'] });
  assert.equal(snap.image, 'sdk-snap:v1');
  assert.deepEqual(snap.scrub, ['/srv/answers/**']);
  assert.deepEqual(snap.parents, ['base']);
  const child = await client.runContainer({ image: snap.image });
  assert.equal(child.info?.spec.image, 'sdk-snap:v1');
  await assert.rejects(
    sb.snapshot({ name: 'Not Valid' }),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'name',
  );

  const forks = await sb.fork(3);
  assert.equal(forks.length, 3);
  for (const f of forks) {
    assert.equal(f.info, undefined);
    const info = await f.refresh();
    assert.equal(info.state, 'running');
    assert.deepEqual(info.spec.labels, { job: 'fork-test' });
    assert.match(info.spec.image, /^fork-/);
  }
  await assert.rejects(
    sb.fork(65),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'count',
  );
  await client.stopJob({ job: 'fork-test' });
  await child.stop();
});

test('whole-job calls and listSandboxes by labels', async () => {
  const job = await Promise.all(
    [0, 1, 2].map((rank) =>
      client.runContainer({ image: 'base', labels: { job: 'rl-7', rank: String(rank) } }),
    ),
  );
  const bystander = await client.runContainer({ image: 'base', labels: { job: 'rl-8' } });
  const ids = job.map((s) => s.id).sort();
  const listed = await client.listSandboxes({ labels: { job: 'rl-7' } });
  assert.deepEqual(listed.map((s) => s.id).sort(), ids);
  const one = await client.listSandboxes({ labels: { job: 'rl-7', rank: '2' } });
  assert.deepEqual(
    one.map((s) => s.id),
    [job[2]!.id],
  );

  const states = (r: { sandboxes: { id: string; state: string }[] }) =>
    r.sandboxes.map((s) => `${s.id}=${s.state}`).sort();
  const paused = await client.pauseJob({ job: 'rl-7' });
  assert.deepEqual(
    states(paused),
    ids.map((id) => `${id}=paused`),
  );
  assert.deepEqual(paused.failed, []);
  assert.equal((await bystander.refresh()).state, 'running');
  assert.deepEqual(
    states(await client.resumeJob({ job: 'rl-7' })),
    ids.map((id) => `${id}=running`),
  );
  const before = Date.now();
  await client.extendJob({ job: 'rl-7' }, 7200);
  for (const s of job) assert.ok(Date.parse((await s.refresh()).expiresAt) >= before + 7_200_000);
  assert.deepEqual(
    states(await client.stopJob({ job: 'rl-7' })),
    ids.map((id) => `${id}=stopped`),
  );
  assert.deepEqual(await client.stopJob({ job: 'rl-7' }), { sandboxes: [], failed: [] });
  await assert.rejects(
    client.pauseJob({}),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'labels',
  );
  await bystander.stop();
});

test('scoped keys: a builder snapshots, a runtime runs the result', async () => {
  const who = await client.open();
  const builderKey = await client.createKey({
    projectId: who.projectId,
    scopes: ['sandboxes:snapshot', 'images:run:base'],
  });
  assert.deepEqual(builderKey.scopes, ['sandboxes:snapshot', 'images:run:base']);
  const runtimeKey = await client.createKey({
    projectId: who.projectId,
    scopes: ['images:run:task-*'],
  });
  const builder = new DSecClient({ url: client.url, apiKey: builderKey.key });
  const runtime = new DSecClient({ url: client.url, apiKey: runtimeKey.key });
  try {
    assert.deepEqual((await runtime.open()).scopes, ['images:run:task-*']);
    const src = await builder.runContainer({ image: 'base' });
    const { image } = await src.snapshot({ name: 'task-sdk' });
    await assert.rejects(
      builder.runContainer({ image }),
      (e) => isDsecError(e, 'permission_denied') && e.field === 'image',
    );
    const sb = await runtime.runContainer({ image });
    await assert.rejects(sb.snapshot({ name: 'task-sdk-2' }), (e) =>
      isDsecError(e, 'permission_denied'),
    );
    await sb.stop();
    await src.stop();
  } finally {
    builder.close();
    runtime.close();
  }
});
