import { isIP } from 'node:net';
import { DsecError } from '@dsec/core';
import {
  bigIntToIp,
  cidrContains,
  formatCidr,
  ipToBigInt,
  parseCidr,
  type Cidr,
  type CompiledPolicy,
} from './policy.js';

/**
 * The address ranges that are not "the internet" (IANA's special-purpose
 * registries, RFC 6890 and its updates), written once: the DNS answer filter
 * and the firewall's always-denied destinations both come from this table.
 *
 * - `reserved`: no sandbox reaches it whatever its rules; the firewall
 *   rejects these destinations before any CIDR rule (`egress4/egress6`), and
 *   DNS answers carrying them are always dropped.
 * - the others (private networks, shared and benchmarking space, NAT64,
 *   documentation…): the firewall denies them as it denies every address
 *   nothing opened; a DNS answer may not open them (it is dropped unless a
 *   CIDR rule of the sandbox's policy covers the address, SECURITY.md L40).
 *
 * 6to4 (2002::/16) is special only when the IPv4 address it embeds is; see
 * {@link classifyAddress}. Teredo (2001::/32) lies inside 2001::/23.
 */
export interface SpecialRange {
  cidr: string;
  what: string;
  rfc: string;
  reserved: boolean;
}

export const SPECIAL_RANGES: readonly SpecialRange[] = [
  { cidr: '0.0.0.0/8', what: '"this network"', rfc: 'RFC 791, RFC 1122', reserved: true },
  { cidr: '10.0.0.0/8', what: 'private network', rfc: 'RFC 1918', reserved: false },
  { cidr: '100.64.0.0/10', what: 'shared address space (CGNAT)', rfc: 'RFC 6598', reserved: false },
  { cidr: '127.0.0.0/8', what: 'loopback', rfc: 'RFC 1122', reserved: true },
  { cidr: '169.254.0.0/16', what: 'link-local (cloud metadata)', rfc: 'RFC 3927', reserved: true },
  { cidr: '172.16.0.0/12', what: 'private network', rfc: 'RFC 1918', reserved: false },
  { cidr: '192.0.0.0/24', what: 'IETF protocol assignments', rfc: 'RFC 6890', reserved: false },
  { cidr: '192.0.2.0/24', what: 'documentation (TEST-NET-1)', rfc: 'RFC 5737', reserved: false },
  { cidr: '192.88.99.0/24', what: '6to4 relay anycast', rfc: 'RFC 7526', reserved: false },
  { cidr: '192.168.0.0/16', what: 'private network', rfc: 'RFC 1918', reserved: false },
  { cidr: '198.18.0.0/15', what: 'benchmarking', rfc: 'RFC 2544', reserved: false },
  { cidr: '198.51.100.0/24', what: 'documentation (TEST-NET-2)', rfc: 'RFC 5737', reserved: false },
  { cidr: '203.0.113.0/24', what: 'documentation (TEST-NET-3)', rfc: 'RFC 5737', reserved: false },
  { cidr: '224.0.0.0/4', what: 'multicast', rfc: 'RFC 5771', reserved: true },
  {
    cidr: '240.0.0.0/4',
    what: 'reserved, limited broadcast',
    rfc: 'RFC 1112, RFC 919',
    reserved: true,
  },
  { cidr: '::/128', what: 'unspecified', rfc: 'RFC 4291', reserved: true },
  { cidr: '::1/128', what: 'loopback', rfc: 'RFC 4291', reserved: true },
  { cidr: '::ffff:0:0/96', what: 'IPv4-mapped', rfc: 'RFC 4291', reserved: true },
  { cidr: '::/96', what: 'IPv4-compatible (deprecated)', rfc: 'RFC 4291', reserved: false },
  { cidr: '64:ff9b::/96', what: 'NAT64 well-known prefix', rfc: 'RFC 6052', reserved: false },
  { cidr: '64:ff9b:1::/48', what: 'NAT64 local-use prefix', rfc: 'RFC 8215', reserved: false },
  { cidr: '100::/64', what: 'discard-only', rfc: 'RFC 6666', reserved: false },
  {
    cidr: '2001::/23',
    what: 'IETF protocol assignments (Teredo, benchmarking, ORCHID)',
    rfc: 'RFC 2928, RFC 4380, RFC 5180',
    reserved: false,
  },
  { cidr: '2001:db8::/32', what: 'documentation', rfc: 'RFC 3849', reserved: false },
  { cidr: '3fff::/20', what: 'documentation', rfc: 'RFC 9637', reserved: false },
  { cidr: '5f00::/16', what: 'SRv6 SIDs', rfc: 'RFC 9602', reserved: false },
  { cidr: 'fc00::/7', what: 'unique local (ULA)', rfc: 'RFC 4193', reserved: false },
  { cidr: 'fe80::/10', what: 'link-local', rfc: 'RFC 4291', reserved: true },
  { cidr: 'fec0::/10', what: 'site-local (deprecated)', rfc: 'RFC 3879', reserved: false },
  { cidr: 'ff00::/8', what: 'multicast', rfc: 'RFC 4291', reserved: true },
];

/**
 * Cloud metadata and platform services outside the reserved ranges (the
 * IPv4 ones, 169.254.169.254 and its neighbours, are link-local and so
 * reserved already): always protected (see {@link NodeRanges.protected}), so
 * no tenant CIDR rule (`fc00::/7`, `100.64.0.0/10`, `::/0`) opens them.
 */
export const METADATA_ADDRESSES: readonly { cidr: string; what: string }[] = [
  { cidr: 'fd00:ec2::254/128', what: 'the AWS instance metadata service (IPv6)' },
  { cidr: 'fd00:ec2::253/128', what: 'the AWS DNS resolver (IPv6)' },
  { cidr: 'fd00:ec2::123/128', what: 'the AWS time service (IPv6)' },
  { cidr: '100.100.100.200/32', what: 'the Alibaba Cloud metadata service' },
];

/** The NAT64 well-known prefix (RFC 6052): its addresses embed an IPv4 address in their last 32 bits. */
export const NAT64_WELL_KNOWN = '64:ff9b::/96';

/** The prefix lengths RFC 6052 (section 2.2) defines for NAT64 prefixes. */
const NAT64_LENGTHS = new Set([32, 40, 48, 56, 64, 96]);

/**
 * An operator's NAT64 prefix (`NetworkOptions.nat64Prefixes`): one of the
 * RFC 6052 lengths, and no reserved range (the IPv4-mapped range is no
 * translator's prefix). Throws `invalid_argument` naming `field`.
 */
export function checkNat64Prefix(prefix: string, field: string): Cidr {
  const c = parseCidr(prefix, field);
  const hit = reservedOverlap(c);
  if (c.family !== 6 || !NAT64_LENGTHS.has(c.prefix) || hit)
    throw new DsecError(
      'invalid_argument',
      `${field}: ${prefix} is not a NAT64 prefix (an IPv6 /32, /40, /48, /56, /64 or /96${
        hit ? ` outside ${hit.cidr}` : ''
      }, RFC 6052)`,
      { field },
    );
  return c;
}

/**
 * Where bit `i` (0 = most significant) of the embedded IPv4 address sits in
 * an address under a NAT64 prefix of length `length` (RFC 6052 section 2.2):
 * right after the prefix, skipping bits 64–71 (the "u" octet) below /96.
 */
function nat64Bit(length: number, i: number): number {
  const at = length + i;
  return length < 96 && at >= 64 ? at + 8 : at;
}

/** The IPv4 address an address under `prefix` embeds. */
export function nat64Embedded(prefix: Cidr, address: bigint): bigint {
  let v4 = 0n;
  for (let i = 0; i < 32; i++)
    v4 = (v4 << 1n) | ((address >> BigInt(127 - nat64Bit(prefix.prefix, i))) & 1n);
  return v4;
}

/**
 * The IPv6 range under a NAT64 prefix whose addresses embed the IPv4
 * addresses of `v4` (the "u" octet, zero, counts as part of the range once
 * the embedded bits pass it).
 */
export function nat64Image(prefix: Cidr, v4: Cidr): Cidr {
  let n = ipToBigInt(prefix.address);
  const bits = ipToBigInt(v4.address);
  for (let i = 0; i < v4.prefix; i++)
    n |= ((bits >> BigInt(31 - i)) & 1n) << BigInt(127 - nat64Bit(prefix.prefix, i));
  const end = prefix.prefix + v4.prefix;
  const length = prefix.prefix < 96 && end > 64 ? end + 8 : end;
  return { family: 6, address: bigIntToIp(n, 6), prefix: length };
}

/** The 6to4 prefix: `2002:AABB:CCDD::/48` carries the IPv4 address `AA.BB.CC.DD` (RFC 3056). */
const SIX_TO_FOUR = parseCidr('2002::/16', '6to4');

const PARSED = SPECIAL_RANGES.map((r) => ({ ...r, parsed: parseCidr(r.cidr, 'special range') }));

/** The always-denied destinations of one family, for the firewall (`nft-ruleset.ts`). */
export function reservedCidrs(family: 4 | 6): string[] {
  return PARSED.filter((r) => r.reserved && r.parsed.family === family).map((r) => r.cidr);
}

/**
 * An address parsed once, for the many range checks of one classification:
 * IPv4 as a plain number (no BigInt on the common path), IPv6 as a BigInt.
 */
type Bits = { family: 4; n: number } | { family: 6; n: bigint };

/** Each range's network and mask, computed once per `Cidr` object. */
const MASKS = new WeakMap<Cidr, { net: number; mask: number } | { top: bigint; shift: bigint }>();

function contains(c: Cidr, b: Bits): boolean {
  if (c.family !== b.family) return false;
  let m = MASKS.get(c);
  if (!m) {
    if (c.family === 4) {
      const mask = c.prefix === 0 ? 0 : (0xffffffff << (32 - c.prefix)) >>> 0;
      m = { net: (Number(ipToBigInt(c.address)) & mask) >>> 0, mask };
    } else {
      const shift = BigInt(128 - c.prefix);
      m = { top: ipToBigInt(c.address) >> shift, shift };
    }
    MASKS.set(c, m);
  }
  if (b.family === 4) return 'mask' in m && (b.n & m.mask) >>> 0 === m.net;
  return 'shift' in m && b.n >> m.shift === m.top;
}

function bitsOf(address: string): Bits | undefined {
  const family = isIP(address);
  if (family === 4) {
    const o = address.split('.');
    return { family, n: ((+o[0]! << 24) | (+o[1]! << 16) | (+o[2]! << 8) | +o[3]!) >>> 0 };
  }
  return family === 6 ? { family, n: ipToBigInt(address) } : undefined;
}

/** Whether `outer` contains `inner` (same family, shorter or equal prefix). */
function within(outer: Cidr, inner: Cidr): boolean {
  const b = outer.family === inner.family && outer.prefix <= inner.prefix && bitsOf(inner.address);
  return b ? contains(outer, b) : false;
}

/** The reserved range of the table that `c` overlaps, if any. */
export function reservedOverlap(c: Cidr): SpecialRange | undefined {
  return PARSED.find((r) => r.reserved && (within(r.parsed, c) || within(c, r.parsed)));
}

/** Where an address falls when it is not simply public. */
export interface AddressClass {
  /** The range it is in (`10.0.0.0/8`, a node network, a sandbox subnet). */
  range: string;
  what: string;
  /** Reserved: never reachable from a sandbox (see {@link SpecialRange}). */
  reserved: boolean;
  /**
   * Protected ({@link NodeRanges.protected}): never reachable either, though
   * a tenant's CIDR rule may name it (the rule's other addresses open).
   */
  protected?: boolean;
}

/** A range no sandbox rule opens, and why. */
export interface ProtectedRange {
  cidr: Cidr;
  what: string;
}

/** The node-specific context of {@link classifyAddress}. */
export interface NodeRanges {
  /** Always denied, like the table's reserved ranges (the edge's sandbox subnets). */
  reserved: Cidr[];
  /**
   * Never opened by a rule: the operator's protected ranges, the metadata
   * addresses, the node's own networks ({@link nodeNetworks}) and the NAT64
   * forms of their IPv4 ones. `publicRanges` never exempts them.
   */
  protected: ProtectedRange[];
  /** Ranges of the table the operator declares public (`NetworkOptions.publicRanges`). */
  public: Cidr[];
  /**
   * NAT64 prefixes (the well-known one and the operator's): an address in
   * one is as reserved or protected as the IPv4 address it embeds, and
   * special otherwise (a CIDR rule over the prefix releases it).
   */
  nat64: Cidr[];
}

export const NO_NODE_RANGES: NodeRanges = {
  reserved: [],
  protected: [],
  public: [],
  nat64: [parseCidr(NAT64_WELL_KNOWN, 'nat64')],
};

/**
 * Whether `address` is special, and how; undefined for a public address.
 * Order: reserved (table and sandbox subnets), protected (the node's own
 * networks among them), NAT64 prefixes (judged by the IPv4 address they
 * embed), then the table's other ranges unless the operator declared them
 * public. A 6to4 address is classified by the IPv4 address it embeds.
 */
export function classifyAddress(
  address: string,
  ranges: NodeRanges = NO_NODE_RANGES,
): AddressClass | undefined {
  const bits = bitsOf(address);
  if (!bits) return { range: 'invalid', what: 'not an address', reserved: true };
  return classifyBits(bits, ranges);
}

function classifyBits(b: Bits, ranges: NodeRanges): AddressClass | undefined {
  for (const c of ranges.reserved)
    if (contains(c, b)) return { range: formatCidr(c), what: 'sandbox network', reserved: true };
  for (const r of PARSED)
    if (r.reserved && contains(r.parsed, b))
      return { range: r.cidr, what: `${r.what} (${r.rfc})`, reserved: true };
  for (const p of ranges.protected)
    if (contains(p.cidr, b))
      return { range: formatCidr(p.cidr), what: p.what, reserved: false, protected: true };
  if (b.family === 6) {
    for (const prefix of ranges.nat64) {
      if (!contains(prefix, b)) continue;
      const v4 = Number(nat64Embedded(prefix, b.n));
      const inner = classifyBits({ family: 4, n: v4 }, ranges);
      const range = formatCidr(prefix);
      const of = `NAT64 (${range}) of ${bigIntToIp(BigInt(v4), 4)}`;
      if (inner?.reserved || inner?.protected)
        return { ...inner, range, what: `${of}: ${inner.what}` };
      return { range, what: `${of} (RFC 6052)`, reserved: false };
    }
  }
  if (ranges.public.some((c) => contains(c, b))) return undefined;
  for (const r of PARSED)
    if (!r.reserved && contains(r.parsed, b))
      return { range: r.cidr, what: `${r.what} (${r.rfc})`, reserved: false };
  if (b.family === 6 && contains(SIX_TO_FOUR, b)) {
    const v4 = Number((b.n >> 80n) & 0xffffffffn);
    const inner = classifyBits({ family: 4, n: v4 }, ranges);
    if (inner)
      return {
        range: '2002::/16',
        what: `6to4 of ${bigIntToIp(BigInt(v4), 4)}: ${inner.what} (RFC 3056)`,
        reserved: inner.reserved,
        ...(inner.protected ? { protected: true } : {}),
      };
  }
  return undefined;
}

/**
 * The node's own networks from its interface addresses (`10.1.2.3/24`, as
 * `ip addr` lists them), less those `exclude` (the edge's own sandbox
 * subnets) or a reserved range covers (loopback, link-local): the
 * operator's LAN, private or not, and any public prefix on an uplink. They
 * are protected (no CIDR rule opens them).
 */
export function nodeNetworks(cidrs: Iterable<string>, exclude: Cidr[]): Cidr[] {
  const out = new Map<string, Cidr>();
  for (const cidr of cidrs) {
    let c: Cidr;
    try {
      c = parseCidr(cidr, 'interface');
    } catch {
      continue;
    }
    if (exclude.some((x) => within(x, c))) continue;
    if (PARSED.some((r) => r.reserved && within(r.parsed, c))) continue;
    out.set(formatCidr(c), c);
  }
  return [...out.values()];
}

/** What a sandbox's policy makes of an address found in a DNS answer. */
export type AddressVerdict =
  /** A public address: released to the sandbox and opened for the name (its ports). */
  | { verdict: 'open' }
  /**
   * Released, not opened: a CIDR rule of the policy covers it, and that rule
   * alone says on which ports it may be reached (the name's rule never widens it).
   */
  | { verdict: 'release' }
  /** Left out of the answer. */
  | { verdict: 'drop'; range: string; why: string };

/**
 * The verdict on an address of an allowed name's answer (SECURITY.md L40):
 * an address the policy refuses as an IP must not be opened by a name. A
 * denied CIDR, a reserved or a protected range (the node's own networks
 * among them) drops it; a private or special-use range drops it unless an
 * allowed CIDR covers it; a public address is opened.
 */
export function screenAddress(
  policy: Pick<CompiledPolicy, 'allowCidrs' | 'denyCidrs'>,
  address: string,
  ranges: NodeRanges = NO_NODE_RANGES,
): AddressVerdict {
  const denied = policy.denyCidrs.find((c) => cidrContains(c, address));
  if (denied) return { verdict: 'drop', range: formatCidr(denied), why: 'a denied CIDR' };
  const special = classifyAddress(address, ranges);
  if (!special) return { verdict: 'open' };
  if (special.reserved || special.protected)
    return { verdict: 'drop', range: special.range, why: special.what };
  if (policy.allowCidrs.some((r) => cidrContains(r.cidr, address))) return { verdict: 'release' };
  return {
    verdict: 'drop',
    range: special.range,
    why: `${special.what}, and no CIDR rule allows it`,
  };
}
