import { createHash } from 'node:crypto';
import type { Cidr, CompiledPolicy } from './policy.js';
import { formatCidr } from './policy.js';
import { reservedCidrs } from './special-ranges.js';

/**
 * nftables text for the edge's one table (`inet <table>`). Its chains and
 * sets are fixed: a sandbox is a handful of *elements* keyed by its veth and
 * its address, never a chain or a set of its own. So adding or removing a
 * sandbox is an element change whose cost does not grow with the number of
 * live sandboxes (no per-sandbox objects for nft to list and the kernel to
 * validate on every transaction), and many sandboxes' changes fit in one
 * transaction (docs/adr/0005-sandbox-network.md, "Bursts").
 *
 * - `forward_hook`: a packet from a sandbox veth (`ifaces`) goes to
 *   `from_sandbox`; packets *to* sandboxes pass only as replies (no inbound
 *   connections, no sandbox-to-sandbox traffic).
 * - `from_sandbox`: the (interface, source address) pair must be the
 *   sandbox's own (`src4/src6`), else the packet is dropped: a sandbox can
 *   neither spoof another's address nor use one of a torn-down sandbox.
 * - `egress4/egress6`: replies pass; platform-reserved destinations (the
 *   sandbox subnet and the reserved ranges of `special-ranges.ts`: loopback,
 *   link-local/metadata, multicast, IPv4-mapped…) are rejected;
 *   a sandbox with CIDR rules jumps (map `cidr_policy`, by veth) to the chain of
 *   its CIDR policy, `pol_<hash>`, which rejects its deny CIDRs and accepts
 *   its allowed CIDRs (any port / some ports). One such chain serves every
 *   sandbox with the same CIDR rules: interval sets keyed per sandbox would
 *   make each removal cost time in proportion to all sandboxes' entries
 *   (nft's concatenated-interval sets delete in O(n)). Then the addresses
 *   of allowed DNS answers, keyed by `source . destination`: `a4/a6` (with
 *   their TTL) and `p4/p6` (the same bound to ports), which only ever hold
 *   public addresses (the resolver screens answers, SECURITY.md L40). Everything else goes
 *   to `deny`: recorded (`denied4/6` dynamic sets, read by the edge for
 *   audit events) and rejected, TCP reset or ICMP admin-prohibited, so a
 *   denied connect fails at once instead of timing out.
 * - `input_hook`: from this edge's sandbox veths (`ifaces`; each edge on a
 *   host filters its own) and sandbox subnets only DNS to that sandbox's
 *   own resolver (UDP 53 to the veth's host-end address, `dns4`: no other
 *   address of the host, no other port, not TCP, not IPv6), at most
 *   `dnsQueriesPerSecond` per veth (`dnsrate`), and IPv6 neighbour
 *   discovery reach the host.
 * - `postrouting_hook`: sandbox addresses are masqueraded on the way out.
 */

/**
 * The sets (and the map) that hold per-sandbox elements; every element's key
 * starts with the sandbox's veth or address. All are hashes: adding and
 * removing an element costs the same however many there are.
 */
export const SANDBOX_SET_NAMES = [
  'ifaces',
  'ctmark',
  'ctcur',
  'src4',
  'src6',
  'a4',
  'p4',
  'a6',
  'p6',
  'cidr_policy',
  'dns4',
  'dnsrate',
] as const;
export type SandboxSetName = (typeof SANDBOX_SET_NAMES)[number];

const SET_TYPES: Record<SandboxSetName, string> = {
  ifaces: 'type ifname;',
  // The sandbox's conntrack mark (written on every flow it is allowed), and the pair checked
  // on every later packet: a flow of another sandbox on the same addresses has another mark.
  ctmark: 'type ifname : mark;',
  ctcur: 'type ifname . mark;',
  src4: 'type ifname . ipv4_addr;',
  src6: 'type ifname . ipv6_addr;',
  a4: 'type ipv4_addr . ipv4_addr; flags timeout;',
  p4: 'type ipv4_addr . ipv4_addr . inet_service; flags timeout;',
  a6: 'type ipv6_addr . ipv6_addr; flags timeout;',
  p6: 'type ipv6_addr . ipv6_addr . inet_service; flags timeout;',
  cidr_policy: 'type ifname : verdict;',
  dns4: 'type ifname . ipv4_addr;',
  // Per veth, the state of its DNS rate limit: made by the input hook's rule, removed at teardown.
  dnsrate: 'type ifname; flags dynamic,timeout; timeout 60s; size 65535;',
};

/** The per-sandbox sets that are maps (element `key : value`). */
const MAPS = new Set<SandboxSetName>(['cidr_policy', 'ctmark']);

const RESERVED4 = reservedCidrs(4);
const RESERVED6 = reservedCidrs(6);

export interface TableInput {
  table: string;
  subnet4: Cidr;
  subnet6?: Cidr | undefined;
  /** How long a denied destination stays in the audit set (one event per window). */
  deniedWindowSeconds: number;
  /**
   * DNS queries per second one sandbox's veth may send its resolver (the
   * burst is twice that); past it they are dropped, so a sandbox's flood
   * costs the edge's event loop a bounded amount. Default 200.
   */
  dnsQueriesPerSecond?: number | undefined;
}

/**
 * The table skeleton. Re-applying it (edge restart) resets the chains and
 * keeps the sets' elements, so running sandboxes keep their rules.
 */
export function tableScript(t: TableInput): string {
  const s4 = formatCidr(t.subnet4);
  const dnsRate = t.dnsQueriesPerSecond ?? 200;
  const s6 = t.subnet6 && formatCidr(t.subnet6);
  const T = `inet ${t.table}`;
  const reserved4 = [s4, ...RESERVED4].join(', ');
  const reserved6 = [...(s6 ? [s6] : []), ...RESERVED6].join(', ');
  const chains = [
    'from_sandbox',
    'egress4',
    'egress6',
    'allow',
    'deny',
    'from_sandbox_to_host',
    'forward_hook',
    'input_hook',
    'postrouting_hook',
  ];
  return [
    `add table ${T}`,
    ...SANDBOX_SET_NAMES.map(
      (name) => `add ${MAPS.has(name) ? 'map' : 'set'} ${T} ${name} { ${SET_TYPES[name]} }`,
    ),
    // Destinations no sandbox rule opens (`NetworkOptions.protectedRanges`, the node's own
    // networks, metadata addresses): filled and kept current by the edge.
    `add set ${T} protected4 { type ipv4_addr; flags interval; auto-merge; }`,
    `add set ${T} protected6 { type ipv6_addr; flags interval; auto-merge; }`,
    `add set ${T} denied4 { type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags dynamic,timeout; timeout ${t.deniedWindowSeconds}s; size 8192; }`,
    `add set ${T} denied6 { type ipv6_addr . ipv6_addr . inet_proto . inet_service; flags dynamic,timeout; timeout ${t.deniedWindowSeconds}s; size 8192; }`,
    `add chain ${T} forward_hook { type filter hook forward priority filter - 5; policy accept; }`,
    `add chain ${T} input_hook { type filter hook input priority filter - 5; policy accept; }`,
    `add chain ${T} postrouting_hook { type nat hook postrouting priority srcnat; policy accept; }`,
    ...chains.filter((c) => !c.endsWith('_hook')).map((c) => `add chain ${T} ${c}`),
    ...chains.map((c) => `flush chain ${T} ${c}`),
    `add rule ${T} forward_hook iifname @ifaces jump from_sandbox`,
    // A sandbox address from an interface that is not (or no longer) a sandbox's goes nowhere.
    `add rule ${T} forward_hook ip saddr ${s4} reject with icmpx admin-prohibited`,
    // Replies, of flows the sandbox on that interface opened (its mark: not a predecessor's).
    `add rule ${T} forward_hook ip daddr ${s4} ct state established,related oifname . ct mark @ctcur accept`,
    `add rule ${T} forward_hook ip daddr ${s4} drop`,
    ...(s6
      ? [
          `add rule ${T} forward_hook ip6 saddr ${s6} reject with icmpx admin-prohibited`,
          `add rule ${T} forward_hook ip6 daddr ${s6} ct state established,related oifname . ct mark @ctcur accept`,
          `add rule ${T} forward_hook ip6 daddr ${s6} drop`,
        ]
      : []),
    `add rule ${T} from_sandbox iifname . ip saddr @src4 goto egress4`,
    `add rule ${T} from_sandbox iifname . ip6 saddr @src6 goto egress6`,
    `add rule ${T} from_sandbox drop`,
    // A flow this sandbox was allowed; one with another mark (a predecessor's on the same
    // addresses, an older edge's) is judged like a new one, and marked if allowed.
    `add rule ${T} egress4 ct state established,related iifname . ct mark @ctcur accept`,
    // Conntrack could not place it: it would leave without its masquerade.
    `add rule ${T} egress4 ct state invalid drop`,
    `add rule ${T} egress4 ip daddr { ${reserved4} } goto deny`,
    // The operator's protected ranges: before any CIDR rule.
    `add rule ${T} egress4 ip daddr @protected4 goto deny`,
    // CIDR rules (deny first, then allows); the chain returns when none decides.
    `add rule ${T} egress4 iifname vmap @cidr_policy`,
    `add rule ${T} egress4 ip saddr . ip daddr @a4 goto allow`,
    `add rule ${T} egress4 meta l4proto { tcp, udp } ip saddr . ip daddr . th dport @p4 goto allow`,
    `add rule ${T} egress4 goto deny`,
    `add rule ${T} egress6 ct state established,related iifname . ct mark @ctcur accept`,
    `add rule ${T} egress6 ct state invalid drop`,
    `add rule ${T} egress6 ip6 daddr { ${reserved6} } goto deny`,
    `add rule ${T} egress6 ip6 daddr @protected6 goto deny`,
    `add rule ${T} egress6 iifname vmap @cidr_policy`,
    `add rule ${T} egress6 ip6 saddr . ip6 daddr @a6 goto allow`,
    `add rule ${T} egress6 meta l4proto { tcp, udp } ip6 saddr . ip6 daddr . th dport @p6 goto allow`,
    `add rule ${T} egress6 goto deny`,
    // Every allowed packet writes the sandbox's mark on its flow (a new one, or one taken over).
    `add rule ${T} allow ct mark set iifname map @ctmark accept`,
    `add rule ${T} deny meta l4proto { tcp, udp } add @denied4 { ip saddr . ip daddr . meta l4proto . th dport }`,
    `add rule ${T} deny meta l4proto != { tcp, udp } add @denied4 { ip saddr . ip daddr . meta l4proto . 0 }`,
    `add rule ${T} deny meta l4proto { tcp, udp } add @denied6 { ip6 saddr . ip6 daddr . meta l4proto . th dport }`,
    `add rule ${T} deny meta l4proto != { tcp, udp } add @denied6 { ip6 saddr . ip6 daddr . meta l4proto . 0 }`,
    `add rule ${T} deny counter`,
    `add rule ${T} deny meta l4proto tcp reject with tcp reset`,
    `add rule ${T} deny reject with icmpx admin-prohibited`,
    // This edge's own veths and taps only: every edge on a host has this hook, and
    // another edge's sandboxes are not in this table's dns4 (their edge admits their DNS).
    `add rule ${T} input_hook iifname @ifaces jump from_sandbox_to_host`,
    `add rule ${T} input_hook ip saddr ${s4} jump from_sandbox_to_host`,
    ...(s6 ? [`add rule ${T} input_hook ip6 saddr ${s6} jump from_sandbox_to_host`] : []),
    // DNS at a bounded rate, before conntrack's verdict (a client's queries from one
    // socket are one "established" flow after the first answer).
    `add rule ${T} from_sandbox_to_host udp dport 53 iifname . ip daddr @dns4 update @dnsrate { iifname limit rate over ${dnsRate}/second burst ${2 * dnsRate} packets } drop`,
    `add rule ${T} from_sandbox_to_host ct state established,related accept`,
    // Only its own resolver: the veth's host-end address, not any local one.
    `add rule ${T} from_sandbox_to_host udp dport 53 iifname . ip daddr @dns4 accept`,
    `add rule ${T} from_sandbox_to_host icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit } accept`,
    `add rule ${T} from_sandbox_to_host meta l4proto tcp reject with tcp reset`,
    `add rule ${T} from_sandbox_to_host reject with icmpx admin-prohibited`,
    `add rule ${T} postrouting_hook ip saddr ${s4} ip daddr != ${s4} masquerade`,
    ...(s6 ? [`add rule ${T} postrouting_hook ip6 saddr ${s6} ip6 daddr != ${s6} masquerade`] : []),
    '',
  ].join('\n');
}

/**
 * One element of a sandbox in one of the shared sets. `key` is nft's text
 * for it (`10.213.0.6 . 198.18.0.0/16 . 80`); it starts with the sandbox's
 * veth name or address, so elements of different sandboxes never collide.
 */
export interface ElementRef {
  set: SandboxSetName;
  key: string;
  /** A map element's value (`jump pol_…`). */
  value?: string | undefined;
  /** Timed elements (DNS answers): how long this addition allows. */
  timeoutSeconds?: number | undefined;
}

/** A sandbox's identity in the firewall: its veth and its addresses. */
export interface SandboxAddresses {
  veth: string;
  /** The veth's host end: the sandbox's gateway and resolver. */
  host4: string;
  sandbox4: string;
  sandbox6?: string | undefined;
}

/**
 * The elements a sandbox has from the moment it is set up: its interface
 * binding, its conntrack mark (`mark`, see conntrack.ts; undefined: leave
 * the mark's elements out, for a teardown that does not know it), its resolver's
 * address and, with CIDR rules, its entry in the `cidr_policy` map (whose
 * chain, {@link policyChain}, must exist first).
 */
export function baseElements(
  s: SandboxAddresses,
  chain: PolicyChain | undefined,
  mark: number | undefined,
): ElementRef[] {
  const out: ElementRef[] = [{ set: 'ifaces', key: `"${s.veth}"` }];
  if (mark !== undefined)
    out.push(
      { set: 'ctmark', key: `"${s.veth}"`, value: String(mark) },
      { set: 'ctcur', key: `"${s.veth}" . ${mark}` },
    );
  out.push({ set: 'src4', key: `"${s.veth}" . ${s.sandbox4}` });
  if (s.sandbox6) out.push({ set: 'src6', key: `"${s.veth}" . ${s.sandbox6}` });
  out.push({ set: 'dns4', key: `"${s.veth}" . ${s.host4}` });
  if (chain) out.push({ set: 'cidr_policy', key: `"${s.veth}"`, value: `jump ${chain.name}` });
  return out;
}

/** The chain that applies a set of CIDR rules; shared by every sandbox with the same rules. */
export interface PolicyChain {
  /** `pol_<hash of the rules>`: the same rules always make the same chain. */
  name: string;
  /** Its rules, without the `add rule <table> <chain>` prefix. */
  rules: string[];
}

/** The CIDR parts of a policy as a chain (undefined when it has none); DNS parts are per answer. */
export function policyChain(policy: CompiledPolicy, hasV6: boolean): PolicyChain | undefined {
  const rules: string[] = [];
  for (const fam of hasV6 ? ([4, 6] as const) : ([4] as const)) {
    const ip = fam === 4 ? 'ip' : 'ip6';
    const deny = policy.denyCidrs.filter((c) => c.family === fam).map(formatCidr);
    const allow = policy.allowCidrs.filter((c) => c.cidr.family === fam);
    const anyPort = allow.filter((c) => c.ports.length === 0).map((c) => formatCidr(c.cidr));
    const ported = allow.flatMap((c) => c.ports.map((p) => `${formatCidr(c.cidr)} . ${p}`));
    const set = (elems: string[]) => `{ ${[...new Set(elems)].sort().join(', ')} }`;
    if (deny.length > 0) rules.push(`${ip} daddr ${set(deny)} goto deny`);
    if (anyPort.length > 0) rules.push(`${ip} daddr ${set(anyPort)} goto allow`);
    if (ported.length > 0)
      rules.push(`meta l4proto { tcp, udp } ${ip} daddr . th dport ${set(ported)} goto allow`);
  }
  if (rules.length === 0) return undefined;
  const hash = createHash('sha256').update(rules.join('\n')).digest('hex').slice(0, 16);
  return { name: `pol_${hash}`, rules };
}

/** Creates (or resets to the same rules) a policy chain: content-addressed, so always idempotent. */
export function policyChainLines(table: string, chain: PolicyChain): string[] {
  const T = `inet ${table}`;
  return [
    `add chain ${T} ${chain.name}`,
    `flush chain ${T} ${chain.name}`,
    ...chain.rules.map((r) => `add rule ${T} ${chain.name} ${r}`),
  ];
}

/** Removes a policy chain no sandbox uses any more (its map entries must be gone first). */
export function deletePolicyChainLines(table: string, name: string): string[] {
  const T = `inet ${table}`;
  return [`add chain ${T} ${name}`, `flush chain ${T} ${name}`, `delete chain ${T} ${name}`];
}

/** A DNS answer's addresses as timed elements of the sandbox's allow sets. */
export function addressElements(
  s: SandboxAddresses,
  entries: { family: 4 | 6; address: string; ports: number[]; timeoutSeconds: number }[],
): ElementRef[] {
  const out: ElementRef[] = [];
  for (const e of entries) {
    const source = e.family === 4 ? s.sandbox4 : s.sandbox6;
    if (!source) continue;
    const set: SandboxSetName = `${e.ports.length === 0 ? 'a' : 'p'}${e.family}`;
    const keys = e.ports.length === 0 ? [e.address] : e.ports.map((p) => `${e.address} . ${p}`);
    for (const k of keys)
      out.push({ set, key: `${source} . ${k}`, timeoutSeconds: e.timeoutSeconds });
  }
  return out;
}

/** Identity of an element (its set, key and map value; not its timeout). */
export function refId(ref: ElementRef): string {
  return `${ref.set} ${elementText(ref)}`;
}

/**
 * nft lines adding elements. A timed element that exists already is removed
 * and added again so its timeout restarts (`add` alone keeps the old one).
 */
export function addLines(table: string, refs: Iterable<ElementRef>): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  for (const r of refs) {
    if (r.timeoutSeconds === undefined) {
      out.push(`add element ${T} ${r.set} { ${elementText(r)} }`);
    } else {
      out.push(
        `add element ${T} ${r.set} { ${r.key} }`,
        `delete element ${T} ${r.set} { ${r.key} }`,
        `add element ${T} ${r.set} { ${r.key} timeout ${r.timeoutSeconds}s }`,
      );
    }
  }
  return out;
}

/**
 * nft lines removing elements whether or not they are still there (a timed
 * one may have expired): each is added, then deleted, in one transaction.
 */
export function deleteLines(table: string, refs: Iterable<ElementRef>): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  for (const r of refs) {
    // A map entry's target chain must exist for the entry to be added.
    const target = r.value && /^(?:jump|goto) (\S+)$/.exec(r.value)?.[1];
    if (target) out.push(`add chain ${T} ${target}`);
    out.push(
      `add element ${T} ${r.set} { ${elementText(r)} }`,
      `delete element ${T} ${r.set} { ${r.key} }`,
    );
  }
  return out;
}

function elementText(r: ElementRef): string {
  return r.value === undefined ? r.key : `${r.key} : ${r.value}`;
}

/** A denied-connection record (`denied4/6`) removed once its sandbox is gone. */
export function deleteDeniedLines(
  table: string,
  entries: Iterable<{ family: 4 | 6; key: string }>,
): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  for (const e of entries) {
    const set = `denied${e.family}`;
    out.push(`add element ${T} ${set} { ${e.key} }`, `delete element ${T} ${set} { ${e.key} }`);
  }
  return out;
}

/**
 * Objects of the per-sandbox layout of earlier edges (a chain, ten sets and
 * a counter per slot, a verdict map from veth to chain): removed when an
 * edge finds them in its table, after the new skeleton no longer uses them.
 */
export function legacyObjectsScript(
  table: string,
  objects: { chains: string[]; sets: string[]; counters: string[]; maps: string[] },
): string {
  const T = `inet ${table}`;
  return [
    ...objects.maps.map((m) => `delete map ${T} ${m}`),
    ...objects.chains.map((c) => `flush chain ${T} ${c}`),
    ...objects.chains.map((c) => `delete chain ${T} ${c}`),
    ...objects.sets.map((s) => `delete set ${T} ${s}`),
    ...objects.counters.map((c) => `delete counter ${T} ${c}`),
    '',
  ].join('\n');
}

/**
 * Replaces the protected ranges (`protected4/6`) in one transaction: the
 * flush and the new elements commit together, so no packet sees the sets
 * empty (overlapping ranges merge: the sets have `auto-merge`).
 */
export function protectedSetLines(table: string, v4: Cidr[], v6: Cidr[]): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  for (const [name, cidrs] of [
    ['protected4', v4],
    ['protected6', v6],
  ] as const) {
    out.push(`flush set ${T} ${name}`);
    const elems = [...new Set(cidrs.map(formatCidr))];
    if (elems.length > 0) out.push(`add element ${T} ${name} { ${elems.join(', ')} }`);
  }
  return out;
}
