import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import type { AddressInfo } from 'node:net';
import { addressKey, ConnectionGuard } from './connection-limits.js';
import type { ConnectionEvent } from './connection-limits.js';

test('addresses are counted per IPv4 address and per IPv6 /64', () => {
  assert.equal(addressKey('203.0.113.9'), '203.0.113.9');
  assert.equal(addressKey('::ffff:203.0.113.9'), '203.0.113.9');
  assert.equal(addressKey('2001:db8:0:1::5'), '2001:db8:0:1::/64');
  assert.equal(addressKey('2001:0db8:0000:0001:ffff:1:2:3'), '2001:db8:0:1::/64');
  assert.equal(addressKey('2001:db8:0:2::5'), '2001:db8:0:2::/64');
  assert.equal(addressKey('fe80::1%eth0'), 'fe80:0:0:0::/64');
  assert.equal(addressKey('::1'), '0:0:0:0::/64');
  assert.equal(addressKey('::ffff:1.2.3.4:0'), '::ffff:1.2.3.4:0'); // not an address: as it came
  assert.equal(addressKey(undefined), 'unknown');
});

test('a busy server refuses a new connection with a 503 only when nothing is idle', async (t) => {
  const events: ConnectionEvent[] = [];
  // Every request stays busy until the test ends: nothing can be evicted.
  const server = http.createServer(() => undefined);
  new ConnectionGuard({ maxConnections: 2 }, { onEvent: (e) => events.push(e) }).attach(server);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const sockets: net.Socket[] = [];
  t.after(async () => {
    for (const s of sockets) s.destroy();
    server.closeAllConnections();
    await new Promise<void>((r) => server.close(() => r()));
  });
  const { port } = server.address() as AddressInfo;
  const send = async () => {
    const s = net.connect(port, '127.0.0.1');
    s.on('error', () => {});
    sockets.push(s);
    let got = '';
    s.setEncoding('latin1');
    s.on('data', (d: string) => (got += d));
    await new Promise<void>((r) => s.once('connect', () => r()));
    s.write('GET / HTTP/1.1\r\nHost: x\r\n\r\n');
    return { s, answer: () => got };
  };
  await send();
  await send();
  await new Promise((r) => setTimeout(r, 100));
  const third = await send();
  await new Promise<void>((r) => third.s.once('close', () => r()));
  assert.match(third.answer(), /^HTTP\/1\.1 503 /);
  assert.match(third.answer(), /"code":"unavailable"/);
  assert.deepEqual(events, ['refused_total']);
});
