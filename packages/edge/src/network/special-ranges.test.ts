import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { hostInterfaceCidrs } from './linux-network.js';
import { bigIntToIp, compilePolicy, formatCidr, ipToBigInt, parseCidr } from './policy.js';
import {
  classifyAddress,
  nodeNetworks,
  reservedCidrs,
  reservedOverlap,
  screenAddress,
  SPECIAL_RANGES,
  type NodeRanges,
} from './special-ranges.js';

const policy = (allow: { cidr: string; ports?: number[] }[] = [], deny: string[] = []) =>
  compilePolicy(
    { networkRules: {}, networkAllow: allow, networkDeny: deny.map((cidr) => ({ cidr })) },
    {},
  );

describe('special ranges', () => {
  it('are written canonically, each with its RFC, and classify their first and last address', () => {
    for (const r of SPECIAL_RANGES) {
      const c = parseCidr(r.cidr, 'r');
      assert.equal(formatCidr(c), r.cidr);
      assert.match(r.rfc, /^RFC \d+/);
      const width = BigInt(c.family === 4 ? 32 : 128);
      const first = ipToBigInt(c.address);
      const last = first + (1n << (width - BigInt(c.prefix))) - 1n;
      for (const a of [first, last]) {
        const got = classifyAddress(bigIntToIp(a, c.family));
        assert.ok(got, `${bigIntToIp(a, c.family)} in ${r.cidr}`);
        // Nested ranges (::/96 holds :: and ::1) take the reserved one first.
        if (!r.reserved) assert.ok(!got.reserved || got.range !== r.cidr);
      }
    }
  });

  it('covers what the issue lists, and leaves public addresses alone', () => {
    const special = [
      '10.1.2.3',
      '172.31.255.255',
      '192.168.0.1',
      '100.64.0.1',
      '100.127.255.254',
      '198.18.0.1',
      '198.19.255.255',
      '192.0.0.8',
      '0.0.0.0',
      '0.1.2.3',
      '169.254.169.254',
      '127.0.0.1',
      '224.0.0.251',
      '239.255.255.250',
      '255.255.255.255',
      '240.0.0.1',
      '192.0.2.1',
      '198.51.100.7',
      '203.0.113.9',
      'fd00::1',
      'fc00::1',
      'fe80::1',
      '::',
      '::1',
      '::ffff:10.0.0.1',
      '::ffff:8.8.8.8',
      '64:ff9b::a00:1',
      '64:ff9b::808:808',
      '64:ff9b:1::1',
      '2001:db8::1',
      '3fff::1',
      '2001::1',
      'ff02::1',
      '::a00:1',
      // 6to4 of private, loopback and metadata addresses.
      '2002:a00:1::1',
      '2002:7f00:1::',
      '2002:a9fe:a9fe::1',
    ];
    for (const a of special) assert.ok(classifyAddress(a), a);
    for (const a of [
      '8.8.8.8',
      '1.1.1.1',
      '100.63.255.255',
      '100.128.0.0',
      '172.32.0.0',
      '198.20.0.0',
      '192.0.1.255',
      '2606:4700::1111',
      '2a00:1450:4001::200e',
      // 6to4 of a public address is a public address.
      '2002:808:808::1',
    ])
      assert.equal(classifyAddress(a), undefined, a);
  });

  it('reserves, for the firewall too, exactly the ranges no rule may open', () => {
    assert.deepEqual(reservedCidrs(4), [
      '0.0.0.0/8',
      '127.0.0.0/8',
      '169.254.0.0/16',
      '224.0.0.0/4',
      '240.0.0.0/4',
    ]);
    assert.deepEqual(reservedCidrs(6), [
      '::/128',
      '::1/128',
      '::ffff:0:0/96',
      'fe80::/10',
      'ff00::/8',
    ]);
    // Overlap either way, including a reserved range in the middle of a big one.
    assert.equal(reservedOverlap(parseCidr('160.0.0.0/3', 'x'))?.cidr, '169.254.0.0/16');
    assert.equal(reservedOverlap(parseCidr('127.0.0.1/32', 'x'))?.cidr, '127.0.0.0/8');
    assert.equal(reservedOverlap(parseCidr('198.18.0.0/15', 'x')), undefined);
    assert.equal(reservedOverlap(parseCidr('::/0', 'x'))?.cidr, '::/128');
  });

  it("classifies the node's networks, the sandbox subnets and declared-public ranges", () => {
    const ranges: NodeRanges = {
      reserved: [parseCidr('10.213.0.0/16', 's'), parseCidr('fd5e:c0de:d5::/48', 's')],
      node: [parseCidr('203.0.114.0/24', 'n'), parseCidr('198.18.0.0/30', 'n')],
      public: [parseCidr('198.18.0.0/15', 'p')],
    };
    assert.equal(classifyAddress('10.213.0.5', ranges)?.reserved, true);
    assert.equal(classifyAddress('fd5e:c0de:d5:1::1', ranges)?.reserved, true);
    assert.equal(classifyAddress('203.0.114.77', ranges)?.node, true);
    // A node network stays filtered inside a range declared public.
    assert.equal(classifyAddress('198.18.0.1', ranges)?.node, true);
    assert.equal(classifyAddress('198.18.1.10', ranges), undefined);
    // Declared public never covers what it does not name.
    assert.ok(classifyAddress('10.1.1.1', ranges));
    // A 6to4 address embedding a node address is special too.
    assert.equal(classifyAddress('2002:cb00:724d::1', ranges)?.range, '2002::/16');
  });

  it("reads the node's networks from its interfaces, less what is covered already", () => {
    const listing = [
      '1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever',
      '1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever',
      '2: eth0    inet 203.0.114.5/24 brd 203.0.114.255 scope global eth0\\       valid_lft forever',
      '2: eth0    inet6 2a01:4f8:1:2::5/64 scope global \\       valid_lft forever',
      '2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever',
      '3: wlan0    inet 192.168.1.5/24 brd 192.168.1.255 scope global wlan0\\       valid_lft 1s',
      '4: up0    inet 198.18.0.1/30 scope global up0\\       valid_lft forever preferred_lft forever',
      '5: dsv0123456789ab    inet 10.213.0.1/30 scope global dsv0123456789ab\\       valid_lft forever',
      '6: dsvfedcba987654    inet 203.0.115.1/30 scope global dsvfedcba987654\\       valid_lft forever',
      '',
    ].join('\n');
    const cidrs = hostInterfaceCidrs(listing);
    // Loopback and every sandbox link (this edge's or another's) are skipped.
    assert.deepEqual(cidrs, [
      '203.0.114.5/24',
      '2a01:4f8:1:2::5/64',
      'fe80::1/64',
      '192.168.1.5/24',
      '198.18.0.1/30',
    ]);
    const nets = nodeNetworks(
      cidrs,
      [parseCidr('10.213.0.0/16', 's')],
      [parseCidr('198.18.0.0/15', 'p')],
    );
    // RFC 1918 and link-local are covered by the table; 198.18.0.0/30 is not, being declared public.
    assert.deepEqual(nets.map(formatCidr).sort(), [
      '198.18.0.0/30',
      '203.0.114.0/24',
      '2a01:4f8:1:2::/64',
    ]);
    assert.deepEqual(
      nodeNetworks(['not an address', '10.213.5.1/30'], [parseCidr('10.213.0.0/16', 's')]),
      [],
    );
  });

  it('gives the verdicts of L40: deny and reserved drop, a CIDR rule releases, public opens', () => {
    assert.deepEqual(screenAddress(policy(), '8.8.8.8'), { verdict: 'open' });
    assert.equal(screenAddress(policy(), '10.1.2.3').verdict, 'drop');
    assert.deepEqual(screenAddress(policy([{ cidr: '10.1.0.0/16', ports: [5432] }]), '10.1.2.3'), {
      verdict: 'release',
    });
    // A CIDR rule of the other family, or another range, does not help.
    assert.equal(screenAddress(policy([{ cidr: 'fd00::/8' }]), '10.1.2.3').verdict, 'drop');
    // Reserved ranges stay closed whatever the rules (the firewall rejects them first).
    assert.equal(
      screenAddress(policy([{ cidr: '169.254.0.0/16' }]), '169.254.169.254').verdict,
      'drop',
    );
    assert.equal(screenAddress(policy([{ cidr: '::/0' }]), '::ffff:10.1.2.3').verdict, 'drop');
    // A denied CIDR drops even a public address.
    assert.deepEqual(screenAddress(policy([], ['8.8.8.0/24']), '8.8.8.8'), {
      verdict: 'drop',
      range: '8.8.8.0/24',
      why: 'a denied CIDR',
    });
    // NAT64 of a public address needs a CIDR rule too (issue 24: the prefix as a whole).
    assert.equal(screenAddress(policy(), '64:ff9b::808:808').verdict, 'drop');
    assert.equal(
      screenAddress(policy([{ cidr: '64:ff9b::/96' }]), '64:ff9b::808:808').verdict,
      'release',
    );
  });
});
