import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { request } from 'node:http';
import type { Duplex } from 'node:stream';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { isDsecError, randomId } from '@dsec/core';
import type { SessionResult } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { makeStateDir, spec } from './fixture.js';

// One edge and one sandbox for the file; every test uses its own sessions, paths and commands.
let edge: Edge;
let sb: string;
let cleanup: () => Promise<void>;

before(async () => {
  const state = await makeStateDir();
  const open = () =>
    openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(state.dir, 'edge'),
      store: state.store,
      cgroupParent: state.cgroupParent,
    });
  edge = await open();
  sb = (await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() })).id;
  cleanup = async () => {
    for (const s of await edge.listSandboxes({}))
      await edge.stopSandbox(s.id).catch(() => undefined);
    await edge.close();
    await state.cleanup();
  };
});

after(async () => {
  await cleanup();
});

const run = (session: string, line: string, extra: { timeoutMs?: number; stdin?: string } = {}) =>
  edge.io.runInSession(sb, session, { line, ...extra });

test('a session keeps cwd, exports, variables and functions across calls', async () => {
  const s = `keep-${randomId('s')}`;
  assert.equal((await run(s, 'cd /tmp && export A=1; B=2; f() { echo "f:$1"; }')).exitCode, 0);
  const r = await run(s, 'echo "$A $B $(pwd)"; f x; echo err >&2; false');
  assert.equal(r.stdout, '1 2 /tmp\nf:x\n');
  assert.equal(r.stderr, 'err\n');
  assert.equal(r.exitCode, 1);
  assert.equal(r.shellRestarted, false);
  // Another session is another shell.
  assert.equal((await run(`${s}-other`, 'echo "[$A]" $(pwd)')).stdout, '[] /root\n');
  // Output without a final newline and a syntax error do not break the session.
  assert.equal((await run(s, 'printf no-newline')).stdout, 'no-newline');
  const bad = await run(s, 'echo "unterminated');
  assert.equal(bad.exitCode, 2);
  assert.equal((await run(s, 'echo $A')).stdout, '1\n');
  assert.equal(
    (await run(s, 'cat', { stdin: 'line one\nline two\n' })).stdout,
    'line one\nline two\n',
  );
  assert.equal((await run(s, 'cat')).stdout, '', 'stdin is /dev/null unless given');
  await edge.io.closeSession(sb, s);
});

test('output cannot forge the end of a call or its exit status', async () => {
  const s = `spoof-${randomId('s')}`;
  // Lookalike markers, with a guessed nonce, on both streams, then a real status of 7.
  const fake = `printf '\\036DSEC:%s:0\\036' 00000000000000000000000000000000; printf '\\036DSEC:%s:0\\036' x >&2; (exit 7)`;
  const r = await run(s, fake);
  assert.equal(r.exitCode, 7);
  assert.equal(r.stdout, '\x1eDSEC:00000000000000000000000000000000:0\x1e');
  assert.equal(r.stderr, '\x1eDSEC:x:0\x1e');
  // A background job chattering between calls does not end or leak into a call's status.
  await run(s, "(for i in 1 2 3 4 5; do printf '\\036DSEC:'; sleep 0.05; done) >/dev/null 2>&1 &");
  for (let i = 0; i < 5; i++)
    assert.equal((await run(s, `exit_with() { return ${i}; }; exit_with`)).exitCode, i);
  await edge.io.closeSession(sb, s);
});

test('calls on one session are serialized', async () => {
  const s = `serial-${randomId('s')}`;
  await run(s, 'n=0');
  const results = await Promise.all(
    Array.from({ length: 6 }, () => run(s, 'n=$((n+1)); sleep 0.02; echo $n')),
  );
  assert.deepEqual(results.map((r) => r.stdout.trim()).sort(), ['1', '2', '3', '4', '5', '6']);
  await edge.io.closeSession(sb, s);
});

test('a timeout kills the foreground job, not the session or its background jobs', async () => {
  const s = `timeout-${randomId('s')}`;
  await run(s, 'export KEEP=yes; sleep 1000 & echo $! > /tmp/bg-pid-' + s);
  const r = await run(s, 'sleep 30', { timeoutMs: 300 });
  assert.equal(r.outcome, 'timeout');
  assert.equal(r.sessionEnded, false);
  const after = await run(s, 'echo $KEEP; kill -0 $(cat /tmp/bg-pid-' + s + ') && echo bg-alive');
  assert.equal(after.stdout, 'yes\nbg-alive\n');
  assert.equal(after.shellRestarted, false);
  await edge.io.closeSession(sb, s);
});

test('a shell that cannot be interrupted, or exits, is replaced on the next call, which says so', async () => {
  const s = `restart-${randomId('s')}`;
  await run(s, 'export GONE=1');
  const stuck = await run(s, 'while :; do :; done', { timeoutMs: 300 });
  assert.equal(stuck.outcome, 'timeout');
  assert.equal(stuck.sessionEnded, true);
  const next = await run(s, 'echo "[$GONE]"');
  assert.equal(next.shellRestarted, true);
  assert.equal(next.stdout, '[]\n');
  const exited = await run(s, 'exit 3');
  assert.equal(exited.exitCode, 3);
  assert.equal(exited.sessionEnded, true);
  assert.equal((await run(s, 'true')).shellRestarted, true);
  await edge.io.closeSession(sb, s);
});

test("sessions use the platform's shell unless asked for the sandbox's own; poisoning /bin/sh changes nothing", async () => {
  const own = await edge.io.runInSession(sb, `own-${randomId('s')}`, {
    line: 'echo $((6*7))',
    shell: '/bin/sh',
  });
  assert.equal(own.stdout, '42\n');
  await edge.runCommand(sb, {
    argv: [
      'sh',
      '-c',
      'rm -f /tmp/sh.bak; cp /bin/busybox /tmp/sh.bak; rm /bin/sh; printf "#!/tmp/sh.bak sh\\necho pwned\\n" > /bin/sh; chmod +x /bin/sh',
    ],
  });
  try {
    const r = await run(`poison-${randomId('s')}`, 'echo clean');
    assert.equal(r.stdout, 'clean\n');
  } finally {
    await edge.runCommand(sb, { argv: ['/tmp/sh.bak', 'ln', '-sf', '/bin/busybox', '/bin/sh'] });
  }
});

test('background commands: streamed stdin, output replay, signal, kill, and results by ID', async () => {
  const cat = await edge.io.startCommand(sb, { argv: ['cat'], stdinOpen: true });
  assert.equal(cat.state, 'running');
  assert.equal(cat.background, true);
  await edge.io.writeStdin(sb, cat.commandId, Buffer.from('hello '));
  await edge.io.writeStdin(sb, cat.commandId, Buffer.from('world'), { eof: true });
  const done = await edge.io.waitCommand(sb, cat.commandId);
  assert.equal(done.stdout, 'hello world');
  assert.equal((await edge.io.getCommand(sb, cat.commandId)).result?.stdout, 'hello world');

  const ticker = await edge.io.startCommand(sb, {
    shell: 'echo first; trap "echo got-term; exit 9" TERM; while :; do sleep 0.05; done',
  });
  await sleep(200);
  const seen: string[] = [];
  const watching = edge.io.watchCommand(sb, ticker.commandId, {
    onStdout: (c) => seen.push(c.toString()),
  });
  await edge.io.signalCommand(sb, ticker.commandId, 'SIGTERM');
  const r = await watching;
  assert.equal(r.exitCode, 9);
  assert.equal(seen.join(''), 'first\ngot-term\n', 'replayed, then live');

  const sleeper = await edge.io.startCommand(sb, { argv: ['sleep', '1000'] });
  await edge.io.killCommand(sb, sleeper.commandId);
  assert.equal((await edge.io.waitCommand(sb, sleeper.commandId)).outcome, 'killed');
  await assert.rejects(edge.io.getCommand(sb, 'cmd-does-not-exist'), (e) =>
    isDsecError(e, 'command_not_found'),
  );
  await assert.rejects(edge.io.writeStdin(sb, sleeper.commandId, Buffer.from('x')), (e) =>
    isDsecError(e, 'conflict'),
  );
});

test('yes for a few seconds keeps the captured output within the cap', async () => {
  const y = await edge.io.startCommand(sb, { argv: ['yes'], maxOutputBytes: 4096 });
  await sleep(2000);
  await edge.io.killCommand(sb, y.commandId);
  const r = await edge.io.waitCommand(sb, y.commandId);
  assert.ok(r.stdoutBytes > 10 * 1024 * 1024, `yes wrote ${r.stdoutBytes} bytes`);
  assert.ok(r.stdout.length <= 4096);
  assert.equal(r.truncated, true);
  assert.ok(r.stdout.startsWith('y\ny\n') && r.stdout.endsWith('y\n'));
});

test('a request ID runs a command once, even when retried concurrently', async () => {
  const file = `/tmp/once-${randomId('f')}`;
  const requestId = randomId('req');
  const cmd = { shell: `echo ran >> ${file}; sleep 0.2; cat ${file}`, requestId };
  const [a, b] = await Promise.all([edge.runCommand(sb, cmd), edge.runCommand(sb, cmd)]);
  const c = await edge.runCommand(sb, cmd);
  assert.equal(a.commandId, b.commandId);
  assert.equal(c.commandId, a.commandId);
  assert.equal(c.stdout, 'ran\n');
  const count = await edge.runCommand(sb, { argv: ['cat', file] });
  assert.equal(count.stdout, 'ran\n');
});

test('files: write, read, stat, list, mkdir, rename, remove; names with spaces and newlines', async () => {
  const dir = `/tmp/files-${randomId('d')}`;
  await edge.io.mkdir(sb, `${dir}/a/b`, { parents: true });
  await assert.rejects(edge.io.mkdir(sb, `${dir}/a`), (e) => isDsecError(e, 'conflict'));
  const odd = 'new\nline and space';
  const info = await edge.io.writeFile(sb, `${dir}/${odd}`, Buffer.from('hi'), { mode: 0o751 });
  assert.deepEqual([info.type, info.size, info.mode], ['file', 2, 0o751]);
  const listing = await edge.io.listDir(sb, dir);
  assert.deepEqual(
    listing.map((e) => [e.name, e.type]),
    [
      ['a', 'directory'],
      [odd, 'file'],
    ],
  );
  const stream = await edge.io.readFile(sb, `${dir}/${odd}`);
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(c as Buffer);
  assert.equal(Buffer.concat(chunks).toString(), 'hi');
  // An existing file keeps its mode when rewritten without one.
  assert.equal((await edge.io.writeFile(sb, `${dir}/${odd}`, Buffer.from('again'))).mode, 0o751);
  await edge.io.rename(sb, `${dir}/${odd}`, `${dir}/renamed`);
  await assert.rejects(edge.io.statFile(sb, `${dir}/${odd}`), (e) => isDsecError(e, 'not_found'));
  await assert.rejects(edge.io.readFile(sb, dir), (e) => isDsecError(e, 'invalid_argument'));
  await assert.rejects(edge.io.remove(sb, dir), (e) => isDsecError(e, 'conflict'));
  await edge.io.remove(sb, dir, { recursive: true });
  await assert.rejects(edge.io.listDir(sb, dir), (e) => isDsecError(e, 'not_found'));
  const leftovers = await edge.runCommand(sb, { shell: 'ls -a /tmp | grep -c dsec-write || true' });
  assert.equal(leftovers.stdout.trim(), '0', 'no temp files are left behind');
});

test('reading a fifo or a device the sandbox made answers invalid_argument at once instead of hanging', async () => {
  const dir = `/tmp/fifo-${randomId('d')}`;
  await edge.runCommand(sb, {
    shell: `mkdir -p ${dir} && mkfifo ${dir}/pipe && ln -s pipe ${dir}/link && ln -s /dev/zero ${dir}/zero`,
  });
  // Nobody ever writes to the fifo: a read that opened it would wait forever.
  for (const path of [`${dir}/pipe`, `${dir}/link`, `${dir}/zero`, '/dev/zero']) {
    await assert.rejects(
      edge.io.readFile(sb, path),
      (e) => isDsecError(e, 'invalid_argument'),
      path,
    );
  }
  await edge.io.remove(sb, dir, { recursive: true });
});

test('file operations stay inside the sandbox through symlinks and .. (SECURITY A9)', async () => {
  const d = `/tmp/a9-${randomId('d')}`;
  const marker = `host-file-${randomBytes(6).toString('hex')}`;
  await edge.runCommand(sb, {
    shell: `mkdir -p ${d}/x/y && ln -s / ${d}/root && ln -s ../../../../../.. ${d}/x/y/up && echo sandbox-hostname > /etc/hostname`,
  });
  const hostHostname = readFileSync('/etc/hostname', 'utf8');
  for (const via of [
    `${d}/root/etc/hostname`,
    `${d}/x/y/up/etc/hostname`,
    `${d}/../../../../etc/hostname`,
  ]) {
    const s = await edge.io.readFile(sb, via);
    let text = '';
    for await (const c of s) text += String(c);
    assert.equal(text, 'sandbox-hostname\n', via);
    assert.notEqual(text, hostHostname);
  }
  // Writing through the links creates files in the sandbox, never on the host.
  await edge.io.writeFile(sb, `${d}/root/tmp/${marker}`, Buffer.from('x'));
  await edge.io.writeFile(sb, `${d}/x/y/up/tmp/${marker}-2`, Buffer.from('x'));
  await edge.io.mkdir(sb, `${d}/root/tmp/${marker}-dir`);
  assert.equal(existsSync(`/tmp/${marker}`), false);
  assert.equal(existsSync(`/tmp/${marker}-2`), false);
  assert.equal(existsSync(`/tmp/${marker}-dir`), false);
  assert.equal((await edge.io.statFile(sb, `/tmp/${marker}-2`)).type, 'file');
  // Listing through a link to / lists the sandbox's root.
  const names = (await edge.io.listDir(sb, `${d}/root`)).map((e) => e.name);
  assert.ok(names.includes('bin') && !names.includes('work'), names.join(','));
  const link = await edge.io.statFile(sb, `${d}/root`);
  assert.deepEqual([link.type, link.target], ['symlink', '/']);

  // The sandbox swaps a path between a directory and a link to / as fast as it can.
  const race = await edge.io.startCommand(sb, {
    shell: `mkdir -p ${d}/real/etc && echo inner > ${d}/real/etc/hostname; while :; do ln -sfn / ${d}/swap; rm -f ${d}/swap; ln -sfn ${d}/real ${d}/swap; rm -f ${d}/swap; done`,
  });
  try {
    for (let i = 0; i < 40; i++) {
      let text = '';
      try {
        for await (const c of await edge.io.readFile(sb, `${d}/swap/etc/hostname`))
          text += String(c);
      } catch (e) {
        // The path may vanish between the checks and the read: any clean error is fine.
        if (!isDsecError(e)) throw e;
      }
      assert.ok(['', 'inner\n', 'sandbox-hostname\n'].includes(text), JSON.stringify(text));
      await edge.io
        .writeFile(sb, `${d}/swap/${marker}-race`, Buffer.from('x'))
        .catch(() => undefined);
    }
  } finally {
    await edge.io.killCommand(sb, race.commandId);
  }
  assert.equal(existsSync(`/${marker}-race`), false);
});

test('a port inside the sandbox answers through connectPort', async () => {
  const httpd = await edge.io.startCommand(sb, {
    shell:
      'mkdir -p /www && echo hello-from-httpd > /www/index.html && exec httpd -f -p 127.0.0.1:8081 -h /www',
  });
  try {
    let body = '';
    for (let attempt = 0; attempt < 50 && body === ''; attempt++) {
      body = await get(await edge.io.connectPort(sb, 8081), '/index.html').catch(async () => {
        await sleep(50);
        return '';
      });
    }
    assert.equal(body, 'hello-from-httpd\n');
    await assert.rejects(
      edge.io.connectPort(sb, 8099).then((s) => get(s, '/')),
      (e) => isDsecError(e, 'unavailable'),
    );
    // The failure reaches a consumer that attaches after `nc` has long given up.
    const late = await edge.io.connectPort(sb, 8098);
    await sleep(500);
    await assert.rejects(get(late, '/'), (e) => isDsecError(e, 'unavailable'));
  } finally {
    await edge.io.killCommand(sb, httpd.commandId);
  }
});

function get(socket: Duplex, path: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({
      path,
      headers: { connection: 'close', host: 'x' },
      createConnection: () => socket,
    });
    req.on('error', reject);
    req.on('response', (res) => {
      let text = '';
      res.on('data', (c: Buffer) => (text += c.toString()));
      res.on('end', () => resolve(text));
      res.on('error', reject);
    });
    req.end();
  });
}

test('the command log survives an edge restart; a retried request ID is not run again', async () => {
  const state = await makeStateDir();
  const open = () =>
    openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(state.dir, 'edge'),
      store: state.store,
      cgroupParent: state.cgroupParent,
    });
  let e = await open();
  try {
    const id = (await e.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() })).id;
    const cmd = { shell: 'echo once >> /tmp/count; cat /tmp/count', requestId: 'restart-1' };
    const first = await e.runCommand(id, cmd);
    const bg = await e.io.startCommand(id, { argv: ['sleep', '1000'], requestId: 'restart-2' });
    const session: SessionResult = await e.io.runInSession(id, 's', { line: 'echo in-session' });
    await e.close();
    e = await open();
    assert.equal((await e.io.getCommand(id, first.commandId)).result?.stdout, 'once\n');
    assert.equal((await e.io.getCommand(id, session.commandId)).result?.stdout, 'in-session\n');
    const again = await e.runCommand(id, cmd);
    assert.equal(again.commandId, first.commandId);
    assert.equal((await e.runCommand(id, { argv: ['cat', '/tmp/count'] })).stdout, 'once\n');
    const lost = await e.io.waitCommand(id, bg.commandId);
    assert.equal(lost.outcome, 'killed');
    assert.match(lost.reason ?? '', /restarted/);
  } finally {
    for (const s of await e.listSandboxes({})) await e.stopSandbox(s.id).catch(() => undefined);
    await e.close();
    await state.cleanup();
  }
});
