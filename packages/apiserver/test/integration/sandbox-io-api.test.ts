import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { createHash, randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, isDsecError, type Sandbox } from '@dsec/sdk';

let node: SingleNode;
let client: DSecClient;
let sb: Sandbox;
let work: string;

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-io-api-'));
  await chmod(work, 0o711);
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'io-node' });
  const rootfs = join(work, 'rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  await rm(rootfs, { recursive: true, force: true });
  client = new DSecClient({ url: node.url, apiKey: node.adminKey });
  sb = await client.runContainer({ image: 'busybox', memoryLimitMb: 256 });
});

after(async () => {
  client?.close();
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

test('sessions over HTTP: state persists, output streams, a request ID runs once', async () => {
  const s = sb.session(`api-${randomBytes(3).toString('hex')}`);
  await s.run('cd /tmp && export GREETING=hello');
  const r = await s.run('echo "$GREETING from $(pwd)"');
  assert.equal(r.stdout, 'hello from /tmp\n');
  assert.equal(r.session, s.name);
  const events: string[] = [];
  const streamed = s.run('echo out; echo err >&2; exit_code() { return 4; }; exit_code');
  for await (const ev of streamed) events.push(`${ev.type}:${ev.data}`);
  assert.deepEqual(events.sort(), ['stderr:err\n', 'stdout:out\n']);
  assert.equal((await streamed).exitCode, 4);
  const once = { requestId: `once-${randomBytes(4).toString('hex')}` };
  const [a, b] = await Promise.all([
    s.run('n=$((n+1)); echo $n', once),
    s.run('n=$((n+1)); echo $n', once),
  ]);
  assert.equal(a.commandId, b.commandId);
  assert.equal((await s.run('echo $n')).stdout, '1\n');
  await s.close();
  const fresh = await s.run('echo "[$GREETING]"');
  assert.equal(fresh.stdout, '[]\n');
  await s.close();
});

test('background commands: reconnect by ID from another client, replay then live output, stdin, kill', async () => {
  const h = await sb.commands.start(
    'echo start; while read line; do echo "got $line"; done; echo end',
    {
      stdinOpen: true,
    },
  );
  await h.sendStdin('one\n');
  await sleep(100);
  const other = new DSecClient({ url: node.url, apiKey: node.adminKey });
  try {
    const again = await other.sandbox(sb.id).commands.get(h.id);
    assert.equal(again.info?.state, 'running');
    const seen: string[] = [];
    const output = again.output({ onStdout: (t) => seen.push(t) });
    const done = output.result;
    await sleep(100);
    await again.sendStdin('two\n');
    await again.closeStdin();
    const result = await done;
    assert.equal(seen.join(''), 'start\ngot one\ngot two\nend\n');
    assert.equal(result.stdout, 'start\ngot one\ngot two\nend\n');
    assert.equal((await h.wait()).exitCode, 0);
  } finally {
    other.close();
  }
  const sleeper = await sb.commands.start(['sleep', '1000']);
  await sleeper.kill();
  assert.equal((await sleeper.wait()).outcome, 'killed');
  await assert.rejects(sb.commands.get('cmd-nope'), (e) => isDsecError(e, 'command_not_found'));
  assert.ok((await sb.commands.list()).some((c) => c.commandId === sleeper.id));
});

test('a command retried with its request ID after the client went away is not run twice', async () => {
  const requestId = `retry-${randomBytes(4).toString('hex')}`;
  const file = `/tmp/${requestId}`;
  const ac = new AbortController();
  const first = sb.commands.run(`echo ran >> ${file}; sleep 0.5; cat ${file}`, {
    requestId,
    signal: ac.signal,
  });
  await sleep(150);
  ac.abort();
  await assert.rejects(first.result, (e) => isDsecError(e, 'aborted'));
  const retry = await sb.commands.run(`echo ran >> ${file}; sleep 0.5; cat ${file}`, { requestId });
  assert.equal(retry.stdout, 'ran\n');
  assert.equal(retry.outcome, 'exited');
});

test('raw stdout streaming: every byte in order, the result in a trailer, errors too', async () => {
  const hash = createHash('sha256');
  let bytes = 0;
  const r = await sb.commands.stream(['sh', '-c', 'seq 1 200000; echo oops >&2; exit 3'], {
    onStdout: (chunk) => {
      bytes += chunk.length;
      hash.update(chunk);
    },
  });
  const expected = Array.from({ length: 200000 }, (_, i) => `${i + 1}\n`).join('');
  assert.equal(bytes, Buffer.byteLength(expected));
  assert.equal(hash.digest('hex'), createHash('sha256').update(expected).digest('hex'));
  assert.equal(r.exitCode, 3);
  assert.equal(r.stdoutBytes, bytes);
  assert.equal(r.stderrBytes, 5);
  assert.equal((await (await sb.commands.get(r.commandId)).wait()).stderr, 'oops\n');
  await assert.rejects(
    sb.commands.stream(['/no/such/program'], { onStdout: () => undefined }),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('`yes` streamed through the full path stays within the cap', async () => {
  let streamed = 0;
  const r = await sb.commands.run(['yes'], {
    timeoutMs: 1500,
    maxOutputBytes: 2048,
    onStdout: (t) => (streamed += t.length),
  });
  assert.equal(r.outcome, 'timeout');
  assert.ok(r.stdoutBytes > 1024 * 1024, `${r.stdoutBytes}`);
  assert.ok(r.stdout.length <= 2048);
  assert.equal(r.truncated, true);
  assert.ok(streamed > 0);
});

test('files over HTTP: text, bytes, listing, errors, and a streamed upload and download', async () => {
  const dir = `/tmp/api-files-${randomBytes(3).toString('hex')}`;
  await sb.files.mkdir(`${dir}/sub`, { parents: true });
  const info = await sb.files.write(`${dir}/hello.txt`, 'hello\n', { mode: 0o600 });
  assert.equal(info.mode, 0o600);
  assert.equal(await sb.files.read(`${dir}/hello.txt`), 'hello\n');
  assert.deepEqual(
    (await sb.files.list(dir)).map((e) => `${e.name}:${e.type}`),
    ['hello.txt:file', 'sub:directory'],
  );
  await sb.files.rename(`${dir}/hello.txt`, `${dir}/sub/moved.txt`);
  assert.equal((await sb.files.stat(`${dir}/sub/moved.txt`)).size, 6);
  await assert.rejects(sb.files.read(`${dir}/hello.txt`), (e) => isDsecError(e, 'not_found'));
  await assert.rejects(sb.files.remove(dir), (e) => isDsecError(e, 'conflict'));

  const local = join(work, 'blob');
  const blob = randomBytes(48 * 1024 * 1024);
  await writeFile(local, blob);
  const up = await sb.files.upload(local, `${dir}/blob`);
  assert.equal(up.size, blob.length);
  const back = join(work, 'blob-back');
  const { bytes } = await sb.files.download(`${dir}/blob`, back);
  assert.equal(bytes, blob.length);
  const digest = (b: Buffer) => createHash('sha256').update(b).digest('hex');
  assert.equal(digest(await readFile(back)), digest(blob));
  const inSandbox = await sb.commands.run(['sha256sum', `${dir}/blob`]);
  assert.equal(inSandbox.stdout.split(' ')[0], digest(blob));

  // A link to / inside the sandbox resolves inside it.
  await sb.commands.run(`ln -s / ${dir}/root; echo sandbox-etc > /etc/motd-dsec`);
  assert.equal(await sb.files.read(`${dir}/root/etc/motd-dsec`), 'sandbox-etc\n');
  await sb.files.remove(dir, { recursive: true });
});

test('HTTP into the sandbox: a request to httpd on a port, its 404s, and a closed port', async () => {
  const httpd = await sb.commands.start(
    'mkdir -p /srv && echo "<h1>hi</h1>" > /srv/index.html && exec httpd -f -p 8080 -h /srv',
  );
  try {
    let res: Response | undefined;
    for (let i = 0; i < 50 && !res; i++) {
      res = await sb.fetch(8080, '/index.html').catch(async () => {
        await sleep(50);
        return undefined;
      });
    }
    assert.equal(res?.status, 200);
    assert.equal(await res?.text(), '<h1>hi</h1>\n');
    const missing = await sb.fetch(8080, '/nope?x=1');
    assert.equal(missing.status, 404);
    await missing.arrayBuffer();
    await assert.rejects(sb.fetch(8099, '/'), (e) => isDsecError(e, 'unavailable'));
  } finally {
    await httpd.kill();
  }
});

test('an interactive terminal: window size, keystrokes, exit code', async () => {
  let out = '';
  const term = await sb.terminal((c) => (out += c.toString()), { rows: 30, cols: 100 });
  term.write('stty size; echo sum-$((40+2))\n');
  for (let i = 0; i < 100 && !out.includes('sum-42'); i++) await sleep(20);
  term.resize(40, 120);
  term.write('stty size; exit 5\n');
  assert.equal(await term.exited, 5);
  assert.match(out, /30 100/);
  assert.match(out, /40 120/);
});

test("another tenant's key sees none of it", async () => {
  const project = await client.createProject({ name: `other-${randomBytes(3).toString('hex')}` });
  const key = await client.createKey({ projectId: project.id });
  const stranger = new DSecClient({ url: node.url, apiKey: key.key });
  try {
    const theirs = stranger.sandbox(sb.id);
    const notFound = (e: unknown) => isDsecError(e, 'sandbox_not_found');
    await assert.rejects(theirs.files.read('/etc/hostname'), notFound);
    await assert.rejects(theirs.files.list('/'), notFound);
    await assert.rejects(theirs.commands.list(), notFound);
    await assert.rejects(theirs.session('x').run('id').result, notFound);
    await assert.rejects(theirs.fetch(8080, '/'), notFound);
    await assert.rejects(
      theirs.terminal(() => undefined),
      notFound,
    );
  } finally {
    stranger.close();
  }
});
