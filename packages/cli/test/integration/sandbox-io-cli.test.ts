import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { main } from '../../src/main.js';

let node: SingleNode;
let work: string;
let id: string;

async function dsec(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(args, {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: node.url, DSEC_API_KEY: node.adminKey },
  });
  return run;
}

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-cli-io-'));
  await chmod(work, 0o711);
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'cli-node' });
  const rootfs = join(work, 'rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  const created = await dsec(['sandbox', 'create', '--image', 'busybox']);
  assert.equal(created.code, 0, created.stderr);
  id = created.stdout.trim();
});

after(async () => {
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

test('exec --session types lines into one shell: cd and export persist; --json has the result', async () => {
  assert.equal(
    (await dsec(['sandbox', 'exec', id, '--session', 's1', '--', 'cd', '/tmp'])).code,
    0,
  );
  assert.equal(
    (await dsec(['sandbox', 'exec', id, '--session', 's1', '--', 'export X=42'])).code,
    0,
  );
  const r = await dsec([
    '--json',
    'sandbox',
    'exec',
    id,
    '--session',
    's1',
    '--',
    'echo $X $(pwd); exit_code() { return 3; }; exit_code',
  ]);
  assert.equal(r.code, 3);
  const json = JSON.parse(r.stdout) as Record<string, unknown>;
  assert.deepEqual(
    {
      exitCode: json.exitCode,
      stdout: json.stdout,
      stderr: json.stderr,
      truncated: json.truncated,
    },
    { exitCode: 3, stdout: '42 /tmp\n', stderr: '', truncated: false },
  );
  const timedOut = await dsec([
    'sandbox',
    'exec',
    id,
    '--session',
    's1',
    '--timeout-ms',
    '300',
    '--',
    'sleep 30',
  ]);
  assert.equal(timedOut.code, 124);
  assert.equal(
    (await dsec(['sandbox', 'exec', id, '--session', 's1', '--', 'echo $X'])).stdout,
    '42\n',
  );
});

test('exec --request-id runs once; a retry prints the recorded result', async () => {
  const rid = `cli-${randomBytes(4).toString('hex')}`;
  const file = `/tmp/${rid}`;
  const cmd = [
    'sandbox',
    'exec',
    id,
    '--request-id',
    rid,
    '--',
    `echo ran >> ${file}; cat ${file}`,
  ];
  const a = await dsec(cmd);
  const b = await dsec(cmd);
  assert.equal(a.stdout, 'ran\n');
  assert.equal(b.stdout, 'ran\n');
});

test('cp copies files both ways', async () => {
  const local = join(work, 'up.bin');
  const data = randomBytes(3 * 1024 * 1024 + 7);
  await writeFile(local, data);
  const up = await dsec(['sandbox', 'cp', local, `${id}:/tmp/`]);
  assert.equal(up.code, 0, up.stderr);
  const down = join(work, 'down.bin');
  const d = await dsec(['sandbox', 'cp', `${id}:/tmp/up.bin`, down]);
  assert.equal(d.code, 0, d.stderr);
  assert.ok((await readFile(down)).equals(data));
  const missing = await dsec(['sandbox', 'cp', `${id}:/nope`, down]);
  assert.notEqual(missing.code, 0);
  assert.match(missing.stderr, /not_found|no such file/i);
});

test('shell without a terminal says so', { skip: process.stdin.isTTY === true }, async () => {
  const r = await dsec(['sandbox', 'shell', id]);
  assert.equal(r.code, 2);
  assert.match(r.stderr, /needs a terminal/);
});
