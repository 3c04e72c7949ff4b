import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { DsecError } from '@dsec/core';
import { QmpClient } from './qmp.js';

const GREETING = { QMP: { version: { qemu: { major: 7, minor: 2, micro: 0 } }, capabilities: [] } };

/** A fake QEMU: greets, then hands each parsed command to `onCommand`. */
async function fakeQemu(
  onCommand: (cmd: { execute: string; arguments?: unknown; id?: string }, s: Socket) => void,
  options: { greeting?: unknown } = {},
): Promise<{ path: string; server: Server; seen: string[]; done: () => Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-qmp-'));
  const path = join(dir, 'qmp.sock');
  const seen: string[] = [];
  const sockets = new Set<Socket>();
  const server = createServer((s) => {
    sockets.add(s);
    if (options.greeting !== null) s.write(JSON.stringify(options.greeting ?? GREETING) + '\r\n');
    let buf = '';
    s.on('data', (c) => {
      buf += c.toString();
      let nl: number;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const cmd = JSON.parse(buf.slice(0, nl)) as { execute: string; id?: string };
        buf = buf.slice(nl + 1);
        seen.push(cmd.execute);
        onCommand(cmd, s);
      }
    });
  });
  await new Promise<void>((r) => server.listen(path, r));
  return {
    path,
    server,
    seen,
    done: async () => {
      for (const s of sockets) s.destroy();
      await new Promise((r) => server.close(r));
      await rm(dir, { recursive: true, force: true });
    },
  };
}

const reply = (s: Socket, msg: unknown) => s.write(JSON.stringify(msg) + '\r\n');

test('negotiates capabilities, then matches answers to commands by id', async () => {
  const q = await fakeQemu((cmd, s) => {
    if (cmd.execute === 'qmp_capabilities') reply(s, { return: {}, id: cmd.id });
    // Answers out of order: the second command's first.
    if (cmd.execute === 'slow') setTimeout(() => reply(s, { return: 'slow', id: cmd.id }), 30);
    if (cmd.execute === 'query-status')
      reply(s, { return: { status: 'running', running: true }, id: cmd.id });
  });
  try {
    const c = await QmpClient.connect(q.path);
    const [slow, status] = await Promise.all([
      c.execute('slow'),
      c.execute<{ status: string }>('query-status'),
    ]);
    assert.equal(slow, 'slow');
    assert.equal(status.status, 'running');
    assert.deepEqual(q.seen, ['qmp_capabilities', 'slow', 'query-status']);
    c.close();
  } finally {
    await q.done();
  }
});

test("QEMU's errors reject with their class, and arguments are sent", async () => {
  let args: unknown;
  const q = await fakeQemu((cmd, s) => {
    if (cmd.execute === 'qmp_capabilities') return reply(s, { return: {}, id: cmd.id });
    args = cmd.arguments;
    reply(s, { error: { class: 'DeviceNotFound', desc: 'no such device' }, id: cmd.id });
  });
  try {
    const c = await QmpClient.connect(q.path);
    const err = await c.execute('device_del', { id: 'x' }).catch((e: unknown) => e);
    assert.ok(err instanceof DsecError);
    assert.equal(err.code, 'unavailable');
    assert.match(err.message, /no such device/);
    assert.deepEqual(err.details, { qmpClass: 'DeviceNotFound' });
    assert.deepEqual(args, { id: 'x' });
    c.close();
  } finally {
    await q.done();
  }
});

test('events reach listeners and waitEvent, interleaved with answers', async () => {
  const q = await fakeQemu((cmd, s) => {
    if (cmd.execute === 'qmp_capabilities') return reply(s, { return: {}, id: cmd.id });
    reply(s, { event: 'MIGRATION', data: { status: 'active' }, timestamp: {} });
    reply(s, { return: {}, id: cmd.id });
    reply(s, { event: 'MIGRATION', data: { status: 'completed' }, timestamp: {} });
  });
  try {
    const c = await QmpClient.connect(q.path);
    const all: string[] = [];
    c.onEvent((e) => all.push(String(e.data?.status)));
    const completed = c.waitEvent('MIGRATION', 5_000, (e) => e.data?.status === 'completed');
    await c.execute('migrate', { uri: 'unix:/x' });
    assert.deepEqual((await completed).data, { status: 'completed' });
    assert.deepEqual(all, ['active', 'completed']);
    c.close();
  } finally {
    await q.done();
  }
});

test('a command without an answer times out; later answers are dropped', async () => {
  const q = await fakeQemu((cmd, s) => {
    if (cmd.execute === 'qmp_capabilities') return reply(s, { return: {}, id: cmd.id });
    if (cmd.execute === 'hang') setTimeout(() => reply(s, { return: 1, id: cmd.id }), 100);
    if (cmd.execute === 'ok') reply(s, { return: 2, id: cmd.id });
  });
  try {
    const c = await QmpClient.connect(q.path);
    const err = await c.execute('hang', undefined, { timeoutMs: 20 }).catch((e: unknown) => e);
    assert.ok(err instanceof DsecError);
    assert.equal(err.code, 'deadline_exceeded');
    await new Promise((r) => setTimeout(r, 150));
    assert.equal(await c.execute('ok'), 2);
    c.close();
  } finally {
    await q.done();
  }
});

test('no greeting, a missing socket and a closed connection are unavailable', async () => {
  const silent = await fakeQemu(() => undefined, { greeting: null });
  try {
    const err = await QmpClient.connect(silent.path, { timeoutMs: 50 }).catch((e: unknown) => e);
    assert.ok(err instanceof DsecError);
    assert.equal(err.code, 'unavailable');
    assert.match(err.message, /no greeting/);
  } finally {
    await silent.done();
  }
  const missing = await QmpClient.connect('/nonexistent/qmp.sock').catch((e: unknown) => e);
  assert.ok(missing instanceof DsecError);
  assert.equal(missing.code, 'unavailable');

  // QEMU exits (as after `quit`) while a command and an event wait are pending.
  const q = await fakeQemu((cmd, s) => {
    if (cmd.execute === 'qmp_capabilities') return reply(s, { return: {}, id: cmd.id });
    s.destroy();
  });
  try {
    const c = await QmpClient.connect(q.path);
    const waiting = c.waitEvent('SHUTDOWN', 5_000).catch((e: unknown) => e);
    const err = await c.execute('quit').catch((e: unknown) => e);
    assert.ok(err instanceof DsecError);
    assert.equal(err.code, 'unavailable');
    assert.ok((await waiting) instanceof DsecError);
    assert.ok(c.closed);
    const after = await c.execute('query-status').catch((e: unknown) => e);
    assert.ok(after instanceof DsecError);
  } finally {
    await q.done();
  }
});
