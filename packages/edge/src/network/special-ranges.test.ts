import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { hostInterfaceCidrs } from './linux-network.js';
import { bigIntToIp, compilePolicy, formatCidr, ipToBigInt, parseCidr } from './policy.js';
import {
  checkNat64Prefix,
  classifyAddress,
  METADATA_ADDRESSES,
  NAT64_WELL_KNOWN,
  nat64Embedded,
  nat64Image,
  NO_NODE_RANGES,
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
        // Nested ranges (::/96 holds :: and ::1) take the reserved one first; a NAT64 address
        // is as reserved as the IPv4 address it embeds (0.0.0.0 and 255.255.255.255 here).
        if (!r.reserved && !r.cidr.startsWith('64:ff9b::/'))
          assert.ok(!got.reserved || got.range !== r.cidr);
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

  const node = (cidr: string) => ({ cidr: parseCidr(cidr, 'n'), what: "the node's own network" });
  const ranges: NodeRanges = {
    reserved: [parseCidr('10.213.0.0/16', 's'), parseCidr('fd5e:c0de:d5::/48', 's')],
    protected: [node('203.0.114.0/24'), node('198.18.0.0/30'), node('10.1.2.0/24')],
    public: [parseCidr('198.18.0.0/15', 'p')],
    nat64: NO_NODE_RANGES.nat64,
  };

  it("classifies the node's networks, the sandbox subnets and declared-public ranges", () => {
    assert.equal(classifyAddress('10.213.0.5', ranges)?.reserved, true);
    assert.equal(classifyAddress('fd5e:c0de:d5:1::1', ranges)?.reserved, true);
    assert.equal(classifyAddress('203.0.114.77', ranges)?.protected, true);
    // A node network stays protected inside a range declared public, and inside a private one.
    assert.equal(classifyAddress('198.18.0.1', ranges)?.protected, true);
    assert.equal(classifyAddress('10.1.2.3', ranges)?.protected, true);
    assert.equal(classifyAddress('198.18.1.10', ranges), undefined);
    // Declared public never covers what it does not name.
    assert.ok(classifyAddress('10.1.1.1', ranges));
    assert.equal(classifyAddress('10.1.1.1', ranges)?.protected, undefined);
    // A 6to4 address embedding a node address is protected too.
    assert.equal(classifyAddress('2002:cb00:724d::1', ranges)?.range, '2002::/16');
    assert.equal(classifyAddress('2002:cb00:724d::1', ranges)?.protected, true);
  });

  it('keeps protected ranges closed whatever CIDR rule a tenant writes, in DNS answers too', () => {
    for (const rule of ['10.0.0.0/8', '0.0.0.0/0', '203.0.114.0/24', '10.1.2.3/32'])
      for (const a of ['10.1.2.3', '203.0.114.77'])
        assert.equal(
          screenAddress(policy([{ cidr: rule }]), a, ranges).verdict,
          'drop',
          `${rule} ${a}`,
        );
    // The rest of the rule still works.
    assert.equal(
      screenAddress(policy([{ cidr: '10.0.0.0/8' }]), '10.9.9.9', ranges).verdict,
      'release',
    );
    // Metadata addresses outside the reserved ranges are always protected (the edge adds them).
    const withMetadata: NodeRanges = {
      ...ranges,
      protected: METADATA_ADDRESSES.map((m) => ({ cidr: parseCidr(m.cidr, 'm'), what: m.what })),
    };
    for (const rule of ['fc00::/7', '::/0', 'fd00:ec2::/32'])
      assert.equal(
        screenAddress(policy([{ cidr: rule }]), 'fd00:ec2::254', withMetadata).verdict,
        'drop',
        rule,
      );
    assert.equal(
      screenAddress(policy([{ cidr: '100.64.0.0/10' }]), '100.100.100.200', withMetadata).verdict,
      'drop',
    );
    // 169.254.169.254 is link-local: reserved already.
    assert.equal(classifyAddress('169.254.169.254')?.reserved, true);
  });

  it('judges a NAT64 address by the IPv4 address it embeds, under every RFC 6052 prefix length', () => {
    // RFC 6052 section 2.4's examples: 192.0.2.33 under each prefix length.
    const examples: [string, string][] = [
      ['2001:db8::/32', '2001:db8:c000:221::'],
      ['2001:db8:100::/40', '2001:db8:1c0:2:21::'],
      ['2001:db8:122::/48', '2001:db8:122:c000:2:2100::'],
      ['2001:db8:122:300::/56', '2001:db8:122:3c0:0:221::'],
      ['2001:db8:122:344::/64', '2001:db8:122:344:c0:2:2100:0'],
      ['2001:db8:122:344::/96', '2001:db8:122:344::c000:221'],
      ['64:ff9b::/96', '64:ff9b::c000:221'],
    ];
    for (const [prefix, address] of examples) {
      const p = parseCidr(prefix, 'p');
      assert.equal(bigIntToIp(nat64Embedded(p, ipToBigInt(address)), 4), '192.0.2.33', prefix);
      // The image of the one address is exactly it (its /128 under /96; the RFC's suffix is 0).
      const image = nat64Image(p, parseCidr('192.0.2.33/32', 'a'));
      assert.equal(
        bigIntToIp(ipToBigInt(image.address), 6),
        bigIntToIp(ipToBigInt(address), 6),
        prefix,
      );
      // Past bit 64 the u octet (zero) is part of it too.
      const end = p.prefix + 32;
      assert.equal(image.prefix, p.prefix < 96 && end > 64 ? end + 8 : end, prefix);
    }
    // An image of a range: 10.0.0.0/8 under a /56 spans the u octet.
    assert.equal(
      formatCidr(nat64Image(parseCidr('2001:db8:122:300::/56', 'p'), parseCidr('10.0.0.0/8', 'a'))),
      '2001:db8:122:30a::/64',
    );
    assert.equal(
      formatCidr(
        nat64Image(parseCidr('2001:db8:122:300::/56', 'p'), parseCidr('10.1.0.0/16', 'a')),
      ),
      '2001:db8:122:30a:1::/80',
    );
    const nsp = parseCidr('2a01:4f8:64::/96', 'p');
    const withNsp: NodeRanges = { ...ranges, nat64: [parseCidr(NAT64_WELL_KNOWN, 'w'), nsp] };
    // Without the setting, an operator's NSP is a public prefix: its private forms open.
    assert.equal(classifyAddress('2a01:4f8:64::a01:203', ranges), undefined);
    // With it: reserved and protected IPv4 stay closed whatever the rules; private need a rule.
    assert.equal(classifyAddress('2a01:4f8:64::a9fe:a9fe', withNsp)?.reserved, true);
    assert.equal(classifyAddress('2a01:4f8:64::a01:203', withNsp)?.protected, true); // 10.1.2.3
    assert.equal(
      screenAddress(policy([{ cidr: '::/0' }]), '2a01:4f8:64::a01:203', withNsp).verdict,
      'drop',
    );
    assert.equal(screenAddress(policy(), '2a01:4f8:64::a09:909', withNsp).verdict, 'drop'); // 10.9.9.9
    assert.equal(
      screenAddress(policy([{ cidr: '2a01:4f8:64::/96' }]), '2a01:4f8:64::a09:909', withNsp)
        .verdict,
      'release',
    );
    // The well-known prefix as the issue says: special as a whole, its protected forms closed.
    assert.equal(screenAddress(policy(), '64:ff9b::808:808', withNsp).verdict, 'drop');
    assert.equal(
      screenAddress(policy([{ cidr: '64:ff9b::/96' }]), '64:ff9b::a01:203', withNsp).verdict,
      'drop',
    );
    assert.equal(
      screenAddress(policy([{ cidr: '64:ff9b::/96' }]), '64:ff9b::7f00:1', withNsp).verdict,
      'drop',
    );
    // Prefixes of other lengths, or over reserved ranges, are refused.
    assert.equal(formatCidr(checkNat64Prefix('2a01:4f8:64::/96', 'f')), '2a01:4f8:64::/96');
    for (const bad of ['2a01:4f8:64::/80', '10.0.0.0/8', '::ffff:0:0/96', 'fe80::/64'])
      assert.throws(() => checkNat64Prefix(bad, 'f'), { code: 'invalid_argument' }, bad);
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
    const nets = nodeNetworks(cidrs, [parseCidr('10.213.0.0/16', 's')]);
    // Private or not, every network but link-local (reserved) is the node's own.
    assert.deepEqual(nets.map(formatCidr).sort(), [
      '192.168.1.0/24',
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
    // NAT64 of a public address needs a CIDR rule too (issue 24: the prefix as a whole), and of a
    // reserved one is never reachable.
    assert.equal(screenAddress(policy(), '64:ff9b::808:808').verdict, 'drop');
    assert.equal(
      screenAddress(policy([{ cidr: '64:ff9b::/96' }]), '64:ff9b::808:808').verdict,
      'release',
    );
    assert.equal(
      screenAddress(policy([{ cidr: '64:ff9b::/96' }]), '64:ff9b::a9fe:a9fe').verdict,
      'drop',
    );
  });
});
