/**
 * What one sandbox can make the edge do through its resolver (SECURITY.md
 * J38, L40; issue 24 points 4 and 5, review): a flood of refused names, and a
 * zone that hands out new addresses on every answer, must each cost the edge
 * a bounded amount (event writes, firewall elements), whatever the sandbox
 * sends; and another edge on the same host must leave this edge's sandboxes
 * their resolver. Against the tests' fake internet (its own namespaces; a
 * guard table drops anything else a sandbox sends), as network.test.ts.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { after, before, describe, it } from 'node:test';
import type { DSecClient, Sandbox } from '@dsec/sdk';
import { LinuxNetwork, readInterfaceCidrs } from '../../src/network/linux-network.js';
import type { FakeInternet } from './fake-internet.js';
import { hasGcc, startEgressNode, type EgressNode } from './network-helpers.js';

const root = process.getuid?.() === 0;
const nftOk = spawnSync('nft', ['list', 'tables']).status === 0;
const skip = !root || !nftOk || !hasGcc() ? 'needs root, nftables and gcc' : false;

describe(
  'egress bounds per sandbox, several edges per host (fake internet)',
  { skip, timeout: 600_000 },
  () => {
    let work = '';
    let fake: FakeInternet;
    let net: LinuxNetwork;
    let env: EgressNode;

    before(async () => {
      env = await startEgressNode('dsec-egress-bounds-', () => ({
        // zero-ttl.test's answers expire within the C19 test.
        minDnsTtlSeconds: 1,
      }));
      ({ work, fake, net } = env);
    });

    after(() => env?.close());

    const create = (opts?: Parameters<DSecClient['runContainer']>[0]) => env.create(opts);
    const sh = (sb: Sandbox, line: string, timeoutMs = 120_000) => env.sh(sb, line, timeoutMs);
    function addr(sb: Sandbox) {
      const n = net.sandboxNetwork(sb.id);
      assert.ok(n, `no network for ${sb.id}`);
      return n;
    }
    /** The sandbox's elements in the DNS allow sets (keyed by its address first). */
    function allowElements(sb: Sandbox): number {
      const source = addr(sb).sandbox4;
      let n = 0;
      for (const set of ['a4', 'p4']) {
        const out = spawnSync('nft', ['-j', 'list', 'set', 'inet', net.table, set], {
          encoding: 'utf8',
          maxBuffer: 1 << 28,
        }).stdout;
        const parsed = JSON.parse(out) as { nftables: { set?: { elem?: unknown[] } }[] };
        for (const o of parsed.nftables)
          for (const e of o.set?.elem ?? []) if (JSON.stringify(e).includes(`"${source}"`)) n++;
      }
      return n;
    }

    it('a flood of refused names is recorded as a bounded number of events', async () => {
      const sb = await create();
      const delay = monitorEventLoopDelay({ resolution: 10 });
      delay.enable();
      const flood = await sh(sb, `probe dns ${addr(sb).host4} '*.exfil.test' 600 0`);
      delay.disable();
      const m = /sent (\d+) replies (\d+) rcode0 \d+ rcode2 \d+ rcode3 (\d+)/.exec(flood);
      assert.ok(m, flood);
      // Every answer a refusal (NXDOMAIN); past the DNS rate (200/s, burst 400) some get none.
      assert.equal(Number(m[3]), Number(m[2]), flood);
      assert.ok(Number(m[2]) >= 300, flood);
      const events = (await sb.events({ limit: 1000 })).filter((e) => e.kind === 'dns_blocked');
      const named = events.filter((e) => typeof e.details.name === 'string');
      // Each stored event is a synchronous, fsynced write on the edge's event loop.
      assert.ok(
        events.length <= 40,
        `${events.length} dns_blocked events stored for ${m[2]} refused names`,
      );
      assert.ok(named.length >= 16, 'the first names are still listed one by one');
      assert.ok(
        events.some((e) => e.details.folded === true),
        'the rest are folded into a count',
      );
      console.log(
        `refused-name flood: ${events.length} events; edge event loop delay max ${(
          delay.max / 1e6
        ).toFixed(1)} ms, p99 ${(delay.percentile(99) / 1e6).toFixed(1)} ms`,
      );
      // No upstream query for any of them.
      assert.deepEqual(
        (await fake.log()).filter((e) => e.kind === 'dns' && e.name?.endsWith('exfil.test')),
        [],
      );
    });

    it('a zone handing out new addresses on every answer fills a bounded allow set', async () => {
      const ports = Array.from({ length: 16 }, (_, i) => 8000 + i);
      const sb = await create({
        image: 'busybox',
        networkAllow: [{ domain: '*.fresh.test', ports }, { domain: 'allowed.test' }],
      });
      // 20 answers of 48 new addresses each, every one for 16 ports: 15,360 elements unbounded.
      const flood = await sh(sb, `probe dns ${addr(sb).host4} '*.fresh.test' 20 1`);
      assert.match(flood, /replies 20 /, flood);
      const elements = allowElements(sb);
      assert.ok(elements <= 4096, `${elements} allow-set elements for one sandbox`);
      // The sandbox is refused more, not the others, and not its own names already open.
      const other = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
      assert.match(await sh(other, 'nslookup allowed.test'), /198\.18\.1\.10/);
      assert.match(await sh(other, `probe tcp ${fake.allowedIp} 80 5000`), /^connected/);
      const events = await sb.events({ limit: 1000 });
      assert.ok(
        events.some((e) => e.kind === 'dns_blocked' && e.details.reason === 'bound'),
        JSON.stringify(events.slice(-5)),
      );
    });

    it("another edge's table on the same host leaves this edge's sandboxes their resolver", async () => {
      const sb = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
      assert.match(await sh(sb, 'nslookup allowed.test'), /198\.18\.1\.10/);
      // A second edge (as a local cluster runs several): its own range, table and hooks.
      const second = await LinuxNetwork.open({
        stateDir: join(work, 'second-edge'),
        upstream: [fake.dns],
        uplinks: [fake.uplink],
        publicRanges: fake.publicRanges,
      });
      try {
        assert.notEqual(second.table, net.table);
        const lookup = await sh(sb, 'nslookup allowed.test');
        assert.match(lookup, /198\.18\.1\.10/, lookup);
        const q = await sh(sb, `probe dns ${addr(sb).host4} allowed.test 4 0`);
        assert.match(q, /sent 4 replies 4 rcode0 4 /, q);
        // And still nothing but its own resolver on the host.
        assert.match(await sh(sb, `probe udp 198.18.0.1 53 x 2000`), /^error /);
      } finally {
        await second.close();
      }
    });

    it('reads the node networks while links come and go', async () => {
      // A link listed a moment ago may be gone when `ip` runs (containers of
      // the node's other software come and go): the others' networks are still read.
      const gone = `dsecgone${process.pid % 10000}`;
      assert.notEqual(spawnSync('ip', ['link', 'show', gone]).status, 0);
      for (const links of [
        [gone, fake.uplink],
        [fake.uplink, gone],
      ]) {
        const cidrs = await readInterfaceCidrs(links);
        assert.ok(cidrs.includes('198.18.0.1/30'), `${links.join(',')}: ${cidrs.join(', ')}`);
        assert.ok(cidrs.includes('fdff:5ec::1/64'), `${links.join(',')}: ${cidrs.join(', ')}`);
      }
    });

    /** The firewall's conntrack entries with this original source (SECURITY.md C19, A10). */
    function flowsFrom(source: string): string[] {
      const table = readFileSync('/proc/net/nf_conntrack', 'utf8');
      return table.split('\n').filter((l) => l.includes(` src=${source} `));
    }

    // The firewall accepts a flow's later packets by its conntrack entry; a stopped sandbox's
    // entries outlive it, and the slot's next sandbox has the same addresses (and 5-tuples).
    it("a sandbox cannot ride the conntrack entries of the slot's previous sandbox (IPv4, IPv6)", async () => {
      const rules = [
        { cidr: `${fake.allowedIp}/32`, ports: [7] },
        { cidr: `${fake.allowedIp6}/128`, ports: [7] },
      ];
      const a = await create({ image: 'busybox', networkAllow: rules });
      const slot = { ...addr(a) };
      assert.match(await sh(a, `probe udp ${fake.allowedIp} 7 first 2000 40000`), /^reply first/);
      assert.match(
        await sh(a, `probe udp ${fake.allowedIp6} 7 first6 2000 40000`),
        /^reply first6/,
      );
      assert.ok(flowsFrom(slot.sandbox4).length > 0, 'the flow is tracked');
      await a.stop();
      const b = await create(); // no egress at all, same slot
      assert.equal(addr(b).sandbox4, slot.sandbox4, 'the same slot');
      assert.match(await sh(b, `probe udp ${fake.allowedIp} 7 fresh 2000 40001`), /^error /);
      const reused = await sh(b, `probe udp ${fake.allowedIp} 7 reused 2000 40000`);
      assert.match(reused, /^error /, reused);
      const reused6 = await sh(b, `probe udp ${fake.allowedIp6} 7 reused6 2000 40000`);
      assert.match(reused6, /^error /, reused6);
      // Nothing of the previous sandbox's flows reaches it either way.
      assert.deepEqual(
        (await fake.log()).filter((e) => e.kind === 'udp' && /reused|fresh/.test(e.data ?? '')),
        [],
      );
      await b.stop();
      // A sandbox allowed the same meets the old entry on its own 5-tuple: it is its flow now.
      const c = await create({ image: 'busybox', networkAllow: rules });
      assert.equal(addr(c).sandbox4, slot.sandbox4, 'the same slot');
      assert.match(await sh(c, `probe udp ${fake.allowedIp} 7 again 2000 40000`), /^reply again/);
      assert.match(
        await sh(c, `probe udp ${fake.allowedIp6} 7 again6 2000 40000`),
        /^reply again6/,
      );
      assert.match(await sh(c, `probe udp ${fake.allowedIp} 7 twice 2000 40000`), /^reply twice/);
      await c.stop();
      // And the flows of the sandboxes that are gone are deleted, not left for the timeout.
      const deadline = Date.now() + 30_000;
      while (flowsFrom(slot.sandbox4).length > 0 && Date.now() < deadline)
        await new Promise((r) => setTimeout(r, 500));
      assert.deepEqual(flowsFrom(slot.sandbox4), []);
      assert.deepEqual(flowsFrom(slot.sandbox6!), []);
    });

    it('a live update that removes a rule cuts the flows it allowed, and only those (C19)', async () => {
      const sb = await create({
        image: 'busybox',
        networkAllow: [
          { domain: 'allowed.test' },
          { domain: 'zero-ttl.test' },
          { cidr: '10.199.53.0/24', ports: [7] },
        ],
      });
      assert.match(await sh(sb, 'nslookup allowed.test'), /198\.18\.1\.10/);
      assert.match(await sh(sb, 'nslookup zero-ttl.test'), /198\.18\.1\.11/);
      const hold = (host: string, out: string) =>
        sb.runShell(`probe hold ${host} 7 /tmp/go 30000 >/tmp/${out} 2>&1 &`);
      await hold(fake.allowedIp, 'by-name');
      await hold(fake.laterIp, 'expired');
      await hold(fake.privateIp, 'by-cidr');
      const read = (f: string) => sh(sb, `cat /tmp/${f}`);
      for (const f of ['by-name', 'expired', 'by-cidr']) {
        const deadline = Date.now() + 10_000;
        while (!/first reply/.test(await read(f)) && Date.now() < deadline)
          await new Promise((r) => setTimeout(r, 200));
        assert.match(await read(f), /^first reply one/, f);
      }
      assert.match(
        await sh(sb, `probe udp ${fake.privateIp} 7 before 2000 40100`),
        /^reply before/,
      );
      // zero-ttl.test's answer has expired (floor 1 s here): its connection lives on its name.
      await new Promise((r) => setTimeout(r, 2500));
      await sb.updateNetworkRules({ allow: [{ domain: 'zero-ttl.test' }] });
      await sb.runShell('touch /tmp/go');
      const second = async (f: string) => {
        const deadline = Date.now() + 10_000;
        let out = await read(f);
        while (!/second/.test(out) && Date.now() < deadline) {
          await new Promise((r) => setTimeout(r, 200));
          out = await read(f);
        }
        return out;
      };
      assert.match(await second('by-cidr'), /second error/, 'the removed CIDR rule cuts its flow');
      assert.match(await second('by-name'), /second error/, 'the removed name cuts its flow');
      assert.match(
        await second('expired'),
        /second reply two/,
        'a name still allowed keeps its flow',
      );
      const udp = await sh(sb, `probe udp ${fake.privateIp} 7 after 2000 40100`);
      assert.match(udp, /^error /, udp);
    });
  },
);
