import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  CommandExitError,
  FileNotFoundError,
  FilesystemEventType,
  FileType,
  NotFoundError,
  Sandbox,
  SandboxNotFoundError,
} from 'e2b';
import type { FilesystemEvent } from 'e2b';
import { DSecClient } from '@dsec/sdk';
import { toDsecSandboxId } from '@dsec/e2b';
import { useE2b, withE2bNode } from './e2b-node.js';

/**
 * The unmodified `e2b` SDK (pinned in package.json) against a real DSec
 * node with the E2B routes: every call docs/e2b.md lists as covered.
 */

const SANDBOX_MS = 300_000;

/** Waits until `check` holds, polling; the SDK's callbacks arrive asynchronously. */
async function until(check: () => boolean, what: string, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

test('control plane: create from a template, get, list with metadata and pages, connect, setTimeout, kill', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const a = await Sandbox.create('base', {
      timeoutMs: SANDBOX_MS,
      metadata: { job: 'j1', 'odd.key/x': 'a&b=c %' },
      envs: { GREETING: 'hello' },
    });
    const b = await Sandbox.create({ template: 'busybox', metadata: { job: 'j1' } });
    const c = await Sandbox.create('busybox', { metadata: { job: 'j2' } });
    assert.match(a.sandboxId, /^sb[a-z2-7]+$/);

    const info = await a.getInfo();
    assert.equal(info.sandboxId, a.sandboxId);
    assert.equal(info.templateId, 'base');
    assert.deepEqual(info.metadata, { job: 'j1', 'odd.key/x': 'a&b=c %' });
    assert.equal(info.state, 'running');
    assert.equal(info.memoryMB, 512);
    assert.equal(info.cpuCount, 1);
    const ttl = info.endAt.getTime() - info.startedAt.getTime();
    assert.ok(Math.abs(ttl - SANDBOX_MS) < 5_000, `ttl ${ttl}`);
    assert.equal((await a.commands.run('echo $GREETING')).stdout, 'hello\n');

    // The same sandbox through the native API: one ID, two spellings.
    const native = new DSecClient({ url, apiKey: adminKey });
    await native.open();
    const nativeInfo = (await native.getSandbox(toDsecSandboxId(a.sandboxId))).info!;
    assert.equal(nativeInfo.spec.image, 'busybox');
    assert.equal(nativeInfo.spec.labels.job, 'j1');
    native.close();

    // Filters: metadata (encoded both ways), template, state; pages of one, newest first.
    const ids = async (opts: Parameters<typeof Sandbox.list>[0]) => {
      const out: string[] = [];
      const pages = Sandbox.list(opts);
      while (pages.hasNext) out.push(...(await pages.nextItems()).map((s) => s.sandboxId));
      return out;
    };
    assert.deepEqual(await ids({ query: { metadata: { job: 'j1' } }, limit: 1 }), [
      b.sandboxId,
      a.sandboxId,
    ]);
    assert.deepEqual(await ids({ query: { metadata: { 'odd.key/x': 'a&b=c %' } } }), [a.sandboxId]);
    assert.deepEqual(await ids({ query: { metadata: { job: 'j1' } }, order: 'asc' }), [
      a.sandboxId,
      b.sandboxId,
    ]);
    assert.deepEqual(await ids({ query: { template: 'base' } }), [a.sandboxId]);
    assert.deepEqual(await ids({ query: { state: ['paused'] } }), []);
    assert.deepEqual((await ids({ limit: 2 })).length, 3);
    const listed = await Sandbox.list({ query: { metadata: { job: 'j2' } } }).nextItems();
    assert.equal(listed[0]?.templateId, 'busybox');
    assert.equal(listed[0]?.state, 'running');

    // Connect gives a working handle; setTimeout moves the end.
    const again = await Sandbox.connect(a.sandboxId);
    assert.equal((await again.commands.run('echo connected')).stdout, 'connected\n');
    await again.setTimeout(60_000);
    const moved = await Sandbox.getInfo(a.sandboxId);
    assert.ok(Math.abs(moved.endAt.getTime() - Date.now() - 60_000) < 5_000);
    assert.equal(await again.isRunning(), true);

    const metrics = await a.getMetrics();
    assert.equal(metrics.length, 1);
    assert.ok(metrics[0]!.memUsed > 0);
    assert.equal(metrics[0]!.memTotal, 512 * 1024 * 1024);

    assert.equal(await Sandbox.kill(c.sandboxId), true);
    assert.equal(await Sandbox.kill(c.sandboxId), false);
    await assert.rejects(Sandbox.getInfo(c.sandboxId), SandboxNotFoundError);
    await assert.rejects(Sandbox.connect(c.sandboxId), SandboxNotFoundError);
    await b.kill();
    assert.equal(await b.isRunning(), false);
    await a.kill();
    assert.deepEqual(await ids({}), []);

    // A volume mount names a DSec volume of the project (docs/volumes.md); unknown templates are not found.
    await assert.rejects(
      Sandbox.create('base', { volumeMounts: { '/data': 'vol' } }),
      /404: no volume vol/,
    );
    await assert.rejects(Sandbox.create('no-such-image'), /404.*no-such-image|image/i);
    await assert.rejects(Sandbox.create('Bad Template'), /400: template "Bad Template"/);
    // DSec's label rules apply to metadata, and name the E2B field.
    await assert.rejects(
      Sandbox.create('base', { metadata: { 'has space': 'x' } }),
      /400: metadata\.has space: must be a label key/,
    );
  });
});

test('commands: streaming callbacks, exit codes, env, cwd, user, background with stdin and kill, list, connect', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
    try {
      const out: string[] = [];
      const err: string[] = [];
      const r = await sbx.commands.run('for i in 1 2 3; do echo out$i; echo err$i >&2; done', {
        onStdout: (d) => void out.push(d),
        onStderr: (d) => void err.push(d),
      });
      assert.equal(r.exitCode, 0);
      assert.equal(r.stdout, 'out1\nout2\nout3\n');
      assert.equal(r.stderr, 'err1\nerr2\nerr3\n');
      assert.equal(out.join(''), r.stdout);
      assert.equal(err.join(''), r.stderr);

      await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (e: unknown) => {
        assert.ok(e instanceof CommandExitError);
        assert.equal(e.exitCode, 3);
        assert.equal(e.stderr, 'bad\n');
        return true;
      });

      const env = await sbx.commands.run('echo $A-$B; pwd; id -u', {
        envs: { A: '1', B: 'two' },
        cwd: '/tmp',
        user: 'root',
      });
      assert.equal(env.stdout, '1-two\n/tmp\n0\n');
      const nobody = await sbx.commands.run('id -u', { user: 'nobody' });
      assert.equal(nobody.stdout, '65534\n');

      // A command longer than its timeout ends with the SDK's timeout error.
      await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 500 }), /timeout|deadline/i);

      // Background: stdin streamed, then closed; the command ends on EOF.
      const chunks: string[] = [];
      const cat = await sbx.commands.run('cat', {
        background: true,
        stdin: true,
        onStdout: (d) => void chunks.push(d),
      });
      assert.ok(cat.pid > 0);
      await sbx.commands.sendStdin(cat.pid, 'line one\n');
      await until(() => chunks.join('') === 'line one\n', 'the first line back');
      await cat.sendStdin('line two\n');
      await cat.closeStdin();
      const catResult = await cat.wait();
      assert.equal(catResult.exitCode, 0);
      assert.equal(catResult.stdout, 'line one\nline two\n');

      // Background sleeper: listed, connectable, killed.
      const sleeper = await sbx.commands.run('echo started; sleep 300', { background: true });
      await until(() => sleeper.stdout === 'started\n', 'the sleeper to start');
      const running = await sbx.commands.list();
      const listed = running.find((p) => p.pid === sleeper.pid);
      assert.ok(listed, JSON.stringify(running));
      assert.deepEqual(listed.args.at(-1), 'echo started; sleep 300');
      const follower = await sbx.commands.connect(sleeper.pid);
      assert.equal(follower.pid, sleeper.pid);
      assert.equal(await sbx.commands.kill(sleeper.pid), true);
      await assert.rejects(sleeper.wait(), (e: unknown) => {
        assert.ok(e instanceof CommandExitError);
        assert.equal(e.exitCode, -1);
        return true;
      });
      await assert.rejects(follower.wait(), CommandExitError);
      assert.equal(await sbx.commands.kill(sleeper.pid), false);
      assert.equal(await sbx.commands.kill(12345), false);
      assert.ok(!(await sbx.commands.list()).some((p) => p.pid === sleeper.pid));

      // stdin not asked for: sending is refused with a clear error.
      const noStdin = await sbx.commands.run('sleep 5', { background: true });
      await assert.rejects(sbx.commands.sendStdin(noStdin.pid, 'x'), /stdin/);
      await noStdin.kill();
    } finally {
      await sbx.kill();
    }
  });
});

test('pty: a terminal takes input, resizes and is killed', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
    try {
      const decoder = new TextDecoder();
      let screen = '';
      const term = await sbx.pty.create({
        cols: 80,
        rows: 24,
        onData: (d) => void (screen += decoder.decode(d, { stream: true })),
      });
      assert.ok(term.pid > 0);
      await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo pty-$((6*7))\n'));
      await until(() => screen.includes('pty-42'), 'the terminal to echo');
      await sbx.pty.resize(term.pid, { cols: 100, rows: 30 });
      await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size\n'));
      await until(() => screen.includes('30 100'), 'the new size');
      assert.ok((await sbx.commands.list()).some((p) => p.pid === term.pid));
      assert.equal(await sbx.pty.kill(term.pid), true);
      await assert.rejects(term.wait(), CommandExitError);

      const exits = await sbx.pty.create({ cols: 80, rows: 24, onData: () => undefined });
      await sbx.pty.sendInput(exits.pid, new TextEncoder().encode('exit 5\n'));
      await assert.rejects(exits.wait(), (e: unknown) => {
        assert.ok(e instanceof CommandExitError);
        assert.equal(e.exitCode, 5);
        return true;
      });
    } finally {
      await sbx.kill();
    }
  });
});

test('files: write, read, list, stat, makeDir, rename, remove, exists, watch, upload and download', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
    try {
      const w = await sbx.files.write('/work/a/hello.txt', 'hello world');
      assert.deepEqual(
        { name: w.name, type: w.type, path: w.path },
        { name: 'hello.txt', type: 'file', path: '/work/a/hello.txt' },
      );
      assert.equal(await sbx.files.read('/work/a/hello.txt'), 'hello world');
      const bytes = Uint8Array.from({ length: 70_000 }, (_, i) => (i * 7) % 256);
      await sbx.files.write('/work/bin.dat', bytes.buffer);
      assert.deepEqual(await sbx.files.read('/work/bin.dat', { format: 'bytes' }), bytes);
      const blob = await sbx.files.read('/work/bin.dat', { format: 'blob' });
      assert.equal(blob.size, bytes.length);
      // Several files in one multipart upload; an empty one; relative paths under the home.
      const many = await sbx.files.write([
        { path: '/work/m/one.txt', data: '1' },
        { path: '/work/m/two.txt', data: new Blob(['22']) },
        { path: 'rel.txt', data: 'home' },
        { path: '/work/m/empty', data: '' },
      ]);
      assert.deepEqual(
        many.map((f) => f.path),
        ['/work/m/one.txt', '/work/m/two.txt', '/root/rel.txt', '/work/m/empty'],
      );
      assert.equal(await sbx.files.read('~/rel.txt'), 'home');
      assert.equal(await sbx.files.read('/work/m/empty'), '');
      // A streamed (octet-stream) upload and a streamed download.
      await sbx.files.write('/work/stream.txt', new Blob(['streamed']).stream());
      const stream = await sbx.files.read('/work/stream.txt', { format: 'stream' });
      assert.equal(await new Response(stream).text(), 'streamed');

      const st = await sbx.files.getInfo('/work/a/hello.txt');
      assert.equal(st.type, FileType.FILE);
      assert.equal(st.size, 11);
      assert.equal(st.name, 'hello.txt');
      assert.equal(st.owner, 'root');
      assert.match(st.permissions, /^-rw/);
      assert.ok(st.modifiedTime instanceof Date && st.modifiedTime.getTime() > 0);
      assert.equal((await sbx.files.getInfo('/work/a')).type, FileType.DIR);

      assert.equal(await sbx.files.makeDir('/work/d/e/f'), true);
      assert.equal(await sbx.files.makeDir('/work/d/e/f'), false);
      const top = await sbx.files.list('/work');
      assert.deepEqual(
        top.map((e) => [e.name, e.type]),
        [
          ['a', FileType.DIR],
          ['bin.dat', FileType.FILE],
          ['d', FileType.DIR],
          ['m', FileType.DIR],
          ['stream.txt', FileType.FILE],
        ],
      );
      const deep = await sbx.files.list('/work/d', { depth: 3 });
      assert.deepEqual(
        deep.map((e) => e.path),
        ['/work/d/e', '/work/d/e/f'],
      );

      const moved = await sbx.files.rename('/work/a/hello.txt', '/work/new/dir/hi.txt');
      assert.equal(moved.path, '/work/new/dir/hi.txt');
      assert.equal(await sbx.files.exists('/work/a/hello.txt'), false);
      assert.equal(await sbx.files.exists('/work/new/dir/hi.txt'), true);
      await sbx.files.remove('/work/new');
      assert.equal(await sbx.files.exists('/work/new'), false);
      await assert.rejects(sbx.files.read('/work/nope'), FileNotFoundError);
      await assert.rejects(sbx.files.getInfo('/work/nope'), FileNotFoundError);
      await assert.rejects(sbx.files.list('/work/nope'), NotFoundError);

      // Watch: creates, writes and removals, recursive, with entries.
      await sbx.files.makeDir('/work/watched/sub');
      const events: FilesystemEvent[] = [];
      const handle = await sbx.files.watchDir('/work/watched', (e) => void events.push(e), {
        recursive: true,
        includeEntry: true,
        timeoutMs: 0,
      });
      await sbx.files.write('/work/watched/new.txt', 'x');
      await sbx.files.write('/work/watched/sub/deep.txt', 'y');
      await until(
        () =>
          events.some((e) => e.name === 'sub/deep.txt' && e.type === FilesystemEventType.CREATE),
        'the nested create',
      );
      await sbx.files.write('/work/watched/new.txt', 'longer');
      await until(
        () => events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.WRITE),
        'the write',
      );
      await sbx.files.remove('/work/watched/new.txt');
      await until(
        () => events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.REMOVE),
        'the removal',
      );
      const created = events.find((e) => e.name === 'new.txt');
      assert.equal(created?.type, FilesystemEventType.CREATE);
      assert.equal(created?.entry?.path, '/work/watched/new.txt');
      await handle.stop();
      await assert.rejects(
        sbx.files.watchDir('/work/watched/nope', () => undefined),
        NotFoundError,
      );

      // Download and upload URLs of the envd HTTP API, used with the key as the SDK does.
      const down = await fetch(`${url}/files?path=${encodeURIComponent('/work/m/two.txt')}`, {
        headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': adminKey },
      });
      assert.equal(down.status, 200);
      assert.equal(await down.text(), '22');
      const form = new FormData();
      form.append('file', new Blob(['posted']), '/work/posted.txt');
      const up = await fetch(`${url}/files`, {
        method: 'POST',
        body: form,
        headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': adminKey },
      });
      assert.equal(up.status, 200);
      assert.deepEqual(await up.json(), [
        { name: 'posted.txt', type: 'file', path: '/work/posted.txt' },
      ]);
      assert.equal(await sbx.files.read('/work/posted.txt'), 'posted');
      await assert.rejects(
        sbx.files.write('/work/meta.txt', 'x', { metadata: { k: 'v' } }),
        /metadata/,
      );
    } finally {
      await sbx.kill();
    }
  });
});

test('isolation and addressing: another project sees nothing, bad keys are refused, the host-routed form works', async () => {
  await withE2bNode(
    async ({ url, adminKey, node }) => {
      useE2b(url, adminKey);
      const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      try {
        const admin = await node.iam.authenticate(adminKey);
        const other = await node.iam.createProject(admin, { name: 'other' });
        const { key: otherKey } = await node.iam.createKey(admin, { projectId: other.id });

        // The other project's key: the sandbox does not exist for it, on either plane.
        const opts = { apiKey: otherKey };
        assert.deepEqual(await Sandbox.list(opts).nextItems(), []);
        await assert.rejects(Sandbox.getInfo(sbx.sandboxId, opts), SandboxNotFoundError);
        await assert.rejects(Sandbox.connect(sbx.sandboxId, opts), SandboxNotFoundError);
        assert.equal(await Sandbox.kill(sbx.sandboxId, opts), false);
        const rpc = await fetch(`${url}/process.Process/List`, {
          method: 'POST',
          headers: {
            'content-type': 'application/json',
            'E2b-Sandbox-Id': sbx.sandboxId,
            'X-Access-Token': otherKey,
          },
          body: '{}',
        });
        assert.equal(rpc.status, 503);
        assert.equal(((await rpc.json()) as { code: string }).code, 'unavailable');
        const file = await fetch(`${url}/files?path=/etc/passwd`, {
          headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': otherKey },
        });
        assert.equal(file.status, 502);

        // No key, a wrong key: 401 everywhere.
        await assert.rejects(Sandbox.list({ apiKey: 'dsec_nope' }).nextItems(), /401|Unauthorized/);
        const anon = await fetch(`${url}/files?path=/etc/passwd`, {
          headers: { 'E2b-Sandbox-Id': sbx.sandboxId },
        });
        assert.equal(anon.status, 401);
        // The internal route prefix is not reachable directly.
        const direct = await fetch(`${url}/_e2b/sandbox/49983/${sbx.sandboxId}/health`, {
          headers: { 'X-Access-Token': adminKey },
        });
        assert.equal(direct.status, 404);

        // Host-routed: envd's port, then a service of the sandbox on another port.
        const host = (port: number) => `${port}-${sbx.sandboxId}.sandbox.test`;
        const viaHost = await httpGet(url, '/files?path=/etc/hostname', {
          host: host(49983),
          'x-access-token': adminKey,
        });
        assert.equal(viaHost.status, 200);
        await sbx.commands.run(
          'mkdir -p /srv && echo served > /srv/index.html && httpd -p 127.0.0.1:8080 -h /srv',
        );
        const page = await httpGet(url, '/index.html', {
          host: host(8080),
          'x-access-token': adminKey,
        });
        assert.equal(page.status, 200);
        assert.equal(page.body, 'served\n');
        assert.equal(sbx.getHost(8080), host(8080));
        // A name under another domain is no name of this server (DNS rebinding): refused.
        const wrongDomain = await httpGet(url, '/index.html', {
          host: `8080-${sbx.sandboxId}.elsewhere.test`,
          'x-access-token': adminKey,
        });
        assert.equal(wrongDomain.status, 400);
      } finally {
        await sbx.kill();
      }
    },
    { sandboxDomain: 'sandbox.test' },
  );
});

test('pause and resume', async () => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);
    const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
    try {
      await sbx.commands.run('echo kept > /root/state');
      assert.equal(await sbx.pause(), true);
      assert.equal((await sbx.getInfo()).state, 'paused');
      assert.equal(await sbx.pause(), false);
      const back = await Sandbox.connect(sbx.sandboxId);
      assert.equal((await back.getInfo()).state, 'running');
      assert.equal(await back.files.read('/root/state'), 'kept\n');
    } finally {
      await sbx.kill();
    }
  });
});

/** A GET with a chosen Host header (fetch does not let a caller set Host). */
async function httpGet(
  base: string,
  path: string,
  headers: Record<string, string>,
): Promise<{ status: number; body: string }> {
  const { request } = await import('node:http');
  const u = new URL(base);
  return new Promise((resolve, reject) => {
    const req = request({ host: u.hostname, port: u.port, path, method: 'GET', headers }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
    });
    req.on('error', reject);
    req.end();
  });
}
