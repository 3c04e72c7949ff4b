import type { Cidr, CompiledPolicy } from './policy.js';
import { formatCidr } from './policy.js';

/**
 * nftables text for the edge's one table (`inet <table>`). Layout:
 *
 * - `forward_hook` sends a packet from a sandbox's veth through that sandbox's
 *   chain `sb_<slot>` (verdict map `egress` keyed by interface name); packets
 *   *to* sandboxes pass only as replies (no inbound connections, no
 *   sandbox-to-sandbox traffic).
 * - `sb_<slot>`: replies pass; platform-reserved destinations (the sandbox
 *   subnet, loopback, link-local/metadata, multicast) and the sandbox's deny
 *   set are rejected; then its allow sets: `a4/a6` (addresses from allowed DNS
 *   answers, with their TTL), `p4/p6` (the same bound to ports), `c4/c6` and
 *   `cp4/cp6` (allowed CIDRs, any port / some ports). Everything else is
 *   recorded (`denied4/6` dynamic sets, read by the edge for audit events,
 *   plus a counter) and rejected: TCP reset or ICMP admin-prohibited, so a
 *   denied connect fails at once instead of timing out.
 * - `input_hook`: from any sandbox veth only DNS (UDP 53, the platform
 *   resolver) and IPv6 neighbour discovery reach the host.
 * - `postrouting_hook`: sandbox addresses are masqueraded on the way out.
 */

export const SANDBOX_SET_NAMES = [
  'a4',
  'p4',
  'c4',
  'cp4',
  'x4',
  'a6',
  'p6',
  'c6',
  'cp6',
  'x6',
] as const;
type SetName = (typeof SANDBOX_SET_NAMES)[number];

const SET_TYPES: Record<SetName, string> = {
  a4: 'type ipv4_addr; flags timeout;',
  p4: 'type ipv4_addr . inet_service; flags timeout;',
  c4: 'type ipv4_addr; flags interval;',
  cp4: 'type ipv4_addr . inet_service; flags interval;',
  x4: 'type ipv4_addr; flags interval;',
  a6: 'type ipv6_addr; flags timeout;',
  p6: 'type ipv6_addr . inet_service; flags timeout;',
  c6: 'type ipv6_addr; flags interval;',
  cp6: 'type ipv6_addr . inet_service; flags interval;',
  x6: 'type ipv6_addr; flags interval;',
};

const RESERVED4 = ['0.0.0.0/8', '127.0.0.0/8', '169.254.0.0/16', '224.0.0.0/3'];
const RESERVED6 = ['::/127', '::ffff:0:0/96', 'fe80::/10', 'ff00::/8'];

export interface TableInput {
  table: string;
  subnet4: Cidr;
  subnet6?: Cidr | undefined;
  /** How long a denied destination stays in the audit set (one event per window). */
  deniedWindowSeconds: number;
}

/** The table skeleton; `add` statements only, so re-applying it keeps sandbox chains and sets. */
export function tableScript(t: TableInput): string {
  const s4 = formatCidr(t.subnet4);
  const s6 = t.subnet6 && formatCidr(t.subnet6);
  const T = `inet ${t.table}`;
  return [
    `add table ${T}`,
    `add map ${T} egress { type ifname : verdict; }`,
    `add set ${T} denied4 { type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags dynamic,timeout; timeout ${t.deniedWindowSeconds}s; size 8192; }`,
    `add set ${T} denied6 { type ipv6_addr . ipv6_addr . inet_proto . inet_service; flags dynamic,timeout; timeout ${t.deniedWindowSeconds}s; size 8192; }`,
    `add chain ${T} forward_hook { type filter hook forward priority filter - 5; policy accept; }`,
    `add chain ${T} input_hook { type filter hook input priority filter - 5; policy accept; }`,
    `add chain ${T} postrouting_hook { type nat hook postrouting priority srcnat; policy accept; }`,
    `add chain ${T} from_sandbox_to_host`,
    `flush chain ${T} forward_hook`,
    `flush chain ${T} input_hook`,
    `flush chain ${T} postrouting_hook`,
    `flush chain ${T} from_sandbox_to_host`,
    `add rule ${T} forward_hook iifname vmap @egress`,
    // A sandbox address whose interface is not (or no longer) in the map goes nowhere.
    `add rule ${T} forward_hook ip saddr ${s4} reject with icmpx admin-prohibited`,
    `add rule ${T} forward_hook ip daddr ${s4} ct state established,related accept`,
    `add rule ${T} forward_hook ip daddr ${s4} drop`,
    ...(s6
      ? [
          `add rule ${T} forward_hook ip6 saddr ${s6} reject with icmpx admin-prohibited`,
          `add rule ${T} forward_hook ip6 daddr ${s6} ct state established,related accept`,
          `add rule ${T} forward_hook ip6 daddr ${s6} drop`,
        ]
      : []),
    `add rule ${T} input_hook iifname "dsv*" jump from_sandbox_to_host`,
    `add rule ${T} input_hook ip saddr ${s4} jump from_sandbox_to_host`,
    ...(s6 ? [`add rule ${T} input_hook ip6 saddr ${s6} jump from_sandbox_to_host`] : []),
    `add rule ${T} from_sandbox_to_host ct state established,related accept`,
    `add rule ${T} from_sandbox_to_host udp dport 53 fib daddr type local accept`,
    `add rule ${T} from_sandbox_to_host icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit } accept`,
    `add rule ${T} from_sandbox_to_host meta l4proto tcp reject with tcp reset`,
    `add rule ${T} from_sandbox_to_host reject with icmpx admin-prohibited`,
    `add rule ${T} postrouting_hook ip saddr ${s4} ip daddr != ${s4} masquerade`,
    ...(s6 ? [`add rule ${T} postrouting_hook ip6 saddr ${s6} ip6 daddr != ${s6} masquerade`] : []),
    '',
  ].join('\n');
}

export interface SandboxRulesInput extends TableInput {
  slot: number;
  veth: string;
}

/**
 * Creates (or resets) one sandbox's chain, sets and counter and hooks its
 * veth to them. Idempotent: `add` then `flush` so a leftover from a crashed
 * stop is reused, never an error.
 */
export function sandboxScript(s: SandboxRulesInput, policy: CompiledPolicy): string {
  const T = `inet ${s.table}`;
  const n = s.slot;
  const chain = `sb_${n}`;
  const lines: string[] = [];
  for (const name of SANDBOX_SET_NAMES) {
    lines.push(`add set ${T} ${name}_${n} { ${SET_TYPES[name]} }`, `flush set ${T} ${name}_${n}`);
  }
  lines.push(`add counter ${T} denied_${n}`);
  const d = `${chain}_deny`;
  lines.push(`add chain ${T} ${chain}`, `flush chain ${T} ${chain}`);
  lines.push(`add chain ${T} ${d}`, `flush chain ${T} ${d}`);
  const r = (rule: string) => lines.push(`add rule ${T} ${chain} ${rule}`);
  const reserved4 = [formatCidr(s.subnet4), ...RESERVED4].join(', ');
  const reserved6 = [...(s.subnet6 ? [formatCidr(s.subnet6)] : []), ...RESERVED6].join(', ');
  r('ct state established,related accept');
  r(`ip daddr { ${reserved4} } goto ${chain}_deny`);
  r(`ip6 daddr { ${reserved6} } goto ${chain}_deny`);
  r(`ip daddr @x4_${n} goto ${chain}_deny`);
  r(`ip6 daddr @x6_${n} goto ${chain}_deny`);
  r(`ip daddr @a4_${n} accept`);
  r(`ip daddr @c4_${n} accept`);
  r(`ip6 daddr @a6_${n} accept`);
  r(`ip6 daddr @c6_${n} accept`);
  r(`meta l4proto { tcp, udp } ip daddr . th dport @p4_${n} accept`);
  r(`meta l4proto { tcp, udp } ip daddr . th dport @cp4_${n} accept`);
  r(`meta l4proto { tcp, udp } ip6 daddr . th dport @p6_${n} accept`);
  r(`meta l4proto { tcp, udp } ip6 daddr . th dport @cp6_${n} accept`);
  r(`goto ${chain}_deny`);
  const dr = (rule: string) => lines.push(`add rule ${T} ${d} ${rule}`);
  dr('meta l4proto { tcp, udp } add @denied4 { ip saddr . ip daddr . meta l4proto . th dport }');
  dr('meta l4proto != { tcp, udp } add @denied4 { ip saddr . ip daddr . meta l4proto . 0 }');
  dr('meta l4proto { tcp, udp } add @denied6 { ip6 saddr . ip6 daddr . meta l4proto . th dport }');
  dr('meta l4proto != { tcp, udp } add @denied6 { ip6 saddr . ip6 daddr . meta l4proto . 0 }');
  dr(`counter name denied_${n}`);
  dr('meta l4proto tcp reject with tcp reset');
  dr('reject with icmpx admin-prohibited');
  // add-delete-add replaces a stale mapping for the same interface name.
  lines.push(
    `add element ${T} egress { "${s.veth}" : jump ${chain} }`,
    `delete element ${T} egress { "${s.veth}" }`,
    `add element ${T} egress { "${s.veth}" : jump ${chain} }`,
  );
  lines.push(...cidrElements(s.table, n, policy));
  lines.push('');
  return lines.join('\n');
}

/** The CIDR parts of a policy as set elements (the DNS parts are added per answer). */
export function cidrElements(table: string, slot: number, policy: CompiledPolicy): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  const add = (set: string, elems: string[]) => {
    if (elems.length > 0) out.push(`add element ${T} ${set}_${slot} { ${elems.join(', ')} }`);
  };
  for (const fam of [4, 6] as const) {
    const allow = policy.allowCidrs.filter((c) => c.cidr.family === fam);
    add(
      `c${fam}`,
      allow.filter((c) => c.ports.length === 0).map((c) => formatCidr(c.cidr)),
    );
    add(
      `cp${fam}`,
      allow.flatMap((c) => c.ports.map((p) => `${formatCidr(c.cidr)} . ${p}`)),
    );
    add(
      `x${fam}`,
      policy.denyCidrs.filter((c) => c.family === fam).map((c) => formatCidr(c)),
    );
  }
  return out;
}

/** Empties a sandbox's allow and deny sets (before re-filling them after a policy change). */
export function flushSandboxSets(table: string, slot: number): string[] {
  return SANDBOX_SET_NAMES.map((name) => `flush set inet ${table} ${name}_${slot}`);
}

/** Removes everything of one sandbox; idempotent (each object is added before it is deleted). */
export function removeSandboxScript(s: SandboxRulesInput): string {
  const T = `inet ${s.table}`;
  const n = s.slot;
  const lines = [
    `add element ${T} egress { "${s.veth}" : jump sb_${n} }`,
    `delete element ${T} egress { "${s.veth}" }`,
  ];
  // The chain must exist for the element above to be added; create-then-delete everything.
  const head = [`add chain ${T} sb_${n}`, `add chain ${T} sb_${n}_deny`];
  lines.push(`flush chain ${T} sb_${n}`, `flush chain ${T} sb_${n}_deny`);
  lines.push(`delete chain ${T} sb_${n}`, `delete chain ${T} sb_${n}_deny`);
  for (const name of SANDBOX_SET_NAMES) {
    head.push(`add set ${T} ${name}_${n} { ${SET_TYPES[name]} }`);
    lines.push(`delete set ${T} ${name}_${n}`);
  }
  head.push(`add counter ${T} denied_${n}`);
  lines.push(`delete counter ${T} denied_${n}`);
  return [...head, ...lines, ''].join('\n');
}

/** A DNS answer's addresses as timed set elements (re-adding refreshes the timeout). */
export function addressElements(
  table: string,
  slot: number,
  entries: { family: 4 | 6; address: string; ports: number[]; timeoutSeconds: number }[],
): string[] {
  const T = `inet ${table}`;
  const out: string[] = [];
  for (const e of entries) {
    const keys = e.ports.length === 0 ? [e.address] : e.ports.map((p) => `${e.address} . ${p}`);
    const set = `${e.ports.length === 0 ? 'a' : 'p'}${e.family}_${slot}`;
    for (const k of keys) {
      out.push(
        `add element ${T} ${set} { ${k} }`,
        `delete element ${T} ${set} { ${k} }`,
        `add element ${T} ${set} { ${k} timeout ${e.timeoutSeconds}s }`,
      );
    }
  }
  return out;
}
