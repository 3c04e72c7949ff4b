import { test } from 'node:test';
import assert from 'node:assert/strict';
import { getEventListeners } from 'node:events';
import { Duplex, Readable } from 'node:stream';
import { DsecError, isDsecError, SandboxIdCodec } from '@dsec/core';
import type {
  CommandResult,
  EdgeApi,
  FileInfo,
  PtySession,
  RunCommandOptions,
  SandboxIoApi,
} from '@dsec/core';
import { edgeApiConformance } from '@dsec/core/testing';
import { addFnCall, FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';

const ids = new SandboxIdCodec('edge-http-unit-secret');
const EDGE = 'edge-h';

edgeApiConformance('RemoteEdge → serveEdge(FakeEdge)', async () => {
  const secret = newEdgeSecret();
  const fake = addFnCall(
    new FakeEdge({
      edgeId: EDGE,
      capacity: { memoryMb: 4096, cpuCores: 4, sandboxes: 3 },
    }),
  );
  fake.fncallDouble.pools = [
    { language: 'python', network: false, idle: 1, busy: 0, starting: 0, max: 4 },
  ];
  const server = await serveEdge({ edge: fake, secret });
  const edge = new RemoteEdge({ edgeId: EDGE, url: server.url, secret });
  return {
    edge,
    capacitySandboxes: 3,
    mintId: () => ids.mint(EDGE),
    image: 'base',
    // The served FakeEdge has none of these; the client answers `unavailable` (tested below).
    io: false,
    events: false,
    // The double echoes stdin whatever the code.
    fncall: { language: 'python', echoCode: 'import sys; sys.stdout.write(sys.stdin.read())' },
    cleanup: async () => {
      edge.close();
      await server.close();
    },
  };
});

/** The FakeEdge's lifecycle with a scripted in-sandbox interface: each test writes the io it needs. */
function scripted(io: Partial<SandboxIoApi>, overrides: Partial<EdgeApi> = {}): EdgeApi {
  const fake = new FakeEdge({ edgeId: EDGE });
  const missing = (name: string) => () => {
    throw new Error(`the test did not script io.${name}`);
  };
  return {
    edgeId: EDGE,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
    io: new Proxy(io, {
      get: (t, p: string) => (t as Record<string, unknown>)[p] ?? missing(p),
    }) as SandboxIoApi,
    ...overrides,
  };
}

async function withServed(edge: EdgeApi, fn: (remote: RemoteEdge) => Promise<void>): Promise<void> {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret });
  const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
  try {
    await fn(remote);
  } finally {
    remote.close();
    await server.close();
  }
}

function result(stdout: string, extra: Partial<CommandResult> = {}): CommandResult {
  return {
    commandId: 'cmd-1',
    exitCode: 0,
    outcome: 'exited',
    stdout,
    stderr: '',
    truncated: false,
    stdoutBytes: stdout.length,
    stderrBytes: 0,
    durationMs: 1,
    ...extra,
  };
}

function deferred<T = void>() {
  let resolve!: (v: T) => void;
  const promise = new Promise<T>((r) => (resolve = r));
  return { promise, resolve };
}

test('an edge without io, events or network policy answers unavailable through the client', async () => {
  await withServed(new FakeEdge({ edgeId: EDGE }), async (remote) => {
    const un = (e: unknown) => isDsecError(e, 'unavailable') && e.message.includes(EDGE);
    const id = ids.mint(EDGE);
    await assert.rejects(remote.io.listCommands(id), un);
    await assert.rejects(remote.io.openPty(id), un);
    await assert.rejects(remote.listEvents(id, {}), un);
    await assert.rejects(remote.updateNetwork(id, { networkRules: { pypi: true } }), un);
  });
});

test('an edge without the lifecycle methods answers unavailable through the client', async () => {
  await withServed(scripted({}), async (remote) => {
    const un = (e: unknown) => isDsecError(e, 'unavailable') && e.message.includes(EDGE);
    const id = ids.mint(EDGE);
    await assert.rejects(remote.pauseSandbox(id), un);
    await assert.rejects(remote.resumeSandbox(id), un);
    await assert.rejects(remote.setSandboxTimeout(id, 60), un);
    await assert.rejects(remote.snapshotSandbox(id, { name: 'snap' }), un);
  });
});

test('fncall: request, project, result and errors cross the wire; an edge without it is unavailable', async () => {
  await withServed(new FakeEdge({ edgeId: EDGE }), async (remote) => {
    await assert.rejects(
      remote.fncall({ language: 'python', code: '' }, { projectId: 'prj-t' }),
      (e) => isDsecError(e, 'unavailable') && e.message.includes(EDGE),
    );
  });
  const served = addFnCall(new FakeEdge({ edgeId: EDGE }));
  served.fncallDouble.onCall = (req) =>
    req.language === 'bash'
      ? { error: new DsecError('capacity_exhausted', 'pool full', { details: { pool: 'bash' } }) }
      : req.language === 'slow'
        ? { delayMs: 60_000 }
        : { result: { exitCode: 3, stderr: 'boom', outcome: 'ok', reason: 'because' } };
  await withServed(served, async (remote) => {
    const req = {
      language: 'python',
      code: 'raise SystemExit(3)',
      stdin: 'in',
      files: { 'lib/x.py': 'y = 1' },
      args: ['a', 'b'],
      env: { K: 'v' },
      timeoutMs: 500,
      memoryMb: 64,
      network: false,
      maxOutputBytes: 10,
      gpu: { mode: 'shared' as const, count: 1 },
      edgeSelector: { pool: 'cpu' },
    };
    const r = await remote.fncall(req, { projectId: 'prj-t' });
    assert.deepEqual(r, {
      exitCode: 3,
      stdout: 'in',
      stderr: 'boom',
      truncated: false,
      outcome: 'ok',
      durationMs: 1,
      edgeId: EDGE,
      reason: 'because',
    });
    assert.deepEqual(served.fncallDouble.calls, [{ req, projectId: 'prj-t' }]);
    await assert.rejects(
      remote.fncall({ language: 'bash', code: '' }, { projectId: 'prj-t' }),
      (e) => isDsecError(e, 'capacity_exhausted') && e.details?.pool === 'bash',
    );
    // Aborting the client's call aborts the edge's.
    const ac = new AbortController();
    const slow = remote.fncall(
      { language: 'slow', code: '' },
      { projectId: 'p', signal: ac.signal },
    );
    while (served.fncallDouble.calls.length < 3) await new Promise((r) => setTimeout(r, 5));
    ac.abort();
    await assert.rejects(slow, (e) => isDsecError(e, 'aborted'));
  });
});

test('lifecycle calls carry their arguments and answers unchanged', async () => {
  const calls: unknown[] = [];
  const fake = new FakeEdge({ edgeId: EDGE });
  const edge = scripted(
    {},
    {
      pauseSandbox: async (id, signal) => {
        calls.push(['pause', id, signal instanceof AbortSignal]);
        return fake.pauseSandbox(id);
      },
      resumeSandbox: async (id) => {
        calls.push(['resume', id]);
        return fake.resumeSandbox(id);
      },
      setSandboxTimeout: async (id, ttl) => {
        calls.push(['timeout', id, ttl]);
        return fake.setSandboxTimeout(id, ttl);
      },
      snapshotSandbox: async (id, req) => {
        calls.push(['snapshot', id, req]);
        return fake.snapshotSandbox(id, req);
      },
    },
  );
  await withServed(edge, async (remote) => {
    const id = ids.mint(EDGE);
    await fake.createSandbox({
      id,
      projectId: 'p',
      spec: {
        backend: 'container',
        image: 'base',
        workspace: 'ws',
        toolkits: ['tk'],
        memoryLimitMb: 64,
        cpuCoresLimit: 0.1,
        pidsLimit: 64,
        ttlSeconds: 600,
        networkRules: {},
        initUser: 'root',
        env: {},
        labels: {},
      },
    });
    const paused = await remote.pauseSandbox(id);
    assert.deepEqual(paused, await fake.pauseSandbox(id));
    assert.equal((await remote.resumeSandbox(id)).state, 'running');
    const timed = await remote.setSandboxTimeout(id, 90);
    assert.equal(timed.expiresAt, (await fake.getSandbox(id)).expiresAt);
    const snap = await remote.snapshotSandbox(id, { name: 'snap:v1', scrub: ['/a', '/b/**'] });
    assert.deepEqual(snap, fake.images.get('p/snap:v1'));
    assert.deepEqual(snap.parents, ['base', 'ws', 'tk']);
    await assert.rejects(remote.snapshotSandbox(id, { name: 'snap:v1' }), (e) =>
      isDsecError(e, 'conflict'),
    );
    // What the apiserver adds (the sandbox's layer view, its image-quota reservation) crosses too.
    fake.snapshotBytes = 100;
    await assert.rejects(
      remote.snapshotSandbox(id, { name: 'snap:v2', layerView: ['root', 'p'], maxBytes: 10 }),
      (e) => isDsecError(e, 'quota_exceeded'),
    );
    assert.deepEqual(calls, [
      ['pause', id, true],
      ['resume', id],
      ['timeout', id, 90],
      ['snapshot', id, { name: 'snap:v1', scrub: ['/a', '/b/**'] }],
      ['snapshot', id, { name: 'snap:v1' }],
      ['snapshot', id, { name: 'snap:v2', layerView: ['root', 'p'], maxBytes: 10 }],
    ]);
    // Malformed bodies are refused before the edge is asked.
    await assert.rejects(
      remote.setSandboxTimeout(id, 1.5),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'ttlSeconds',
    );
    await assert.rejects(
      remote.snapshotSandbox(id, { name: 'x', scrub: [1] as unknown as string[] }),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'scrub',
    );
    for (const [bad, field] of [
      [{ maxBytes: -1 }, 'maxBytes'],
      [{ maxBytes: 1.5 }, 'maxBytes'],
      [{ layerView: 'p' }, 'layerView'],
      [{ layerView: [1] }, 'layerView'],
    ] as const) {
      await assert.rejects(
        remote.snapshotSandbox(id, { name: 'x', ...(bad as object) }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === field,
        JSON.stringify(bad),
      );
    }
    assert.equal(calls.length, 6);
  });
});

test('DsecErrors cross the wire exactly: code, message, field, details', async () => {
  const thrown = new DsecError('invalid_argument', 'cpuCoresLimit is too large', {
    field: 'spec.cpuCoresLimit',
    details: { limit: 4, asked: [8, 'cores'], nested: { ok: false } },
  });
  const midStream = new DsecError('resource_exhausted', 'pids limit', {
    details: { resource: 'pids', limit: 64 },
  });
  const edge = scripted(
    {
      getCommand: async () => {
        throw thrown;
      },
      runCommand: async (_id, _spec, o: RunCommandOptions = {}) => {
        o.onStdout?.(Buffer.from('partial'));
        throw midStream;
      },
    },
    {
      getSandbox: async () => {
        throw new Error('disk on fire');
      },
    },
  );
  await withServed(edge, async (remote) => {
    const same = (want: DsecError) => (e: unknown) => {
      assert.ok(e instanceof DsecError);
      assert.deepEqual(
        { code: e.code, message: e.message, field: e.field, details: e.details },
        { code: want.code, message: want.message, field: want.field, details: want.details },
      );
      return true;
    };
    await assert.rejects(remote.io.getCommand('sb', 'c'), same(thrown));
    const seen: string[] = [];
    await assert.rejects(
      remote.io.runCommand('sb', { argv: ['x'] }, { onStdout: (c) => seen.push(c.toString()) }),
      same(midStream),
    );
    assert.deepEqual(seen, ['partial']);
    await assert.rejects(
      remote.getSandbox('sb'),
      (e) => isDsecError(e, 'internal') && e.message === 'disk on fire',
    );
  });
});

test('command output reaches the client while the command still runs', async () => {
  const firstSeen = deferred();
  const edge = scripted({
    runCommand: async (_id, _spec, o: RunCommandOptions = {}) => {
      o.onStdout?.(Buffer.from('one\n'));
      // The command goes on only once the client has seen its first line:
      // buffering anywhere on the way would deadlock here.
      await firstSeen.promise;
      o.onStderr?.(Buffer.from('warn\n'));
      o.onStdout?.(Buffer.from('two\n'));
      return result('one\ntwo\n', { stderr: 'warn\n' });
    },
  });
  await withServed(edge, async (remote) => {
    const out: string[] = [];
    const err: string[] = [];
    const r = await remote.io.runCommand(
      'sb',
      { argv: ['x'] },
      {
        onStdout: (c) => {
          out.push(c.toString());
          firstSeen.resolve();
        },
        onStderr: (c) => err.push(c.toString()),
      },
    );
    assert.deepEqual(out, ['one\n', 'two\n']);
    assert.deepEqual(err, ['warn\n']);
    assert.equal(r.stdout, 'one\ntwo\n');
  });
});

test('aborting a call aborts the edge call; each call holds one abort listener, released after', async () => {
  const entered = deferred();
  const serverAborted = deferred<unknown>();
  const edge = scripted({
    runCommand: (_id, _spec, o: RunCommandOptions = {}) =>
      new Promise<CommandResult>((_resolve, reject) => {
        entered.resolve();
        o.signal?.addEventListener('abort', () => {
          serverAborted.resolve(o.signal?.reason);
          reject(new DsecError('aborted', 'operation aborted'));
        });
      }),
  });
  await withServed(edge, async (remote) => {
    const shared = new AbortController();
    // Quick calls sharing the caller's signal leave no listener behind.
    await Promise.all(Array.from({ length: 20 }, () => remote.status(shared.signal)));
    assert.equal(getEventListeners(shared.signal, 'abort').length, 0);
    const running = remote.io.runCommand('sb', { argv: ['sleep'] }, { signal: shared.signal });
    await entered.promise;
    assert.equal(getEventListeners(shared.signal, 'abort').length, 1);
    shared.abort();
    await assert.rejects(running, (e) => isDsecError(e, 'aborted'));
    const reason = await serverAborted.promise;
    assert.ok(isDsecError(reason, 'aborted'), 'the edge call saw the client go away');
    assert.equal(getEventListeners(shared.signal, 'abort').length, 0);
    // An already-aborted signal fails at once, without a request.
    await assert.rejects(remote.status(shared.signal), (e) => isDsecError(e, 'aborted'));
  });
});

test('writeStdin streams the body with back-pressure', async () => {
  const TOTAL = 64 * 1024 * 1024;
  const CHUNK = 64 * 1024;
  const gate = deferred();
  const readFirst = deferred();
  let eof: boolean | undefined;
  const edge = scripted({
    writeStdin: async (_id, _cid, data, options = {}) => {
      assert.ok(data && !Buffer.isBuffer(data), 'a stream reaches the edge');
      let bytes = 0;
      for await (const chunk of data) {
        bytes += (chunk as Buffer).length;
        if (bytes >= 1024 * 1024 && bytes - (chunk as Buffer).length < 1024 * 1024) {
          readFirst.resolve();
          await gate.promise; // a slow command: the edge stops reading
        }
      }
      eof = options.eof;
      return { bytes };
    },
  });
  await withServed(edge, async (remote) => {
    let produced = 0;
    const source = new Readable({
      read() {
        if (produced >= TOTAL) this.push(null);
        else {
          produced += CHUNK;
          this.push(Buffer.alloc(CHUNK, 1));
        }
      },
    });
    const writing = remote.io.writeStdin('sb', 'cmd', source, { eof: true });
    await readFirst.promise;
    // Wait until the sender stops (the buffers on the way are full), then look.
    let last = -1;
    while (produced !== last) {
      last = produced;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.ok(produced < TOTAL / 2, `the sender stopped after ${produced} of ${TOTAL} bytes`);
    gate.resolve();
    assert.deepEqual(await writing, { bytes: TOTAL });
    assert.equal(eof, true);
  });
});

test('files: uploads and downloads stream; an error after the first byte arrives intact', async () => {
  const late = new DsecError('resource_exhausted', 'the sandbox hit its pids limit', {
    details: { resource: 'pids' },
  });
  const edge = scripted({
    writeFile: async (_id, path, body, options = {}) => {
      let size = 0;
      for await (const c of body as Readable) size += (c as Buffer).length;
      const info: FileInfo = {
        name: path.split('/').pop() ?? '',
        path,
        type: 'file',
        size,
        mode: options.mode ?? 0o644,
        mtime: new Date(0).toISOString(),
        uid: 0,
        gid: 0,
      };
      return info;
    },
    readFile: async (_id, path) => {
      if (path === '/missing') throw new DsecError('not_found', 'no such file');
      const stream = new Readable({ read: () => undefined });
      stream.push(Buffer.from('abc'));
      if (path === '/broken') setImmediate(() => stream.destroy(late));
      else stream.push(null);
      return stream;
    },
  });
  await withServed(edge, async (remote) => {
    const written = await remote.io.writeFile(
      'sb',
      '/x/y.bin',
      Readable.from([Buffer.alloc(70_000), Buffer.alloc(5)]),
      { mode: 0o600 },
    );
    assert.equal(written.size, 70_005);
    assert.equal(written.mode, 0o600);
    assert.equal((await remote.io.writeFile('sb', '/e', Buffer.alloc(0))).size, 0);
    const ok: Buffer[] = [];
    for await (const c of await remote.io.readFile('sb', '/fine')) ok.push(c as Buffer);
    assert.equal(Buffer.concat(ok).toString(), 'abc');
    await assert.rejects(remote.io.readFile('sb', '/missing'), (e) => isDsecError(e, 'not_found'));
    const got: Buffer[] = [];
    await assert.rejects(
      (async () => {
        for await (const c of await remote.io.readFile('sb', '/broken')) got.push(c as Buffer);
      })(),
      (e) =>
        isDsecError(e, 'resource_exhausted') &&
        e.message === late.message &&
        (e.details as { resource?: string }).resource === 'pids',
    );
    // As in-process, destroying a stream drops what its reader had not taken yet.
    assert.ok('abc'.startsWith(Buffer.concat(got).toString()));
  });
});

test('a terminal: output, input, resize, end-of-input and the exit over one upgrade', async () => {
  const resized: [number, number][] = [];
  let openedWith: unknown;
  const edge = scripted({
    openPty: async (_id, options) => {
      openedWith = options;
      const listeners: ((c: Buffer) => void)[] = [];
      const exit = deferred<{ exitCode: number; signal?: string | undefined }>();
      const emit = (s: string) => listeners.forEach((l) => l(Buffer.from(s)));
      const session: PtySession = {
        onOutput: (cb) => {
          listeners.push(cb);
          emit('$ ');
        },
        write: (d) => emit(`echo:${d.toString()}`),
        resize: (rows, cols) => resized.push([rows, cols]),
        end: () => exit.resolve({ exitCode: 3 }),
        kill: () => exit.resolve({ exitCode: 137, signal: 'SIGKILL' }),
        exited: exit.promise,
      };
      return session;
    },
  });
  await withServed(edge, async (remote) => {
    const pty = await remote.io.openPty('sb', { rows: 30, cols: 100, env: { A: '1' } });
    assert.deepEqual(openedWith, { rows: 30, cols: 100, env: { A: '1' } });
    let seen = '';
    const echoed = deferred();
    pty.onOutput((c) => {
      seen += c.toString();
      if (seen.includes('echo:ls')) echoed.resolve();
    });
    pty.write(Buffer.from('ls'));
    await echoed.promise;
    assert.equal(seen, '$ echo:ls');
    pty.resize(50, 132);
    pty.end();
    assert.deepEqual(await pty.exited, { exitCode: 3, signal: undefined });
    assert.deepEqual(resized, [[50, 132]]);

    const killed = await remote.io.openPty('sb');
    killed.kill();
    assert.deepEqual(await killed.exited, { exitCode: 137, signal: 'SIGKILL' });
  });
});

test('a port: raw bytes both ways with half-close; a refusal arrives as its error', async () => {
  const edge = scripted({
    connectPort: async (_id, port) => {
      if (port === 81) throw new DsecError('unavailable', 'nothing answers on port 81');
      // An upper-casing echo service that answers once its input ends.
      const got: Buffer[] = [];
      const svc: Duplex = new Duplex({
        read: () => undefined,
        write: (chunk: Buffer, _enc, cb) => {
          got.push(chunk);
          cb();
        },
        final: (cb) => {
          svc.push(Buffer.concat(got).toString().toUpperCase());
          svc.push(null);
          cb();
        },
      });
      return svc;
    },
  });
  await withServed(edge, async (remote) => {
    const socket = await remote.io.connectPort('sb', 80);
    const answer: Buffer[] = [];
    const ended = new Promise<void>((r) => socket.on('end', r));
    socket.on('data', (c: Buffer) => answer.push(c));
    socket.write('hello ');
    socket.end('port');
    await ended;
    assert.equal(Buffer.concat(answer).toString(), 'HELLO PORT');
    await assert.rejects(
      remote.io.connectPort('sb', 81),
      (e) => isDsecError(e, 'unavailable') && e.message === 'nothing answers on port 81',
    );
  });
});

test('hundreds of concurrent commands through one client', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  await withServed(fake, async (remote) => {
    const sandbox = await remote.createSandbox({
      id: ids.mint(EDGE),
      projectId: 'p',
      spec: {
        backend: 'container',
        image: 'base',
        toolkits: [],
        memoryLimitMb: 64,
        cpuCoresLimit: 0.1,
        pidsLimit: 64,
        ttlSeconds: 600,
        networkRules: {},
        initUser: 'root',
        env: {},
        labels: {},
      },
    });
    const results = await Promise.all(
      Array.from({ length: 400 }, (_, i) =>
        remote.runCommand(sandbox.id, { argv: ['echo', String(i)] }, { projectId: 'p' }),
      ),
    );
    results.forEach((r, i) => assert.equal(r.stdout, `echo ${i}\n`));
  });
});

test('a callback that throws ends the call with its own error and aborts the edge call', async () => {
  const aborted = deferred();
  const edge = scripted({
    runCommand: (_id, _spec, o: RunCommandOptions = {}) =>
      new Promise<CommandResult>((_resolve, reject) => {
        o.signal?.addEventListener('abort', () => {
          aborted.resolve();
          reject(new DsecError('aborted', 'operation aborted'));
        });
        o.onStdout?.(Buffer.from('boom'));
      }),
    getCommand: () => {
      throw new DsecError('command_not_found', 'thrown before any await');
    },
  });
  await withServed(edge, async (remote) => {
    const mine = new Error('the consumer gave up');
    await assert.rejects(
      remote.io.runCommand(
        'sb',
        { argv: ['x'] },
        {
          onStdout: () => {
            throw mine;
          },
        },
      ),
      (e) => e === mine,
    );
    await aborted.promise;
    await assert.rejects(remote.io.getCommand('sb', 'c'), (e) =>
      isDsecError(e, 'command_not_found'),
    );
  });
});

test('a command result of many MiB crosses the wire copied a bounded number of times', async () => {
  // The result frame carries both streams' kept output (up to 64 MiB each, the sandbox's to
  // fill) and reaches the apiserver in socket reads of at most 64 KiB. Gathering it used to
  // copy everything so far on each read: 16 MiB cost 2 GiB of copying (12 s of the
  // apiserver's event loop), 128 MiB would have been minutes.
  const stdout = 'x'.repeat(16 << 20);
  const edge = scripted({
    runCommand: async () => result(stdout, { stderr: 'y'.repeat(1 << 20) }),
  });
  await withServed(edge, async (remote) => {
    const concat = Buffer.concat;
    let copied = 0;
    Buffer.concat = (list: readonly Uint8Array[], totalLength?: number) => {
      const out = concat(list, totalLength);
      copied += out.length;
      return out;
    };
    let r: CommandResult;
    try {
      r = await remote.io.runCommand('sb', { argv: ['x'] });
    } finally {
      Buffer.concat = concat;
    }
    assert.equal(r.stdout.length, stdout.length);
    assert.equal(r.stderr.length, 1 << 20);
    // What the client must copy at least once, with room for the HTTP layers' own copies.
    assert.ok(copied <= 4 * (17 << 20), `${copied} bytes copied for a 17 MiB result`);
  });
});

test('a genuine large JSON answer (a command result) arrives whole, as the same result streamed does', async () => {
  // What the real edge answers to a wait on `head -c 12M /dev/zero` run with
  // `maxOutputBytes: 16 MiB` (the API allows 64 MiB a stream): every NUL is six
  // bytes of JSON, 72 MiB in all, beyond the 64 MiB the client used to take whole
  // (it refused the edge's genuine answer as `unavailable`), and well within what
  // the same result is allowed as the last frame of a command stream.
  const stdout = '\0'.repeat(12 << 20);
  const result: CommandResult = {
    commandId: 'cmd-big',
    exitCode: 0,
    outcome: 'exited',
    stdout,
    stderr: '',
    truncated: false,
    stdoutBytes: stdout.length,
    stderrBytes: 0,
    durationMs: 1,
  };
  assert.ok(JSON.stringify(result).length > 64 << 20);
  const edge = scripted({
    waitCommand: async () => result,
    runCommand: async () => result,
  });
  await withServed(edge, async (remote) => {
    const streamed = await remote.io.runCommand('sb', { argv: ['head'] });
    assert.equal(streamed.stdout.length, stdout.length, 'streamed');
    const waited = await remote.io.waitCommand('sb', 'cmd-big');
    assert.equal(waited.stdout.length, stdout.length, 'waited');
  });
});

test('a body whose consumer stops reading early (the command exited) still gets its answer', async () => {
  const edge = scripted({
    writeStdin: async (_id, _cid, data) => {
      let bytes = 0;
      for await (const chunk of data as Readable) {
        bytes += (chunk as Buffer).length;
        break; // the command took one chunk and exited
      }
      return { bytes };
    },
  });
  await withServed(edge, async (remote) => {
    for (let i = 0; i < 2; i++) {
      const body = Readable.from(
        (function* () {
          for (let n = 0; n < 128; n++) yield Buffer.alloc(64 * 1024, 0x61);
        })(),
      );
      const { bytes } = await remote.io.writeStdin('sb', 'cmd', body, { eof: true });
      assert.ok(bytes > 0 && bytes < 8 * 1024 * 1024, `${bytes} bytes taken`);
    }
  });
});
