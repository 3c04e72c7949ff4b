import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { createServer } from 'node:net';
import type { Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { ChronusConnection, decodeWaitStatus } from './chronus-client.js';
import type { ChronusError } from './chronus-client.js';

function frame(type: number, stream: number, payload: Buffer = Buffer.alloc(0)): Buffer {
  const h = Buffer.alloc(9);
  h.writeUInt32LE(payload.length + 5, 0);
  h.writeUInt8(type, 4);
  h.writeUInt32LE(stream, 5);
  return Buffer.concat([h, payload]);
}

/** A fake daemon: hands the first client socket and everything it sent so far to the test. */
async function fakeDaemon(t: { after: (fn: () => Promise<void>) => void }) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-native-client-'));
  const path = join(dir, 's.sock');
  let received = Buffer.alloc(0);
  const server = createServer();
  const peer = new Promise<Socket>((resolve) =>
    server.once('connection', (s: Socket) => {
      s.on('data', (d: Buffer) => (received = Buffer.concat([received, d])));
      resolve(s);
    }),
  );
  await new Promise<void>((resolve) => server.listen(path, resolve));
  t.after(async () => {
    server.close();
    await rm(dir, { recursive: true, force: true });
  });
  return { path, peer, received: () => received };
}

test('decodeWaitStatus', () => {
  assert.deepEqual(decodeWaitStatus(7 << 8), { exitCode: 7, signal: null });
  assert.deepEqual(decodeWaitStatus(9), { exitCode: null, signal: 'SIGKILL' });
  assert.deepEqual(decodeWaitStatus(0x8b), { exitCode: null, signal: 'SIGSEGV' }); // with core dump bit
});

test('frames split at every byte and coalesced are decoded in order', async (t) => {
  const d = await fakeDaemon(t);
  const conn = await ChronusConnection.connect(d.path);
  const h = conn.spawn({
    argv: ['echo', 'hi'],
    env: { A: 'b' },
    cwd: '/w',
    user: 'alice',
    stdin: true,
  });
  const out: string[] = [];
  const err: string[] = [];
  h.onStdout((b) => out.push(b.toString()));
  h.onStderr((b) => err.push(b.toString()));
  const sock = await d.peer;

  const pid = Buffer.alloc(4);
  pid.writeUInt32LE(42, 0);
  const exit = Buffer.alloc(28);
  exit.writeInt32LE(3 << 8, 0);
  exit.writeBigUInt64LE(11n, 4);
  exit.writeBigUInt64LE(22n, 12);
  exit.writeBigUInt64LE(33n, 20);
  const big = Buffer.alloc(200_000, 'x');
  const all = Buffer.concat([
    frame(0x81, h.stream, pid),
    frame(0x83, h.stream, Buffer.from('a')),
    frame(0x84, h.stream, Buffer.from('e')),
    frame(0x83, h.stream, big),
    frame(0x83, 999, Buffer.from('unknown stream: ignored')),
    frame(0x85, h.stream, exit),
  ]);
  for (let i = 0; i < 64; i++) sock.write(all.subarray(i, i + 1)); // byte by byte
  sock.write(all.subarray(64)); // then the rest at once
  assert.deepEqual(await h.started, { pid: 42, reclaimedProcesses: 0, reclaimedGroups: 0 });
  assert.deepEqual(await h.exited, {
    waitStatus: 3 << 8,
    exitCode: 3,
    signal: null,
    userUsec: 11,
    sysUsec: 22,
    maxRssKib: 33,
  });
  assert.equal(out.join(''), `a${big.toString()}`);
  assert.deepEqual(err, ['e']);

  // The SPAWN frame the client sent.
  const sent = d.received();
  assert.equal(sent.readUInt8(4), 0x01);
  const p = sent.subarray(9, 4 + sent.readUInt32LE(0));
  assert.equal(p.readUInt32LE(0), 2); // STDIN flag
  assert.equal(p.readUInt32LE(16), 2); // argc
  assert.equal(p.readUInt32LE(20), 1); // envc
  assert.deepEqual(p.subarray(24).toString().split('\0'), ['/w', 'alice', 'echo', 'hi', 'A=b', '']);
  conn.close();
});

test('SPAWN_ERROR rejects with errno; a dropped connection rejects with ECONNRESET', async (t) => {
  const d = await fakeDaemon(t);
  const conn = await ChronusConnection.connect(d.path);
  const bad = conn.spawn({ argv: ['nope'] });
  const pending = conn.spawn({ argv: ['sleep'] });
  const sock = await d.peer;
  const e = Buffer.alloc(4);
  e.writeInt32LE(2, 0);
  sock.write(frame(0x82, bad.stream, Buffer.concat([e, Buffer.from('exec nope')])));
  await assert.rejects(
    bad.started,
    (err: ChronusError) => err.errno === 2 && err.code === 'ENOENT',
  );
  sock.destroy();
  await assert.rejects(pending.exited, (err: ChronusError) => err.code === 'ECONNRESET');
  await assert.rejects(
    conn.spawn({ argv: ['true'] }).started,
    (err: ChronusError) => err.code === 'ECONNRESET',
  );
});

test('an oversized frame from the daemon drops the connection', async (t) => {
  const d = await fakeDaemon(t);
  const conn = await ChronusConnection.connect(d.path);
  const h = conn.spawn({ argv: ['x'] });
  const sock = await d.peer;
  const hdr = Buffer.alloc(9);
  hdr.writeUInt32LE((2 << 20) + 5, 0);
  sock.write(hdr);
  await assert.rejects(h.started, (err: ChronusError) => err.code === 'ECONNRESET');
});
