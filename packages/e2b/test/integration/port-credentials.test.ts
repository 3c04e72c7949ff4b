/**
 * Issue 24 item 9 on a real node: a web server inside a sandbox (busybox
 * `nc` running a script that echoes the request head it got, and logs it)
 * is reached through the native port route and the E2B host-routed form with
 * the caller's key in every header form, a cookie and the query string, plain
 * and as a WebSocket upgrade. Nothing it ever receives carries the key.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import { toE2bSandboxId } from '@dsec/e2b';
import { DSecClient } from '@dsec/sdk';
import { withE2bNode } from './e2b-node.js';

const root = process.getuid?.() === 0;

/** Reads a request head, logs it, answers it as the body. */
const ECHO_SCRIPT = `#!/bin/sh
head=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
  head="$head$line
"
done
printf '%s---\\n' "$head" >> /tmp/heads.log
printf 'HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nConnection: close\\r\\nContent-Length: %s\\r\\n\\r\\n%s' "\${#head}" "$head"
`;

function keyForms(key: string): string[] {
  const b64 = (s: string) => [
    Buffer.from(s).toString('base64').replace(/=+$/, ''),
    Buffer.from(s).toString('base64url'),
  ];
  return [key, encodeURIComponent(key).replaceAll('_', '%5F'), ...b64(key), ...b64(`user:${key}`)];
}

function assertNoKey(text: string, key: string, what: string): void {
  for (const form of keyForms(key))
    assert.ok(!text.includes(form.slice(0, 40)), `${what}: the sandbox got ${form}\n${text}`);
  assert.doesNotMatch(text, /dsk_[A-Za-z0-9_-]{43}/, what);
}

function send(
  base: string,
  path: string,
  headers: Record<string, string>,
): Promise<{ status: number; body: string }> {
  const u = new URL(base);
  return new Promise((resolve, reject) => {
    const req = http.request({ host: u.hostname, port: u.port, path, headers }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (c: string) => (body += c));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
    });
    req.on('upgrade', (res, socket) => {
      socket.destroy();
      resolve({ status: res.statusCode ?? 0, body: '' });
    });
    req.on('error', reject);
    req.end();
  });
}

test(
  'a sandbox web server never receives the caller’s key, through either proxy',
  { skip: root ? false : 'needs root', timeout: 300_000 },
  () =>
    withE2bNode(
      async ({ url, adminKey: key }) => {
        const client = new DSecClient({ url, apiKey: key });
        const sb = await client.runContainer({ image: 'busybox', ttlSeconds: 300 });
        try {
          await sb.files.write('/tmp/echo.sh', ECHO_SCRIPT, { mode: 0o755 });
          const started = await sb.exec([
            'sh',
            '-c',
            'nc -ll -p 8080 -e /tmp/echo.sh </dev/null >/dev/null 2>&1 &',
          ]);
          assert.equal(started.exitCode, 0);
          const listening = await sb.exec([
            'sh',
            '-c',
            'for i in $(seq 100); do netstat -ltn | grep -q ":8080 " && exit 0; sleep 0.1; done; exit 1',
          ]);
          assert.equal(listening.exitCode, 0, 'the echo server listens');
          const query = `?x=1&token=${key}&enc=${encodeURIComponent(key).replaceAll('_', '%5F')}`;
          const everywhere = {
            'x-api-key': key,
            'x-access-token': key,
            'e2b-traffic-access-token': key,
            'proxy-authorization': `Basic ${Buffer.from(`u:${key}`).toString('base64')}`,
            'x-forwarded-authorization': `Bearer ${key}`,
            cookie: `theme=dark; session=${key}`,
            referer: `http://app.example/?k=${key}`,
            'x-benign': 'kept',
          };
          const host = `8080-${toE2bSandboxId(sb.id)}.sandbox.test`;
          const upgrade = { connection: 'Upgrade', upgrade: 'websocket' };
          const calls: [string, string, Record<string, string>][] = [
            [
              'native',
              `/v1/sandboxes/${sb.id}/ports/8080/app${query}`,
              { authorization: `Bearer ${key}` },
            ],
            ['e2b bearer', `/app${query}`, { host, authorization: `Bearer ${key}` }],
            [
              'e2b basic',
              `/app${query}`,
              { host, authorization: `Basic ${Buffer.from(`user:${key}`).toString('base64')}` },
            ],
            [
              'native upgrade',
              `/v1/sandboxes/${sb.id}/ports/8080/ws${query}`,
              { authorization: `Bearer ${key}`, ...upgrade },
            ],
            ['e2b upgrade', `/ws${query}`, { host, ...upgrade }],
          ];
          for (const [what, path, extra] of calls) {
            const res = await send(url, path, { ...everywhere, ...extra });
            if (!what.includes('upgrade')) {
              assert.equal(res.status, 200, `${what}: ${res.body}`);
              assertNoKey(res.body, key, what);
              assert.match(res.body, /^x-benign: kept$/im, what);
              assert.match(res.body, /^cookie: theme=dark$/im, what);
            }
          }
          // Everything the server ever received, upgrades included.
          const heads = await sb.files.read('/tmp/heads.log');
          assert.ok(heads.split('---').length >= 4, heads);
          assertNoKey(heads, key, 'the server’s log');
        } finally {
          await sb.stop();
        }
      },
      { sandboxDomain: 'sandbox.test' },
    ),
);
