import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { elementFromJson } from './linux-network.js';
import {
  addLines,
  addressElements,
  baseElements,
  deleteLines,
  policyChain,
  refId,
  tableScript,
} from './nft-ruleset.js';
import { compilePolicy, DEFAULT_NETWORK_CATALOGUE, parseCidr } from './policy.js';

const sb = {
  veth: 'dsv0123456789ab',
  host4: '10.213.0.5',
  sandbox4: '10.213.0.6',
  sandbox6: 'fd5e:c0de:d5:1::2',
};
const policy = (allow: { cidr: string; ports?: number[] }[], deny: { cidr: string }[] = []) =>
  compilePolicy(
    { networkRules: {}, networkAllow: allow, networkDeny: deny },
    DEFAULT_NETWORK_CATALOGUE,
  );

describe('nft ruleset', () => {
  it('has no per-sandbox chain or set: a sandbox is elements keyed by its veth and address', () => {
    const table = tableScript({
      table: 't',
      subnet4: parseCidr('10.213.0.0/16', 's'),
      subnet6: parseCidr('fd5e:c0de:d5::/48', 's'),
      deniedWindowSeconds: 60,
    });
    assert.doesNotMatch(table, /sb_\d|_\d+ \{/);
    const base = baseElements(sb, undefined, 0xd5000001);
    assert.deepEqual(
      base.map((r) => r.set),
      ['ifaces', 'ctmark', 'ctcur', 'src4', 'src6', 'dns4'],
    );
    assert.deepEqual(
      base.filter((r) => r.set.startsWith('ct')).map((r) => [r.key, r.value]),
      [
        [`"${sb.veth}"`, String(0xd5000001)],
        [`"${sb.veth}" . ${0xd5000001}`, undefined],
      ],
    );
    // A teardown that does not know the mark leaves those two to the reconcile.
    assert.deepEqual(
      baseElements(sb, undefined, undefined).map((r) => r.set),
      ['ifaces', 'src4', 'src6', 'dns4'],
    );
    for (const r of base) assert.ok(r.key.startsWith(`"${sb.veth}"`), r.key);
    const dns = addressElements(sb, [
      { family: 4, address: '198.18.1.10', ports: [], timeoutSeconds: 30 },
      { family: 6, address: 'fdff:5ec:1::10', ports: [443], timeoutSeconds: 30 },
    ]);
    assert.deepEqual(
      dns.map((r) => [r.set, r.key]),
      [
        ['a4', '10.213.0.6 . 198.18.1.10'],
        ['p6', 'fd5e:c0de:d5:1::2 . fdff:5ec:1::10 . 443'],
      ],
    );
  });

  it("lets DNS reach only the sandbox's own resolver address, and reserves the table's reserved ranges", () => {
    const table = tableScript({
      table: 't',
      subnet4: parseCidr('10.213.0.0/16', 's'),
      subnet6: parseCidr('fd5e:c0de:d5::/48', 's'),
      deniedWindowSeconds: 60,
    });
    const toHost = table.split('\n').filter((l) => l.includes(' from_sandbox_to_host '));
    // No "any local address" accept (SECURITY.md L40): only the (veth, host end) pair.
    assert.ok(!toHost.some((l) => /fib daddr/.test(l)), toHost.join('\n'));
    // Only this edge's links (another edge's sandboxes are not in this table's dns4).
    assert.ok(table.includes('input_hook iifname @ifaces jump from_sandbox_to_host'), table);
    assert.ok(!table.includes('"dsv*"'), table);
    // DNS at a bounded rate per veth, before conntrack lets a flow's later queries through.
    assert.equal(
      toHost[0],
      'add rule inet t from_sandbox_to_host udp dport 53 iifname . ip daddr @dns4 update @dnsrate { iifname limit rate over 200/second burst 400 packets } drop',
    );
    const accepts = toHost.filter((l) => l.endsWith(' accept'));
    assert.deepEqual(accepts, [
      'add rule inet t from_sandbox_to_host ct state established,related accept',
      'add rule inet t from_sandbox_to_host udp dport 53 iifname . ip daddr @dns4 accept',
      'add rule inet t from_sandbox_to_host icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit } accept',
    ]);
    assert.deepEqual(
      baseElements(sb, undefined, 1).find((r) => r.set === 'dns4'),
      { set: 'dns4', key: `"${sb.veth}" . ${sb.host4}` },
    );
    assert.match(
      table,
      /egress4 ip daddr \{ 10\.213\.0\.0\/16, 0\.0\.0\.0\/8, 127\.0\.0\.0\/8, 169\.254\.0\.0\/16, 224\.0\.0\.0\/4, 240\.0\.0\.0\/4 \} goto deny/,
    );
    assert.match(
      table,
      /egress6 ip6 daddr \{ fd5e:c0de:d5::\/48, ::\/128, ::1\/128, ::ffff:0:0\/96, fe80::\/10, ff00::\/8 \} goto deny/,
    );
  });

  it("accepts a flow's later packets only with its sandbox's mark, and marks what it allows", () => {
    const table = tableScript({
      table: 't',
      subnet4: parseCidr('10.213.0.0/16', 's'),
      subnet6: parseCidr('fd5e:c0de:d5::/48', 's'),
      deniedWindowSeconds: 60,
    });
    const lines = table.split('\n');
    const accepts = lines.filter(
      (l) => / (egress4|egress6|forward_hook|allow) /.test(l) && / accept$/.test(l),
    );
    // No bare `ct state established accept`: every one names the interface and its mark.
    assert.deepEqual(accepts, [
      'add rule inet t forward_hook ip daddr 10.213.0.0/16 ct state established,related oifname . ct mark @ctcur accept',
      'add rule inet t forward_hook ip6 daddr fd5e:c0de:d5::/48 ct state established,related oifname . ct mark @ctcur accept',
      'add rule inet t egress4 ct state established,related iifname . ct mark @ctcur accept',
      'add rule inet t egress6 ct state established,related iifname . ct mark @ctcur accept',
      'add rule inet t allow ct mark set iifname map @ctmark accept',
    ]);
    // Every other way out of the egress chains is through `allow` (which marks) or `deny`.
    for (const l of lines.filter((x) => / egress[46] /.test(x) && !x.includes('@ctcur')))
      assert.match(l, /(goto (allow|deny)|vmap @cidr_policy|ct state invalid drop)$/, l);
    const chain = policyChain(
      policy([{ cidr: '10.9.0.0/16' }, { cidr: '8.8.8.0/24', ports: [53] }]),
      true,
    )!;
    for (const r of chain.rules) assert.match(r, /goto (allow|deny)$/, r);
    // The protected ranges come before any CIDR rule, in both families.
    const e4 = lines.filter((l) => l.includes(' egress4 '));
    assert.ok(
      e4.findIndex((l) => l.includes('@protected4')) <
        e4.findIndex((l) => l.includes('@cidr_policy')),
    );
    assert.ok(lines.some((l) => l.includes('egress6 ip6 daddr @protected6 goto deny')));
  });

  it('shares one chain among sandboxes with the same CIDR rules, whatever their order', () => {
    assert.equal(policyChain(policy([]), true), undefined);
    const a = policyChain(
      policy(
        [{ cidr: '198.18.0.0/16', ports: [80] }, { cidr: '10.9.0.0/16' }],
        [{ cidr: '198.18.5.0/24' }],
      ),
      true,
    );
    const b = policyChain(
      policy(
        [{ cidr: '10.9.0.0/16' }, { cidr: '198.18.0.0/16', ports: [80] }],
        [{ cidr: '198.18.5.0/24' }],
      ),
      true,
    );
    assert.ok(a && b);
    assert.equal(a.name, b.name);
    assert.match(a.name, /^pol_[0-9a-f]{16}$/);
    // Deny first: it wins over every allow, DNS ones included (those come after the jump).
    assert.match(a.rules[0]!, /^ip daddr \{ 198\.18\.5\.0\/24 \} goto deny$/);
    const other = policyChain(policy([{ cidr: '10.9.0.0/16' }]), true);
    assert.notEqual(other?.name, a.name);
    const withChain = baseElements(sb, a, 1);
    assert.deepEqual(withChain.at(-1), {
      set: 'cidr_policy',
      key: `"${sb.veth}"`,
      value: `jump ${a.name}`,
    });
  });

  it('removes elements whether or not they are still there, and restarts timeouts', () => {
    const [timed] = addressElements(sb, [
      { family: 4, address: '198.18.1.10', ports: [], timeoutSeconds: 30 },
    ]);
    assert.ok(timed);
    assert.deepEqual(addLines('t', [timed]), [
      'add element inet t a4 { 10.213.0.6 . 198.18.1.10 }',
      'delete element inet t a4 { 10.213.0.6 . 198.18.1.10 }',
      'add element inet t a4 { 10.213.0.6 . 198.18.1.10 timeout 30s }',
    ]);
    const chain = policyChain(policy([{ cidr: '10.9.0.0/16' }]), false)!;
    const entry = baseElements(sb, chain, 1).at(-1)!;
    assert.deepEqual(deleteLines('t', [entry]), [
      `add chain inet t ${chain.name}`,
      `add element inet t cidr_policy { "${sb.veth}" : jump ${chain.name} }`,
      `delete element inet t cidr_policy { "${sb.veth}" }`,
    ]);
    // A map entry pointing elsewhere is another element (it must be replaced, not kept).
    assert.notEqual(refId(entry), refId({ ...entry, value: 'jump pol_other' }));
  });

  it("reads elements back from nft's JSON as the text that removes them", () => {
    assert.deepEqual(elementFromJson('ifaces', sb.veth), { key: `"${sb.veth}"`, owner: sb.veth });
    assert.deepEqual(elementFromJson('src4', { concat: [sb.veth, '10.213.0.6'] }), {
      key: `"${sb.veth}" . 10.213.0.6`,
      owner: sb.veth,
    });
    assert.deepEqual(
      elementFromJson('p4', {
        elem: { val: { concat: ['10.213.0.6', '198.18.1.10', 443] }, timeout: 30, expires: 12 },
      }),
      { key: '10.213.0.6 . 198.18.1.10 . 443', owner: '10.213.0.6', expiresSeconds: 12 },
    );
    assert.deepEqual(
      elementFromJson('cidr_policy', [sb.veth, { jump: { target: 'pol_0123456789abcdef' } }]),
      { key: `"${sb.veth}"`, owner: sb.veth, value: 'jump pol_0123456789abcdef' },
    );
    assert.deepEqual(elementFromJson('ctmark', [sb.veth, 3573547009]), {
      key: `"${sb.veth}"`,
      owner: sb.veth,
      value: '3573547009',
    });
    assert.deepEqual(elementFromJson('ctcur', { concat: [sb.veth, 3573547009] }), {
      key: `"${sb.veth}" . 3573547009`,
      owner: sb.veth,
    });
    assert.deepEqual(elementFromJson('dns4', { concat: [sb.veth, sb.host4] }), {
      key: `"${sb.veth}" . ${sb.host4}`,
      owner: sb.veth,
    });
    // A rate limiter's state, as nft 1.0.6 lists it (removed at teardown by this key).
    assert.deepEqual(
      elementFromJson('dnsrate', {
        elem: {
          val: sb.veth,
          expires: 59,
          limit: { rate: 200, burst: 400, per: 'second', inv: true },
        },
      }),
      { key: `"${sb.veth}"`, owner: sb.veth, expiresSeconds: 59 },
    );
    assert.deepEqual(
      elementFromJson('denied4', {
        concat: ['10.213.0.6', '198.18.1.20', 'tcp', 443],
      }),
      { key: '10.213.0.6 . 198.18.1.20 . tcp . 443', owner: '10.213.0.6' },
    );
  });
});
