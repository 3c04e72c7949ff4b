/**
 * DNS queries reach the edge at a bounded rate per sandbox (SECURITY.md J38,
 * L40; issue 24 points 4 and 5, review): the resolver runs on the edge's
 * event loop, so a sandbox blasting queries at its resolver must not get more
 * of it than `network.dnsQueriesPerSecond` (set low here so the bound is far
 * below what the edge would answer), and must not slow another sandbox's DNS.
 * Against the tests' fake internet, as network.test.ts.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { after, before, describe, it } from 'node:test';
import type { DSecClient, Sandbox } from '@dsec/sdk';
import type { LinuxNetwork } from '../../src/network/linux-network.js';
import { hasGcc, startEgressNode, type EgressNode } from './network-helpers.js';

const root = process.getuid?.() === 0;
const nftOk = spawnSync('nft', ['list', 'tables']).status === 0;
const skip = !root || !nftOk || !hasGcc() ? 'needs root, nftables and gcc' : false;

/** The test node's bound: queries per second per sandbox (the burst is twice that). */
const RATE = 20;

describe('DNS query rate per sandbox (fake internet)', { skip, timeout: 300_000 }, () => {
  let net: LinuxNetwork;
  let env: EgressNode;

  before(async () => {
    env = await startEgressNode('dsec-egress-rate-', () => ({ dnsQueriesPerSecond: RATE }));
    ({ net } = env);
  });

  after(() => env?.close());

  const create = (opts?: Parameters<DSecClient['runContainer']>[0]) => env.create(opts);
  const sh = (sb: Sandbox, line: string, timeoutMs = 120_000) => env.sh(sb, line, timeoutMs);
  function host4(sb: Sandbox): string {
    const n = net.sandboxNetwork(sb.id);
    assert.ok(n, `no network for ${sb.id}`);
    return n.host4;
  }

  it('a sandbox blasting its resolver is answered at its rate; another sandbox is not slowed', async () => {
    const flooder = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
    const other = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
    // Another sandbox's lookups meanwhile: each one answered (10 within its own burst).
    const blast = sh(flooder, `probe dns ${host4(flooder)} '*.flood.test' 30000 0 0`);
    const polite = sh(other, `probe dns ${host4(other)} allowed.test 10 0`);
    const [out, otherOut] = await Promise.all([blast, polite]);
    const m = /sent (\d+) replies (\d+) .* sending_ms (\d+)/.exec(out);
    assert.ok(m, out);
    const [replies, sendingMs] = [Number(m[2]), Number(m[3])];
    // Admitted at most: the burst, then the rate while it sent (and a second of slack).
    const bound = 2 * RATE + RATE * (sendingMs / 1000 + 1);
    assert.ok(
      replies <= bound,
      `${replies} answers to a blast of ${sendingMs} ms (bound ${bound})`,
    );
    assert.ok(replies > 0, out);
    assert.match(otherOut, /sent 10 replies 10 rcode0 10 /, otherOut);
    // Once the bucket refills, the flooder's own lookups work again.
    await new Promise((r) => setTimeout(r, (2000 * 2 * RATE) / RATE));
    assert.match(
      await sh(flooder, `probe dns ${host4(flooder)} allowed.test 10 0`),
      /sent 10 replies 10 rcode0 10 /,
    );
  });
});
