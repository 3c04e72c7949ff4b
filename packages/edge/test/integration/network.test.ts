/**
 * Egress policy against a fake internet (SECURITY.md C17–C21 and L40, issues 5
 * and 24). Every
 * packet goes to loopback, the host's own addresses, or hosts this test
 * creates in a network namespace it creates; that namespace is the edge's
 * only uplink and upstream resolver, and a guard table drops anything else a
 * sandbox sends, so a wrong rule cannot reach a real address.
 */
import assert from 'node:assert/strict';
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { readlinkSync } from 'node:fs';
import { readlink, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import type { LinuxNetwork } from '../../src/network/linux-network.js';
import type { NetworkSandbox } from '../../src/network/network-manager.js';
import { startFakeInternet, startHostServices, type FakeInternet } from './fake-internet.js';
import { buildTestLayers, hasGcc, workDir } from './network-helpers.js';

const root = process.getuid?.() === 0;
const nftOk = spawnSync('nft', ['list', 'tables']).status === 0;
const skip = !root || !nftOk || !hasGcc() ? 'needs root, nftables and gcc' : false;

describe('sandbox egress policy (fake internet)', { skip, timeout: 300_000 }, () => {
  let work = '';
  let fake: FakeInternet;
  let node: SingleNode;
  let client: DSecClient;
  let net: LinuxNetwork;
  const sandboxes: Sandbox[] = [];

  before(async () => {
    work = await workDir('dsec-net-it-');
    fake = await startFakeInternet();
    node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      network: {
        mode: 'isolated',
        upstream: [fake.dns],
        uplinks: [fake.uplink],
        publicRanges: fake.publicRanges,
      },
    });
    net = node.edge.options.network as LinuxNetwork;
    fake.guard({
      subnet4: `${net.subnet4.address}/${net.subnet4.prefix}`,
      subnet6: net.subnet6 && `${net.subnet6.address}/${net.subnet6.prefix}`,
    });
    await buildTestLayers(node, work);
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
  });

  after(async () => {
    try {
      for (const sb of sandboxes) await sb.stop().catch(() => undefined);
      client?.close();
      await node?.close({ stopSandboxes: true });
    } finally {
      await fake?.close();
      if (work) await rm(work, { recursive: true, force: true });
    }
    // Nothing of this edge's network is left on the host.
    if (net) {
      assert.notEqual(spawnSync('nft', ['list', 'table', 'inet', net.table]).status, 0);
      const links = spawnSync('ip', ['-br', 'link'], { encoding: 'utf8' }).stdout;
      for (const sb of sandboxes)
        assert.doesNotMatch(links, new RegExp(net.names({ id: sb.id, slot: 0 }).veth));
    }
  });

  async function create(opts: Parameters<DSecClient['runContainer']>[0] = { image: 'busybox' }) {
    const sb = await client.runContainer({ toolkits: ['probe'], ...opts, image: 'busybox' });
    sandboxes.push(sb);
    return sb;
  }
  async function sh(sb: Sandbox, line: string): Promise<string> {
    const r = await sb.runShell(`${line} 2>&1`, { timeoutMs: 30_000 });
    return r.stdout;
  }
  async function hits(pred: (e: Awaited<ReturnType<FakeInternet['log']>>[number]) => boolean) {
    return (await fake.log()).filter(pred);
  }

  it('denies everything by default: no names, no addresses, fast failure', async () => {
    const sb = await create();
    assert.match(await sh(sb, 'nslookup allowed.test'), /NXDOMAIN/);
    const tcp = await sh(sb, `probe tcp ${fake.allowedIp} 80 5000`);
    assert.match(tcp, /^error ECONNREFUSED/, tcp); // a TCP reset, not a timeout
    assert.match(
      await sh(sb, `probe udp ${fake.allowedIp} 7 hello 3000`),
      /^error (EHOSTUNREACH|ECONNREFUSED)/,
    );
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp6} 80 5000`), /^error ECONNREFUSED/);
    assert.deepEqual(await hits((e) => e.kind === 'http' || e.kind === 'udp'), []);
  });

  it('allows a domain: it resolves and connects over IPv4, IPv6, UDP and ICMP; others stay denied', async () => {
    await fake.clear();
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ domain: 'allowed.test' }, { domain: '*.allowed.test', ports: [8080] }],
    });
    const lookup = await sh(sb, 'nslookup allowed.test');
    assert.match(lookup, new RegExp(fake.allowedIp.replaceAll('.', '\\.')));
    assert.match(lookup, /fdff:5ec:1::10/);
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp} 80 5000`), /^connected/);
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp6} 80 5000`), /^connected/);
    const page = await sh(sb, `printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 allowed.test 80`);
    assert.match(page, /hello from/);
    assert.match(
      await sh(sb, `probe udp ${fake.allowedIp} 7 allowed-udp 3000`),
      /^reply allowed-udp/,
    );
    assert.match(await sh(sb, `ping -c 1 -W 3 ${fake.allowedIp}`), /1 packets received/);
    // Port-restricted wildcard: www.allowed.test only on 8080 (same address, but the
    // plain-domain rule already opened every port of it, so check the name resolves).
    assert.match(await sh(sb, 'nslookup www.allowed.test'), /198\.18\.1\.10/);

    // A denied name does not resolve; its address, hard-coded, fails at once.
    assert.match(await sh(sb, 'nslookup denied.test'), /NXDOMAIN/);
    const denied = await sh(sb, `probe tcp ${fake.deniedIp} 80 10000`);
    assert.match(denied, /^error ECONNREFUSED/, denied);
    assert.ok(Number(/(\d+)ms/.exec(denied)?.[1]) < 2000, denied);
    assert.match(await sh(sb, `probe tcp ${fake.deniedIp6} 80 10000`), /^error ECONNREFUSED/);
    assert.match(await sh(sb, `probe udp ${fake.deniedIp} 7 DENIEDMARK 2000`), /^error /);
    assert.match(await sh(sb, `ping -c 1 -W 2 ${fake.deniedIp}`), /0 packets received/);
    const reached = await hits((e) => e.server === fake.deniedIp || e.server === fake.deniedIp6);
    assert.deepEqual(reached, []);
  });

  it('cannot bypass the platform resolver or use an allowed host as a proxy', async () => {
    await fake.clear();
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ domain: 'allowed.test', ports: [80] }],
    });
    assert.match(await sh(sb, 'nslookup allowed.test'), /198\.18\.1\.10/);
    // Other DNS servers: over UDP and TCP, by address.
    assert.doesNotMatch(await sh(sb, `nslookup denied.test ${fake.rogueDns}`), /198\.18\.1\.20/);
    assert.match(await sh(sb, `probe tcp ${fake.rogueDns} 53 3000`), /^error/);
    assert.match(await sh(sb, `probe udp ${fake.dns} 53 x 2000`), /^error/);
    // The open proxy on the allowed host is on a port the rule does not open.
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp} 3128 3000`), /^error ECONNREFUSED/);
    // The platform has no proxy of its own on the gateway.
    assert.match(await sh(sb, `probe tcp ${addr(sb).host4} 3128 3000`), /^error/);
    const log = await fake.log();
    assert.deepEqual(
      log.filter((e) => e.server === fake.rogueDns || e.kind.startsWith('proxy')),
      [],
    );
    assert.deepEqual(
      log.filter((e) => e.kind === 'dns' && e.name === 'denied.test'),
      [],
    );
  });

  it('applies live updates within seconds, to that sandbox only', async () => {
    const a = await create();
    const b = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
    assert.match(await sh(a, 'nslookup later.test'), /NXDOMAIN/);
    await a.updateNetworkRules({ allow: [{ domain: 'later.test' }] });
    assert.match(await sh(a, 'nslookup later.test'), /198\.18\.1\.11/);
    assert.match(await sh(a, `probe tcp ${fake.laterIp} 80 5000`), /^connected/);
    // B is untouched: still its own rules only.
    assert.match(await sh(b, 'nslookup later.test'), /NXDOMAIN/);
    assert.match(await sh(b, `probe tcp ${fake.laterIp} 80 5000`), /^error ECONNREFUSED/);
    assert.match(await sh(b, 'nslookup allowed.test'), /198\.18\.1\.10/);
    assert.match(await sh(b, `probe tcp ${fake.allowedIp} 80 5000`), /^connected/);
    // Removing the rule blocks new connections, even to the address resolved before.
    const info = await a.updateNetworkRules({ allow: [] });
    assert.deepEqual(info.spec.networkAllow, []);
    assert.match(await sh(a, `probe tcp ${fake.laterIp} 80 5000`), /^error ECONNREFUSED/);
    assert.match(await sh(a, 'nslookup later.test'), /NXDOMAIN/);
    await assert.rejects(a.updateNetworkRules({ networkRules: { nosuchrule: true } }), {
      code: 'invalid_argument',
    });
  });

  it('named rules come from the catalogue; deny wins over allow', async () => {
    const sb = await create({
      image: 'busybox',
      networkRules: { pypi: true },
      networkAllow: [{ cidr: `${fake.laterIp}/32`, ports: [80] }, { domain: 'allowed.test' }],
      networkDeny: [{ cidr: `${fake.allowedIp}/32` }],
    });
    assert.equal(sb.info?.spec.networkRules.pypi, true);
    assert.match(await sh(sb, `probe tcp ${fake.laterIp} 80 5000`), /^connected/);
    assert.match(await sh(sb, `probe tcp ${fake.laterIp} 8080 5000`), /^error ECONNREFUSED/);
    await sh(sb, 'nslookup allowed.test');
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp} 80 5000`), /^error ECONNREFUSED/);
    await assert.rejects(
      client.runContainer({ image: 'busybox', networkRules: { nosuch: true } }),
      {
        code: 'invalid_argument',
      },
    );
  });

  it('finds nothing open when scanning the gateway, the host and other sandboxes', async () => {
    const target = await create();
    const scanner = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
    const ownGateway = addr(scanner).host4;
    const otherSandbox = addr(target).sandbox4;
    const otherGateway = addr(target).host4;
    // A listener in the target that the scan must not reach.
    await target.runShell('nc -l -p 8000 -e true </dev/null >/dev/null 2>&1 &');
    const apiPort = new URL(node.url).port;
    for (const [host, lo, hi] of [
      [ownGateway, 1, 2048],
      [otherGateway, 1, 1024],
      [otherSandbox, 1, 1024],
      ['198.18.0.1', 1, 1024],
      [ownGateway, Number(apiPort), Number(apiPort)],
      [otherSandbox, 8000, 8000],
    ] as const) {
      const out = await sh(scanner, `probe scan ${host} ${lo} ${hi} 300`);
      assert.match(out, /open 0$/m, `${host}: ${out}`);
    }
  });

  it('records denied connections and refused names as events', async () => {
    const sb = await create();
    await sh(sb, 'nslookup denied.test');
    await sh(sb, `probe tcp ${fake.deniedIp} 443 2000`);
    const events = await sb.events();
    assert.ok(
      events.some((e) => e.kind === 'dns_blocked' && e.details.name === 'denied.test'),
      JSON.stringify(events),
    );
    assert.ok(
      events.some(
        (e) =>
          e.kind === 'network_denied' &&
          e.details.destination === fake.deniedIp &&
          e.details.port === 443,
      ),
      JSON.stringify(events),
    );
    const later = await sb.events({ afterId: events.at(-1)?.id });
    assert.deepEqual(later, []);
  });

  it("removes veths and firewall entries on stop; the slot's next sandbox waits for the veth", async () => {
    const sb = await create();
    const n = addr(sb);
    assert.equal(spawnSync('ip', ['link', 'show', n.veth]).status, 0);
    await sb.stop();
    // The firewall state is gone when stop returns; the kernel may still be
    // removing the veth (its namespace is released).
    const table = spawnSync('nft', ['list', 'table', 'inet', net.table], {
      encoding: 'utf8',
    }).stdout;
    assert.doesNotMatch(table, new RegExp(`"${n.veth}"`));
    // The next sandbox gets the same slot at once; its veth comes only after the old one went.
    const next = await create({ image: 'busybox', networkAllow: [{ domain: 'allowed.test' }] });
    assert.equal(addr(next).sandbox4, n.sandbox4);
    assert.notEqual(spawnSync('ip', ['link', 'show', n.veth]).status, 0);
    assert.match(await sh(next, 'nslookup allowed.test'), /198\.18\.1\.10/);
    assert.match(await sh(next, `probe tcp ${fake.allowedIp} 80 5000`), /^connected/);
    const nextVeth = addr(next).veth;
    await next.stop();
    await net.drained();
    assert.notEqual(spawnSync('ip', ['link', 'show', nextVeth]).status, 0);
  });

  it('wires a sandbox with ip when nothing in the sandbox configures its end, and drains its veth', async () => {
    // A process in namespaces of its own, as a runtime makes them (the network
    // namespace owned by a user namespace), far above this test's slots.
    const slot = 4000;
    const fakes: {
      sb: NetworkSandbox;
      proc: ChildProcess;
    }[] = [];
    const start = async (id: string) => {
      const proc = spawn('unshare', ['--user', '--map-root-user', '--net', 'sleep', '600'], {
        stdio: 'ignore',
      });
      const own = readlinkSync('/proc/self/ns/net');
      for (let i = 0; i < 200; i++) {
        const ns = await readlink(`/proc/${proc.pid}/ns/net`).catch(() => own);
        if (ns !== own) break;
        await new Promise((r) => setTimeout(r, 10));
      }
      const f = { sb: { id, slot, spec: { networkRules: {} } }, proc };
      fakes.push(f);
      await net.setup(f.sb);
      await net.attach(f.sb, proc.pid!);
      return f;
    };
    const stop = async (f: (typeof fakes)[number]) => {
      f.proc.kill('SIGKILL');
      await new Promise((r) => f.proc.once('exit', r));
      await net.teardown(f.sb);
    };
    try {
      const a = await start(`fake-net-a-${process.pid}`);
      const n = net.names(a.sb);
      const inside = JSON.parse(
        spawnSync('nsenter', ['-t', String(a.proc.pid), '-n', 'ip', '-j', 'addr', 'show', 'eth0'], {
          encoding: 'utf8',
        }).stdout,
      ) as { flags: string[]; addr_info: { local: string }[] }[];
      assert.ok(inside[0]?.flags.includes('UP'));
      assert.deepEqual(
        inside[0]?.addr_info.map((i) => i.local).filter((l) => !l.startsWith('fe80')),
        [n.sandbox4, n.sandbox6],
      );
      const route = spawnSync('nsenter', ['-t', String(a.proc.pid), '-n', 'ip', 'route'], {
        encoding: 'utf8',
      }).stdout;
      assert.match(route, new RegExp(`default via ${n.host4.replaceAll('.', '\\.')} dev eth0`));
      await stop(a);
      // Same slot, right after: attach waits until the old veth is gone.
      const b = await start(`fake-net-b-${process.pid}`);
      assert.notEqual(spawnSync('ip', ['link', 'show', n.veth]).status, 0);
      assert.equal(spawnSync('ip', ['link', 'show', net.names(b.sb).veth]).status, 0);
      await stop(b);
      await net.drained();
      assert.notEqual(spawnSync('ip', ['link', 'show', net.names(b.sb).veth]).status, 0);
    } finally {
      for (const f of fakes) {
        f.proc.kill('SIGKILL');
        await net.teardown(f.sb).catch(() => undefined);
      }
      await net.drained();
    }
  });

  // L40: an allowed name's answer must not open what the policy refuses as an address.
  it('an allowed name whose answer is a private address does not open it (L40)', async () => {
    await fake.clear();
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ domain: 'private.test' }, { domain: 'mixed.test' }, { domain: 'node.test' }],
    });
    // Refused as an address, before and after the name is looked up.
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    const lookup = await sh(sb, 'nslookup private.test');
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    assert.match(await sh(sb, `probe tcp ${fake.privateIp6} 80 3000`), /^error ECONNREFUSED/);
    // The answer itself no longer carries the addresses (the name resolves to nothing).
    assert.doesNotMatch(lookup, /10\.199\.53\.10|fdff:5ec:2::10/, lookup);
    // One public and one private address: the public one is kept and works.
    const mixed = await sh(sb, 'nslookup mixed.test');
    assert.match(mixed, /198\.18\.1\.10/, mixed);
    assert.doesNotMatch(mixed, /10\.199\.53\.10/, mixed);
    assert.match(await sh(sb, `probe tcp ${fake.allowedIp} 80 3000`), /^connected/);
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    // The node's own networks (the uplink's /30 and /64), even inside a range declared public.
    const node = await sh(sb, 'nslookup node.test');
    assert.doesNotMatch(node, /198\.18\.0\.1\b|fdff:5ec::1\b/, node);
    const reached = await hits(
      (e) => e.kind === 'http' && (e.server === fake.privateIp || e.server === fake.privateIp6),
    );
    assert.deepEqual(reached, []);
    const events = await sb.events();
    const filtered = events.filter(
      (e) => e.kind === 'dns_blocked' && e.details.reason === 'address',
    );
    assert.ok(
      filtered.some(
        (e) =>
          e.details.name === 'private.test' &&
          JSON.stringify(e.details.dropped).includes(fake.privateIp),
      ),
      JSON.stringify(events),
    );
    assert.ok(
      filtered.some((e) => e.details.name === 'node.test'),
      JSON.stringify(events),
    );
  });

  it('filters private addresses in every form: ULA, IPv4-mapped, NAT64, behind a CNAME (L40)', async () => {
    const sb = await create({
      image: 'busybox',
      networkAllow: [
        { domain: 'cname.test' },
        { domain: 'nat64.test' },
        { domain: 'mapped.test' },
        { domain: 'private.test', ports: [80] },
      ],
    });
    // A CNAME to a name the policy does not name, whose A is private.
    const cname = await sh(sb, 'nslookup cname.test');
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    assert.doesNotMatch(cname, /10\.199\.53\.10/, cname);
    // NAT64 (64:ff9b::/96) embedding the private address, routed to the private host.
    const nat64 = await sh(sb, 'nslookup -type=aaaa nat64.test');
    assert.match(await sh(sb, `probe tcp ${fake.nat64Ip6} 80 3000`), /^error ECONNREFUSED/);
    assert.doesNotMatch(nat64, /64:ff9b/i, nat64);
    // IPv4-mapped (::ffff:10.199.53.10).
    const mapped = await sh(sb, 'nslookup -type=aaaa mapped.test');
    assert.doesNotMatch(mapped, /ffff/i, mapped);
    // A ULA answer (fc00::/7).
    const ula = await sh(sb, 'nslookup -type=aaaa private.test');
    assert.match(await sh(sb, `probe tcp ${fake.privateIp6} 80 3000`), /^error ECONNREFUSED/);
    assert.doesNotMatch(ula, /fdff:5ec:2/, ula);
  });

  it('an explicit CIDR rule opens a private range, on its own ports, and follows live updates (L40, C19)', async () => {
    const cidr = { cidr: '10.199.53.0/24', ports: [80] };
    const sb = await create({
      image: 'busybox',
      networkAllow: [{ domain: 'private.test' }, cidr],
    });
    const lookup = await sh(sb, 'nslookup private.test');
    assert.match(lookup, /10\.199\.53\.10/, lookup);
    // No IPv6 CIDR rule: the ULA answer is still dropped.
    assert.doesNotMatch(lookup, /fdff:5ec:2::10/, lookup);
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^connected/);
    // The name's rule (every port) does not widen the CIDR rule's ports.
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 8080 3000`), /^error ECONNREFUSED/);
    // Removing the CIDR rule closes the address and the answer at once.
    await sb.updateNetworkRules({ allow: [{ domain: 'private.test' }] });
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    assert.doesNotMatch(await sh(sb, 'nslookup private.test'), /10\.199\.53\.10/);
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^error ECONNREFUSED/);
    // And adding it back opens them again.
    await sb.updateNetworkRules({ allow: [{ domain: 'private.test' }, cidr] });
    assert.match(await sh(sb, 'nslookup private.test'), /10\.199\.53\.10/);
    assert.match(await sh(sb, `probe tcp ${fake.privateIp} 80 3000`), /^connected/);
  });

  it('reaches no DNS but its own resolver: other host addresses, other ports, TCP, IPv6 (C18, L40)', async () => {
    const sb = await create();
    const n = addr(sb);
    assert.ok(n.host6, 'the edge has IPv6');
    // Services on other host-local addresses (the uplink's host end) and on the
    // sandbox's own gateway on other ports or the other family.
    const services = await startHostServices([
      { address: '198.18.0.1', port: 53 },
      { address: 'fdff:5ec::1', port: 53 },
      { address: n.host4, port: 5353 },
      { address: n.host6, port: 53 },
    ]);
    try {
      for (const [host, port] of [
        ['198.18.0.1', 53],
        ['fdff:5ec::1', 53],
        [n.host4, 5353],
        [n.host6, 53],
      ] as const) {
        const udp = await sh(sb, `probe udp ${host} ${port} EXFIL 2000`);
        assert.match(udp, /^error /, `udp ${host}:${port}: ${udp}`);
        const tcp = await sh(sb, `probe tcp ${host} ${port} 2000`);
        assert.match(tcp, /^error /, `tcp ${host}:${port}: ${tcp}`);
      }
      assert.deepEqual(services.hits, []);
      // Its own resolver still answers (a refusal: the sandbox allows nothing).
      assert.match(await sh(sb, 'nslookup allowed.test'), /NXDOMAIN/);
    } finally {
      await services.close();
    }
  });

  function addr(sb: Sandbox) {
    const n = net.sandboxNetwork(sb.id);
    assert.ok(n, `no network for ${sb.id}`);
    return n;
  }
});
