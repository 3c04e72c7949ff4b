/**
 * Destinations no tenant rule can open (issue 24 point 5, review follow-up;
 * SECURITY.md L40, C20): the node's own networks, the operator's protected
 * ranges (`network.protectedRanges`), metadata addresses, and the NAT64
 * forms of them under the operator's translator prefixes
 * (`network.nat64Prefixes`). A tenant's `0.0.0.0/0`, `10.0.0.0/8` or `::/0`
 * opens the rest of what it names, never these, neither by address nor
 * through DNS answers. Against the tests' fake internet, whose uplink's far
 * end (198.18.0.2, fdff:5ec::2) stands for a host of the operator's LAN and
 * whose private host (10.199.53.10) for its database.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { after, before, describe, it } from 'node:test';
import type { SingleNode } from '@dsec/cluster';
import type { DSecClient, Sandbox } from '@dsec/sdk';
import type { LinuxNetwork } from '../../src/network/linux-network.js';
import type { FakeInternet } from './fake-internet.js';
import { hasGcc, startEgressNode, type EgressNode } from './network-helpers.js';

const root = process.getuid?.() === 0;
const nftOk = spawnSync('nft', ['list', 'tables']).status === 0;
const skip = !root || !nftOk || !hasGcc() ? 'needs root, nftables and gcc' : false;

describe('protected ranges and NAT64 prefixes (fake internet)', { skip, timeout: 600_000 }, () => {
  let fake: FakeInternet;
  let node: SingleNode;
  let net: LinuxNetwork;
  let env: EgressNode;

  before(async () => {
    env = await startEgressNode('dsec-egress-protected-', (fake) => ({
      // The operator's database network.
      protectedRanges: ['10.199.53.0/24'],
      nat64Prefixes: [fake.nat64Prefix],
    }));
    ({ fake, node, net } = env);
  });

  after(() => env?.close());

  const create = (opts?: Parameters<DSecClient['runContainer']>[0]) => env.create(opts);
  const sh = (sb: Sandbox, line: string, timeoutMs = 60_000) => env.sh(sb, line, timeoutMs);
  /** The firewall's protected set of a family, as nft lists it. */
  function protectedSet(family: 4 | 6): string {
    return spawnSync('nft', ['list', 'set', 'inet', net.table, `protected${family}`], {
      encoding: 'utf8',
    }).stdout;
  }

  it("keeps the node's networks and the operator's ranges closed under any tenant CIDR rule", async () => {
    await fake.clear();
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ cidr: '0.0.0.0/0' }, { cidr: '::/0' }],
    });
    // The rest of what the rules name opens.
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp} 80 3000`), /^connected/);
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp6} 80 3000`), /^connected/);
    // A host on the node's own network (the uplink's far end, with a listener on 9999).
    const lan = await sh(sb, 'probe tcp 198.18.0.2 9999 3000');
    assert.match(lan, /^error ECONNREFUSED/, lan);
    const lan6 = await sh(sb, 'ping -c 1 -W 2 fdff:5ec::2');
    assert.match(lan6, /0 packets received/, lan6);
    // The operator's protected range (its "database").
    const db = await sh(sb, `probe tcp ${fake.privateIp} 80 3000`);
    assert.match(db, /^error ECONNREFUSED/, db);
    assert.match(await sh(sb, `probe udp ${fake.privateIp} 7 x 2000`), /^error /);
    assert.deepEqual(
      (await fake.log()).filter((e) => e.server === fake.privateIp),
      [],
      'nothing reached the protected host',
    );
    // Said in the sandbox's events: the rule's protected part, and the refused connection.
    await node.edge.options.network?.collectEvents();
    const events = await sb.events({ limit: 1000 });
    const overlap = events.find(
      (e) =>
        e.kind === 'network_denied' &&
        e.details.reason === 'protected' &&
        e.details.rule === '0.0.0.0/0',
    );
    assert.ok(overlap, JSON.stringify(events));
    assert.ok(
      JSON.stringify(overlap.details.protected).includes('10.199.53.0/24'),
      JSON.stringify(overlap),
    );
    assert.ok(
      events.some(
        (e) =>
          e.kind === 'network_denied' &&
          e.details.destination === '198.18.0.2' &&
          e.details.reason === 'protected',
      ),
      JSON.stringify(events),
    );
  });

  it('leaves protected addresses out of DNS answers even under a covering CIDR rule', async () => {
    const sb = await create({
      image: 'busybox',
      networkAllow: [
        { domain: 'private.test' },
        { domain: 'lan.test' },
        { cidr: '10.0.0.0/8' },
        { cidr: '198.18.0.0/15' },
        { cidr: 'fdff:5ec::/32' },
      ],
    });
    const priv = await sh(sb, 'nslookup private.test');
    assert.doesNotMatch(priv, /10\.199\.53\.10/, priv);
    const lan = await sh(sb, 'nslookup lan.test');
    assert.doesNotMatch(lan, /198\.18\.0\.2|fdff:5ec::2/, lan);
    const events = await sb.events({ limit: 1000 });
    assert.ok(
      events.some(
        (e) =>
          e.kind === 'dns_blocked' &&
          e.details.name === 'lan.test' &&
          JSON.stringify(e.details.dropped).includes('198.18.0.2'),
      ),
      JSON.stringify(events),
    );
  });

  it('accepts a rule that names only protected addresses, and opens nothing with it', async () => {
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ cidr: `${fake.privateIp}/32`, ports: [80] }],
    });
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    const events = await sb.events();
    assert.ok(
      events.some((e) => e.details.reason === 'protected' && e.details.rule === '10.199.53.10/32'),
      JSON.stringify(events),
    );
    // A live update to such a rule is accepted the same way.
    await sb.updateNetworkRules({ allow: [{ cidr: '198.18.0.0/30' }] });
    assert.match(await sh(sb, 'probe tcp 198.18.0.2 9999 3000'), /^error ECONNREFUSED/);
  });

  it("judges an operator's NAT64 prefix by the IPv4 address it embeds", async () => {
    // Without a CIDR rule the prefix is special, like the well-known one: no form opens by name.
    const byName = await create({
      image: 'busybox',
      networkAllow: [{ domain: 'nsp-private.test' }, { domain: 'nsp-public.test' }],
    });
    const priv = await sh(byName, 'nslookup -type=aaaa nsp-private.test');
    assert.doesNotMatch(priv, /fdff:5ec:1::64:ac7:350a/, priv);
    assert.match(
      await sh(byName, `probe tcp ${fake.nspPrivateIp6} 80 3000`),
      /^error ECONNREFUSED/,
    );
    const pub = await sh(byName, 'nslookup -type=aaaa nsp-public.test');
    assert.doesNotMatch(pub, /fdff:5ec:1::64:c612:10a/, pub);
    // A CIDR rule over the prefix releases the forms of IPv4 addresses that are not protected,
    // and never the protected ones (the firewall holds their NAT64 forms too).
    const byCidr = await create({
      image: 'busybox',
      networkAllow: [
        { domain: 'nsp-private.test' },
        { domain: 'nsp-public.test' },
        { cidr: fake.nat64Prefix },
      ],
    });
    assert.match(
      await sh(byCidr, 'nslookup -type=aaaa nsp-public.test'),
      /fdff:5ec:1::64:c612:10a/,
    );
    assert.match(await sh(byCidr, `probe tcp ${fake.nspPublicIp6} 80 3000`), /^connected/);
    const priv2 = await sh(byCidr, 'nslookup -type=aaaa nsp-private.test');
    assert.doesNotMatch(priv2, /fdff:5ec:1::64:ac7:350a/, priv2);
    assert.match(
      await sh(byCidr, `probe tcp ${fake.nspPrivateIp6} 80 3000`),
      /^error ECONNREFUSED/,
    );
    assert.deepEqual(
      (await fake.log()).filter((e) => e.server === fake.nspPrivateIp6),
      [],
      'nothing reached the NAT64 form of the protected host',
    );
  });

  it('installs the metadata addresses and the NAT64 forms in the firewall', () => {
    const v4 = protectedSet(4);
    const v6 = protectedSet(6);
    // The node's own network (the uplink's /30), the operator's range, Alibaba's metadata.
    for (const c of ['198.18.0.0/30', '10.199.53.0/24', '100.100.100.200'])
      assert.ok(v4.includes(c), `${c} in\n${v4}`);
    // AWS's IPv6 metadata; NAT64 forms of link-local (metadata) and of the protected range.
    for (const c of ['fd00:ec2::254', '64:ff9b::a9fe:0/112', 'fdff:5ec:1::64:ac7:3500/120'])
      assert.ok(v6.includes(c), `${c} in\n${v6}`);
    assert.ok(net.protectedRanges().includes('fdff:5ec::/64'), net.protectedRanges().join(' '));
  });
});
