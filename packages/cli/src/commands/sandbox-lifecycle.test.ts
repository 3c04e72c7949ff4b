// `dsec sandbox pause|resume|rm --label|snapshot|fork|timeout|ls --label|get` against the real
// apiserver over FakeEdge, through HTTP, in main.test.ts's style.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { SandboxInfo, SnapshotInfo } from '@dsec/core';
import { createTestApi } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { main } from '../main.js';

let api: TestApi;
let url: string;
let stateDir: string;

before(async () => {
  api = await createTestApi();
  url = await api.app.listen({ port: 0, host: '127.0.0.1' });
  stateDir = await mkdtemp(join(tmpdir(), 'dsec-cli-lifecycle-'));
});
after(async () => {
  await api.close();
  await rm(stateDir, { recursive: true, force: true });
});

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

async function dsec(args: string[]): Promise<Run> {
  const run: Run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(args, {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: url, DSEC_API_KEY: api.rootKey, DSEC_STATE_DIR: stateDir },
  });
  return run;
}

async function createSandbox(...labels: string[]): Promise<string> {
  const r = await dsec([
    'sandbox',
    'create',
    '--image',
    'base',
    ...labels.flatMap((l) => ['--label', l]),
  ]);
  assert.equal(r.code, 0, r.stderr);
  return r.stdout.trim();
}

async function info(id: string): Promise<SandboxInfo> {
  const r = await dsec(['sandbox', 'get', id, '--json']);
  assert.equal(r.code, 0, r.stderr);
  return JSON.parse(r.stdout) as SandboxInfo;
}

test('pause and resume by ID print the IDs; get shows state and memoryBytes', async () => {
  const id = await createSandbox();
  const p = await dsec(['sandbox', 'pause', id]);
  assert.deepEqual([p.code, p.stdout, p.stderr], [0, `${id}\n`, '']);
  const paused = await info(id);
  assert.equal(paused.state, 'paused');
  assert.equal(typeof paused.memoryBytes, 'number');
  const text = await dsec(['sandbox', 'get', id]);
  assert.match(text.stdout, /^state\s+paused$/m);
  assert.match(text.stdout, /^memory used\s+\d/m);
  assert.match(text.stdout, /^paused until\s+\S+/m);
  // Again: a no-op, not an error.
  assert.equal((await dsec(['sandbox', 'pause', id])).code, 0);
  const json = await dsec(['sandbox', 'resume', id, '--json']);
  assert.equal(json.code, 0);
  assert.deepEqual(JSON.parse(json.stdout), { sandboxes: [{ id, state: 'running' }], failed: [] });
  assert.equal((await info(id)).state, 'running');
});

test('a failure is reported per sandbox and the exit code is 1', async () => {
  const id = await createSandbox();
  await dsec(['sandbox', 'rm', id]);
  const r = await dsec(['sandbox', 'pause', id]);
  assert.equal(r.code, 1);
  assert.equal(r.stdout, '');
  assert.match(r.stderr, /\[sandbox_not_running\]/);
  const neither = await dsec(['sandbox', 'pause']);
  assert.equal(neither.code, 1);
  assert.match(neither.stderr, /give sandbox IDs or --label/);
  const both = await dsec(['sandbox', 'resume', id, '--label', 'job=x']);
  assert.equal(both.code, 1);
});

test('pause, resume and rm --label act on a whole job; ls --label filters', async () => {
  const job = [
    await createSandbox('job=cli-1', 'rank=0'),
    await createSandbox('job=cli-1', 'rank=1'),
  ];
  const bystander = await createSandbox('job=cli-2');
  const ls = await dsec(['sandbox', 'ls', '--label', 'job=cli-1', '--json']);
  assert.deepEqual(
    (JSON.parse(ls.stdout) as SandboxInfo[]).map((s) => s.id).sort(),
    [...job].sort(),
  );
  const lsText = await dsec(['sandbox', 'ls', '--label', 'job=cli-1', '--label', 'rank=1']);
  const rows = lsText.stdout.trimEnd().split('\n').slice(1);
  assert.deepEqual(
    rows.map((l) => l.split(/\s+/)[0]),
    [job[1]],
  );

  const paused = await dsec(['sandbox', 'pause', '--label', 'job=cli-1']);
  assert.equal(paused.code, 0, paused.stderr);
  assert.deepEqual(paused.stdout.trim().split('\n').sort(), [...job].sort());
  for (const id of job) assert.equal((await info(id)).state, 'paused');
  assert.equal((await info(bystander)).state, 'running');
  const resumed = await dsec(['sandbox', 'resume', '--label', 'job=cli-1', '--json']);
  assert.deepEqual(
    (JSON.parse(resumed.stdout) as { sandboxes: { state: string }[] }).sandboxes.map(
      (s) => s.state,
    ),
    ['running', 'running'],
  );
  const removed = await dsec(['sandbox', 'rm', '--label', 'job=cli-1', '--json']);
  assert.deepEqual(
    (JSON.parse(removed.stdout) as { removed: string[] }).removed.sort(),
    [...job].sort(),
  );
  for (const id of job) assert.equal((await info(id)).state, 'stopped');
  assert.equal((await info(bystander)).state, 'running');
});

test('timeout --seconds moves the deadline, by ID or by label', async () => {
  const id = await createSandbox('job=cli-t');
  const before = Date.now();
  const r = await dsec(['sandbox', 'timeout', id, '--seconds', '7200']);
  assert.equal(r.code, 0, r.stderr);
  assert.match(r.stdout, new RegExp(`^${id}  expires \\S+ \\(in (?:2h00m|1h59m)\\)\\n$`));
  assert.ok(Date.parse((await info(id)).expiresAt) >= before + 7_200_000);
  const byLabel = await dsec(['sandbox', 'timeout', '--label', 'job=cli-t', '--seconds', '60']);
  assert.deepEqual([byLabel.code, byLabel.stdout], [0, `${id}\n`]);
  assert.ok(Date.parse((await info(id)).expiresAt) < before + 7_200_000);
  const bad = await dsec(['sandbox', 'timeout', id, '--seconds', '0']);
  assert.equal(bad.code, 1);
  assert.match(bad.stderr, /\[invalid_argument\]/);
});

test('snapshot prints an image create accepts; fork --count prints the new IDs', async () => {
  const id = await createSandbox('job=cli-f');
  const snap = await dsec([
    'sandbox',
    'snapshot',
    id,
    '--name',
    'cli-snap:v1',
    '--scrub',
    '/srv/answer.txt',
    '--scrub',
    '/build/**',
    '--json',
  ]);
  assert.equal(snap.code, 0, snap.stderr);
  const s = JSON.parse(snap.stdout) as SnapshotInfo;
  assert.equal(s.image, 'cli-snap:v1');
  assert.deepEqual(s.scrub, ['/srv/answer.txt', '/build/**']);
  assert.deepEqual(Object.keys(s).sort(), [
    'freezeMs',
    'image',
    'layer',
    'parents',
    'scrub',
    'totalMs',
  ]);
  const child = await dsec(['sandbox', 'create', '--image', s.image]);
  assert.equal(child.code, 0, child.stderr);
  const plain = await dsec(['sandbox', 'snapshot', id, '--name', 'cli-snap:v2']);
  assert.deepEqual([plain.code, plain.stdout], [0, 'cli-snap:v2\n']);
  const bad = await dsec(['sandbox', 'snapshot', id, '--name', 'x', '--scrub', 'relative']);
  assert.equal(bad.code, 1);
  assert.match(bad.stderr, /hint: fix --scrub/);

  const fork = await dsec(['sandbox', 'fork', id, '--count', '3', '--json']);
  assert.equal(fork.code, 0, fork.stderr);
  const { ids } = JSON.parse(fork.stdout) as { ids: string[] };
  assert.equal(ids.length, 3);
  for (const f of ids) {
    const fi = await info(f);
    assert.equal(fi.state, 'running');
    assert.deepEqual(fi.spec.labels, { job: 'cli-f' });
  }
  const text = await dsec(['sandbox', 'fork', id, '--count', '1']);
  assert.match(text.stdout, /^sb-\S+\n$/);
  const tooMany = await dsec(['sandbox', 'fork', id, '--count', '65']);
  assert.equal(tooMany.code, 1);
  assert.match(tooMany.stderr, /hint: fix --count/);
});

test('key create --scope makes a builder key that snapshots but cannot run the result', async () => {
  const who = await dsec([
    '--json',
    'key',
    'create',
    '--project',
    api.rootProjectId,
    '--scope',
    'sandboxes:snapshot',
    '--scope',
    'images:run:base',
  ]);
  assert.equal(who.code, 0, who.stderr);
  const created = JSON.parse(who.stdout) as { key: string; scopes: string[] };
  assert.deepEqual(created.scopes, ['sandboxes:snapshot', 'images:run:base']);
  const as = async (args: string[]) => {
    const run: Run = { code: -1, stdout: '', stderr: '' };
    run.code = await main(args, {
      stdout: { write: (s: string) => (run.stdout += s) },
      stderr: { write: (s: string) => (run.stderr += s) },
      env: { DSEC_URL: url, DSEC_API_KEY: created.key, DSEC_STATE_DIR: stateDir },
    });
    return run;
  };
  const id = (await as(['sandbox', 'create', '--image', 'base'])).stdout.trim();
  const snap = await as(['sandbox', 'snapshot', id, '--name', 'cli-built']);
  assert.equal(snap.code, 0, snap.stderr);
  const run = await as(['sandbox', 'create', '--image', snap.stdout.trim()]);
  assert.equal(run.code, 1);
  assert.match(run.stderr, /\[permission_denied\]/);
});
