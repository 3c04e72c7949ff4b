import { after, before, beforeEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { DsecError, isDsecError } from '@dsec/core';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';
import { DSecClient } from './index.js';

// The SDK against the real apiserver (routes, schemas, auth, errors) over a scripted fake edge.
let server: TestServer;
let client: DSecClient;
/** Retries as by default, without the waits. */
const fastRetry = { baseDelayMs: 1, maxDelayMs: 2 };

before(async () => {
  server = await startTestServer();
});
after(async () => {
  client?.close();
  await server.close();
});
beforeEach(() => {
  client?.close();
  client = new DSecClient({ url: server.url, apiKey: server.key, retry: fastRetry });
  server.requests.length = 0;
  server.edge.hangCreates = false;
  server.edge.onCommand = () => ({ stdout: ['ok\n'] });
});

void describe('request shapes', () => {
  void test('open checks health then whoami', async () => {
    const who = await client.open();
    assert.deepEqual(who, {
      keyId: who.keyId,
      projectId: server.api.rootProjectId,
      role: 'admin',
    });
    assert.deepEqual(
      server.requests.map((r) => `${r.method} ${r.path}`),
      ['GET /healthz', 'GET /v1/whoami'],
    );
    assert.equal(server.requests[1]?.headers.authorization, `Bearer ${server.key}`);
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
    assert.ok(sandbox.id.length > 0);
    assert.equal(sandbox.info?.state, 'running');
    assert.equal(sandbox.info?.spec.ttlSeconds, 300);
    assert.equal(sandbox.info?.spec.memoryLimitMb, 4096);
  });

  void test('runContainer sends a fresh requestId when given none', async () => {
    await client.runContainer({ image: 'busybox' });
    await client.runContainer({ image: 'busybox' });
    const ids = server.requests.map((r) => (r.body as { requestId?: string }).requestId);
    assert.equal(ids.length, 2);
    assert.match(ids[0] ?? '', /^ts-[0-9a-f-]{36}$/);
    assert.notEqual(ids[0], ids[1]);
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

    server.edge.onCommand = () => ({ stderr: ['bad\n'], exitCode: 3 });
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

  void test('listSandboxes passes projectId and labels as a query', async () => {
    const sb = await client.runContainer({ image: 'busybox', labels: { job: 'q-1' } });
    const list = await client.listSandboxes({ projectId: server.api.rootProjectId });
    assert.ok(list.some((s) => s.id === sb.id));
    assert.equal(server.requests.at(-1)?.query.get('projectId'), server.api.rootProjectId);
    const labelled = await client.listSandboxes({ labels: { job: 'q-1' } });
    assert.deepEqual(
      labelled.map((s) => s.id),
      [sb.id],
    );
    assert.deepEqual(server.requests.at(-1)?.query.getAll('label'), ['job=q-1']);
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
    await assert.rejects(client.sandbox('sb-nope').refresh(), (e) =>
      isDsecError(e, 'sandbox_not_found'),
    );
  });

  void test('a 400 keeps its field', async () => {
    await assert.rejects(
      client.runContainer({ image: 'busybox', memoryLimitMb: 1 }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'memoryLimitMb',
    );
  });

  void test('a bad key is unauthenticated, and not retried', async () => {
    const bad = new DSecClient({ url: server.url, apiKey: 'wrong', retry: fastRetry });
    await assert.rejects(bad.listSandboxes(), (e) => isDsecError(e, 'unauthenticated'));
    assert.equal(server.requests.length, 0, 'rejected before routing');
    bad.close();
  });

  void test('an unreachable server is unavailable with a hint', async () => {
    const port = await freePort();
    const down = new DSecClient({ url: `http://127.0.0.1:${port}`, apiKey: 'k', retry: fastRetry });
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
    server.edge.onCommand = () => ({
      output: [
        { stdout: 'one\n' },
        { stderr: 'warn\n' },
        // A two-byte character split across events must arrive whole.
        { stdout: e.subarray(0, 1) },
        { stdout: Buffer.concat([e.subarray(1), Buffer.from('\ntwo\n')]) },
      ],
      delayMs: 5,
    });
    const seen: string[] = [];
    const result = await sandbox.runShell('x', {
      onStdout: (s) => seen.push(`out:${s}`),
      onStderr: (s) => seen.push(`err:${s}`),
    });
    seen.push('result');
    assert.equal(server.requests.at(-1)?.headers.accept, 'application/x-ndjson');
    assert.deepEqual(seen, ['out:one\n', 'err:warn\n', 'out:é\ntwo\n', 'result']);
    assert.equal(result.stdout, 'one\né\ntwo\n');
    assert.equal(result.stderr, 'warn\n');
  });

  void test('scripted output streams through the callbacks and iteration', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({ stdout: ['a', 'b'], stderr: ['c'], exitCode: 1 });
    let out = '';
    const result = await sandbox.exec(['x'], { onStdout: (s) => (out += s) });
    assert.equal(out, 'ab');
    assert.equal(result.exitCode, 1);
    const events: string[] = [];
    for await (const ev of sandbox.commands.run('x')) events.push(`${ev.type}:${ev.data}`);
    assert.deepEqual(events, ['stdout:a', 'stdout:b', 'stderr:c']);
  });

  void test('an error event rejects with its code', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({
      error: new DsecError('sandbox_not_running', 'it stopped'),
    });
    await assert.rejects(sandbox.runShell('x', { onStdout: () => {} }), (e) =>
      isDsecError(e, 'sandbox_not_running'),
    );
  });

  void test('raw stdout streams bytes and the result comes from the trailer', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({ stdout: ['bulk ', 'bytes'], exitCode: 2 });
    const chunks: Buffer[] = [];
    const result = await sandbox.commands.stream('cat big', { onStdout: (c) => chunks.push(c) });
    assert.equal(Buffer.concat(chunks).toString(), 'bulk bytes');
    assert.equal(result.exitCode, 2);
    assert.equal(result.stdout, '');
    assert.equal(server.requests.at(-1)?.headers.accept, 'application/octet-stream');
  });
});

void describe('commands by ID, files, sessions', () => {
  void test('a background command: start, get, wait, output, list', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({ stdout: ['bg\n'] });
    const handle = await sandbox.commands.start(['make'], { requestId: 'bg-1' });
    assert.equal((server.requests.at(-1)?.body as { background?: boolean }).background, true);
    assert.equal((await handle.wait()).stdout, 'bg\n');
    const again = await sandbox.commands.get(handle.id);
    assert.equal(again.info?.state, 'finished');
    let out = '';
    await again.output({ onStdout: (s) => (out += s) });
    assert.equal(out, 'bg\n');
    assert.deepEqual(
      (await sandbox.commands.list()).map((c) => c.commandId),
      [handle.id],
    );
    await assert.rejects(sandbox.commands.get('cmd-nope'), (e) =>
      isDsecError(e, 'command_not_found'),
    );
  });

  void test('files: write, read, stat, list, mkdir, rename, remove', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    await sandbox.files.mkdir('/work');
    const info = await sandbox.files.write('/work/a.txt', 'hello', { mode: 0o600 });
    assert.equal(server.requests.at(-1)?.query.get('mode'), '600');
    assert.deepEqual([info.path, info.size, info.mode], ['/work/a.txt', 5, 0o600]);
    assert.equal(await sandbox.files.read('/work/a.txt'), 'hello');
    assert.deepEqual(
      await sandbox.files.read('/work/a.txt', { format: 'bytes' }),
      Buffer.from('hello'),
    );
    assert.equal((await sandbox.files.stat('/work')).type, 'directory');
    await sandbox.files.rename('/work/a.txt', '/work/b.txt');
    assert.deepEqual(
      (await sandbox.files.list('/work')).map((f) => f.name),
      ['b.txt'],
    );
    await sandbox.files.remove('/work/b.txt');
    await assert.rejects(sandbox.files.read('/work/b.txt'), (e) => isDsecError(e, 'not_found'));
    await assert.rejects(
      sandbox.files.read('/work'),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'path',
    );
  });

  void test('a session line posts a SessionRunBody', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = undefined;
    const session = sandbox.session('main', { cwd: '/tmp' });
    const result = await session.run('echo hi', { timeoutMs: 5000 });
    assert.deepEqual(server.requests.at(-1)?.body, {
      line: 'echo hi',
      timeoutMs: 5000,
      cwd: '/tmp',
    });
    assert.equal(result.session, 'main');
    assert.equal(result.stdout, 'echo hi\n');
    await session.close();
  });
});

void describe('retries', () => {
  const posts = (path: string) =>
    server.requests.filter((r) => r.method === 'POST' && r.path === path);

  void test('a create is resent on unavailable with the same requestId', async () => {
    server.edge.failNextCreate = new DsecError('unavailable', 'edge restarting');
    const sandbox = await client.runContainer({ image: 'busybox' });
    const sent = posts('/v1/sandboxes');
    assert.equal(sent.length, 2);
    const [first, second] = sent.map((r) => (r.body as { requestId: string }).requestId);
    assert.equal(first, second);
    assert.equal(sandbox.info?.state, 'running');
  });

  void test('429 quota_exceeded is retried with backoff, up to maxRetries', async () => {
    const who = await client.open();
    const admin = await client.createProject({
      name: 'tiny',
      parentId: who.projectId,
      quota: { sandboxes: 1 },
    });
    const key = await client.createKey({ projectId: admin.id, role: 'admin' });
    const tenant = new DSecClient({
      url: server.url,
      apiKey: key.key,
      retry: { maxRetries: 2, baseDelayMs: 1 },
    });
    try {
      const held = await tenant.runContainer({ image: 'busybox' });
      server.requests.length = 0;
      await assert.rejects(tenant.runContainer({ image: 'busybox' }), (e) => {
        assert.ok(isDsecError(e, 'quota_exceeded'));
        assert.equal(e.status, 429);
        return true;
      });
      assert.equal(posts('/v1/sandboxes').length, 3, 'the first try and 2 retries');
      await held.stop();
    } finally {
      tenant.close();
    }
  });

  void test('a command is resent only when it has a requestId', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const path = `/v1/sandboxes/${sandbox.id}/commands`;
    let failures = 1;
    server.edge.onCommand = () =>
      failures-- > 0 ? { error: new DsecError('unavailable', 'blip') } : { stdout: ['done\n'] };
    server.requests.length = 0;
    await assert.rejects(sandbox.runShell('x'), (e) => isDsecError(e, 'unavailable'));
    assert.equal(posts(path).length, 1);

    failures = 1;
    server.requests.length = 0;
    const result = await sandbox.commands.run('x', { requestId: 'once-1' });
    assert.equal(result.stdout, 'done\n');
    assert.equal(posts(path).length, 2);
  });

  void test('resource_exhausted is not retried; retry: false turns retries off', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const path = `/v1/sandboxes/${sandbox.id}/commands`;
    server.edge.onCommand = () => ({
      error: new DsecError('resource_exhausted', 'pids limit'),
    });
    server.requests.length = 0;
    await assert.rejects(sandbox.commands.run('x', { requestId: 'r-1' }).result, (e) =>
      isDsecError(e, 'resource_exhausted'),
    );
    assert.equal(posts(path).length, 1);

    const noRetry = new DSecClient({ url: server.url, apiKey: server.key, retry: false });
    try {
      server.edge.failNextCreate = new DsecError('unavailable', 'edge restarting');
      server.requests.length = 0;
      // The apiserver may report the failed edge as `unavailable` or `capacity_exhausted`.
      await assert.rejects(
        noRetry.runContainer({ image: 'busybox' }),
        (e) => isDsecError(e) && (e.code === 'unavailable' || e.code === 'capacity_exhausted'),
      );
      assert.equal(posts('/v1/sandboxes').length, 1);
    } finally {
      noRetry.close();
    }
  });

  void test('a streamed command that already delivered output is not resent', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    const path = `/v1/sandboxes/${sandbox.id}/commands`;
    server.edge.onCommand = () => ({
      stdout: ['partial\n'],
      error: new DsecError('unavailable', 'edge lost the sandbox'),
    });
    server.requests.length = 0;
    const seen: string[] = [];
    await assert.rejects(
      sandbox.commands.run('x', { requestId: 's-1', onStdout: (s) => seen.push(s) }).result,
      (e) => isDsecError(e, 'unavailable'),
    );
    assert.deepEqual(seen, ['partial\n']);
    assert.equal(posts(path).length, 1);
  });
});

void describe('cancellation', () => {
  void test('aborting a pending call throws aborted and frees the socket', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({ hang: true });
    const ac = new AbortController();
    const pending = sandbox.runShell('sleep 100', { signal: ac.signal });
    setTimeout(() => ac.abort(), 20);
    await assert.rejects(pending, (e) => isDsecError(e, 'aborted'));
    server.edge.onCommand = undefined;
    assert.equal((await sandbox.runShell('true')).exitCode, 0);
  });

  void test('aborting mid-stream stops the callbacks', async () => {
    const sandbox = await client.runContainer({ image: 'busybox' });
    server.edge.onCommand = () => ({
      stdout: Array.from({ length: 200 }, () => 'tick\n'),
      delayMs: 10,
    });
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
    server.edge.hangCreates = true;
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
