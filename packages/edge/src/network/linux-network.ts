import { createHash } from 'node:crypto';
import { existsSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { chmod, mkdir, readFile, readdir, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { DnsAddressRecord } from './dns-message.js';
import type {
  FarEndConfig,
  FarEndConfigurator,
  NetworkEventSink,
  NetworkManager,
  NetworkSandbox,
  SandboxNetwork,
  TapLink,
} from './network-manager.js';
import { MicroBatcher } from './batcher.js';
import { ConntrackSession, markTag, newMark, type ConntrackEntry } from './conntrack.js';
import {
  addLines,
  addressElements,
  baseElements,
  deleteDeniedLines,
  deleteLines,
  deletePolicyChainLines,
  legacyObjectsScript,
  policyChain,
  policyChainLines,
  protectedSetLines,
  refId,
  SANDBOX_SET_NAMES,
  tableScript,
  type ElementRef,
  type PolicyChain,
  type SandboxSetName,
} from './nft-ruleset.js';
import {
  bigIntToIp,
  cidrContains,
  compilePolicy,
  DEFAULT_NETWORK_CATALOGUE,
  ipToBigInt,
  matchDomain,
  formatCidr,
  parseCidr,
  type Cidr,
  type CompiledPolicy,
} from './policy.js';
import { hasNetworkLink } from './network-manager.js';
import {
  parseResolvConf,
  parseUpstream,
  PlatformResolver,
  type DroppedRecord,
} from './resolver.js';
import {
  checkNat64Prefix,
  classifyAddress,
  METADATA_ADDRESSES,
  NAT64_WELL_KNOWN,
  nat64Image,
  nodeNetworks,
  reservedCidrs,
  reservedOverlap,
  screenAddress,
  type NodeRanges,
  type ProtectedRange,
} from './special-ranges.js';
import { IpSession, nft, nftBatcher, NftSession, runTool, startTool } from './sys.js';

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
  /**
   * DNS queries per second a sandbox may send its resolver (burst twice
   * that); the firewall drops the rest, so one sandbox's flood costs the
   * edge's event loop a bounded amount. Default 200.
   */
  dnsQueriesPerSecond?: number;
  /**
   * Special-use ranges (of `SPECIAL_RANGES`, special-ranges.ts) this node
   * treats as public, for a lab whose "internet" is, say, a benchmarking or
   * CGNAT range: DNS answers in them are not filtered. Never a reserved
   * range (loopback, link-local, multicast, IPv4-mapped…) or the sandbox
   * subnets, and the node's own networks stay filtered. Default none.
   */
  publicRanges?: string[];
  /**
   * Destinations no sandbox rule can open (CIDRs): the operator's LAN, its
   * databases and object stores, other clouds' metadata services. Always
   * protected besides these: the node's own networks (its interfaces'
   * prefixes, less sandbox links, re-read every 5 s), the cloud metadata
   * addresses of {@link METADATA_ADDRESSES}, and the NAT64 forms of all of
   * them (and of the reserved IPv4 ranges). The firewall denies them before
   * any CIDR rule and DNS answers never carry them; a rule that overlaps them
   * is accepted, and the protected part stays closed (a `network_denied`
   * event says so). The cluster adds its own services' addresses (database,
   * image store, apiserver and edge listeners) when they are IP literals.
   */
  protectedRanges?: string[];
  /**
   * NAT64 prefixes of the node's translator besides the well-known
   * 64:ff9b::/96 (RFC 6052 lengths: /32, /40, /48, /56, /64, /96). An
   * address in one is judged by the IPv4 address it embeds: a reserved or
   * protected one is never reachable (the firewall denies its NAT64 form
   * too); any other needs a CIDR rule over the prefix, as for the
   * well-known prefix. Default none.
   */
  nat64Prefixes?: string[];
  onEvent?: NetworkEventSink;
  log?: (msg: string, fields?: Record<string, unknown>) => void;
}

const CLAIMS_DIR = '/run/dsec-network';
const CANDIDATE_SECOND_OCTETS = Array.from({ length: 38 }, (_, i) => 213 + i);
const DENIED_WINDOW_SECONDS = 60;
const MAX_CACHED_NAMES = 2048;
const MAX_DNS_TTL_SECONDS = 86_400;
/**
 * How often the node's own networks (its interfaces' prefixes, filtered out
 * of DNS answers) are read again: an address added to the host is filtered
 * at most this long after.
 */
const NODE_NETWORKS_REFRESH_MS = 5000;
/** Records listed in one answer-filtered event (the count says how many there were). */
const MAX_EVENT_RECORDS = 16;
/**
 * Network events (refused names, filtered answers, denied connections) a
 * sandbox gets recorded one by one per window; past it, each kind is folded
 * into one event whose count says how many (the event log folds repeats of
 * one key). Each recorded event is a synchronous, fsynced write on the edge's
 * event loop: a sandbox sending random refused names held it ~2 ms a query.
 */
const EVENT_BUDGET = 32;
const EVENT_WINDOW_MS = 10_000;
/**
 * Allow-set elements (address, or address and port) a sandbox's DNS answers
 * may hold open at once. Past it, an answer that would open more is refused
 * (SERVFAIL) until some expire: a zone that hands out new addresses on every
 * answer would otherwise grow the shared nftables sets (kernel memory, and
 * every sandbox's firewall transactions) without end. Far above what any
 * client connects to within its answers' TTLs.
 */
const MAX_ALLOW_ELEMENTS = 4096;
/** Addresses whose opening names a sandbox's record keeps ({@link Live.openedBy}). */
const MAX_OPENED_ADDRESSES = 4096;
/**
 * How long after a teardown the flows of sandboxes that are gone are swept
 * (one kernel walk of the conntrack table for every teardown meanwhile).
 * They are dead weight only: the slot's next sandbox has another mark.
 */
const SWEEP_DELAY_MS = 5000;

interface Live {
  sb: NetworkSandbox;
  policy: CompiledPolicy;
  names: ReturnType<LinuxNetwork['names']>;
  /** Answers handed out, so a policy change can keep still-allowed names working. */
  resolved: Map<string, { records: DnsAddressRecord[]; expiresAt: number }>;
  /**
   * Every element this sandbox has in the shared sets (by {@link refId}), so
   * teardown and policy changes remove exactly these. Timed ones carry their
   * expiry and are forgotten a while after it (the kernel drops them itself).
   */
  elements: Map<string, { ref: ElementRef; expiresAt?: number }>;
  /** Serialises nft changes of one sandbox (DNS answers vs. policy updates). */
  queue: Promise<unknown>;
  /**
   * The sandbox's conntrack mark (conntrack.ts): written on each flow the
   * firewall admits from it, required on every later packet.
   */
  mark: number;
  /**
   * The names whose answers opened each address (newest last, at most
   * {@link MAX_OPENED_ADDRESSES}): a live update keeps a flow to an address a
   * still-allowed name opened, even after the answer's TTL, and cuts the rest.
   */
  openedBy: Map<string, string[]>;
}

/** A denied connection recorded by the firewall (`denied4/6`). */
interface DeniedEntry {
  family: 4 | 6;
  source: string;
  destination: string;
  protocol: string;
  port: number;
  /** nft's text for the element, to delete it. */
  key: string;
}

/** How long after its expiry a timed element is still deleted explicitly (kernel GC lag). */
const EXPIRED_GRACE_MS = 60_000;
/** How long a stopped sandbox's veth may outlive it before the edge deletes it itself. */
const VETH_GONE_WAIT_MS = 2000;

/** A torn-down sandbox's veth the kernel has yet to remove. */
interface Draining {
  slot: number;
  deadline: number;
  /** Resolves once the veth is gone, or once deleting it failed (logged; `attach` tries again). */
  gone: Promise<void>;
  resolve: () => void;
}

/**
 * Per-sandbox network namespaces on Linux, wired to the host by a veth pair,
 * with egress enforced by one nftables table per edge and fed by the platform
 * resolver (docs/adr/0005-sandbox-network.md).
 *
 * Bursts: a sandbox is a few elements in the table's fixed sets (plus an
 * entry in the CIDR-policy map, whose chains are shared by identical rules),
 * and the changes of concurrent creates, removals and DNS answers are
 * coalesced into one nft transaction at a time ({@link nftBatcher}), run
 * by one long-lived `nft -i` process ({@link NftSession}), which also reads
 * the denied-connection sets; host-side `ip` commands go through one
 * long-lived `ip -batch` process ({@link IpSession}). Only the configuration
 * inside each sandbox's own namespace takes a process per sandbox.
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
  readonly #nftSession = new NftSession();
  readonly #nft = nftBatcher((commands) => this.#nftSession.run(commands));
  readonly #ip = new IpSession();
  readonly #conntrack = new ConntrackSession();
  /** The high byte of this edge's conntrack marks (conntrack.ts). */
  readonly #markTag: number;
  #sweepTimer: NodeJS.Timeout | undefined;
  #sweeping: Promise<void> | undefined;
  /** Protected by configuration: the operator's ranges and the metadata addresses. */
  readonly #protectedStatic: ProtectedRange[];
  /** The NAT64 prefixes whose embedded IPv4 is judged: the well-known one and the operator's. */
  readonly #nat64: Cidr[];
  /** The protected ranges as last installed in the firewall (`protected4/6`), to skip unchanged ones. */
  #protectedInstalled = '';
  /** Denied-set reads; a caller arriving mid-read shares the next read (it may hold news). */
  readonly #denied = new MicroBatcher<void, DeniedEntry[]>(async (items) => {
    const entries = await this.#readDenied();
    return items.map(() => ({ status: 'fulfilled', value: entries }));
  });
  /**
   * Elements a failed teardown could not remove, by the sandbox address they
   * are keyed on: removed by the next setup on that address (a slot's next
   * sandbox must never inherit its predecessor's allows) or the next reconcile.
   */
  readonly #orphans = new Map<string, ElementRef[]>();
  /** Sandboxes using each CIDR policy chain (`pol_<hash>`); a chain goes with its last user. */
  readonly #chainUsers = new Map<string, Set<string>>();
  #poller: NodeJS.Timeout | undefined;
  /** What DNS answers are screened against besides the policy (see `special-ranges.ts`). */
  #ranges: NodeRanges;
  #rangesTimer: NodeJS.Timeout | undefined;
  #rangesReading = false;
  /** The node's own networks as last read ({@link #refreshNodeNetworks}). */
  #nodeNetworks: Cidr[] = [];
  /** Per sandbox: events left to record one by one in the current window ({@link EVENT_BUDGET}). */
  readonly #eventBudget = new Map<string, { until: number; left: number }>();
  /**
   * Host ends of torn-down sandboxes' veths that the kernel has yet to
   * remove, by name (see {@link #drain}). Their slot's addresses are not
   * handed to a new sandbox's veth until they are gone.
   */
  readonly #draining = new Map<string, Draining>();
  #drainTimer: NodeJS.Timeout | undefined;

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
    this.#markTag = markTag(this.table);
    this.#nat64 = [
      parseCidr(NAT64_WELL_KNOWN, 'nat64'),
      ...(o.nat64Prefixes ?? []).map((p, i) => checkNat64Prefix(p, `nat64Prefixes.${i}`)),
    ];
    this.#protectedStatic = [
      ...(o.protectedRanges ?? []).map((r, i) => ({
        cidr: parseCidr(r, `protectedRanges.${i}`),
        what: 'a protected range of the operator',
      })),
      ...METADATA_ADDRESSES.map((m) => ({ cidr: parseCidr(m.cidr, 'metadata'), what: m.what })),
    ];
    this.#ranges = {
      reserved: [subnet4, ...(subnet6 ? [subnet6] : [])],
      protected: [],
      public: (o.publicRanges ?? []).map((r, i) => parseCidr(r, `publicRanges.${i}`)),
      nat64: this.#nat64,
    };
  }

  /** Firewall installs started by `setup`, awaited by `attach`. */
  readonly #prepared = new Map<string, Promise<void>>();
  /** Attaches in progress (settled, never rejecting), awaited by `teardown`. */
  readonly #attaching = new Map<string, Promise<void>>();

  /** Probes nftables and netns support, claims an address range, installs the table. */
  static async open(o: NetworkOptions): Promise<LinuxNetwork> {
    checkPublicRanges(o.publicRanges ?? []);
    for (const [i, r] of (o.protectedRanges ?? []).entries()) parseCidr(r, `protectedRanges.${i}`);
    for (const [i, p] of (o.nat64Prefixes ?? []).entries())
      checkNat64Prefix(p, `nat64Prefixes.${i}`);
    const rate = o.dnsQueriesPerSecond;
    if (rate !== undefined && (!Number.isInteger(rate) || rate < 1))
      throw new DsecError('invalid_argument', 'dnsQueriesPerSecond: a positive integer', {
        field: 'dnsQueriesPerSecond',
      });
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
        dnsQueriesPerSecond: o.dnsQueriesPerSecond,
      }),
    );
    // The session's process starts now, off the first create's path; a host
    // where it cannot run (no `stdbuf`) cannot run isolated networks.
    await net.#nftSession.run([]).catch((err: unknown) => {
      net.#nftSession.close();
      throw new DsecError('unavailable', `nft -i session: ${String(err)}`, { cause: err });
    });
    const uplinks = o.uplinks ?? (await defaultRouteInterfaces());
    for (const dev of uplinks) await enableForwarding(dev, subnet6 !== undefined);
    net.#poller = setInterval(() => void net.collectEvents(), 2000);
    net.#poller.unref();
    // Before the first answer is screened (and the protected ranges are in the
    // firewall before the first sandbox); then again and again.
    await net.#refreshNodeNetworks();
    if (net.#protectedInstalled === '') {
      clearInterval(net.#poller);
      net.#nftSession.close();
      throw new DsecError('unavailable', 'the protected ranges could not be installed in nftables');
    }
    net.#rangesTimer = setInterval(() => void net.#refreshNodeNetworks(), NODE_NETWORKS_REFRESH_MS);
    net.#rangesTimer.unref();
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

  /** Interface, addresses and conntrack mark of a sandbox this edge networks (undefined if none). */
  sandboxNetwork(id: string): (ReturnType<LinuxNetwork['names']> & { mark: number }) | undefined {
    const live = this.#live.get(id);
    return live && { ...live.names, mark: live.mark };
  }

  /** The protected ranges now in force (for logs and tests). */
  protectedRanges(): string[] {
    return this.#ranges.protected.map((p) => formatCidr(p.cidr));
  }

  async setup(sb: NetworkSandbox): Promise<SandboxNetwork> {
    const policy = compilePolicy(sb.spec, this.#catalogue);
    const n = this.names(sb);
    writeFileSync(n.resolvConf, `nameserver ${n.host4}\noptions timeout:2 attempts:2\n`, {
      mode: 0o644,
    });
    const live = this.#track(sb, policy);
    // A retried setup keeps its mark; a new sandbox on the slot gets another.
    if (live.mark === 0) live.mark = this.#newMark();
    this.#protectedOverlap(live);
    const chain = policyChain(policy, this.subnet6 !== undefined);
    const base = baseElements(n, chain, live.mark);
    // The sandbox's elements are installed while the runtime starts the
    // sandbox; `attach` waits for them before wiring the veth, so no packet
    // ever crosses an interface without its rules.
    const firewall = this.#serial(live, () => {
      // A repeated setup (a retried create) replaces what the earlier try installed.
      const keep = new Set(base.map(refId));
      const stale = [
        ...[...live.elements.values()].map((e) => e.ref),
        ...this.#takeOrphans(n.sandbox4, n.sandbox6),
      ].filter((r) => !keep.has(refId(r)));
      live.elements = new Map(base.map((r) => [refId(r), { ref: r }]));
      return this.#nft.submit(
        script([
          ...this.#useChain(sb.id, chain),
          ...deleteLines(this.table, stale),
          ...addLines(this.table, base),
          ...this.#dropChains(sb.id, chain?.name),
        ]),
      );
    });
    firewall.catch(() => undefined); // reported by attach
    this.#prepared.set(sb.id, firewall);
    return {
      resolvConf: n.resolvConf,
      addresses: [n.sandbox4, ...(n.sandbox6 ? [n.sandbox6] : [])],
      gateway4: n.host4,
    };
  }

  /**
   * The runtime made the sandbox's network namespace (so it belongs to the
   * sandbox's user namespace and sysfs can be mounted in it; root inside has
   * no CAP_NET_ADMIN, so it cannot change what is set up here). The veth is
   * made with its far end directly in that namespace (moving a device there
   * afterwards costs an RCU grace period each, which serializes a burst) and
   * its host end configured, through the edge's long-lived `ip` session.
   * The far end is configured by `farEnd` (the sandbox's chronus daemon,
   * already in the sandbox's namespaces: a few netlink messages) or, without
   * one, by one process in the namespace, started first so that its
   * start-up (a fork of the edge, then `nsenter` and `ip`) overlaps with the
   * rest: `ip -batch -` runs each line as it arrives, and gets its lines once
   * the far end exists. Meanwhile the resolver binds on the host end.
   */
  attach(sb: NetworkSandbox, initPid: number, farEnd?: FarEndConfigurator): Promise<void> {
    // A teardown (a create that failed elsewhere meanwhile) waits for this,
    // so the veth it may still make is one that teardown drains.
    const attaching = this.#attach(sb, initPid, farEnd);
    const tracked = attaching
      .catch(() => undefined)
      .finally(() => {
        if (this.#attaching.get(sb.id) === tracked) this.#attaching.delete(sb.id);
      });
    this.#attaching.set(sb.id, tracked);
    return attaching;
  }

  async #attach(sb: NetworkSandbox, initPid: number, farEnd?: FarEndConfigurator): Promise<void> {
    const n = this.names(sb);
    const v6 = n.host6 !== undefined && n.sandbox6 !== undefined;
    const firewall = this.#prepared.get(sb.id);
    this.#prepared.delete(sb.id);
    if (!firewall) throw new DsecError('internal', `sandbox ${sb.id}: network attach before setup`);
    const tool = farEnd
      ? undefined
      : startTool('nsenter', ['-t', String(initPid), '-n', 'ip', '-batch', '-'], { stdin: true });
    try {
      // The slot's previous veth must be gone: its host end holds the same addresses.
      await Promise.all([firewall, this.#slotDrained(sb.slot)]);
      // A leftover of an earlier try: the session may know its name by the old index.
      if (await this.#deleteLink(n.veth)) this.#ip.close();
      await this.#ip.run([
        `link add ${n.veth} type veth peer name eth0 netns ${initPid}`,
        ...hostEndLines(n),
      ]);
      hostEndSysctls(n);
    } catch (err) {
      tool?.kill();
      throw err;
    }
    const addresses = farEndAddresses(n);
    const configured = tool
      ? tool.finish(
          [
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
        )
      : farEnd?.({ interface: 'eth0', addresses });
    await Promise.all([configured, this.#listen(sb)]);
  }

  /**
   * A microVM's link (ADR 0016): a tap on the host where a container's veth
   * host end would be, under the same name, so the table's interface-keyed
   * elements (the input hook's `ifaces` match among them) and the resolver's
   * socket on its address apply unchanged. Owned by the hypervisor's uid; QEMU opens it
   * (as root, before it drops to that uid). Unlike a veth it is not removed
   * by the kernel when the VM ends: `teardown` deletes it.
   */
  attachTap(sb: NetworkSandbox, options: { ownerUid: number }): Promise<TapLink> {
    const attaching = this.#attachTap(sb, options.ownerUid);
    const tracked = attaching
      .then(() => undefined)
      .catch(() => undefined)
      .finally(() => {
        if (this.#attaching.get(sb.id) === tracked) this.#attaching.delete(sb.id);
      });
    this.#attaching.set(sb.id, tracked);
    return attaching;
  }

  async #attachTap(sb: NetworkSandbox, ownerUid: number): Promise<TapLink> {
    if (!Number.isInteger(ownerUid) || ownerUid < 0)
      throw new DsecError('internal', `bad tap owner ${ownerUid}`);
    const n = this.names(sb);
    const firewall = this.#prepared.get(sb.id);
    this.#prepared.delete(sb.id);
    if (!firewall) throw new DsecError('internal', `sandbox ${sb.id}: network attach before setup`);
    await Promise.all([firewall, this.#slotDrained(sb.slot)]);
    // A leftover of an earlier try: the session may know its name by the old index.
    if (await this.#deleteLink(n.veth)) this.#ip.close();
    await this.#ip.run([
      `tuntap add dev ${n.veth} mode tap user ${ownerUid} group ${ownerUid}`,
      ...hostEndLines(n),
    ]);
    hostEndSysctls(n);
    await this.#listen(sb);
    return {
      tap: n.veth,
      guest: { interface: 'eth0', addresses: farEndAddresses(n) },
      nameserver: n.host4,
    };
  }

  async update(sb: NetworkSandbox): Promise<void> {
    const policy = compilePolicy(sb.spec, this.#catalogue);
    const live = this.#live.get(sb.id);
    if (!live && linkFixedAtBoot(sb.spec)) {
      // Its network device was fixed at boot: none, so there is nothing to open.
      if (!hasNetworkLink(sb.spec)) return;
      throw new DsecError(
        'invalid_argument',
        `${sb.spec.backend} sandbox ${sb.id} was created without network rules, so it has no network device; create it with rules to change them later`,
        { field: 'networkRules' },
      );
    }
    if (!live) throw new DsecError('sandbox_not_running', `sandbox ${sb.id} has no network`);
    live.sb = sb;
    live.policy = policy;
    this.#protectedOverlap(live);
    const now = Date.now();
    const chain = policyChain(policy, this.subnet6 !== undefined);
    const next = baseElements(live.names, chain, live.mark);
    // Newest answers first, within the sandbox's bound (new ports multiply elements).
    const reopened = new Set<string>();
    for (const [name, entry] of [...live.resolved].reverse()) {
      const d = matchDomain(policy, name);
      const refs =
        d.allowed && entry.expiresAt > now
          ? addressElements(
              live.names,
              this.#elements(entry.records, d.ports, now, entry.expiresAt),
            )
          : [];
      const ids = refs.map(refId).filter((id) => !reopened.has(id));
      if (refs.length === 0 || reopened.size + new Set(ids).size > MAX_ALLOW_ELEMENTS) {
        live.resolved.delete(name);
        continue;
      }
      for (const id of ids) reopened.add(id);
      next.push(...refs);
    }
    // One transaction: the sandbox is never without its rules in between.
    await this.#serial(live, () => {
      const keep = new Set(next.map(refId));
      const gone = [...live.elements.values()].map((e) => e.ref).filter((r) => !keep.has(refId(r)));
      live.elements = new Map(next.map((r) => [refId(r), this.#tracked(r, now)]));
      return this.#nft.submit(
        script([
          ...this.#useChain(sb.id, chain),
          ...deleteLines(this.table, gone),
          ...addLines(this.table, next),
          ...this.#dropChains(sb.id, chain?.name),
        ]),
      );
    });
    // New flows meet the new policy now; the established ones it no longer allows go too.
    await this.#cutFlows(live);
  }

  /**
   * Deletes the sandbox's established flows (by its conntrack mark) that its
   * policy, as it stands, would not admit as new ones (SECURITY.md C19):
   * their next packet is then judged like a new flow's and refused (a TCP
   * reset, ICMP for the rest), and replies find no flow to return by. A flow
   * to an address a still-allowed name opened is kept, even once the
   * answer's TTL has run out (so a long download survives an unrelated
   * update), as are flows to the sandbox's own gateway (its resolver).
   */
  async #cutFlows(live: Live): Promise<void> {
    const flows = await this.#conntrack.list(live.mark);
    const cut = flows.filter((f) => !this.#flowAllowed(live, f)).map((f) => f.key);
    if (cut.length > 0) await this.#conntrack.delete(cut);
  }

  #flowAllowed(live: Live, f: ConntrackEntry): boolean {
    const n = live.names;
    if (f.destination === n.host4 || f.destination === n.host6) return true;
    const ported = f.protocol === 6 || f.protocol === 17;
    const onPorts = (ports: number[]) =>
      ports.length === 0 || (ported && f.port !== undefined && ports.includes(f.port));
    const verdict = screenAddress(live.policy, f.destination, this.#ranges);
    if (verdict.verdict === 'drop' && verdict.why === 'a denied CIDR') return false;
    const special = classifyAddress(f.destination, this.#ranges);
    if (special?.reserved || special?.protected) return false;
    if (live.policy.allowCidrs.some((r) => cidrContains(r.cidr, f.destination) && onPorts(r.ports)))
      return true;
    // By name: only what a name's answer may open (public addresses), on the name's ports.
    if (verdict.verdict !== 'open') return false;
    return (live.openedBy.get(f.destination) ?? []).some((name) => {
      const d = matchDomain(live.policy, name);
      return d.allowed && onPorts(d.ports);
    });
  }

  async teardown(sb: Pick<NetworkSandbox, 'id' | 'slot'>): Promise<void> {
    const n = this.names(sb);
    // A create that failed before `attach` may still be installing the
    // firewall; one that failed elsewhere during `attach` may still be making the veth.
    await this.#prepared.get(sb.id)?.catch(() => undefined);
    this.#prepared.delete(sb.id);
    await this.#attaching.get(sb.id);
    this.#resolver.detach(sb.id);
    const errors: unknown[] = [];
    // The kernel removes the veth with the namespace; nothing here depends on
    // that, and the slot's next sandbox waits for it. A microVM's tap stays
    // until deleted (its VM has ended by now): deleted meanwhile.
    const tap = isTap(n.veth)
      ? this.#deleteLink(n.veth).then(
          () => undefined,
          (e: unknown) => {
            errors.push(e);
            this.#drain(n.veth, sb.slot);
          },
        )
      : this.#drain(n.veth, sb.slot);
    const live = this.#live.get(sb.id);
    this.#live.delete(sb.id);
    if (live) await live.queue.catch(() => undefined);
    // The last denied connections are turned into events while the source
    // still maps to this sandbox; then their records go too. The sandbox's own
    // elements do not depend on that read: they go in a transaction of their
    // own meanwhile, and the denial records only need a second one when there
    // are any.
    const deniedRead = this.#denied.submit().catch(() => [] as DeniedEntry[]);
    const sources = new Set([n.sandbox4, n.sandbox6]);
    const refs = [
      ...(live
        ? [...live.elements.values()].map((e) => e.ref)
        : baseElements(n, undefined, undefined)),
      ...this.#takeOrphans(n.sandbox4, n.sandbox6),
      // Made by the firewall itself on the sandbox's first DNS query (its rate limit's state).
      { set: 'dnsrate' as const, key: `"${n.veth}"` },
    ];
    const removed = this.#nft
      .submit(script([...deleteLines(this.table, refs), ...this.#dropChains(sb.id)]))
      .catch((e: unknown) => {
        this.#orphans.set(n.sandbox4, refs);
        errors.push(e);
      });
    const denied = (await deniedRead).filter((d) => sources.has(d.source));
    for (const [src, id] of this.#bySource) if (id === sb.id) this.#bySource.delete(src);
    this.#eventBudget.delete(sb.id);
    await removed;
    if (denied.length > 0) {
      // Records of a sandbox that is gone; they would also expire by their timeout.
      await this.#nft
        .submit(script(deleteDeniedLines(this.table, denied)))
        .catch((e: unknown) => errors.push(e));
    }
    // One unlink: synchronous, as a thread-pool round trip costs more on a busy host.
    rmSync(n.resolvConf, { force: true });
    // Its flows are dead now (no interface carries its mark); deleted in a while, with others'.
    this.#scheduleSweep();
    await tap;
    if (errors.length > 0) throw errors[0];
  }

  async drained(): Promise<void> {
    while (this.#draining.size > 0)
      await Promise.all([...this.#draining.values()].map((d) => d.gone));
  }

  async reconcile(all: NetworkSandbox[]): Promise<void> {
    // A VM has a link only if it booted with one (its tap is still there).
    const live = all.filter(
      (sb) => !linkFixedAtBoot(sb.spec) || existsSync(`/sys/class/net/${this.names(sb).veth}`),
    );
    for (const sb of live) {
      try {
        this.#track(sb, compilePolicy(sb.spec, this.#catalogue));
        await this.#listen(sb);
      } catch (err) {
        this.#o.log?.('adopting a sandbox network failed', { id: sb.id, err: String(err) });
      }
    }
    // A gone sandbox's network namespace died with its processes, and the
    // kernel removes its veth; one an earlier edge left draining (it stopped
    // or crashed meanwhile) drains here, so no new sandbox on its slot meets it.
    await this.#drainLeftovers(live);
    // What is left is firewall state and resolv.conf files.
    const keepConf = new Set(live.map((sb) => this.names(sb).resolvConf));
    for (const f of await readdir(join(this.#dir, 'resolv')).catch(() => [] as string[])) {
      const path = join(this.#dir, 'resolv', f);
      if (!keepConf.has(path)) await rm(path, { force: true });
    }
    const [state] = (await this.#nftSession.run([`list table inet ${this.table}`])) as {
      nftables: NftJsonObject[];
    }[];
    if (!state) throw new DsecError('internal', `nft listed nothing for table ${this.table}`);
    await this.#removeLegacyObjects(state.nftables);
    // Elements are owned by the veth or address they start with: the live
    // sandboxes' DNS allows are adopted (so their teardown removes them),
    // their bindings and CIDR policy entries re-made (idempotent), the rest go.
    // A live sandbox keeps its conntrack mark (its flows carry it); one adopted
    // from an edge before marks gets one now, and its flows are marked again
    // by their next packet out.
    const marks = new Map<string, number>();
    for (const obj of state.nftables) {
      if (obj.map?.name !== 'ctmark') continue;
      for (const raw of obj.map.elem ?? []) {
        const e = elementFromJson('ctmark', raw);
        const mark = Number(e?.value);
        if (e && Number.isInteger(mark) && mark > 0) marks.set(e.owner, mark);
      }
    }
    const owners = new Map<string, Live>();
    const bases = new Map<Live, ElementRef[]>();
    const lines: string[] = [];
    for (const l of this.#live.values()) {
      for (const k of [l.names.veth, l.names.sandbox4, l.names.sandbox6]) if (k) owners.set(k, l);
      const kept = marks.get(l.names.veth);
      if (l.mark === 0)
        l.mark =
          kept !== undefined && (kept & 0xff000000) === this.#markTag ? kept : this.#newMark();
      const chain = policyChain(l.policy, this.subnet6 !== undefined);
      lines.push(...this.#useChain(l.sb.id, chain));
      const base = baseElements(l.names, chain, l.mark);
      bases.set(l, base);
      for (const r of base) l.elements.set(refId(r), { ref: r });
    }
    const now = Date.now();
    const stale: ElementRef[] = [];
    const staleDenied: { family: 4 | 6; key: string }[] = [];
    const chainsInTable: string[] = [];
    for (const obj of state.nftables) {
      if (obj.chain?.name?.startsWith('pol_')) chainsInTable.push(obj.chain.name);
      const set = obj.set ?? obj.map;
      if (!set?.name) continue;
      for (const raw of set.elem ?? []) {
        const e = elementFromJson(set.name, raw);
        if (!e) continue;
        if (set.name === 'denied4' || set.name === 'denied6') {
          if (!owners.has(e.owner))
            staleDenied.push({ family: set.name === 'denied4' ? 4 : 6, key: e.key });
          continue;
        }
        if (!(SANDBOX_SET_NAMES as readonly string[]).includes(set.name)) continue;
        const ref: ElementRef = {
          set: set.name as SandboxSetName,
          key: e.key,
          ...(e.value !== undefined ? { value: e.value } : {}),
        };
        const owner = owners.get(e.owner);
        if (owner && ['a4', 'p4', 'a6', 'p6'].includes(ref.set)) {
          owner.elements.set(refId(ref), {
            ref,
            ...(e.expiresSeconds !== undefined ? { expiresAt: now + e.expiresSeconds * 1000 } : {}),
          });
        } else if (!owner || !bases.get(owner)?.some((b) => refId(b) === refId(ref))) {
          stale.push(ref);
        }
      }
    }
    lines.push(
      ...deleteLines(this.table, stale),
      ...deleteDeniedLines(this.table, staleDenied),
      ...addLines(this.table, [...bases.values()].flat()),
      ...chainsInTable
        .filter((c) => !this.#chainUsers.has(c))
        .flatMap((c) => deletePolicyChainLines(this.table, c)),
    );
    await this.#nft
      .submit(script(lines))
      .catch((err: unknown) =>
        this.#o.log?.('removing stale firewall entries failed', { err: String(err) }),
      );
    // Flows of sandboxes that went while no edge ran (or whose teardown an edge
    // crash cut short): inert already, deleted now.
    this.#scheduleSweep(0);
  }

  async collectEvents(): Promise<void> {
    if (this.#live.size === 0 || !this.#o.onEvent) return;
    await this.#denied
      .submit()
      .catch((err: unknown) =>
        this.#o.log?.('reading denied connections failed', { err: String(err) }),
      );
  }

  async close(): Promise<void> {
    // Before the range can be given back: no veth of ours may still route it.
    await this.drained();
    clearInterval(this.#poller);
    clearInterval(this.#rangesTimer);
    // The flows of what was torn down go now rather than with the timer.
    if (this.#sweepTimer) {
      clearTimeout(this.#sweepTimer);
      this.#sweepTimer = undefined;
      await this.#sweep();
    }
    await this.#sweeping;
    this.#conntrack.close();
    await this.#denied.idle();
    await this.#nft.idle();
    this.#resolver.close();
    this.#ip.close();
    this.#nftSession.close();
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
      elements: new Map(),
      queue: Promise.resolve(),
      mark: 0,
      openedBy: new Map(),
    };
    live.sb = sb;
    live.policy = policy;
    this.#live.set(sb.id, live);
    this.#bySource.set(n.sandbox4, sb.id);
    if (n.sandbox6) this.#bySource.set(n.sandbox6, sb.id);
    return live;
  }

  /** A mark for a new sandbox: this edge's tag, none of a live sandbox's. */
  #newMark(): number {
    return newMark(this.#markTag, new Set([...this.#live.values()].map((l) => l.mark)));
  }

  /**
   * Sweeps the conntrack entries of this edge's subnets whose mark is no
   * live sandbox's, `delayMs` from now (teardowns meanwhile share the sweep).
   */
  #scheduleSweep(delayMs = SWEEP_DELAY_MS): void {
    if (this.#sweepTimer) return;
    this.#sweepTimer = setTimeout(() => {
      this.#sweepTimer = undefined;
      void this.#sweep();
    }, delayMs);
    this.#sweepTimer.unref();
  }

  async #sweep(): Promise<void> {
    await this.#sweeping;
    const cidrs = [this.subnet4, ...(this.subnet6 ? [this.subnet6] : [])].map(formatCidr);
    const keep = [...this.#live.values()].map((l) => l.mark).filter((m) => m !== 0);
    const run = this.#conntrack
      .sweep(this.#markTag, cidrs, keep)
      .then(
        (deleted) => {
          if (deleted > 0) this.#o.log?.('swept the flows of stopped sandboxes', { deleted });
        },
        (err: unknown) => {
          this.#o.log?.("sweeping stopped sandboxes' flows failed", { err: String(err) });
          // They stay inert meanwhile (no interface carries their marks); try again later.
          this.#scheduleSweep(SWEEP_DELAY_MS * 6);
        },
      )
      .finally(() => {
        if (this.#sweeping === run) this.#sweeping = undefined;
      });
    this.#sweeping = run;
    await run;
  }

  /**
   * A CIDR rule that overlaps protected ranges is accepted, and those parts
   * stay closed: the sandbox's events say which (one per rule and window).
   */
  #protectedOverlap(live: Live): void {
    for (const rule of live.policy.allowCidrs) {
      const hits = this.#ranges.protected.filter(
        (p) => within(p.cidr, rule.cidr) || within(rule.cidr, p.cidr),
      );
      if (hits.length === 0) continue;
      const listed = hits.slice(0, MAX_EVENT_RECORDS).map((p) => ({
        range: formatCidr(p.cidr),
        what: p.what,
      }));
      const ruleText = formatCidr(rule.cidr);
      this.#event(
        live.sb.id,
        'network_denied',
        `network rule ${ruleText} overlaps protected ranges, which stay closed: ${listed
          .map((p) => p.range)
          .join(', ')}${hits.length > listed.length ? ', …' : ''}`,
        { reason: 'protected', rule: ruleText, protected: listed, protectedCount: hits.length },
        `protected-rule:${ruleText}`,
      );
    }
  }

  #tracked(ref: ElementRef, now: number): { ref: ElementRef; expiresAt?: number } {
    return ref.timeoutSeconds === undefined
      ? { ref }
      : { ref, expiresAt: now + ref.timeoutSeconds * 1000 };
  }

  /** Lines that (re)make a CIDR policy's chain and count `id` among its users. */
  #useChain(id: string, chain: PolicyChain | undefined): string[] {
    if (!chain) return [];
    const users = this.#chainUsers.get(chain.name) ?? new Set<string>();
    users.add(id);
    this.#chainUsers.set(chain.name, users);
    return policyChainLines(this.table, chain);
  }

  /**
   * Stops counting `id` as a user of any chain but `keep`; lines that remove
   * the chains nobody uses any more (after the map entries that jump to them).
   */
  #dropChains(id: string, keep?: string): string[] {
    const out: string[] = [];
    for (const [name, users] of this.#chainUsers) {
      if (name === keep || !users.delete(id) || users.size > 0) continue;
      this.#chainUsers.delete(name);
      out.push(...deletePolicyChainLines(this.table, name));
    }
    return out;
  }

  #takeOrphans(...addresses: (string | undefined)[]): ElementRef[] {
    const out: ElementRef[] = [];
    for (const a of addresses) {
      if (a === undefined) continue;
      out.push(...(this.#orphans.get(a) ?? []));
      this.#orphans.delete(a);
    }
    return out;
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
      screen: (address) => screenAddress(live.policy, address, this.#ranges),
      allowAddresses: (name, ports, records) => this.#allow(live, name, ports, records),
      blocked: (name, qtype) =>
        this.#event(
          sb.id,
          'dns_blocked',
          `DNS name not allowed: ${name}`,
          { name, qtype, reason: 'name' },
          `dns:${name}`,
        ),
      filtered: (name, qtype, dropped) => this.#filtered(sb.id, name, qtype, dropped),
    });
  }

  /** An allowed name's answer lost records to the screen (SECURITY.md L40): one event per name and window. */
  #filtered(id: string, name: string, qtype: number, dropped: DroppedRecord[]): void {
    const listed = dropped.slice(0, MAX_EVENT_RECORDS).map((d) => ({
      name: d.name,
      type: d.type,
      why: d.why,
      ...(d.address !== undefined ? { address: d.address } : {}),
      ...(d.range !== undefined ? { range: d.range } : {}),
    }));
    const what = listed.map((d) => d.address ?? `a type ${d.type} record`).join(', ');
    this.#event(
      id,
      'dns_blocked',
      `DNS answer for ${name}: left out ${what}${dropped.length > listed.length ? ', …' : ''}`,
      { name, qtype, reason: 'address', dropped: listed, droppedCount: dropped.length },
      `dns-answer:${name}`,
    );
  }

  /**
   * Records a network event of a sandbox within its budget
   * ({@link EVENT_BUDGET} per {@link EVENT_WINDOW_MS}); past it, as one
   * folded event per kind, which the event log counts instead of storing.
   */
  #event(
    id: string,
    kind: 'dns_blocked' | 'network_denied',
    message: string,
    details: Record<string, unknown>,
    key: string,
  ): void {
    const sink = this.#o.onEvent;
    if (!sink) return;
    const now = Date.now();
    let budget = this.#eventBudget.get(id);
    if (!budget || budget.until <= now) {
      budget = { until: now + EVENT_WINDOW_MS, left: EVENT_BUDGET };
      this.#eventBudget.set(id, budget);
    }
    if (budget.left > 0) {
      budget.left--;
      sink(id, kind, message, details, key);
      return;
    }
    sink(
      id,
      kind,
      kind === 'dns_blocked'
        ? 'more refused DNS names and filtered answers than are recorded one by one (counted)'
        : 'more denied connections than are recorded one by one (counted)',
      { folded: true },
      `folded:${kind}`,
    );
  }

  /**
   * Reads the host's interface networks again, so the operator's LAN and any
   * public prefix of an uplink are filtered out of DNS answers like private
   * ranges. Off the event loop and independent of the number of sandboxes:
   * the links of `/sys/class/net` but loopback and sandbox links (`dsv*`,
   * veths and taps of any edge) are asked for by name, in one `ip -batch`
   * (`os.networkInterfaces()` and a full `ip addr` listing cost ≈ 200 ms and
   * ≈ 40 ms of the event loop with 1,000 sandbox veths).
   */
  async #refreshNodeNetworks(): Promise<void> {
    if (this.#rangesReading) return;
    this.#rangesReading = true;
    try {
      const links = (await readdir('/sys/class/net')).filter(
        (l) => l !== 'lo' && !l.startsWith('dsv') && /^[A-Za-z0-9_.@-]{1,15}$/.test(l),
      );
      const cidrs = await readInterfaceCidrs(links);
      this.#nodeNetworks = nodeNetworks(cidrs, this.#ranges.reserved);
    } catch (err) {
      // Keep the last good list (links that went away meanwhile are read around, so this is
      // `ip` itself failing; the next read comes in NODE_NETWORKS_REFRESH_MS).
      this.#o.log?.('reading the node networks failed', { err: String(err) });
    }
    try {
      await this.#applyProtected();
    } catch (err) {
      this.#o.log?.('installing the protected ranges failed', { err: String(err) });
    } finally {
      this.#rangesReading = false;
    }
  }

  /**
   * The protected ranges from the configured ones, the node's networks and
   * the NAT64 forms of the IPv4 ones (and of the reserved IPv4 ranges) under
   * each NAT64 prefix; installed in the firewall when they changed, in one
   * transaction (the sets are never empty in between), then used by the DNS
   * screen.
   */
  async #applyProtected(): Promise<void> {
    const base: ProtectedRange[] = [
      ...this.#protectedStatic,
      ...this.#nodeNetworks.map((cidr) => ({ cidr, what: "the node's own network" })),
    ];
    const images: ProtectedRange[] = [];
    const v4 = [
      ...RESERVED4.map((cidr) => ({ cidr, what: 'a reserved range' })),
      ...base.filter((p) => p.cidr.family === 4),
    ];
    for (const prefix of this.#nat64)
      for (const p of v4)
        images.push({
          cidr: nat64Image(prefix, p.cidr),
          what: `the NAT64 form of ${formatCidr(p.cidr)} (${p.what})`,
        });
    const all = [...base, ...images];
    const text = (family: 4 | 6) =>
      [...new Set(all.filter((p) => p.cidr.family === family).map((p) => formatCidr(p.cidr)))]
        .sort()
        .join(', ');
    const key = `${text(4)} / ${text(6)}`;
    if (key !== this.#protectedInstalled) {
      await this.#nft.submit(
        script(
          protectedSetLines(
            this.table,
            all.filter((p) => p.cidr.family === 4).map((p) => p.cidr),
            all.filter((p) => p.cidr.family === 6).map((p) => p.cidr),
          ),
        ),
      );
      this.#protectedInstalled = key;
    }
    this.#ranges = { ...this.#ranges, protected: all };
  }

  async #allow(
    live: Live,
    name: string,
    ports: number[],
    records: DnsAddressRecord[],
  ): Promise<boolean> {
    if (records.length === 0) return true;
    if (!this.#live.has(live.sb.id)) return true;
    const now = Date.now();
    const ttl = Math.max(...records.map((r) => this.#ttl(r.ttlSeconds)));
    const expiresAt = now + ttl * 1000;
    const refs = addressElements(live.names, this.#elements(records, ports, now));
    // Forget timed elements long expired (the kernel removed them), so the
    // record stays bounded by what is allowed now; count those still open.
    let open = 0;
    for (const [id, e] of live.elements) {
      if (e.expiresAt === undefined) continue;
      if (e.expiresAt + EXPIRED_GRACE_MS < now) live.elements.delete(id);
      else if (e.expiresAt > now) open++;
    }
    const added = new Set<string>();
    for (const r of refs) {
      const id = refId(r);
      const e = live.elements.get(id);
      if (!(e?.expiresAt !== undefined && e.expiresAt > now)) added.add(id);
    }
    if (open + added.size > MAX_ALLOW_ELEMENTS) {
      this.#event(
        live.sb.id,
        'dns_blocked',
        `DNS answer for ${name} refused: the sandbox holds ${open} open addresses (at most ${MAX_ALLOW_ELEMENTS})`,
        { name, reason: 'bound', open, max: MAX_ALLOW_ELEMENTS, wanted: added.size },
        'dns-bound',
      );
      return false;
    }
    if (live.resolved.size >= MAX_CACHED_NAMES && !live.resolved.has(name)) {
      const oldest = live.resolved.keys().next().value;
      if (oldest !== undefined) live.resolved.delete(oldest);
    }
    live.resolved.delete(name);
    live.resolved.set(name, { records, expiresAt });
    for (const r of records) {
      const names = live.openedBy.get(r.address) ?? [];
      live.openedBy.delete(r.address);
      live.openedBy.set(r.address, [...names.filter((n) => n !== name), name].slice(-8));
      if (live.openedBy.size > MAX_OPENED_ADDRESSES) {
        const oldest = live.openedBy.keys().next().value;
        if (oldest !== undefined) live.openedBy.delete(oldest);
      }
    }
    for (const r of refs) live.elements.set(refId(r), this.#tracked(r, now));
    await this.#serial(live, () => this.#nft.submit(script(addLines(this.table, refs))));
    return true;
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

  /**
   * Watches a torn-down sandbox's veth until it is gone. The kernel removes
   * the pair with the sandbox's network namespace once its last process has
   * exited (≈ 20 ms after the kill here: the namespace's teardown waits for
   * RCU grace periods, batched across namespaces). An explicit `ip link del`
   * waits for the same (an `rcu_barrier` per request, about 20 ms, one after
   * the other in one process), so the edge only watches, and deletes the veth
   * itself when the namespace outlives `VETH_GONE_WAIT_MS` (something still
   * holds it). Teardown does not wait: the veth's firewall elements are gone
   * and no process is left to send through it; what it still holds is its
   * slot's addresses, so `attach` on that slot waits ({@link #slotDrained}),
   * and `close` waits for all ({@link drained}).
   */
  #drain(name: string, slot: number): void {
    if (this.#draining.has(name) || !existsSync(`/sys/class/net/${name}`)) return;
    let resolve!: () => void;
    const gone = new Promise<void>((r) => (resolve = r));
    // A tap is not the kernel's to remove: deleted at once.
    const wait = isTap(name) ? 0 : VETH_GONE_WAIT_MS;
    this.#draining.set(name, { slot, deadline: Date.now() + wait, gone, resolve });
    this.#watchDraining();
  }

  /**
   * Waits until no veth of an earlier sandbox on `slot` is left. One the
   * watch could not delete is tried once more here; if it still stands, the
   * attach fails rather than give its addresses a second route.
   */
  async #slotDrained(slot: number): Promise<void> {
    const waiting: [string, Draining][] = [];
    for (const entry of this.#draining) if (entry[1].slot === slot) waiting.push(entry);
    if (waiting.length === 0) return;
    await Promise.all(waiting.map(([, d]) => d.gone));
    for (const [name] of waiting) await this.#deleteLink(name);
  }

  /** One timer checks every draining veth (a burst of removals is one check per tick). */
  #watchDraining(): void {
    if (this.#drainTimer || this.#draining.size === 0) return;
    this.#drainTimer = setTimeout(
      () => {
        this.#drainTimer = undefined;
        // Many at once: one listing instead of a lookup each.
        const present =
          this.#draining.size > 16 ? new Set(readdirSync('/sys/class/net')) : undefined;
        const now = Date.now();
        for (const [name, d] of this.#draining) {
          if (present ? present.has(name) : existsSync(`/sys/class/net/${name}`)) {
            if (now < d.deadline) continue;
            // Still in the map while it is deleted: its slot stays taken.
            d.deadline = Infinity;
            this.#deleteLink(name)
              .catch((err: unknown) =>
                this.#o.log?.('deleting a stopped sandbox veth failed', {
                  veth: name,
                  err: String(err),
                }),
              )
              .finally(() => {
                this.#draining.delete(name);
                d.resolve();
              });
            continue;
          }
          this.#draining.delete(name);
          d.resolve();
        }
        this.#watchDraining();
      },
      this.#draining.size > 16 ? 10 : 2,
    );
  }

  /**
   * Veths (and microVM taps) on this host with a host-end address in this edge's range that no
   * live sandbox owns: left by an earlier edge of this state directory
   * (a sandbox stopped while its veth drained, then that edge exited or
   * crashed). Drained like a teardown's, under the slot their address names.
   */
  async #drainLeftovers(live: NetworkSandbox[]): Promise<void> {
    const ours = new Set(live.map((sb) => this.names(sb).veth));
    const links = JSON.parse(
      await runTool('ip', ['-j', '-4', 'addr', 'show']).catch(() => '[]'),
    ) as { ifname?: string; addr_info?: { local?: string; prefixlen?: number }[] }[];
    const base = ipToBigInt(this.subnet4.address);
    for (const link of links) {
      if (!link.ifname?.startsWith('dsv') || ours.has(link.ifname)) continue;
      for (const a of link.addr_info ?? []) {
        if (a.local === undefined || a.prefixlen !== 30 || !cidrContains(this.subnet4, a.local))
          continue;
        // Host end `.1` of the slot's /30 (see names()).
        this.#drain(link.ifname, Number((ipToBigInt(a.local) - base - 1n) / 4n) - 1);
      }
    }
  }

  /**
   * Deletes a host link if it is there; true if it was. The kernel tears a
   * dead namespace's veth pair down asynchronously, so one seen a moment ago
   * may be gone by the time `ip` runs: that is success too. A process of its
   * own, not the shared `ip` session: the session would keep the deleted
   * name's index in its cache.
   */
  async #deleteLink(name: string): Promise<boolean> {
    if (!existsSync(`/sys/class/net/${name}`)) return false;
    await runTool('ip', ['link', 'del', name]).catch((err: unknown) => {
      if (existsSync(`/sys/class/net/${name}`)) throw err;
    });
    return true;
  }

  /** Removes the chains, sets, counters and map of the per-sandbox layout of earlier edges. */
  async #removeLegacyObjects(objects: NftJsonObject[]): Promise<void> {
    const legacy = {
      chains: [] as string[],
      sets: [] as string[],
      counters: [] as string[],
      maps: [] as string[],
    };
    const perSlot = /^(sb_\d+(_deny)?|(a4|p4|c4|cp4|x4|a6|p6|c6|cp6|x6|denied)_\d+)$/;
    for (const obj of objects) {
      if (obj.chain?.name && perSlot.test(obj.chain.name)) legacy.chains.push(obj.chain.name);
      if (obj.set?.name && perSlot.test(obj.set.name)) legacy.sets.push(obj.set.name);
      if (obj.counter?.name && perSlot.test(obj.counter.name))
        legacy.counters.push(obj.counter.name);
      if (obj.map?.name === 'egress') legacy.maps.push('egress');
    }
    if (Object.values(legacy).every((l) => l.length === 0)) return;
    await nft(legacyObjectsScript(this.table, legacy)).catch((err: unknown) =>
      this.#o.log?.('removing the old per-sandbox firewall layout failed', { err: String(err) }),
    );
  }

  async #readDenied(): Promise<DeniedEntry[]> {
    const entries: DeniedEntry[] = [];
    const sink = this.#o.onEvent;
    const now = Date.now();
    for (const [k, t] of this.#deniedSeen) if (t < now) this.#deniedSeen.delete(k);
    // Both sets at once: one command per request (nft 1.0.6 cannot list two in one).
    const lists = await Promise.all(
      ([4, 6] as const).map((family) =>
        this.#nftSession.run([`list set inet ${this.table} denied${family}`]),
      ),
    );
    for (const family of [4, 6] as const) {
      const parsed = (lists[family === 4 ? 0 : 1] ?? []) as { nftables?: NftJsonObject[] }[];
      for (const obj of parsed.flatMap((p) => p.nftables ?? [])) {
        for (const e of obj.set?.elem ?? []) {
          const concat = elementConcat(e);
          if (!concat || concat.length !== 4) continue;
          const [src, dst, proto, port] = concat.map(String) as [string, string, string, string];
          const protocol = protoName(proto);
          const entry: DeniedEntry = {
            family,
            source: src,
            destination: dst,
            protocol,
            port: Number(port),
            key: `${src} . ${dst} . ${proto} . ${port}`,
          };
          entries.push(entry);
          const seenKey = concat.join(' ');
          if (!sink || this.#deniedSeen.has(seenKey)) continue;
          this.#deniedSeen.set(seenKey, now + DENIED_WINDOW_SECONDS * 1000);
          const id = this.#bySource.get(src);
          if (!id) continue;
          const ported = protocol === 'tcp' || protocol === 'udp';
          const special = classifyAddress(dst, this.#ranges);
          const guarded = special?.protected ? { reason: 'protected', range: special.range } : {};
          this.#event(
            id,
            'network_denied',
            `connection denied: ${protocol} to ${dst}${ported ? ` port ${entry.port}` : ''}${
              special?.protected ? ` (${special.what})` : ''
            }`,
            { destination: dst, protocol, ...(ported ? { port: entry.port } : {}), ...guarded },
            `net:${dst}:${protocol}:${entry.port}`,
          );
        }
      }
    }
    return entries;
  }
}

/**
 * The addresses (with prefix length) of these host links, by one `ip -batch`.
 * A link that went away since it was listed fails the whole batch (`ip`
 * stops at the first error): read again without the links now gone, so the
 * churn of the node's other links (containers of other software) cannot
 * keep the node's networks unread. A link still there that fails is an error.
 */
export async function readInterfaceCidrs(links: string[]): Promise<string[]> {
  let left = links;
  for (let attempt = 0; left.length > 0; attempt++) {
    try {
      const text = await runTool('ip', ['-o', '-batch', '-'], {
        stdin: left.map((l) => `addr show dev ${l}\n`).join(''),
      });
      return hostInterfaceCidrs(text);
    } catch (err) {
      const still = left.filter((l) => existsSync(`/sys/class/net/${l}`));
      if (still.length === left.length || attempt >= 8) throw err;
      left = still;
    }
  }
  return [];
}

/**
 * The addresses (with prefix length) of the host's interfaces from `ip -o
 * addr show` lines (`4: eth0    inet 192.0.2.2/24 brd … scope global eth0\ …`),
 * less loopback and sandbox links (`dsv*`, veths and microVM taps of any edge).
 */
export function hostInterfaceCidrs(text: string): string[] {
  const out: string[] = [];
  for (const line of text.split('\n')) {
    const [, ifname = '', family, cidr] = line.split(/\s+/, 4);
    const name = ifname.split('@')[0]!;
    if (name === 'lo' || name.startsWith('dsv') || !cidr) continue;
    if (family === 'inet' || family === 'inet6') out.push(cidr);
  }
  return out;
}

/** The host end's address and state lines (`ip -batch`), for a veth or a tap named `n.veth`. */
function hostEndLines(n: ReturnType<LinuxNetwork['names']>): string[] {
  // A batch line takes no `-6`: the family follows from the address.
  return [
    ...(n.host6 !== undefined && n.sandbox6 !== undefined
      ? [`addr add ${n.host6}/64 dev ${n.veth} nodad`]
      : []),
    `addr add ${n.host4}/30 dev ${n.veth}`,
    `link set ${n.veth} up`,
  ];
}

function hostEndSysctls(n: ReturnType<LinuxNetwork['names']>): void {
  const conf = (family: string, key: string, value: string) =>
    writeFileSync(`/proc/sys/net/${family}/conf/${n.veth}/${key}`, value);
  conf('ipv4', 'forwarding', '1');
  // Strict reverse-path check: a sandbox cannot send with another's source address.
  conf('ipv4', 'rp_filter', '1');
  if (n.host6 !== undefined && n.sandbox6 !== undefined) {
    conf('ipv6', 'accept_ra', '0');
    conf('ipv6', 'force_forwarding', '1');
  }
}

function farEndAddresses(n: ReturnType<LinuxNetwork['names']>): FarEndConfig['addresses'] {
  const addresses = [{ address: n.sandbox4, prefixLength: 30, gateway: n.host4 }];
  if (n.sandbox6 !== undefined && n.host6 !== undefined)
    addresses.push({ address: n.sandbox6, prefixLength: 64, gateway: n.host6 });
  return addresses;
}

/** A VM's: its network device (if any, {@link hasNetworkLink}) was fixed when it booted. */
function linkFixedAtBoot(spec: NetworkSandbox['spec']): boolean {
  return spec.backend !== undefined && spec.backend !== 'container';
}

/** A tun/tap device (a microVM's link), which the kernel does not remove by itself. */
function isTap(name: string): boolean {
  return existsSync(`/sys/class/net/${name}/tun_flags`);
}

function script(lines: string[]): string {
  return lines.length === 0 ? '' : lines.join('\n') + '\n';
}

/** The parts of `nft -j list` output this module reads. */
interface NftJsonObject {
  set?: { name?: string; elem?: unknown[] };
  map?: { name?: string; elem?: unknown[] };
  chain?: { name?: string };
  counter?: { name?: string };
}

/** The fields of a (possibly timed) set element in nft's JSON. */
function elementConcat(e: unknown): unknown[] | undefined {
  if (e === null || e === undefined) return undefined;
  // A plain string or number is a one-field element (a string's own `concat` is a method).
  if (typeof e !== 'object') return [e];
  const inner = (e as { elem?: { val?: unknown } }).elem?.val ?? e;
  if (typeof inner !== 'object' || inner === null) return [inner];
  const concat = (inner as { concat?: unknown }).concat;
  return Array.isArray(concat) ? concat : [inner];
}

/**
 * A set element of `set` from nft's JSON as nft text (`"dsv…" . 10.213.0.6`,
 * `10.213.0.6 . 198.18.0.0/16 . 80`), with its first field (the owning
 * veth or address) and, for a timed one, the seconds until it expires.
 */
export function elementFromJson(
  set: string,
  e: unknown,
): { key: string; owner: string; value?: string; expiresSeconds?: number } | undefined {
  // A map element is `[key, value]`; a verdict value is `{ jump: { target } }`.
  if (Array.isArray(e)) {
    const k = elementFromJson(set, e[0]);
    // A mark (`ctmark`): a number.
    if (typeof e[1] === 'number') return k && { ...k, value: String(e[1]) };
    const v = e[1] as { jump?: { target?: string }; goto?: { target?: string } } | undefined;
    const verdict = v?.jump ? 'jump' : v?.goto ? 'goto' : undefined;
    const target = v?.jump?.target ?? v?.goto?.target;
    return k && verdict && target ? { ...k, value: `${verdict} ${target}` } : undefined;
  }
  const fields = elementConcat(e);
  if (!fields || fields.length === 0) return undefined;
  // Interface names are strings in nft's syntax; addresses, ports and protocols are not.
  const quoteFirst =
    set === 'ifaces' ||
    set === 'ctmark' ||
    set === 'ctcur' ||
    set === 'src4' ||
    set === 'src6' ||
    set === 'cidr_policy' ||
    set === 'dns4' ||
    set === 'dnsrate';
  const text = (v: unknown, quoted = false): string | undefined => {
    if (typeof v === 'number') return String(v);
    if (typeof v === 'string') return quoted ? JSON.stringify(v) : v;
    const p = (v as { prefix?: { addr?: string; len?: number } }).prefix;
    if (p?.addr !== undefined && p.len !== undefined) return `${p.addr}/${p.len}`;
    const r = (v as { range?: unknown[] }).range;
    if (r?.length === 2) {
      const [a, b] = r.map((x) => text(x));
      return a !== undefined && b !== undefined ? `${a}-${b}` : undefined;
    }
    return undefined;
  };
  const parts = fields.map((f, i) => text(f, quoteFirst && i === 0));
  if (parts.some((p) => p === undefined)) return undefined;
  const owner = fields[0];
  if (typeof owner !== 'string') return undefined;
  const expires = (e as { elem?: { expires?: number } }).elem?.expires;
  return {
    key: parts.join(' . '),
    owner,
    ...(expires !== undefined ? { expiresSeconds: expires } : {}),
  };
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

/**
 * `publicRanges` must be CIDRs outside the reserved ranges (a sandbox never
 * reaches those, so declaring them public would only mislead).
 */
function checkPublicRanges(ranges: string[]): void {
  for (const [i, r] of ranges.entries()) {
    const field = `publicRanges.${i}`;
    const hit = reservedOverlap(parseCidr(r, field));
    if (hit)
      throw new DsecError('invalid_argument', `${field}: ${r} overlaps ${hit.cidr} (${hit.what})`, {
        field,
      });
  }
}

/** Whether `outer` contains all of `inner`. */
function within(outer: Cidr, inner: Cidr): boolean {
  return (
    outer.family === inner.family &&
    outer.prefix <= inner.prefix &&
    cidrContains(outer, inner.address)
  );
}

const RESERVED4 = reservedCidrs(4).map((c) => parseCidr(c, 'reserved'));

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
    // The long-lived nft session needs its output line-buffered (NftSession).
    await runTool('stdbuf', ['--version'], { timeoutMs: 5000 });
    return true;
  } catch {
    return false;
  }
}
