import { after, before, beforeEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { SandboxInfo } from '@dsec/core';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';
import { main } from './main.js';

// The CLI against the real apiserver over a scripted fake edge.
let server: TestServer;
let stateDir: string;

before(async () => {
  server = await startTestServer();
  stateDir = await mkdtemp(join(tmpdir(), 'dsec-cli-test-'));
});
after(async () => {
  await server.close();
  await rm(stateDir, { recursive: true, force: true });
});
beforeEach(() => {
  server.edge.onCommand = () => ({ stdout: ['ok\n'] });
});

interface Run {
  code: number;
  stdout: string;
  stderr: string;
  /** stdout and stderr interleaved as written, each part tagged. */
  writes: string[];
}

async function dsec(args: string[], env: Record<string, string | undefined> = {}): Promise<Run> {
  const run: Run = { code: -1, stdout: '', stderr: '', writes: [] };
  run.code = await main(args, {
    stdout: { write: (s: string) => ((run.stdout += s), run.writes.push(`out:${s}`)) },
    stderr: { write: (s: string) => ((run.stderr += s), run.writes.push(`err:${s}`)) },
    env: { DSEC_URL: server.url, DSEC_API_KEY: server.key, DSEC_STATE_DIR: stateDir, ...env },
  });
  return run;
}

async function createSandbox(): Promise<string> {
  const r = await dsec(['sandbox', 'create', '--image', 'busybox']);
  assert.equal(r.code, 0, r.stderr);
  return r.stdout.trim();
}

void describe('sandbox create', () => {
  void test('prints the ID and maps flags onto the request body', async () => {
    const r = await dsec([
      'sandbox',
      'create',
      '--image',
      'busybox',
      '--workspace',
      'ws',
      '--toolkit',
      'a',
      '--toolkit',
      'b',
      '--memory-mb',
      '2048',
      '--cpus',
      '0.5',
      '--pids',
      '64',
      '--ttl-seconds',
      '300',
      '--env',
      'A=1',
      '--env',
      'B=x=y',
      '--label',
      'task=t1',
      '--request-id',
      'r-1',
    ]);
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stdout, /^sb-\S+\n$/);
    assert.equal(r.stderr, '');
    assert.deepEqual(server.requests.at(-1)?.body, {
      backend: 'container',
      image: 'busybox',
      workspace: 'ws',
      toolkits: ['a', 'b'],
      memoryLimitMb: 2048,
      cpuCoresLimit: 0.5,
      pidsLimit: 64,
      ttlSeconds: 300,
      env: { A: '1', B: 'x=y' },
      labels: { task: 't1' },
      requestId: 'r-1',
    });
  });

  void test('--json prints the SandboxInfo', async () => {
    const r = await dsec(['sandbox', 'create', '--image', 'busybox', '--json']);
    assert.equal(r.code, 0);
    const info = JSON.parse(r.stdout) as SandboxInfo;
    assert.match(info.id, /^sb-/);
    assert.equal(info.state, 'running');
    assert.equal(info.spec.image, 'busybox');
  });

  void test('a 400 names the flag to fix', async () => {
    const r = await dsec(['sandbox', 'create', '--image', 'busybox', '--memory-mb', '1']);
    assert.equal(r.code, 1);
    assert.equal(r.stdout, '');
    assert.equal(
      r.stderr,
      'error: memoryLimitMb: Number must be greater than or equal to 16 [invalid_argument]\n' +
        'hint: fix --memory-mb (field memoryLimitMb)\n',
    );
  });

  void test('a missing image points at image ls', async () => {
    server.edge.failNextCreate = new DsecError('image_not_found', 'no image "missing"');
    const r = await dsec(['sandbox', 'create', '--image', 'missing']);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /^error: .* \[image_not_found\]\nhint: .*`dsec image ls`/);
  });

  void test('usage errors exit 1 without a request', async () => {
    const before = server.requests.length;
    const r = await dsec(['sandbox', 'create', '--image', 'busybox', '--cpus', 'lots']);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /--cpus/);
    assert.equal(server.requests.length, before);
  });
});

void describe('sandbox exec', () => {
  void test('streams output as it comes and exits with the exit code', async () => {
    const id = await createSandbox();
    server.edge.onCommand = () => ({
      stdout: ['one\n', 'two\n'],
      stderr: ['warn\n'],
      exitCode: 3,
      delayMs: 2,
    });
    const r = await dsec([
      'sandbox',
      'exec',
      id,
      '--cwd',
      '/w',
      '--env',
      'K=V',
      '--',
      'make',
      '-j',
      '4',
    ]);
    assert.equal(r.code, 3);
    assert.deepEqual(r.writes, ['out:one\n', 'out:two\n', 'err:warn\n']);
    const req = server.requests.at(-1);
    assert.equal(req?.headers.accept, 'application/x-ndjson');
    assert.deepEqual(req?.body, { argv: ['make', '-j', '4'], cwd: '/w', env: { K: 'V' } });
  });

  void test('one word with spaces runs as a shell line; one plain word as argv', async () => {
    const id = await createSandbox();
    await dsec(['sandbox', 'exec', id, '--', 'echo hi && ls']);
    assert.deepEqual(server.requests.at(-1)?.body, { shell: 'echo hi && ls' });
    await dsec(['sandbox', 'exec', id, '--', 'ls']);
    assert.deepEqual(server.requests.at(-1)?.body, { argv: ['ls'] });
  });

  void test('options after -- belong to the command', async () => {
    const id = await createSandbox();
    const r = await dsec([
      'sandbox',
      'exec',
      id,
      '--timeout-ms',
      '5000',
      '--',
      'ls',
      '--json',
      '-la',
    ]);
    assert.equal(r.code, 0);
    assert.equal(r.stdout, 'ok\n');
    assert.deepEqual(server.requests.at(-1)?.body, {
      argv: ['ls', '--json', '-la'],
      timeoutMs: 5000,
    });
  });

  void test('signal deaths exit 128+N and timeouts 124, with a note', async () => {
    const id = await createSandbox();
    server.edge.onCommand = () => ({ exitCode: -1, signal: 'SIGKILL', outcome: 'oom' });
    const oom = await dsec(['sandbox', 'exec', id, '--', 'big']);
    assert.equal(oom.code, 137);
    assert.match(oom.stderr, /^dsec: .*out of memory/);
    server.edge.onCommand = () => ({ exitCode: -1, signal: 'SIGTERM' });
    assert.equal((await dsec(['sandbox', 'exec', id, '--', 'x'])).code, 143);
    server.edge.onCommand = () => ({ exitCode: -1, signal: 'SIGKILL', outcome: 'timeout' });
    const slow = await dsec(['sandbox', 'exec', id, '--timeout-ms', '10', '--', 'sleep', '9']);
    assert.equal(slow.code, 124);
    assert.match(slow.stderr, /timed out after 10 ms/);
  });

  void test('--json prints the result once and exits with the exit code', async () => {
    const id = await createSandbox();
    server.edge.onCommand = () => ({ stdout: ['a', 'b'], stderr: ['c'], exitCode: 2 });
    const r = await dsec(['sandbox', 'exec', id, '--json', '--', 'x y']);
    assert.equal(r.code, 2);
    assert.equal(server.requests.at(-1)?.headers.accept, 'application/json');
    assert.deepEqual(JSON.parse(r.stdout), {
      exitCode: 2,
      stdout: 'ab',
      stderr: 'c',
      truncated: false,
      outcome: 'exited',
    });
    assert.equal(r.stderr, '');
  });

  void test('an unknown sandbox exits 1 with a hint', async () => {
    const r = await dsec(['sandbox', 'exec', 'sb-nope', '--', 'ls']);
    assert.equal(r.code, 1);
    assert.match(
      r.stderr,
      /^error: no sandbox "sb-nope" \[sandbox_not_found\]\nhint: .*`dsec sandbox ls`\n$/,
    );
  });

  void test('a stopped sandbox is sandbox_not_running', async () => {
    const id = await createSandbox();
    assert.equal((await dsec(['sandbox', 'rm', id])).code, 0);
    const r = await dsec(['sandbox', 'exec', id, '--', 'ls']);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /\[sandbox_not_running\]/);
  });
});

void describe('sandbox ls / get / rm', () => {
  void test('ls prints a table and --json an array', async () => {
    const id = await createSandbox();
    const r = await dsec(['sandbox', 'ls']);
    assert.equal(r.code, 0);
    const [header, ...lines] = r.stdout.trimEnd().split('\n');
    assert.match(header ?? '', /^ID\s+STATE\s+IMAGE\s+CREATED\s+EXPIRES$/);
    assert.ok(lines.some((l) => l.startsWith(id) && /\brunning\s+busybox\b/.test(l)));
    const json = await dsec(['--json', 'sandbox', 'ls']);
    assert.ok((JSON.parse(json.stdout) as SandboxInfo[]).some((s) => s.id === id));
  });

  void test('get shows one sandbox', async () => {
    const id = await createSandbox();
    const text = await dsec(['sandbox', 'get', id]);
    assert.match(text.stdout, new RegExp(`^id\\s+${id}$`, 'm'));
    const json = await dsec(['sandbox', 'get', id, '--json']);
    assert.equal((JSON.parse(json.stdout) as SandboxInfo).id, id);
  });

  void test('rm removes several and reports the ones that failed', async () => {
    const a = await createSandbox();
    const b = await createSandbox();
    const r = await dsec(['sandbox', 'rm', a, 'sb-nope', b]);
    assert.equal(r.code, 1);
    assert.equal(r.stdout, `${a}\n${b}\n`);
    assert.match(r.stderr, /\[sandbox_not_found\]/);
    assert.equal((await server.edge.getSandbox(a)).state, 'stopped');
  });
});

void describe('images, projects, keys', () => {
  void test('image ls', async () => {
    const r = await dsec(['image', 'ls']);
    assert.equal(r.code, 0);
    assert.match(
      r.stdout,
      /^IMAGE\s+KIND\s+SIZE\s+FILES\s+CREATED\s+DIGEST\s+OWNER\nbusybox:latest\s+base\s+1\.1 MiB\s+420\s.*\splatform\n/,
    );
    const json = await dsec(['image', 'ls', '--json']);
    assert.equal((JSON.parse(json.stdout) as Array<{ name: string }>)[0]?.name, 'busybox');
  });

  void test('project create sends the quota; project ls lists it', async () => {
    const r = await dsec([
      'project',
      'create',
      'team-a',
      '--parent',
      server.api.rootProjectId,
      '--max-sandboxes',
      '10',
      '--max-cpus',
      '2.5',
      '--max-fncalls-per-second',
      '50',
      '--max-image-bytes',
      '1073741824',
    ]);
    assert.equal(r.code, 0, r.stderr);
    assert.deepEqual(server.requests.at(-1)?.body, {
      name: 'team-a',
      parentId: server.api.rootProjectId,
      quota: { sandboxes: 10, cpuCores: 2.5, fncallsPerSecond: 50, imageBytes: 1073741824 },
    });
    const id = r.stdout.trim();
    const ls = await dsec(['project', 'ls']);
    assert.match(
      ls.stdout,
      new RegExp(
        `^${id}\\s+team-a\\s+${server.api.rootProjectId}\\s+10\\s+-\\s+2\\.5\\s+50/s\\s+1\\.0 GiB$`,
        'm',
      ),
    );
  });

  void test('key create prints only the secret on stdout; key rm revokes', async () => {
    const root = server.api.rootProjectId;
    const r = await dsec(['key', 'create', '--project', root, '--role', 'admin']);
    assert.equal(r.code, 0, r.stderr);
    const secret = r.stdout.trim();
    assert.match(r.stdout, /^\S{16,}\n$/);
    assert.match(r.stderr, /not shown again/);
    assert.deepEqual(server.requests.at(-1)?.body, { projectId: root, role: 'admin' });
    const bad = await dsec(['key', 'create', '--project', 'p', '--role', 'owner']);
    assert.equal(bad.code, 1);
    const { keyId } = await server.api.iam.authenticate(secret);
    const rmKey = await dsec(['key', 'rm', keyId]);
    assert.equal(rmKey.code, 0, rmKey.stderr);
    assert.equal(server.requests.at(-1)?.method, 'DELETE');
    assert.equal(server.requests.at(-1)?.path, `/v1/keys/${keyId}`);
    const revoked = await dsec(['sandbox', 'ls'], { DSEC_API_KEY: secret });
    assert.match(revoked.stderr, /\[unauthenticated\]/);
  });
});

void describe('global options and errors', () => {
  void test('an unreachable server says to start a cluster', async () => {
    const port = await freePort();
    const r = await dsec(['sandbox', 'ls'], { DSEC_URL: `http://127.0.0.1:${port}` });
    assert.equal(r.code, 1);
    assert.match(
      r.stderr,
      /^error: cannot reach DSec at .* \[unavailable\]\nhint: start a cluster with `dsec up`/,
    );
  });

  void test('--url wins over DSEC_URL', async () => {
    const r = await dsec(['--url', server.url, 'sandbox', 'ls'], {
      DSEC_URL: 'http://127.0.0.1:1',
    });
    assert.equal(r.code, 0, r.stderr);
  });

  void test('without a key the admin key is read from the state dir', async () => {
    const noKey = await dsec(['sandbox', 'ls'], { DSEC_API_KEY: undefined });
    assert.equal(noKey.code, 1);
    assert.match(noKey.stderr, /\[unauthenticated\]\nhint: pass --api-key or set DSEC_API_KEY/);
    const dir = await mkdtemp(join(tmpdir(), 'dsec-cli-state-'));
    try {
      await writeFile(join(dir, 'admin.key'), `${server.key}\n`);
      const r = await dsec(['--state-dir', dir, 'sandbox', 'ls'], { DSEC_API_KEY: undefined });
      assert.equal(r.code, 0, r.stderr);
      assert.equal(server.requests.at(-1)?.headers.authorization, `Bearer ${server.key}`);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  void test('--help and --version exit 0 on stdout', async () => {
    const help = await dsec(['sandbox', '--help']);
    assert.equal(help.code, 0);
    assert.match(help.stdout, /Usage: dsec sandbox/);
    const version = await dsec(['--version']);
    assert.equal(version.code, 0);
    assert.match(version.stdout, /^\d+\.\d+\.\d+\n$/);
  });

  void test('an unknown command suggests and exits 1', async () => {
    const r = await dsec(['sandbox', 'lst']);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /Did you mean ls\?/);
  });
});

async function freePort(): Promise<number> {
  const s = http.createServer();
  await new Promise<void>((resolve) => s.listen(0, '127.0.0.1', resolve));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return port;
}
