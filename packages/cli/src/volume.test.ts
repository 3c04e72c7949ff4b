import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';
import { main } from './main.js';

// `dsec volume …` and `sandbox create --volume` against the real apiserver over a fake edge.
let server: TestServer;
let stateDir: string;

before(async () => {
  server = await startTestServer();
  stateDir = await mkdtemp(join(tmpdir(), 'dsec-cli-volume-test-'));
});
after(async () => {
  await server.close();
  await rm(stateDir, { recursive: true, force: true });
});

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(args, {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: server.url, DSEC_API_KEY: server.key, DSEC_STATE_DIR: stateDir },
  });
  return run;
}

test('volume create, ls, get and rm, in text and --json', async () => {
  const made = await dsec(['volume', 'create', 'data', '--size-mb', '64']);
  assert.equal(made.code, 0, made.stderr);
  assert.equal(made.stdout, 'data\n');
  const json = await dsec(['--json', 'volume', 'create', 'cache', '--size-mb', '16']);
  assert.equal(json.code, 0, json.stderr);
  assert.equal((JSON.parse(json.stdout) as { sizeMb: number }).sizeMb, 16);

  const ls = await dsec(['volume', 'ls']);
  assert.equal(ls.code, 0, ls.stderr);
  assert.match(ls.stdout, /^NAME\s+SIZE\s+EDGE\s+STATE\s+CREATED\n/);
  assert.match(ls.stdout, /\ncache\s+16 MiB\s+\S+\s+ready/);
  assert.match(ls.stdout, /\ndata\s+64 MiB/);
  const lsJson = JSON.parse((await dsec(['--json', 'volume', 'ls'])).stdout) as {
    volumes: { name: string }[];
  };
  assert.deepEqual(
    lsJson.volumes.map((v) => v.name),
    ['cache', 'data'],
  );

  // Mounted by a sandbox: shown on both sides, and rm is refused with the code.
  const sb = await dsec([
    'sandbox',
    'create',
    '--image',
    'busybox',
    '--volume',
    'data:/data',
    '--volume',
    'cache:/root/.cache',
  ]);
  assert.equal(sb.code, 0, sb.stderr);
  const id = sb.stdout.trim();
  const body = server.requests.findLast((r) => r.method === 'POST' && r.path === '/v1/sandboxes')
    ?.body as { volumes?: unknown };
  assert.deepEqual(body.volumes, [
    { name: 'data', path: '/data' },
    { name: 'cache', path: '/root/.cache' },
  ]);
  assert.match(
    (await dsec(['sandbox', 'get', id])).stdout,
    /volumes\s+data:\/data, cache:\/root\/\.cache/,
  );
  assert.match((await dsec(['volume', 'get', 'data'])).stdout, new RegExp(`mounted by\\s+${id}`));
  const busy = await dsec(['--json', 'volume', 'rm', 'data']);
  assert.notEqual(busy.code, 0);
  assert.match(busy.stderr, /volume_in_use/);
  assert.equal((await dsec(['sandbox', 'rm', id])).code, 0);

  const rm = await dsec(['--json', 'volume', 'rm', 'data', 'cache']);
  assert.equal(rm.code, 0, rm.stderr);
  assert.deepEqual(JSON.parse(rm.stdout), { removed: ['data', 'cache'] });
  const gone = await dsec(['volume', 'get', 'data']);
  assert.notEqual(gone.code, 0);
  assert.match(gone.stderr, /volume_not_found|no volume/);
});

test('bad --volume and --size-mb are usage errors', async () => {
  for (const v of ['data', 'data:relative', ':/x'])
    assert.notEqual(
      (await dsec(['sandbox', 'create', '--image', 'busybox', '--volume', v])).code,
      0,
      v,
    );
  assert.notEqual((await dsec(['volume', 'create', 'x'])).code, 0, 'size is required');
  const bad = await dsec(['volume', 'create', 'a/b', '--size-mb', '16']);
  assert.notEqual(bad.code, 0);
  assert.match(bad.stderr, /invalid_argument|volume name/);
});
