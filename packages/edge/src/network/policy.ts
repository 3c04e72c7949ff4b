import { isIP } from 'node:net';
import { DsecError } from '@dsec/core';
import type { NetworkRules, NetworkTarget, SandboxSpec } from '@dsec/core';

/**
 * The catalogue of named network rules (`networkRules: { pypi: true }`, paper
 * 2.1): each name stands for the domains a tool needs. An edge may replace or
 * extend it (`NetworkOptions.catalogue`).
 */
export const DEFAULT_NETWORK_CATALOGUE: Readonly<Record<string, readonly string[]>> = {
  pypi: ['pypi.org', 'files.pythonhosted.org'],
  npm: ['registry.npmjs.org'],
  github: [
    'github.com',
    'api.github.com',
    'codeload.github.com',
    'objects.githubusercontent.com',
    'raw.githubusercontent.com',
  ],
  huggingface: ['huggingface.co', '*.huggingface.co', 'cdn-lfs.hf.co', '*.hf.co'],
  debian: ['deb.debian.org', 'security.debian.org'],
  crates: ['crates.io', 'index.crates.io', 'static.crates.io'],
  golang: ['proxy.golang.org', 'sum.golang.org'],
  rubygems: ['rubygems.org', 'index.rubygems.org'],
  maven: ['repo.maven.apache.org', 'repo1.maven.org'],
};

export interface Cidr {
  family: 4 | 6;
  /** Canonical network address and prefix length (`10.1.2.0`, 24). */
  address: string;
  prefix: number;
}

export interface DomainRule {
  /** Lower-case, no trailing dot; `*.` prefix for subdomains. */
  pattern: string;
  /** Empty: every port and protocol. */
  ports: number[];
}

export interface CidrRule {
  cidr: Cidr;
  ports: number[];
}

/** A sandbox's egress policy, compiled from its spec and the edge's catalogue. */
export interface CompiledPolicy {
  allowDomains: DomainRule[];
  denyDomains: string[];
  allowCidrs: CidrRule[];
  denyCidrs: Cidr[];
}

export function compilePolicy(
  spec: Pick<SandboxSpec, 'networkRules' | 'networkAllow' | 'networkDeny'>,
  catalogue: Readonly<Record<string, readonly string[]>>,
): CompiledPolicy {
  const policy: CompiledPolicy = {
    allowDomains: [],
    denyDomains: [],
    allowCidrs: [],
    denyCidrs: [],
  };
  for (const [name, on] of Object.entries(spec.networkRules ?? {})) {
    const domains = Object.hasOwn(catalogue, name) ? catalogue[name] : undefined;
    if (!domains) {
      throw new DsecError('invalid_argument', `unknown network rule ${JSON.stringify(name)}`, {
        field: `networkRules.${name}`,
        details: { known: Object.keys(catalogue) },
      });
    }
    for (const d of domains) {
      const pattern = normalizeDomain(d, `networkRules.${name}`);
      if (on) policy.allowDomains.push({ pattern, ports: [] });
      else policy.denyDomains.push(pattern);
    }
  }
  for (const [i, t] of (spec.networkAllow ?? []).entries()) {
    const ports = checkPorts(t.ports, `networkAllow.${i}.ports`);
    if ('domain' in t)
      policy.allowDomains.push({ pattern: normalizeDomain(t.domain, `networkAllow.${i}`), ports });
    else policy.allowCidrs.push({ cidr: parseCidr(t.cidr, `networkAllow.${i}.cidr`), ports });
  }
  for (const [i, t] of (spec.networkDeny ?? []).entries()) {
    if ('domain' in t) policy.denyDomains.push(normalizeDomain(t.domain, `networkDeny.${i}`));
    else policy.denyCidrs.push(parseCidr(t.cidr, `networkDeny.${i}.cidr`));
  }
  return policy;
}

/**
 * Whether a DNS name may be resolved, and on which ports its addresses are
 * then allowed. Deny wins over allow; several allows merge their ports (any
 * rule without ports opens every port).
 */
export function matchDomain(
  policy: CompiledPolicy,
  name: string,
): { allowed: false } | { allowed: true; ports: number[] } {
  const n = name.toLowerCase().replace(/\.$/, '');
  if (policy.denyDomains.some((p) => domainMatches(p, n))) return { allowed: false };
  const hits = policy.allowDomains.filter((r) => domainMatches(r.pattern, n));
  if (hits.length === 0) return { allowed: false };
  if (hits.some((h) => h.ports.length === 0)) return { allowed: true, ports: [] };
  return { allowed: true, ports: [...new Set(hits.flatMap((h) => h.ports))].sort((a, b) => a - b) };
}

export function domainMatches(pattern: string, name: string): boolean {
  if (pattern.startsWith('*.'))
    return name.endsWith(pattern.slice(1)) && name.length > pattern.length - 1;
  return name === pattern;
}

export function normalizeDomain(d: string, field: string): string {
  const s = d.toLowerCase().replace(/\.$/, '');
  const label = '[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?';
  const re = new RegExp(`^(?:\\*\\.)?(?:${label}\\.)*${label}$`);
  if (s.length === 0 || s.length > 253 || !re.test(s)) {
    throw new DsecError('invalid_argument', `${field}: not a domain name or *.domain pattern`, {
      field,
    });
  }
  return s;
}

function checkPorts(ports: number[] | undefined, field: string): number[] {
  if (!ports) return [];
  for (const p of ports) {
    if (!Number.isInteger(p) || p < 1 || p > 65535)
      throw new DsecError('invalid_argument', `${field}: ports are 1–65535`, { field });
  }
  return [...new Set(ports)].sort((a, b) => a - b);
}

export function parseCidr(s: string, field: string): Cidr {
  const [addr = '', len, ...rest] = s.split('/');
  const family = isIP(addr);
  const max = family === 4 ? 32 : 128;
  const prefix = len === undefined ? max : Number(len);
  if (family === 0 || rest.length > 0 || !Number.isInteger(prefix) || prefix < 0 || prefix > max) {
    throw new DsecError('invalid_argument', `${field}: not an IPv4 or IPv6 CIDR`, { field });
  }
  const bits = ipToBigInt(addr);
  const width = BigInt(max);
  const mask = prefix === 0 ? 0n : ((1n << BigInt(prefix)) - 1n) << (width - BigInt(prefix));
  return { family: family as 4 | 6, address: bigIntToIp(bits & mask, family as 4 | 6), prefix };
}

export function cidrContains(c: Cidr, ip: string): boolean {
  const family = isIP(ip);
  if (family !== c.family) return false;
  const max = BigInt(family === 4 ? 32 : 128);
  const shift = max - BigInt(c.prefix);
  return ipToBigInt(ip) >> shift === ipToBigInt(c.address) >> shift;
}

export function formatCidr(c: Cidr): string {
  return `${c.address}/${c.prefix}`;
}

export function ipToBigInt(ip: string): bigint {
  if (isIP(ip) === 4) return ip.split('.').reduce((acc, o) => (acc << 8n) | BigInt(Number(o)), 0n);
  let [head = '', tail] = ip.split('::') as [string, string | undefined];
  // An embedded IPv4 tail (::ffff:1.2.3.4) becomes two groups.
  const v4 = /(\d+\.\d+\.\d+\.\d+)$/.exec(tail ?? head);
  if (v4?.[1]) {
    const n = ipToBigInt(v4[1]);
    const groups = `${(n >> 16n).toString(16)}:${(n & 0xffffn).toString(16)}`;
    if (tail !== undefined) tail = tail.replace(v4[1], groups);
    else head = head.replace(v4[1], groups);
  }
  const h = head ? head.split(':') : [];
  const t = tail ? tail.split(':') : [];
  const groups =
    tail === undefined ? h : [...h, ...Array<string>(8 - h.length - t.length).fill('0'), ...t];
  return groups.reduce((acc, g) => (acc << 16n) | BigInt(parseInt(g || '0', 16)), 0n);
}

export function bigIntToIp(n: bigint, family: 4 | 6): string {
  if (family === 4) return [24n, 16n, 8n, 0n].map((s) => String((n >> s) & 0xffn)).join('.');
  const groups: string[] = [];
  for (let s = 112n; s >= 0n; s -= 16n) groups.push(((n >> s) & 0xffffn).toString(16));
  // Compress the longest run of zero groups (RFC 5952) so the result is canonical.
  let best = -1;
  let bestLen = 1;
  for (let i = 0; i < 8;) {
    if (groups[i] !== '0') {
      i++;
      continue;
    }
    let j = i;
    while (j < 8 && groups[j] === '0') j++;
    if (j - i > bestLen) {
      best = i;
      bestLen = j - i;
    }
    i = j;
  }
  if (best < 0) return groups.join(':');
  return `${groups.slice(0, best).join(':')}::${groups.slice(best + bestLen).join(':')}`;
}

/** The rules as given in a spec, after a patch: names merged, lists replaced when given. */
export function applyPatch<
  T extends Pick<SandboxSpec, 'networkRules' | 'networkAllow' | 'networkDeny'>,
>(
  spec: T,
  patch: {
    networkRules?: NetworkRules | undefined;
    allow?: NetworkTarget[] | undefined;
    deny?: NetworkTarget[] | undefined;
  },
): T {
  return {
    ...spec,
    networkRules: { ...spec.networkRules, ...patch.networkRules },
    networkAllow: patch.allow ?? spec.networkAllow,
    networkDeny: patch.deny ?? spec.networkDeny,
  };
}
