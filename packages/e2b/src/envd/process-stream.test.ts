import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import Fastify from 'fastify';
import type { FastifyInstance } from 'fastify';
import { Code, ConnectError, createClient } from '@connectrpc/connect';
import { createConnectTransport } from '@connectrpc/connect-node';
import { DsecError, SandboxIdCodec } from '@dsec/core';
import type {
  CommandInfo,
  CommandResult,
  EdgeApi,
  PtySession,
  RunCommandOptions,
  SandboxIoApi,
  StartCommandSpec,
} from '@dsec/core';
import { ApiMetrics, CallerLimits } from '@dsec/apiserver';
import type { SandboxService } from '@dsec/apiserver';
import type { Iam, Principal } from '@dsec/iam';
import { Process } from '../gen/process/process_pb.js';
import { registerE2bRoutes } from '../register.js';
import { envelope } from './connect-stream.js';
import { commandPid, MAX_PTYS_PER_SANDBOX } from './process-table.js';

/**
 * envd's `Process.Start` and `Process.Connect` streams as the SDKs open them
 * (the lean path) against the same calls through Connect's adapter (taken
 * when the client accepts gzip: messages this small are not compressed), on
 * a scripted in-sandbox interface: output, exit codes, signals, errors and
 * what reaches the edge must be the same either way.
 */

const KEY = 'dsk_test';
const principal: Principal = { keyId: 'k1', projectId: 'p1', role: 'admin' };
const SANDBOX = new SandboxIdCodec('0123456789abcdef0123').mint('edge-a');

/** What a command line does in the scripted sandbox. */
const SCRIPTS: Record<string, (o: RunCommandOptions) => Promise<Partial<CommandResult>>> = {
  out: async (o) => {
    o.onStdout?.(Buffer.from('one\n'));
    o.onStderr?.(Buffer.from('two\n'));
    o.onStdout?.(Buffer.from([0xe2, 0x82]));
    o.onStdout?.(Buffer.from([0xac, 0x0a]));
    return {};
  },
  exit3: async () => ({ exitCode: 3 }),
  killed: async () => ({ outcome: 'killed', exitCode: 137, signal: 'SIGKILL' }),
  // Killed as its sandbox is torn down: the exit is seen before the channel closes.
  withSandbox: async () => ({ outcome: 'signaled', exitCode: 137, signal: 'SIGKILL' }),
  timeout: async () => ({ outcome: 'timeout', exitCode: 137, signal: 'SIGKILL' }),
  lost: async () => {
    throw new DsecError('sandbox_not_found', 'the sandbox is gone');
  },
  flood: async (o) => {
    const chunk = Buffer.alloc(64 * 1024, 'y');
    for (;;) {
      if (o.signal?.aborted) throw new DsecError('aborted', 'stopped watching');
      o.onStdout?.(chunk);
      await new Promise(setImmediate);
    }
  },
  hang: (o) =>
    new Promise((_resolve, reject) => {
      const onAbort = () => reject(new DsecError('aborted', 'stopped watching'));
      if (o.signal?.aborted) onAbort();
      o.signal?.addEventListener('abort', onAbort);
    }),
};

class ScriptedIo {
  /** Set, the sandbox has been killed (the service's `get` says so). */
  sandboxGone = false;
  started: StartCommandSpec[] = [];
  watches: { commandId: string; signal: AbortSignal | undefined }[] = [];
  kills: string[] = [];

  killCommand = async (_id: string, commandId: string) => void this.kills.push(commandId);
  signalCommand = async (_id: string, commandId: string) => void this.kills.push(commandId);

  statFile = async (_id: string, path: string) => {
    if (path === '/bin/bash') return { type: 'file' };
    throw new DsecError('not_found', path);
  };

  startCommand = async (sandboxId: string, spec: StartCommandSpec): Promise<CommandInfo> => {
    this.started.push(spec);
    return {
      commandId: `cmd-${spec.argv?.at(-1) ?? spec.shell}`,
      sandboxId,
      background: true,
      state: 'running',
      startedAt: new Date(0).toISOString(),
    };
  };

  watchCommand = async (
    _id: string,
    commandId: string,
    o: RunCommandOptions,
  ): Promise<CommandResult> => {
    this.watches.push({ commandId, signal: o.signal });
    const script = SCRIPTS[commandId.slice('cmd-'.length)];
    if (!script) throw new DsecError('command_not_found', commandId);
    return {
      commandId,
      exitCode: 0,
      outcome: 'exited',
      stdout: '',
      stderr: '',
      truncated: false,
      stdoutBytes: 0,
      stderrBytes: 0,
      durationMs: 1,
      ...(await script(o)),
    };
  };

  /** Terminals opened, each ended by its `kill`; an open waits a few turns (a slow edge). */
  ptyKills: (() => void)[] = [];
  openPty = async (): Promise<PtySession> => {
    for (let i = 0; i < 5; i++) await new Promise(setImmediate);
    let end!: () => void;
    const exited = new Promise<{ exitCode: number }>((r) => (end = () => r({ exitCode: 0 })));
    this.ptyKills.push(() => end());
    return {
      onOutput: () => undefined,
      write: () => undefined,
      resize: () => undefined,
      end: () => end(),
      kill: () => end(),
      exited,
    };
  };

  listCommands = async (sandboxId: string): Promise<CommandInfo[]> =>
    Object.keys(SCRIPTS).map((s) => ({
      commandId: `cmd-${s}`,
      sandboxId,
      background: true,
      state: 'running',
      startedAt: new Date(0).toISOString(),
    }));
}

async function withEnvd(
  fn: (url: string, io: ScriptedIo) => Promise<void>,
  onApp: (app: FastifyInstance) => void = () => undefined,
  metrics?: ApiMetrics,
  limits?: CallerLimits,
): Promise<void> {
  const io = new ScriptedIo();
  const edge = { edgeId: 'edge-a', io: io as unknown as SandboxIoApi } as unknown as EdgeApi;
  const service = {
    authorize: async (_p: Principal, id: string) => {
      if (id !== SANDBOX) throw new DsecError('sandbox_not_found', `no sandbox ${id}`);
      return { edge, projectId: 'p1' };
    },
    get: async (_p: Principal, id: string) => {
      if (id !== SANDBOX || io.sandboxGone) {
        throw new DsecError('sandbox_not_found', `no sandbox ${id}`);
      }
      return { state: 'running' };
    },
  } as unknown as SandboxService;
  const iam = {
    authenticate: async (key: string) => {
      if (key !== KEY) throw new DsecError('unauthenticated', 'bad key');
      return principal;
    },
  } as unknown as Iam;
  const app = Fastify();
  onApp(app);
  registerE2bRoutes(app, { service, iam, metrics, limits });
  await app.listen({ port: 0, host: '127.0.0.1' });
  try {
    await fn(`http://127.0.0.1:${(app.server.address() as AddressInfo).port}`, io);
  } finally {
    app.server.closeAllConnections();
    await app.close();
  }
}

interface Answer {
  status: number;
  events: unknown[];
}

/** `Start` (or `Connect`) as the JS SDK sends it; `adapter` takes Connect's generic path. */
async function call(
  url: string,
  message: unknown,
  options: { adapter?: boolean; headers?: Record<string, string>; method?: string } = {},
): Promise<Answer> {
  const body = envelope(0, Buffer.from(JSON.stringify(message)));
  return new Promise((resolve, reject) => {
    const req = http.request(`${url}/process.Process/${options.method ?? 'Start'}`, {
      method: 'POST',
      agent: false,
      headers: {
        'content-type': 'application/connect+json',
        'connect-protocol-version': '1',
        'connect-timeout-ms': '60000',
        'e2b-sandbox-id': SANDBOX,
        'e2b-sandbox-port': '49983',
        'keepalive-ping-interval': '50',
        'x-access-token': KEY,
        ...(options.adapter ? { 'connect-accept-encoding': 'gzip' } : {}),
        ...options.headers,
      },
    });
    req.on('error', reject);
    req.on('response', (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('end', () => {
        const all = Buffer.concat(chunks);
        const events: unknown[] = [];
        const plain = res.headers['content-type']?.startsWith('application/json') === true;
        if (plain) events.push(JSON.parse(all.toString()));
        for (let o = 0; !plain && o < all.length;) {
          const n = all.readUInt32BE(o + 1);
          const data = JSON.parse(all.subarray(o + 5, o + 5 + n).toString()) as unknown;
          events.push(all[o] === 2 ? { endOfStream: data } : data);
          o += 5 + n;
        }
        resolve({ status: res.statusCode ?? 0, events });
      });
    });
    req.end(body);
  });
}

const bash = (line: string, extra: Record<string, unknown> = {}) => ({
  process: { cmd: '/bin/bash', args: ['-l', '-c', line], ...extra },
  stdin: false,
});

test('Start: output, exit codes, signals, timeouts and errors read the same on both paths', async () => {
  await withEnvd(async (url) => {
    for (const line of ['out', 'exit3', 'killed', 'timeout', 'lost', 'missing']) {
      const lean = await call(url, bash(line));
      const adapter = await call(url, bash(line), { adapter: true });
      assert.deepEqual(lean, adapter, line);
    }
    const pid = commandPid('cmd-out');
    assert.deepEqual((await call(url, bash('out'))).events, [
      { event: { start: { pid } } },
      { event: { data: { stdout: Buffer.from('one\n').toString('base64') } } },
      { event: { data: { stderr: Buffer.from('two\n').toString('base64') } } },
      { event: { data: { stdout: Buffer.from([0xe2, 0x82]).toString('base64') } } },
      { event: { data: { stdout: Buffer.from([0xac, 0x0a]).toString('base64') } } },
      { event: { end: { exited: true, status: 'exit status 0' } } },
      { endOfStream: {} },
    ]);
    assert.deepEqual((await call(url, bash('exit3'))).events.at(-2), {
      event: { end: { exitCode: 3, exited: true, status: 'exit status 3' } },
    });
    assert.deepEqual((await call(url, bash('killed'))).events.at(-2), {
      event: { end: { exitCode: -1, status: 'signal: killed' } },
    });
    assert.deepEqual((await call(url, bash('lost'))).events, [
      { event: { start: { pid: commandPid('cmd-lost') } } },
      { endOfStream: { error: { code: 'unavailable', message: 'the sandbox is gone' } } },
    ]);
  });
});

test('Start: a command that dies with its sandbox ends the stream with an error, not an end event', async () => {
  await withEnvd(async (url, io) => {
    // The sandbox still runs: a command killed by a signal ends as envd's `end`.
    assert.deepEqual((await call(url, bash('withSandbox'))).events.at(-2), {
      event: { end: { exitCode: -1, status: 'signal: killed' } },
    });
    io.sandboxGone = true;
    for (const adapter of [false, true]) {
      const answer = await call(url, bash('withSandbox'), { adapter });
      assert.deepEqual(answer.events.at(-1), {
        endOfStream: {
          error: {
            code: 'unavailable',
            message: `the sandbox ${SANDBOX} was killed while the process ran`,
          },
        },
      });
      assert.ok(!answer.events.some((e) => JSON.stringify(e).includes('"end"')));
    }
    // A command that exited by itself is an exit, sandbox or not.
    assert.deepEqual((await call(url, bash('exit3'))).events.at(-2), {
      event: { end: { exitCode: 3, exited: true, status: 'exit status 3' } },
    });
  });
});

test('Start: what reaches the edge is the same on both paths (argv, env, cwd, user, stdin, timeout)', async () => {
  await withEnvd(async (url, io) => {
    const message = {
      ...bash('exit3', { envs: { A: '1' }, cwd: '/tmp' }),
      stdin: true,
    };
    const headers = {
      authorization: `Basic ${Buffer.from('app:').toString('base64')}`,
      'connect-timeout-ms': '5000',
    };
    await call(url, message, { headers });
    await call(url, message, { headers, adapter: true });
    assert.equal(io.started.length, 2);
    const [lean, adapter] = io.started as [StartCommandSpec, StartCommandSpec];
    assert.ok(lean.timeoutMs! > 4000 && lean.timeoutMs! <= 5000, String(lean.timeoutMs));
    assert.deepEqual({ ...lean, timeoutMs: 0 }, { ...adapter, timeoutMs: 0 });
    assert.deepEqual(
      { argv: lean.argv, env: lean.env, cwd: lean.cwd, user: lean.user, stdinOpen: lean.stdinOpen },
      {
        argv: ['/bin/bash', '-l', '-c', 'exit3'],
        env: { A: '1' },
        cwd: '/tmp',
        user: 'app',
        stdinOpen: true,
      },
    );

    // A body validated once is reused with each call's own deadline, and never shared.
    await call(url, message, { headers: { ...headers, 'connect-timeout-ms': '2000' } });
    const again = io.started[2]!;
    assert.ok(again.timeoutMs! > 1000 && again.timeoutMs! <= 2000, String(again.timeoutMs));
    assert.deepEqual({ ...again, timeoutMs: 0 }, { ...lean, timeoutMs: 0 });
    assert.notEqual(again.argv, lean.argv);
    assert.notEqual(again.env, lean.env);
    // An invalid body is refused every time: only valid ones are kept.
    for (let i = 0; i < 2; i++) {
      const bad = await call(url, bash('exit3', { envs: { 'A-B': '1' } }));
      const [only] = bad.events as [{ endOfStream: { error: { code: string; message: string } } }];
      assert.equal(bad.events.length, 1);
      assert.equal(only.endOfStream.error.code, 'invalid_argument');
      assert.match(only.endOfStream.error.message, /environment variable name/);
    }
    assert.equal(io.started.length, 3);
  });
});

test('Start and Connect: a refused caller or sandbox, and a process found by pid', async () => {
  await withEnvd(async (url) => {
    // A bad key is refused before any RPC runs (envd's HTTP error); another sandbox is not found.
    const elsewhere = {
      'e2b-sandbox-id': new SandboxIdCodec('0123456789abcdef0123').mint('edge-a'),
    };
    for (const adapter of [false, true]) {
      const badKey = await call(url, bash('out'), { adapter, headers: { 'x-access-token': 'no' } });
      assert.equal(badKey.status, 401);
      const other = await call(url, bash('out'), { adapter, headers: elsewhere });
      assert.equal(other.status, 200);
      assert.deepEqual(other.events, [
        {
          endOfStream: {
            error: { code: 'unavailable', message: `no sandbox ${elsewhere['e2b-sandbox-id']}` },
          },
        },
      ]);
    }
    const pid = commandPid('cmd-exit3');
    const byPid = { process: { pid } };
    const lean = await call(url, byPid, { method: 'Connect' });
    assert.deepEqual(lean, await call(url, byPid, { method: 'Connect', adapter: true }));
    assert.deepEqual(lean.events, [
      { event: { start: { pid } } },
      { event: { end: { exitCode: 3, exited: true, status: 'exit status 3' } } },
      { endOfStream: {} },
    ]);
    const unknown = await call(url, { process: { pid: 12345 } }, { method: 'Connect' });
    assert.deepEqual(unknown.events, [
      {
        endOfStream: { error: { code: 'not_found', message: 'process with pid 12345 not found' } },
      },
    ]);
  });
});

test('the SDKs’ streams skip the router; what it would refuse reads the same either way', async () => {
  const routed: string[] = [];
  await withEnvd(
    async (url) => {
      const lean = await call(url, bash('exit3'));
      assert.equal(lean.status, 200);
      assert.deepEqual(routed, [], 'a Start as the SDKs send it never reaches the router');
      assert.deepEqual(lean, await call(url, bash('exit3'), { adapter: true }));
      assert.deepEqual(routed, ['/process.Process/Start']);

      // A refused key: the fast path answers as the routed handler does (envd's JSON error).
      routed.length = 0;
      const bad = { 'x-access-token': 'dsk_wrong' };
      const fast = await call(url, bash('out'), { headers: bad });
      assert.deepEqual(routed, []);
      assert.deepEqual(fast, await call(url, bash('out'), { adapter: true, headers: bad }));
      assert.deepEqual(fast.events, [
        { code: 401, message: 'bad key', error_code: 'unauthenticated' },
      ]);

      // No key, a malformed sandbox ID, another port: left to the router, which answers them.
      routed.length = 0;
      const noKey = await call(url, bash('out'), { headers: { 'x-access-token': '' } });
      assert.equal(noKey.status, 401);
      const badId = await call(url, bash('out'), { headers: { 'e2b-sandbox-id': 'sb!' } });
      assert.equal(badId.status, 502); // as E2B's proxy answers an unknown sandbox
      assert.equal(routed.length, 2);
    },
    (app) =>
      app.addHook('onRequest', async (req) => {
        routed.push(req.raw.url?.replace(/^\/_e2b\/sandbox\/\d+\/[^/]+/, '') ?? '');
      }),
  );
});

test('the streams that skip the router count in the request metrics as the router counted them', async () => {
  const metrics = new ApiMetrics();
  const routed: string[] = [];
  await withEnvd(
    async (url) => {
      assert.equal((await call(url, bash('exit3'))).status, 200);
      assert.equal((await call(url, bash('out'))).status, 200);
    },
    (app) => app.addHook('onRequest', async (req) => void routed.push(req.url)),
    metrics,
  );
  assert.deepEqual(routed, [], 'both took the fast path');
  const text = await metrics.text();
  const route = 'route="/_e2b/sandbox/:port/:id/*"';
  assert.ok(text.includes(`dsec_http_requests_total{method="POST",${route},status="200"} 2`), text);
  assert.ok(text.includes(`dsec_http_request_duration_seconds_count{method="POST",${route}} 2`));
});

test('a client that leaves mid-stream stops the watch; the command is not killed', async () => {
  await withEnvd(async (url, io) => {
    const client = createClient(
      Process,
      createConnectTransport({ baseUrl: url, httpVersion: '1.1' }),
    );
    const ac = new AbortController();
    const headers = { 'e2b-sandbox-id': SANDBOX, 'x-access-token': KEY };
    const stream = client.start(bash('hang'), { headers, signal: ac.signal });
    const it = stream[Symbol.asyncIterator]();
    const first = await it.next();
    assert.equal(first.value?.event?.event.case, 'start');
    await until(() => io.watches.length === 1);
    ac.abort();
    await assert.rejects(it.next(), (e) => ConnectError.from(e).code === Code.Canceled);
    const watch = io.watches[0]!;
    await until(() => watch.signal?.aborted === true);
    assert.deepEqual(io.kills, []);
  });
});

async function until(cond: () => boolean): Promise<void> {
  while (!cond()) await new Promise((r) => setImmediate(r));
}

// SECURITY J38: an unread stream is cut with its connection, and streams count against the key.
test('Start: a client that stops reading is cut, its connection reset; streams per key are capped', async () => {
  const limits = new CallerLimits({ maxStreamsPerKey: 2, streamBufferBytes: 1024 * 1024 });
  await withEnvd(
    async (url, io) => {
      const u = new URL(url);
      const body = envelope(0, Buffer.from(JSON.stringify(bash('flood'))));
      const socket = net.connect(Number(u.port), u.hostname);
      socket.on('error', () => {});
      const closed = new Promise<void>((r) => socket.once('close', () => r()));
      await new Promise<void>((r) => socket.once('connect', () => r()));
      socket.write(
        `POST /process.Process/Start HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/connect+json\r\n` +
          `connect-protocol-version: 1\r\ne2b-sandbox-id: ${SANDBOX}\r\nx-access-token: ${KEY}\r\n` +
          `content-length: ${body.length}\r\n\r\n`,
      );
      socket.write(body);
      socket.pause();
      // The watch of the command stops once the stream is cut...
      for (let i = 0; i < 600 && !io.watches.at(-1)?.signal?.aborted; i++) {
        await new Promise((r) => setTimeout(r, 50));
      }
      assert.ok(io.watches.at(-1)?.signal?.aborted, 'the flooding watch was stopped');
      // ...and nothing of it stays: the stream holds no byte and its connection is gone.
      assert.equal(limits.budget.streams, 0);
      assert.equal(limits.budget.queuedBytes(), 0);
      socket.resume();
      const late = new Promise<string>((r) => setTimeout(() => r('still open'), 30_000).unref());
      assert.equal(await Promise.race([closed.then(() => 'closed'), late]), 'closed');

      // Two streams of one key at once; a third is refused on its stream, before any start.
      const hangs = [call(url, bash('hang')), call(url, bash('hang'))];
      for (const h of hangs) h.catch(() => undefined); // cut when the server closes
      while (limits.budget.streams < 2) await new Promise((r) => setTimeout(r, 20));
      const third = await call(url, bash('out'));
      const end = third.events.at(-1) as { endOfStream: { error?: { code: string } } };
      assert.equal(end.endOfStream.error?.code, 'resource_exhausted');
      assert.equal(third.events.length, 1);
    },
    () => undefined,
    undefined,
    limits,
  );
});

test('attack: terminals opened at once cannot pass the per-sandbox bound', async () => {
  await withEnvd(async (url, io) => {
    const tries = MAX_PTYS_PER_SANDBOX + 8;
    let answered = 0;
    const calls = Array.from({ length: tries }, () =>
      call(url, {
        process: { cmd: '/bin/bash', args: [] },
        pty: { size: { rows: 24, cols: 80 } },
      }).finally(() => answered++),
    );
    // The refused ones answer at once; the opened ones stream until their terminal ends.
    await until(() => io.ptyKills.length + answered >= tries);
    assert.equal(io.ptyKills.length, MAX_PTYS_PER_SANDBOX);
    for (const kill of io.ptyKills) kill();
    const answers = await Promise.all(calls);
    const refused = answers.filter((a) => JSON.stringify(a.events).includes('resource_exhausted'));
    assert.equal(refused.length, tries - MAX_PTYS_PER_SANDBOX, JSON.stringify(answers[0]));
  });
});
