import { createHash } from 'node:crypto';
import { existsSync, writeFileSync } from 'node:fs';
import { chmod, mkdir, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { DnsAddressRecord } from './dns-message.js';
import type {
  NetworkEventSink,
  NetworkManager,
  NetworkSandbox,
  SandboxNetwork,
} from './network-manager.js';
import {
  addressElements,
  cidrElements,
  flushSandboxSets,
  removeSandboxScript,
  sandboxScript,
  tableScript,
} from './nft-ruleset.js';
import {
  bigIntToIp,
  cidrContains,
  compilePolicy,
  DEFAULT_NETWORK_CATALOGUE,
  ipToBigInt,
  matchDomain,
  parseCidr,
  type Cidr,
  type CompiledPolicy,
} from './policy.js';
import { parseResolvConf, parseUpstream, PlatformResolver } from './resolver.js';
import { nft, runTool } from './sys.js';

export interface NetworkOptions {
  /** The edge's state directory; the network layer keeps its files under `network/`. */
  stateDir: string;
  /**
   * IPv4 range carved into one /30 per sandbox (host end .1, sandbox .2). Default:
   * the first free /16 of 10.213.0.0–10.250.0.0 on this host, remembered across restarts.
   */
  subnet4?: string;
  /** IPv6 /48 for one /64 per sandbox; `false` for IPv4 only. Default fd5e:c0de:<second octet>::/48. */
  subnet6?: string | false;
  /** Upstream resolvers (`1.2.3.4`, `1.2.3.4:5353`, `[::1]:53`). Default: /etc/resolv.conf. */
  upstream?: string[];
  /** Named rules (`pypi` → domains). Default {@link DEFAULT_NETWORK_CATALOGUE}. */
  catalogue?: Record<string, readonly string[]>;
  /**
   * Interfaces that carry sandbox traffic to the outside: forwarding is switched
   * on for them (and for sandbox veths) only, not host-wide. Default: the
   * interfaces of the host's default routes.
   */
  uplinks?: string[];
  /** Floor on how long a resolved address stays allowed (TTL 0 answers must still connect). */
  minDnsTtlSeconds?: number;
  onEvent?: NetworkEventSink;
  log?: (msg: string, fields?: Record<string, unknown>) => void;
}

const CLAIMS_DIR = '/run/dsec-network';
const CANDIDATE_SECOND_OCTETS = Array.from({ length: 38 }, (_, i) => 213 + i);
const DENIED_WINDOW_SECONDS = 60;
const MAX_CACHED_NAMES = 2048;
const MAX_DNS_TTL_SECONDS = 86_400;

interface Live {
  sb: NetworkSandbox;
  policy: CompiledPolicy;
  names: ReturnType<LinuxNetwork['names']>;
  /** Answers handed out, so a policy change can keep still-allowed names working. */
  resolved: Map<string, { records: DnsAddressRecord[]; expiresAt: number }>;
  /** Serialises nft changes of one sandbox (DNS answers vs. policy updates). */
  queue: Promise<unknown>;
}

/**
 * Per-sandbox network namespaces on Linux, wired to the host by a veth pair,
 * with egress enforced by one nftables table per edge and fed by the platform
 * resolver (docs/adr/0005-sandbox-network.md).
 */
export class LinuxNetwork implements NetworkManager {
  readonly mode = 'isolated' as const;
  readonly table: string;
  readonly subnet4: Cidr;
  readonly subnet6: Cidr | undefined;
  readonly #o: NetworkOptions;
  readonly #dir: string;
  readonly #catalogue: Record<string, readonly string[]>;
  readonly #resolver: PlatformResolver;
  readonly #live = new Map<string, Live>();
  readonly #bySource = new Map<string, string>();
  readonly #deniedSeen = new Map<string, number>();
  #poller: NodeJS.Timeout | undefined;
  #collecting: Promise<void> | undefined;

  private constructor(
    o: NetworkOptions,
    subnet4: Cidr,
    subnet6: Cidr | undefined,
    resolver: PlatformResolver,
  ) {
    this.#o = o;
    this.#dir = join(o.stateDir, 'network');
    this.subnet4 = subnet4;
    this.subnet6 = subnet6;
    this.table = `dsec_${subnet4.address.split('.').slice(0, 2).join('_')}`;
    this.#catalogue = { ...(o.catalogue ?? DEFAULT_NETWORK_CATALOGUE) };
    this.#resolver = resolver;
  }

  /** Firewall installs started by `setup`, awaited by `attach`. */
  readonly #firewalls = new Map<string, Promise<string>>();

  /** Probes nftables and netns support, claims an address range, installs the table. */
  static async open(o: NetworkOptions): Promise<LinuxNetwork> {
    const dir = join(o.stateDir, 'network');
    await mkdir(join(dir, 'resolv'), { recursive: true });
    await chmod(dir, 0o711);
    await chmod(join(dir, 'resolv'), 0o711);
    const { subnet4, subnet6 } = await claimSubnets(dir, o);
    const upstream = o.upstream
      ? o.upstream.map(parseUpstream)
      : parseResolvConf(await readFile('/etc/resolv.conf', 'utf8').catch(() => ''));
    const resolver = new PlatformResolver({ upstream, log: o.log });
    const net = new LinuxNetwork(o, subnet4, subnet6, resolver);
    await nft(
      tableScript({
        table: net.table,
        subnet4,
        subnet6,
        deniedWindowSeconds: DENIED_WINDOW_SECONDS,
      }),
    );
    const uplinks = o.uplinks ?? (await defaultRouteInterfaces());
    for (const dev of uplinks) await enableForwarding(dev, subnet6 !== undefined);
    net.#poller = setInterval(() => void net.collectEvents(), 2000);
    net.#poller.unref();
    return net;
  }

  validate(spec: NetworkSandbox['spec']): void {
    compilePolicy(spec, this.#catalogue);
  }

  names(sb: Pick<NetworkSandbox, 'id' | 'slot'>) {
    const h = createHash('sha256').update(sb.id).digest('hex');
    const max = 2 ** (32 - this.subnet4.prefix) / 4 - 2;
    if (sb.slot < 0 || sb.slot >= max) {
      throw new DsecError(
        'capacity_exhausted',
        `no address left in ${this.subnet4.address}/${this.subnet4.prefix}`,
      );
    }
    const base4 = ipToBigInt(this.subnet4.address) + BigInt(4 * (sb.slot + 1));
    const base6 = this.subnet6 && ipToBigInt(this.subnet6.address) + (BigInt(sb.slot + 1) << 64n);
    return {
      veth: `dsv${h.slice(0, 12)}`,
      host4: bigIntToIp(base4 + 1n, 4),
      sandbox4: bigIntToIp(base4 + 2n, 4),
      host6: base6 === undefined ? undefined : bigIntToIp(base6 + 1n, 6),
      sandbox6: base6 === undefined ? undefined : bigIntToIp(base6 + 2n, 6),
      resolvConf: join(this.#dir, 'resolv', `${h.slice(0, 20)}.conf`),
    };
  }

  /** Interface and addresses of a sandbox this edge networks (undefined if none). */
  sandboxNetwork(id: string): ReturnType<LinuxNetwork['names']> | undefined {
    return this.#live.get(id)?.names;
  }

  async setup(sb: NetworkSandbox): Promise<SandboxNetwork> {
    const policy = compilePolicy(sb.spec, this.#catalogue);
    const n = this.names(sb);
    writeFileSync(n.resolvConf, `nameserver ${n.host4}\noptions timeout:2 attempts:2\n`, {
      mode: 0o644,
    });
    // The sandbox's chain and sets are installed while the runtime starts the
    // sandbox; `attach` waits for them before wiring the veth, so no packet
    // ever crosses an interface without its rules.
    const firewall = nft(
      sandboxScript(
        {
          table: this.table,
          subnet4: this.subnet4,
          subnet6: this.subnet6,
          deniedWindowSeconds: DENIED_WINDOW_SECONDS,
          slot: sb.slot,
          veth: n.veth,
        },
        policy,
      ),
    );
    firewall.catch(() => undefined); // reported by attach
    this.#firewalls.set(sb.id, firewall);
    this.#track(sb, policy);
    return {
      resolvConf: n.resolvConf,
      addresses: [n.sandbox4, ...(n.sandbox6 ? [n.sandbox6] : [])],
      gateway4: n.host4,
    };
  }

  /**
   * The runtime made the sandbox's network namespace (so it belongs to the
   * sandbox's user namespace and sysfs can be mounted in it; root inside has
   * no CAP_NET_ADMIN, so it cannot change what is set up here). One shell
   * does the plumbing to keep process start-ups off the create path.
   */
  async attach(sb: NetworkSandbox, initPid: number): Promise<void> {
    const n = this.names(sb);
    const v6 = n.host6 !== undefined && n.sandbox6 !== undefined;
    const firewall = this.#firewalls.get(sb.id);
    this.#firewalls.delete(sb.id);
    await firewall;
    // Two `ip -batch` runs instead of a dozen `ip` processes (a batch line takes
    // no `-6`: the family follows from the address): one on the host
    // (the veth, its far end moved into the sandbox's namespace as eth0), one
    // inside that namespace.
    await deleteLink(n.veth);
    await runTool('ip', ['-batch', '-'], {
      stdin: [
        `link add ${n.veth} type veth peer name eth0 netns ${initPid}`,
        v6 ? `addr add ${n.host6}/64 dev ${n.veth} nodad` : '',
        `addr add ${n.host4}/30 dev ${n.veth}`,
        `link set ${n.veth} up`,
      ]
        .filter(Boolean)
        .join('\n')
        .concat('\n'),
    });
    const conf = (family: string, key: string, value: string) =>
      writeFileSync(`/proc/sys/net/${family}/conf/${n.veth}/${key}`, value);
    conf('ipv4', 'forwarding', '1');
    // Strict reverse-path check: a sandbox cannot send with another's source address.
    conf('ipv4', 'rp_filter', '1');
    if (v6) {
      conf('ipv6', 'accept_ra', '0');
      conf('ipv6', 'force_forwarding', '1');
    }
    await runTool('nsenter', ['-t', String(initPid), '-n', 'ip', '-batch', '-'], {
      stdin: [
        'link set lo up',
        `addr add ${n.sandbox4}/30 dev eth0`,
        v6 ? `addr add ${n.sandbox6}/64 dev eth0 nodad` : '',
        'link set eth0 up',
        `route add default via ${n.host4}`,
        v6 ? `route add default via ${n.host6}` : '',
      ]
        .filter(Boolean)
        .join('\n')
        .concat('\n'),
    });
    await this.#listen(sb);
  }

  async update(sb: NetworkSandbox): Promise<void> {
    const policy = compilePolicy(sb.spec, this.#catalogue);
    const live = this.#live.get(sb.id);
    if (!live) throw new DsecError('sandbox_not_running', `sandbox ${sb.id} has no network`);
    live.sb = sb;
    live.policy = policy;
    const now = Date.now();
    const lines = [
      ...flushSandboxSets(this.table, sb.slot),
      ...cidrElements(this.table, sb.slot, policy),
    ];
    for (const [name, entry] of live.resolved) {
      const d = matchDomain(policy, name);
      if (!d.allowed || entry.expiresAt <= now) {
        live.resolved.delete(name);
        continue;
      }
      lines.push(
        ...addressElements(
          this.table,
          sb.slot,
          this.#elements(entry.records, d.ports, now, entry.expiresAt),
        ),
      );
    }
    await this.#serial(live, () => nft(lines.join('\n') + '\n'));
  }

  async teardown(sb: Pick<NetworkSandbox, 'id' | 'slot'>): Promise<void> {
    const n = this.names(sb);
    // A create that failed before `attach` may still be installing the firewall.
    await this.#firewalls.get(sb.id)?.catch(() => undefined);
    this.#firewalls.delete(sb.id);
    this.#resolver.detach(sb.id);
    const live = this.#live.get(sb.id);
    this.#live.delete(sb.id);
    if (live) await live.queue.catch(() => undefined);
    for (const [src, id] of this.#bySource) if (id === sb.id) this.#bySource.delete(src);
    await this.#collectOnce().catch(() => undefined);
    const errors: unknown[] = [];
    await nft(
      removeSandboxScript({
        table: this.table,
        subnet4: this.subnet4,
        subnet6: this.subnet6,
        deniedWindowSeconds: DENIED_WINDOW_SECONDS,
        slot: sb.slot,
        veth: n.veth,
      }),
    ).catch((e: unknown) => errors.push(e));
    // The veth normally died with the sandbox's network namespace.
    await deleteLink(n.veth).catch((e: unknown) => errors.push(e));
    await rm(n.resolvConf, { force: true });
    if (errors.length > 0) throw errors[0];
  }

  async reconcile(live: NetworkSandbox[]): Promise<void> {
    for (const sb of live) {
      try {
        this.#track(sb, compilePolicy(sb.spec, this.#catalogue));
        await this.#listen(sb);
      } catch (err) {
        this.#o.log?.('adopting a sandbox network failed', { id: sb.id, err: String(err) });
      }
    }
    // A gone sandbox's network namespace died with its processes, and its veth
    // with it; what is left is firewall state and resolv.conf files.
    const keepConf = new Set(live.map((sb) => this.names(sb).resolvConf));
    for (const f of await readdir(join(this.#dir, 'resolv')).catch(() => [] as string[])) {
      const path = join(this.#dir, 'resolv', f);
      if (!keepConf.has(path)) await rm(path, { force: true });
    }
    // Chains, sets and map entries of slots no live sandbox holds.
    const slots = new Set(live.map((sb) => sb.slot));
    const state = JSON.parse(await runTool('nft', ['-j', 'list', 'table', 'inet', this.table])) as {
      nftables: Record<string, { name?: string; elem?: unknown[] }>[];
    };
    const orphanSlots = new Set<number>();
    const vethBySlot = new Map<number, string>();
    for (const obj of state.nftables) {
      const name = obj.chain?.name ?? obj.set?.name ?? obj.counter?.name;
      const m = name && /_(\d+)$/.exec(name);
      if (name && m?.[1] && /^(sb|a4|p4|c4|cp4|x4|a6|p6|c6|cp6|x6|denied)_/.test(name)) {
        const slot = Number(m[1]);
        if (!slots.has(slot)) orphanSlots.add(slot);
      }
      if (obj.map?.name === 'egress') {
        for (const e of obj.map.elem ?? []) {
          const pair = e as [string, { jump?: { target?: string } }];
          const target = pair[1]?.jump?.target;
          const sm = target && /^sb_(\d+)$/.exec(target);
          if (sm?.[1]) vethBySlot.set(Number(sm[1]), pair[0]);
        }
      }
    }
    for (const slot of orphanSlots) {
      await nft(
        removeSandboxScript({
          table: this.table,
          subnet4: this.subnet4,
          subnet6: this.subnet6,
          deniedWindowSeconds: DENIED_WINDOW_SECONDS,
          slot,
          veth: vethBySlot.get(slot) ?? 'dsvnone',
        }),
      ).catch((err: unknown) =>
        this.#o.log?.('removing stale firewall entries failed', { slot, err: String(err) }),
      );
    }
  }

  async collectEvents(): Promise<void> {
    if (this.#live.size === 0 || !this.#o.onEvent) return;
    await this.#collectOnce().catch((err: unknown) =>
      this.#o.log?.('reading denied connections failed', { err: String(err) }),
    );
  }

  async close(): Promise<void> {
    clearInterval(this.#poller);
    await this.#collecting?.catch(() => undefined);
    this.#resolver.close();
    if (this.#live.size === 0) {
      // Nothing of ours is left on the host: give the range back.
      await runTool('nft', ['delete', 'table', 'inet', this.table]).catch(() => undefined);
      await rm(join(this.#dir, 'config.json'), { force: true });
      await rm(join(CLAIMS_DIR, claimName(this.subnet4)), { force: true });
    }
  }

  #track(sb: NetworkSandbox, policy: CompiledPolicy): Live {
    const n = this.names(sb);
    const live: Live = this.#live.get(sb.id) ?? {
      sb,
      policy,
      names: n,
      resolved: new Map(),
      queue: Promise.resolve(),
    };
    live.sb = sb;
    live.policy = policy;
    this.#live.set(sb.id, live);
    this.#bySource.set(n.sandbox4, sb.id);
    if (n.sandbox6) this.#bySource.set(n.sandbox6, sb.id);
    return live;
  }

  /** Binds the sandbox's resolver socket (its host-end address must exist). */
  async #listen(sb: NetworkSandbox): Promise<void> {
    const live = this.#live.get(sb.id);
    if (!live) throw new DsecError('sandbox_not_running', `sandbox ${sb.id} has no network`);
    const n = live.names;
    await this.#resolver.attach(sb.id, {
      listenAddress: n.host4,
      sourceAddresses: [n.sandbox4],
      decide: (name) => matchDomain(live.policy, name),
      allowAddresses: (name, ports, records) => this.#allow(live, name, ports, records),
      blocked: (name, qtype) =>
        this.#o.onEvent?.(
          sb.id,
          'dns_blocked',
          `DNS name not allowed: ${name}`,
          { name, qtype },
          `dns:${name}`,
        ),
    });
  }

  async #allow(
    live: Live,
    name: string,
    ports: number[],
    records: DnsAddressRecord[],
  ): Promise<void> {
    if (records.length === 0) return;
    if (!this.#live.has(live.sb.id)) return;
    const now = Date.now();
    const ttl = Math.max(...records.map((r) => this.#ttl(r.ttlSeconds)));
    const expiresAt = now + ttl * 1000;
    if (live.resolved.size >= MAX_CACHED_NAMES && !live.resolved.has(name)) {
      const oldest = live.resolved.keys().next().value;
      if (oldest !== undefined) live.resolved.delete(oldest);
    }
    live.resolved.delete(name);
    live.resolved.set(name, { records, expiresAt });
    const lines = addressElements(this.table, live.sb.slot, this.#elements(records, ports, now));
    await this.#serial(live, () => nft(lines.join('\n') + '\n'));
  }

  #elements(records: DnsAddressRecord[], ports: number[], now: number, until?: number) {
    return records
      .filter((r) => (r.family === 6 ? this.subnet6 !== undefined : true))
      .map((r) => ({
        family: r.family,
        address: r.address,
        ports,
        timeoutSeconds:
          until === undefined
            ? this.#ttl(r.ttlSeconds)
            : Math.max(1, Math.ceil((until - now) / 1000)),
      }));
  }

  #ttl(seconds: number): number {
    return Math.min(MAX_DNS_TTL_SECONDS, Math.max(this.#o.minDnsTtlSeconds ?? 30, seconds));
  }

  #serial<T>(live: Live, f: () => Promise<T>): Promise<T> {
    const next = live.queue.then(f, f);
    live.queue = next.catch(() => undefined);
    return next;
  }

  /** One read at a time; a caller arriving mid-read gets a fresh read after it (it may hold news). */
  #collectOnce(): Promise<void> {
    const prior = this.#collecting ?? Promise.resolve();
    const next: Promise<void> = prior
      .catch(() => undefined)
      .then(() => this.#readDenied())
      .finally(() => {
        if (this.#collecting === next) this.#collecting = undefined;
      });
    this.#collecting = next;
    return next;
  }

  async #readDenied(): Promise<void> {
    const sink = this.#o.onEvent;
    if (!sink) return;
    const now = Date.now();
    for (const [k, t] of this.#deniedSeen) if (t < now) this.#deniedSeen.delete(k);
    for (const set of ['denied4', 'denied6']) {
      const out = await runTool('nft', ['-j', 'list', 'set', 'inet', this.table, set]);
      const parsed = JSON.parse(out) as { nftables: { set?: { elem?: unknown[] } }[] };
      for (const obj of parsed.nftables) {
        for (const e of obj.set?.elem ?? []) {
          const concat = ((e as { elem?: { val?: { concat?: unknown[] } } }).elem?.val?.concat ??
            (e as { concat?: unknown[] }).concat) as (string | number)[] | undefined;
          if (!concat || concat.length !== 4) continue;
          const [src, dst, proto, port] = concat.map(String) as [string, string, string, string];
          const key = concat.join(' ');
          if (this.#deniedSeen.has(key)) continue;
          this.#deniedSeen.set(key, now + DENIED_WINDOW_SECONDS * 1000);
          const id = this.#bySource.get(src);
          if (!id) continue;
          const protocol = protoName(proto);
          const dport = Number(port);
          sink(
            id,
            'network_denied',
            `connection denied: ${protocol} to ${dst}${protocol === 'tcp' || protocol === 'udp' ? ` port ${dport}` : ''}`,
            {
              destination: dst,
              protocol,
              ...(protocol === 'tcp' || protocol === 'udp' ? { port: dport } : {}),
            },
            `net:${dst}:${protocol}:${dport}`,
          );
        }
      }
    }
  }
}

function protoName(p: string): string {
  const n = Number(p);
  if (Number.isNaN(n)) return p;
  return (
    ({ 1: 'icmp', 6: 'tcp', 17: 'udp', 58: 'icmpv6' } as Record<number, string>)[n] ?? String(n)
  );
}

function claimName(c: Cidr): string {
  return `${c.address}_${c.prefix}`;
}

/**
 * Picks the edge's address ranges: the ones it used before (kept in
 * `network/config.json`, so running sandboxes keep their addresses across an
 * edge restart), else the configured one, else the first /16 of the
 * candidates that no route on this host overlaps and no other edge claimed
 * (claims are files under /run, one per range, naming the claiming edge).
 */
async function claimSubnets(
  dir: string,
  o: NetworkOptions,
): Promise<{ subnet4: Cidr; subnet6: Cidr | undefined }> {
  const configFile = join(dir, 'config.json');
  const saved = await readFile(configFile, 'utf8')
    .then((s) => JSON.parse(s) as { subnet4: string; subnet6?: string })
    .catch(() => undefined);
  await mkdir(CLAIMS_DIR, { recursive: true, mode: 0o700 });
  const v6For = (c: Cidr) => {
    if (o.subnet6 === false) return undefined;
    if (o.subnet6) return parseCidr(o.subnet6, 'subnet6');
    const second = Number(c.address.split('.')[1]);
    return parseCidr(`fd5e:c0de:${second.toString(16)}::/48`, 'subnet6');
  };
  const tryClaim = async (c: Cidr): Promise<boolean> => {
    const file = join(CLAIMS_DIR, claimName(c));
    const owner = await readFile(file, 'utf8').catch(() => undefined);
    if (owner !== undefined && owner !== dir) {
      // A claim whose edge forgot it (state dir gone) is stale.
      const alive = await readFile(join(owner, 'config.json'), 'utf8').catch(() => undefined);
      if (alive !== undefined) return false;
    }
    await writeFile(file, dir, { mode: 0o600 });
    return (await readFile(file, 'utf8')) === dir;
  };
  let subnet4: Cidr | undefined;
  if (saved) {
    subnet4 = parseCidr(saved.subnet4, 'subnet4');
    await tryClaim(subnet4);
  } else if (o.subnet4) {
    subnet4 = parseCidr(o.subnet4, 'subnet4');
    if (!(await tryClaim(subnet4)))
      throw new DsecError('conflict', `${o.subnet4} is used by another edge on this host`);
  } else {
    const used = await usedPrefixes();
    for (const second of CANDIDATE_SECOND_OCTETS) {
      const c = parseCidr(`10.${second}.0.0/16`, 'subnet4');
      if (used.some((u) => overlaps(u, c))) continue;
      if (await tryClaim(c)) {
        subnet4 = c;
        break;
      }
    }
    if (!subnet4) throw new DsecError('unavailable', 'no free address range for sandbox networks');
  }
  const subnet6 = saved
    ? saved.subnet6
      ? parseCidr(saved.subnet6, 'subnet6')
      : undefined
    : v6For(subnet4);
  if (subnet6 && subnet6.prefix !== 48)
    throw new DsecError('invalid_argument', 'subnet6 must be a /48', { field: 'subnet6' });
  if (subnet4.prefix > 28)
    throw new DsecError('invalid_argument', 'subnet4 must be /28 or larger', { field: 'subnet4' });
  const fmt = (c: Cidr) => `${c.address}/${c.prefix}`;
  await writeFile(
    configFile,
    JSON.stringify({ subnet4: fmt(subnet4), ...(subnet6 ? { subnet6: fmt(subnet6) } : {}) }),
    { mode: 0o600 },
  );
  return { subnet4, subnet6 };
}

function overlaps(a: Cidr, b: Cidr): boolean {
  return cidrContains(a, b.address) || cidrContains(b, a.address);
}

async function usedPrefixes(): Promise<Cidr[]> {
  const out: Cidr[] = [];
  const routes = JSON.parse(await runTool('ip', ['-j', '-4', 'route', 'show', 'table', 'all'])) as {
    dst?: string;
  }[];
  for (const r of routes) {
    if (!r.dst || r.dst === 'default') continue;
    try {
      out.push(parseCidr(r.dst, 'dst'));
    } catch {
      // not an address (e.g. "broadcast" entries carry one anyway)
    }
  }
  return out;
}

async function defaultRouteInterfaces(): Promise<string[]> {
  const devs = new Set<string>();
  for (const fam of ['-4', '-6']) {
    const routes = JSON.parse(
      await runTool('ip', ['-j', fam, 'route', 'show', 'default']).catch(() => '[]'),
    ) as {
      dev?: string;
    }[];
    for (const r of routes) if (r.dev) devs.add(r.dev);
  }
  return [...devs];
}

/** Per-interface forwarding: replies from the outside come in here and must be forwarded back. */
export async function enableForwarding(dev: string, ipv6: boolean): Promise<void> {
  if (!/^[A-Za-z0-9_.@-]{1,15}$/.test(dev))
    throw new DsecError('invalid_argument', `bad interface name ${dev}`);
  await writeFile(`/proc/sys/net/ipv4/conf/${dev}/forwarding`, '1');
  if (ipv6)
    await writeFile(`/proc/sys/net/ipv6/conf/${dev}/force_forwarding`, '1').catch(() => undefined);
}

/** Whether this host can run isolated networks (nftables usable, netns and veth available). */
export async function probeLinuxNetwork(): Promise<boolean> {
  if (process.getuid?.() !== 0) return false;
  try {
    await runTool('nft', ['list', 'tables'], { timeoutMs: 5000 });
    await runTool('ip', ['-V'], { timeoutMs: 5000 });
    await runTool('nsenter', ['--version'], { timeoutMs: 5000 });
    return true;
  } catch {
    return false;
  }
}

/**
 * Deletes a host link if it is there. The kernel tears a dead namespace's
 * veth pair down asynchronously, so one seen a moment ago may be gone by the
 * time `ip` runs: that is success too.
 */
async function deleteLink(name: string): Promise<void> {
  if (!existsSync(`/sys/class/net/${name}`)) return;
  await runTool('ip', ['link', 'del', name]).catch((err: unknown) => {
    if (existsSync(`/sys/class/net/${name}`)) throw err;
  });
}
