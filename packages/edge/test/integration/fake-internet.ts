import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { createSocket, type Socket } from 'node:dgram';
import { request } from 'node:http';
import { createServer, isIP, type Server } from 'node:net';
import { fileURLToPath } from 'node:url';

/**
 * The tests' own "internet" (SECURITY.md C17–C21): a network namespace this
 * test creates, joined to the host by a veth, holding a DNS server, a rogue
 * DNS server, web servers, an open HTTP proxy and a UDP echo server on
 * addresses of 198.18.0.0/15 (benchmarking range) and fdff:5ec::/32, routed
 * from the host through that veth only. A guard table drops any forwarded
 * packet from the sandbox ranges that would leave by another interface, so
 * even a wrong rule cannot send a sandbox's packet off this machine.
 *
 * Both ranges are special-use, so the edge must be told to treat the public
 * part as public (`network.publicRanges: fake.publicRanges`). The "operator's
 * network" the platform must keep sandboxes out of (SECURITY.md L40) is a
 * private host (`privateIp`, 10.199.53.0/24; `privateIp6`, a ULA outside the
 * public part; `nat64Ip6`, the NAT64 form of `privateIp`) in the same
 * namespace, and names of the zone answer with it.
 */
export interface FakeInternet {
  /** Host end of the veth (the uplink the edge forwards through). */
  uplink: string;
  dns: string;
  rogueDns: string;
  allowedIp: string;
  allowedIp6: string;
  laterIp: string;
  deniedIp: string;
  deniedIp6: string;
  privateIp: string;
  privateIp6: string;
  nat64Ip6: string;
  /**
   * A network-specific NAT64 prefix (RFC 6052 /96) inside the public part,
   * and its forms of `privateIp` and `allowedIp`: hosts of the fake internet
   * standing for what a translator would reach (`network.nat64Prefixes`).
   */
  nat64Prefix: string;
  nspPrivateIp6: string;
  nspPublicIp6: string;
  /** The part of the fake internet the edge treats as public (`network.publicRanges`). */
  publicRanges: string[];
  zone: Record<
    string,
    { a?: string[]; aaaa?: string[]; cname?: string; fresh?: number; ttl?: number }
  >;
  /** What reached the fake internet since the last `clear()`. */
  log(): Promise<FakeLogEntry[]>;
  clear(): Promise<void>;
  /** Drops forwarded packets from these ranges unless they go to the fake internet. */
  guard(ranges: { subnet4: string; subnet6?: string | undefined }): void;
  close(): Promise<void>;
}

export interface FakeLogEntry {
  kind: 'dns' | 'dns-tcp' | 'http' | 'proxy' | 'proxy-connect' | 'udp' | 'tcp-echo';
  server: string;
  name?: string;
  port?: number;
  target?: string;
  data?: string;
}

function sh(cmd: string, args: string[], ignoreErrors = false): string {
  const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 15_000 });
  if (r.status !== 0 && !ignoreErrors) throw new Error(`${cmd} ${args.join(' ')}: ${r.stderr}`);
  return r.stdout;
}

export async function startFakeInternet(): Promise<FakeInternet> {
  const tag = (process.pid % 100000).toString(36);
  const ns = `dsectest-inet-${tag}`;
  const uplink = `dfi${tag}h`;
  const guardTable = `dsectest_guard_${tag}`;
  const fake = {
    uplink,
    dns: '198.18.1.53',
    rogueDns: '198.18.1.99',
    allowedIp: '198.18.1.10',
    allowedIp6: 'fdff:5ec:1::10',
    laterIp: '198.18.1.11',
    deniedIp: '198.18.1.20',
    deniedIp6: 'fdff:5ec:1::20',
    privateIp: '10.199.53.10',
    privateIp6: 'fdff:5ec:2::10',
    // 64:ff9b::10.199.53.10 (RFC 6052 well-known prefix).
    nat64Ip6: '64:ff9b::ac7:350a',
    nat64Prefix: 'fdff:5ec:1::64:0:0/96',
    nspPrivateIp6: 'fdff:5ec:1::64:ac7:350a', // 10.199.53.10
    nspPublicIp6: 'fdff:5ec:1::64:c612:10a', // 198.18.1.10
    // The uplink's own /30 and /64 (198.18.0.0/30, fdff:5ec::/64) are the node's
    // networks: the edge must filter them even inside a public range.
    publicRanges: ['198.18.0.0/15', 'fdff:5ec:1::/64'],
  };
  const zone = {
    'allowed.test': { a: [fake.allowedIp], aaaa: [fake.allowedIp6], ttl: 60 },
    'www.allowed.test': { a: [fake.allowedIp], ttl: 60 },
    'later.test': { a: [fake.laterIp], ttl: 60 },
    'denied.test': { a: [fake.deniedIp], aaaa: [fake.deniedIp6], ttl: 60 },
    'zero-ttl.test': { a: [fake.laterIp], ttl: 0 },
    // Answers an operator's private network would give (SECURITY.md L40).
    'private.test': { a: [fake.privateIp], aaaa: [fake.privateIp6], ttl: 60 },
    'mixed.test': { a: [fake.allowedIp, fake.privateIp], ttl: 60 },
    'mapped.test': { aaaa: ['::ffff:ac7:350a'], ttl: 60 }, // ::ffff:10.199.53.10
    'nat64.test': { aaaa: [fake.nat64Ip6], ttl: 60 },
    'cname.test': { cname: 'private.test', ttl: 60 },
    'node.test': { a: ['198.18.0.1'], aaaa: ['fdff:5ec::1'], ttl: 60 },
    // The other end of the uplink: a host on the node's own network (protected).
    'lan.test': { a: ['198.18.0.2'], aaaa: ['fdff:5ec::2'], ttl: 60 },
    'nsp-private.test': { aaaa: [fake.nspPrivateIp6], ttl: 60 },
    'nsp-public.test': { aaaa: [fake.nspPublicIp6], ttl: 60 },
    // A zone that answers every query with addresses it never gave before (of 198.19.0.0/16).
    'fresh.test': { fresh: 48, ttl: 300 },
    '*.fresh.test': { fresh: 48, ttl: 300 },
  };
  let servers: ChildProcess | undefined;
  const close = async () => {
    if (servers && servers.exitCode === null) {
      servers.stdin?.end();
      servers.kill('SIGKILL');
    }
    sh('nft', ['delete', 'table', 'inet', guardTable], true);
    sh('ip', ['netns', 'del', ns], true);
    sh('ip', ['link', 'del', uplink], true);
    sh('ip', ['route', 'del', '198.18.1.0/24'], true);
    sh('ip', ['-6', 'route', 'del', 'fdff:5ec:1::/64'], true);
    sh('ip', ['route', 'del', '10.199.53.0/24'], true);
    sh('ip', ['-6', 'route', 'del', 'fdff:5ec:2::/64'], true);
    sh('ip', ['-6', 'route', 'del', `${fake.nat64Ip6}/128`], true);
  };
  await close();
  try {
    sh('ip', ['netns', 'add', ns]);
    sh('ip', ['link', 'add', uplink, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns]);
    sh('ip', ['addr', 'add', '198.18.0.1/30', 'dev', uplink]);
    sh('ip', ['-6', 'addr', 'add', 'fdff:5ec::1/64', 'dev', uplink, 'nodad']);
    sh('ip', ['link', 'set', uplink, 'up']);
    const inNs = (...args: string[]) => sh('ip', ['-n', ns, ...args]);
    inNs('link', 'set', 'lo', 'up');
    inNs('addr', 'add', '198.18.0.2/30', 'dev', 'eth0');
    inNs('-6', 'addr', 'add', 'fdff:5ec::2/64', 'dev', 'eth0', 'nodad');
    inNs('link', 'set', 'eth0', 'up');
    const v4 = [
      fake.dns,
      fake.rogueDns,
      fake.allowedIp,
      fake.laterIp,
      fake.deniedIp,
      fake.privateIp,
    ];
    for (const ip of v4) inNs('addr', 'add', `${ip}/32`, 'dev', 'lo');
    const v6 = [
      fake.allowedIp6,
      fake.deniedIp6,
      fake.privateIp6,
      fake.nat64Ip6,
      fake.nspPrivateIp6,
      fake.nspPublicIp6,
    ];
    for (const ip of v6) inNs('-6', 'addr', 'add', `${ip}/128`, 'dev', 'lo', 'nodad');
    inNs('route', 'add', 'default', 'via', '198.18.0.1');
    inNs('-6', 'route', 'add', 'default', 'via', 'fdff:5ec::1');
    sh('ip', ['route', 'add', '198.18.1.0/24', 'via', '198.18.0.2', 'dev', uplink]);
    sh('ip', ['-6', 'route', 'add', 'fdff:5ec:1::/64', 'via', 'fdff:5ec::2', 'dev', uplink]);
    // The private host: routed like the rest, so only the edge's policy stands in the way.
    sh('ip', ['route', 'add', '10.199.53.0/24', 'via', '198.18.0.2', 'dev', uplink]);
    sh('ip', ['-6', 'route', 'add', 'fdff:5ec:2::/64', 'via', 'fdff:5ec::2', 'dev', uplink]);
    sh('ip', ['-6', 'route', 'add', `${fake.nat64Ip6}/128`, 'via', 'fdff:5ec::2', 'dev', uplink]);

    const script = fileURLToPath(new URL('./fixtures/fake-internet-servers.mjs', import.meta.url));
    const config = {
      zone,
      dns: [fake.dns],
      rogueDns: [fake.rogueDns],
      web: [
        fake.allowedIp,
        fake.laterIp,
        fake.deniedIp,
        fake.allowedIp6,
        fake.deniedIp6,
        fake.privateIp,
        fake.privateIp6,
        fake.nat64Ip6,
        fake.nspPrivateIp6,
        fake.nspPublicIp6,
      ],
      proxy: [fake.allowedIp],
      // UDP and TCP echo on port 7.
      udpEcho: [fake.allowedIp, fake.laterIp, fake.deniedIp, fake.allowedIp6, fake.privateIp],
      control: '198.18.0.2',
    };
    const child = spawn(
      'ip',
      ['netns', 'exec', ns, process.execPath, script, JSON.stringify(config)],
      {
        stdio: ['pipe', 'pipe', 'inherit'],
      },
    );
    servers = child;
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error('fake internet did not start')), 15_000);
      child.stdout?.setEncoding('utf8').on('data', (s: string) => {
        if (s.includes('ready')) {
          clearTimeout(timer);
          resolve();
        }
      });
      child.on('exit', (code) => reject(new Error(`fake internet exited ${code}`)));
    });
    // Until the edge's ranges are known, anything forwarded from a sandbox veth may only go here.
    const base = [
      `add table inet ${guardTable}`,
      `add chain inet ${guardTable} guard_fwd { type filter hook forward priority -300; policy accept; }`,
      `add rule inet ${guardTable} guard_fwd iifname "dsv*" oifname != { "${uplink}", "dsv*" } drop`,
    ];
    const r = spawnSync('nft', ['-f', '-'], { input: base.join('\n') + '\n', encoding: 'utf8' });
    if (r.status !== 0) throw new Error(`guard: ${r.stderr}`);
  } catch (err) {
    await close();
    throw err;
  }
  const control = (path: string) =>
    new Promise<string>((resolve, reject) => {
      const req = request({ host: '198.18.0.2', port: 9999, path, timeout: 5000 }, (res) => {
        let body = '';
        res.setEncoding('utf8').on('data', (s: string) => (body += s));
        res.on('end', () => resolve(body));
      });
      req.on('timeout', () => req.destroy(new Error('control timeout')));
      req.on('error', reject);
      req.end();
    });
  return {
    ...fake,
    zone,
    log: async () => JSON.parse(await control('/log')) as FakeLogEntry[],
    clear: async () => {
      await control('/clear');
    },
    guard(ranges) {
      const rules = [
        `add rule inet ${guardTable} guard_fwd ip saddr ${ranges.subnet4} oifname != { "${uplink}", "dsv*" } drop`,
        ...(ranges.subnet6
          ? [
              `add rule inet ${guardTable} guard_fwd ip6 saddr ${ranges.subnet6} oifname != { "${uplink}", "dsv*" } drop`,
            ]
          : []),
      ];
      const r = spawnSync('nft', ['-f', '-'], { input: rules.join('\n') + '\n', encoding: 'utf8' });
      if (r.status !== 0) throw new Error(`guard: ${r.stderr}`);
    },
    close,
  };
}

/** What reached a {@link HostServices} listener. */
export interface HostServiceHit {
  protocol: 'udp' | 'tcp';
  address: string;
  port: number;
  from: string;
}

/**
 * Services on the host's own addresses (SECURITY.md C18, L40): a UDP socket
 * that answers every datagram (echoes it) and a TCP listener, on each address
 * and port given. They stand for a DNS server, or anything else, that the
 * operator runs on another address of the node. Only addresses this test made
 * (the fake internet's uplink, a sandbox's gateway) are ever used.
 */
export interface HostServices {
  hits: HostServiceHit[];
  close(): Promise<void>;
}

export async function startHostServices(
  endpoints: { address: string; port: number }[],
): Promise<HostServices> {
  const hits: HostServiceHit[] = [];
  const sockets: Socket[] = [];
  const servers: Server[] = [];
  const close = async () => {
    for (const s of sockets) s.close();
    await Promise.all(servers.map((s) => new Promise((r) => s.close(r))));
  };
  try {
    for (const { address, port } of endpoints) {
      const udp = createSocket(isIP(address) === 6 ? 'udp6' : 'udp4');
      sockets.push(udp);
      udp.on('message', (msg, rinfo) => {
        hits.push({ protocol: 'udp', address, port, from: rinfo.address });
        udp.send(msg, rinfo.port, rinfo.address);
      });
      await new Promise<void>((resolve, reject) => {
        udp.once('error', reject);
        udp.bind({ address, port, exclusive: true }, () => resolve());
      });
      const tcp = createServer((sock) => {
        hits.push({ protocol: 'tcp', address, port, from: sock.remoteAddress ?? '' });
        sock.end('hello\n');
      });
      servers.push(tcp);
      await new Promise<void>((resolve, reject) => {
        tcp.once('error', reject);
        tcp.listen({ host: address, port, exclusive: true }, () => resolve());
      });
    }
  } catch (err) {
    await close();
    throw err;
  }
  return { hits, close };
}
