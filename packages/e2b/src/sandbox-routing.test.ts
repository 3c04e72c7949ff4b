import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { SandboxIdCodec } from '@dsec/core';
import { toE2bSandboxId } from './ids.js';
import {
  addressOf,
  ENVD_PORT,
  installSandboxRouting,
  parseSandboxHost,
  routedUrl,
  sandboxAddressOf,
} from './sandbox-routing.js';

const id = toE2bSandboxId(new SandboxIdCodec('0123456789abcdef0123').mint('node-1'));

test('the host form names a port and an E2B sandbox ID, under the domain when one is set', () => {
  assert.deepEqual(parseSandboxHost(`49983-${id}.sandbox.example`), {
    port: 49983,
    sandboxId: id,
  });
  assert.deepEqual(parseSandboxHost(`8080-${id.toUpperCase()}.sandbox.example:443`), {
    port: 8080,
    sandboxId: id,
  });
  assert.deepEqual(parseSandboxHost(`3000-${id}.sandbox.example`, 'SANDBOX.example'), {
    port: 3000,
    sandboxId: id,
  });
  for (const host of [
    undefined,
    '',
    'localhost',
    '127.0.0.1:7420',
    `49983-${id}`, // no domain at all
    `3000-${id}.other.example`, // wrong domain when one is set
    `0-${id}.sandbox.example`,
    `70000-${id}.sandbox.example`,
    '3000-sbmzxw6ytboj.sandbox.example', // not an ID any encoding produces
    '3000-api.sandbox.example',
  ]) {
    const domain = host?.includes('other') ? 'sandbox.example' : undefined;
    assert.equal(parseSandboxHost(host, domain), undefined, String(host));
  }
});

test('the E2b-Sandbox-Id header wins over the host; its port defaults to envd', () => {
  assert.deepEqual(
    addressOf({ headers: { 'e2b-sandbox-id': 'sb-x', host: 'api.example' }, url: '/files?path=a' }),
    { port: ENVD_PORT, sandboxId: 'sb-x', url: '/files?path=a' },
  );
  assert.deepEqual(
    addressOf({ headers: { 'e2b-sandbox-id': 'sb-x', 'e2b-sandbox-port': '8080' }, url: '/' }),
    { port: 8080, sandboxId: 'sb-x', url: '/' },
  );
  assert.equal(
    addressOf({ headers: { 'e2b-sandbox-id': 'sb-x', 'e2b-sandbox-port': 'x' }, url: '/' })?.port,
    0,
  );
  assert.equal(addressOf({ headers: { host: 'api.example' }, url: '/v2/sandboxes' }), undefined);
  assert.equal(
    routedUrl({ port: 80, sandboxId: 'sb-a/b', url: '/x?y=1' }),
    '/_e2b/sandbox/80/sb-a%2Fb/x?y=1',
  );
});

test('the rewrite runs before the server’s own listener, which cannot be reached directly', async () => {
  const seen: { url?: string | undefined; address?: unknown }[] = [];
  const server = createServer((req, res) => {
    seen.push({ url: req.url, address: sandboxAddressOf(req) });
    res.end();
  });
  installSandboxRouting(server);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  try {
    await fetch(`${base}/files?path=x`, { headers: { 'e2b-sandbox-id': id } });
    await fetch(`${base}/v2/sandboxes`);
    await fetch(`${base}/_e2b/sandbox/49983/${id}/files`);
    assert.deepEqual(seen, [
      {
        url: `/_e2b/sandbox/49983/${id}/files?path=x`,
        address: { port: ENVD_PORT, sandboxId: id, url: '/files?path=x' },
      },
      { url: '/v2/sandboxes', address: undefined },
      { url: '/_e2b/not-a-route', address: undefined },
    ]);
  } finally {
    await new Promise((r) => server.close(r));
  }
});
