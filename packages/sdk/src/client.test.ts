import { after, before, beforeEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { isDsecError } from '@dsec/core';
import { DSecClient } from './index.js';
import { FAKE_API_KEY, startFakeServer } from './testing/fake-server.js';
import type { FakeServer } from './testing/fake-server.js';

let server: FakeServer;
let client: DSecClient;

before(async () => {
  server = await startFakeServer();
});
after(async () => {
  await server.close();
});
beforeEach(() => {
  client?.close();
  client = new DSecClient({ url: server.url, apiKey: FAKE_API_KEY });
  server.requests.length = 0;
  server.override = undefined;
  server.onCommand = () => ({ stdout: ['ok\n'] });
});

void describe('request shapes', () => {
  void test('open checks health then whoami', async () => {
    const who = await client.open();
    assert.deepEqual(who, { keyId: 'key-1', projectId: 'prj-root', role: 'admin' });
    assert.deepEqual(
      server.requests.map((r) => `${r.method} ${r.path}`),
      ['GET /healthz', 'GET /v1/whoami'],
    );
    assert.equal(server.requests[1]?.headers.authorization, `Bearer ${FAKE_API_KEY}`);
  });

  void test('runContainer posts a CreateSandboxBody and maps ttlRunningStopSeconds', async () => {
    const sandbox = await client.runContainer({
      image: 'busybox',
      memoryLimitMb: 4096,
      cpuCoresLimit: 4,
      ttlRunningStopSeconds: 300,
      networkRules: { npm: false, pypi: true },
      initUser: 'root',
      requestId: 'req-1',
    });
    const req = server.requests.at(-1);
    assert.equal(req?.method, 'POST');
    assert.equal(req?.path, '/v1/sandboxes');
    assert.equal(req?.headers['content-type'], 'application/json');
    assert.deepEqual(req?.body, {
      backend: 'container',
      image: 'busybox',
      memoryLimitMb: 4096,
      cpuCoresLimit: 4,
      ttlSeconds: 300,
      networkRules: { npm: false, pypi: true },
      initUser: 'root',
      requestId: 'req-1',
    });
    assert.match(sandbox.id, /^sb-/);
    assert.equal(sandbox.info?.state, 'running');
    assert.equal(sandbox.info?.spec.ttlSeconds, 300);
  });

  void test('conflicting TTL aliases are rejected before any request', async () => {
    await assert.rejects(
      client.runContainer({ image: 'busybox', ttlSeconds: 1, ttlRunningStopSeconds: 2 }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'ttlRunningStopSeconds',
    );
    assert.equal(server.requests.length, 0);
  });

  void test('runShell and exec post a CommandBody and return the CommandResult', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const shell = await sandbox.runShell('echo hello world', {
      cwd: '/tmp',
      env: { A: '1' },
      timeoutMs: 5000,
    });
    assert.deepEqual(server.requests.at(-1)?.body, {
      shell: 'echo hello world',
      cwd: '/tmp',
      env: { A: '1' },
      timeoutMs: 5000,
    });
    assert.equal(server.requests.at(-1)?.path, `/v1/sandboxes/${sandbox.id}/commands`);
    assert.equal(shell.exitCode, 0);
    assert.equal(shell.stdout, 'ok\n');
    assert.equal(shell.outcome, 'exited');

    server.onCommand = () => ({ stderr: ['bad\n'], exitCode: 3 });
    const exec = await sandbox.exec(['ls', '-la'], { user: 'app', stdin: 'x' });
    assert.deepEqual(server.requests.at(-1)?.body, {
      argv: ['ls', '-la'],
      user: 'app',
      stdin: 'x',
    });
    assert.equal(exec.exitCode, 3);
    assert.equal(exec.stderr, 'bad\n');
  });

  void test('stop deletes, refresh re-reads, sandbox(id) makes no request', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const handle = client.sandbox(sandbox.id);
    const initial = handle.info;
    assert.equal(initial, undefined);
    const before = server.requests.length;
    await sandbox.stop();
    assert.equal(server.requests.length, before + 1);
    assert.equal(server.requests.at(-1)?.method, 'DELETE');
    assert.equal(server.requests.at(-1)?.path, `/v1/sandboxes/${sandbox.id}`);
    assert.equal((await handle.refresh()).state, 'stopped');
    assert.equal(handle.info?.state, 'stopped');
  });

  void test('listSandboxes passes projectId as a query', async () => {
    await client.runContainer({ image: 'busybox' });
    const list = await client.listSandboxes({ projectId: 'prj-root' });
    assert.ok(list.length >= 1);
    assert.equal(server.requests.at(-1)?.query.get('projectId'), 'prj-root');
  });

  void test('calls reuse one keep-alive connection', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const start = server.connections;
    for (let i = 0; i < 20; i++) await sandbox.runShell('true');
    assert.ok(server.connections - start <= 1, `opened ${server.connections - start} connections`);
  });
});

void describe('error mapping', () => {
  void test('a 404 body becomes sandbox_not_found', async () => {
    await assert.rejects(client.sandbox('sb-nope').runShell('true'), (e) => {
      assert.ok(isDsecError(e, 'sandbox_not_found'));
      assert.equal(e.status, 404);
      assert.match(e.message, /sb-nope/);
      return true;
    });
  });

  void test('a 400 keeps its field', async () => {
    await assert.rejects(
      client.runContainer({ image: 'busybox', memoryLimitMb: 1 }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'memoryLimitMb',
    );
  });

  void test('a bad key is unauthenticated; a body-less 5xx is unavailable', async () => {
    const bad = new DSecClient({ url: server.url, apiKey: 'wrong' });
    await assert.rejects(bad.open(), (e) => isDsecError(e, 'unauthenticated'));
    bad.close();
    server.override = () => ({ status: 502 });
    await assert.rejects(client.listSandboxes(), (e) => isDsecError(e, 'unavailable'));
  });

  void test('an unreachable server is unavailable with a hint', async () => {
    const port = await freePort();
    const down = new DSecClient({ url: `http://127.0.0.1:${port}`, apiKey: 'k' });
    await assert.rejects(down.open(), (e) => {
      assert.ok(isDsecError(e, 'unavailable'));
      assert.match(
        e.message,
        /cannot reach DSec at http:\/\/127\.0\.0\.1:\d+: .* is `dsec up` running\?/,
      );
      return true;
    });
    down.close();
  });

  void test('a closed client refuses calls', async () => {
    client.close();
    await assert.rejects(client.listSandboxes(), (e) => isDsecError(e, 'unavailable'));
  });
});

void describe('streaming', () => {
  void test('NDJSON chunks arrive in order before the result', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const e = Buffer.from('é');
    const events = [
      { type: 'stdout', data: Buffer.from('one\n').toString('base64') },
      { type: 'stderr', data: Buffer.from('warn\n').toString('base64') },
      // A two-byte character split across events must arrive whole.
      { type: 'stdout', data: e.subarray(0, 1).toString('base64') },
      {
        type: 'stdout',
        data: Buffer.concat([e.subarray(1), Buffer.from('\ntwo\n')]).toString('base64'),
      },
      {
        type: 'result',
        result: {
          commandId: 'cmd-1',
          exitCode: 0,
          outcome: 'exited',
          stdout: 'one\né\ntwo\n',
          stderr: 'warn\n',
          truncated: false,
          stdoutBytes: 10,
          stderrBytes: 5,
          durationMs: 1,
        },
      },
    ];
    server.override = (req) =>
      req.path.endsWith('/commands') ? { ndjson: events, delayMs: 5 } : undefined;
    const seen: string[] = [];
    const result = await sandbox.runShell('x', {
      onStdout: (s) => seen.push(`out:${s}`),
      onStderr: (s) => seen.push(`err:${s}`),
    });
    seen.push('result');
    assert.equal(server.requests.at(-1)?.headers.accept, 'application/x-ndjson');
    assert.deepEqual(seen, ['out:one\n', 'err:warn\n', 'out:é\ntwo\n', 'result']);
    assert.equal(result.commandId, 'cmd-1');
  });

  void test('the fake server streams scripted output through the callbacks', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.onCommand = () => ({ stdout: ['a', 'b'], stderr: ['c'], exitCode: 1 });
    let out = '';
    const result = await sandbox.exec(['x'], { onStdout: (s) => (out += s) });
    assert.equal(out, 'ab');
    assert.equal(result.exitCode, 1);
  });

  void test('an error event rejects with its code', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.override = (req) =>
      req.path.endsWith('/commands')
        ? {
            ndjson: [
              { type: 'error', error: { code: 'sandbox_not_running', message: 'it stopped' } },
            ],
          }
        : undefined;
    await assert.rejects(sandbox.runShell('x', { onStdout: () => {} }), (e) =>
      isDsecError(e, 'sandbox_not_running'),
    );
  });

  void test('a stream without a result is unavailable', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.override = (req) => (req.path.endsWith('/commands') ? { ndjson: [] } : undefined);
    await assert.rejects(sandbox.runShell('x', { onStdout: () => {} }), (e) =>
      isDsecError(e, 'unavailable'),
    );
  });

  void test('a server that does not stream still feeds the callbacks', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const result = {
      commandId: 'c',
      exitCode: 0,
      outcome: 'exited',
      stdout: 'all\n',
      stderr: '',
      truncated: false,
      stdoutBytes: 4,
      stderrBytes: 0,
      durationMs: 1,
    };
    server.override = (req) => (req.path.endsWith('/commands') ? { body: result } : undefined);
    let out = '';
    await sandbox.runShell('x', { onStdout: (s) => (out += s) });
    assert.equal(out, 'all\n');
  });
});

void describe('cancellation', () => {
  void test('aborting a pending call throws aborted and frees the socket', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.override = (req) => (req.path.endsWith('/commands') ? { hang: true } : undefined);
    const ac = new AbortController();
    const pending = sandbox.runShell('sleep 100', { signal: ac.signal });
    setTimeout(() => ac.abort(), 20);
    await assert.rejects(pending, (e) => isDsecError(e, 'aborted'));
    server.override = undefined;
    assert.equal((await sandbox.runShell('true')).exitCode, 0);
  });

  void test('aborting mid-stream stops the callbacks', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const chunk = { type: 'stdout', data: Buffer.from('tick\n').toString('base64') };
    server.override = (req) =>
      req.path.endsWith('/commands')
        ? { ndjson: Array.from({ length: 200 }, () => chunk), delayMs: 10 }
        : undefined;
    const ac = new AbortController();
    let ticks = 0;
    const pending = sandbox.runShell('yes', {
      signal: ac.signal,
      onStdout: () => {
        if (++ticks === 2) ac.abort();
      },
    });
    await assert.rejects(pending, (e) => isDsecError(e, 'aborted'));
    assert.equal(ticks, 2);
  });

  void test('an already-aborted signal sends nothing', async () => {
    await assert.rejects(client.listSandboxes({ signal: AbortSignal.abort() }), (e) =>
      isDsecError(e, 'aborted'),
    );
    assert.equal(server.requests.length, 0);
  });

  void test('a deadline throws deadline_exceeded', async () => {
    server.override = () => ({ hang: true });
    await assert.rejects(client.runContainer({ image: 'busybox' }, { timeoutMs: 30 }), (e) =>
      isDsecError(e, 'deadline_exceeded'),
    );
  });
});

async function freePort(): Promise<number> {
  const s = http.createServer();
  await new Promise<void>((resolve) => s.listen(0, '127.0.0.1', resolve));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return port;
}
