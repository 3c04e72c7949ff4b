import { DsecError } from '@dsec/core';

/**
 * Debian package metadata and the dependency closure a toolkit layer needs.
 * Pure functions over the text of apt's `Packages` indexes and dpkg's
 * `status` file: no I/O, so the closure is unit-tested on fixtures.
 */

export type VersionOp = '<<' | '<=' | '=' | '>=' | '>>';

/** One alternative of a dependency clause: `name [(op version)]`. */
export interface DebRelation {
  name: string;
  op?: VersionOp | undefined;
  version?: string | undefined;
}

/** `a | b (>= 1)`: satisfied by any one of its alternatives. */
export type DebClause = DebRelation[];

export interface DebPackage {
  name: string;
  version: string;
  architecture: string;
  preDepends: DebClause[];
  depends: DebClause[];
  /** Virtual names (with the version they provide, when given). */
  provides: DebRelation[];
  /** The stanza as read, field names as written (`Package`, `Depends`…). */
  fields: Record<string, string>;
}

/** What `resolveDebClosure` decided. */
export interface DebClosure {
  /** Packages to extract into the layer, sorted by name. */
  install: DebPackage[];
  /** Requested or needed packages the base already holds at a fitting version, sorted. */
  fromBase: string[];
}

/** Splits deb822 text (`Packages`, `status`) into stanzas; continuation lines are joined with `\n`. */
export function parseDeb822(text: string): Record<string, string>[] {
  const stanzas: Record<string, string>[] = [];
  let current: Record<string, string> = {};
  let key: string | undefined;
  const flush = (): void => {
    if (Object.keys(current).length > 0) stanzas.push(current);
    current = {};
    key = undefined;
  };
  for (const line of text.split('\n')) {
    if (line.trim() === '') {
      flush();
      continue;
    }
    if (line.startsWith('#')) continue;
    if ((line.startsWith(' ') || line.startsWith('\t')) && key !== undefined) {
      current[key] = `${current[key] ?? ''}\n${line}`;
      continue;
    }
    const i = line.indexOf(':');
    if (i <= 0) continue;
    key = line.slice(0, i);
    current[key] = line.slice(i + 1).trim();
  }
  flush();
  return stanzas;
}

const RELATION =
  /^([a-z0-9][a-z0-9+.-]*)(?::[a-z0-9-]+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?$/;

/** Parses a `Depends`-style field. Architecture qualifiers (`:any`) and restrictions (`[amd64]`, `<!nocheck>`) are dropped. */
export function parseRelations(field: string | undefined): DebClause[] {
  if (field === undefined || field.trim() === '') return [];
  return field.split(',').map((clause) =>
    clause.split('|').map((alt) => {
      const text = alt
        .replace(/\[[^\]]*\]/g, '')
        .replace(/<[^>]*>/g, '')
        .trim();
      const m = RELATION.exec(text);
      if (!m) {
        throw new DsecError(
          'invalid_argument',
          `cannot parse package relation ${JSON.stringify(alt.trim())}`,
          {
            field: 'packages',
          },
        );
      }
      // `<` and `>` are obsolete spellings of `<=` and `>=` (deb-control(5)).
      const op = m[2] === '<' ? '<=' : m[2] === '>' ? '>=' : (m[2] as VersionOp | undefined);
      return { name: m[1]!, ...(op !== undefined ? { op, version: m[3] } : {}) };
    }),
  );
}

function toPackage(fields: Record<string, string>): DebPackage | undefined {
  const name = fields['Package'];
  const version = fields['Version'];
  if (name === undefined || version === undefined) return undefined;
  return {
    name,
    version,
    architecture: fields['Architecture'] ?? 'all',
    preDepends: parseRelations(fields['Pre-Depends']),
    depends: parseRelations(fields['Depends']),
    provides: parseRelations(fields['Provides']).map((c) => c[0]!),
    fields,
  };
}

/** The packages of a `Packages` index that run on `arch` (its own and `all`). */
export function packagesFromIndex(text: string, arch: string): DebPackage[] {
  const out: DebPackage[] = [];
  for (const stanza of parseDeb822(text)) {
    const pkg = toPackage(stanza);
    if (pkg && (pkg.architecture === arch || pkg.architecture === 'all')) out.push(pkg);
  }
  return out;
}

/** The packages a dpkg `status` file records as installed (`Status: install ok installed`). */
export function installedFromStatus(text: string): DebPackage[] {
  const out: DebPackage[] = [];
  for (const stanza of parseDeb822(text)) {
    const status = (stanza['Status'] ?? '').split(/\s+/);
    if (status[2] !== 'installed') continue;
    const pkg = toPackage(stanza);
    if (pkg) out.push(pkg);
  }
  return out;
}

/** dpkg's ordering of characters in the non-digit parts: `~` first, then end, letters, the rest. */
function charOrder(s: string, i: number): number {
  if (i >= s.length) return 0;
  const c = s.charCodeAt(i);
  if (c >= 48 && c <= 57) return 0;
  if ((c >= 65 && c <= 90) || (c >= 97 && c <= 122)) return c;
  if (c === 126) return -1;
  return c + 256;
}

function isDigit(s: string, i: number): boolean {
  const c = s.charCodeAt(i);
  return i < s.length && c >= 48 && c <= 57;
}

/** dpkg's `verrevcmp`: compares an upstream version or a revision. */
function compareFragment(a: string, b: string): number {
  let i = 0;
  let j = 0;
  while (i < a.length || j < b.length) {
    let firstDiff = 0;
    while ((i < a.length && !isDigit(a, i)) || (j < b.length && !isDigit(b, j))) {
      const ac = charOrder(a, i);
      const bc = charOrder(b, j);
      if (ac !== bc) return ac - bc;
      i++;
      j++;
    }
    while (a[i] === '0') i++;
    while (b[j] === '0') j++;
    while (isDigit(a, i) && isDigit(b, j)) {
      if (firstDiff === 0) firstDiff = a.charCodeAt(i) - b.charCodeAt(j);
      i++;
      j++;
    }
    if (isDigit(a, i)) return 1;
    if (isDigit(b, j)) return -1;
    if (firstDiff !== 0) return firstDiff;
  }
  return 0;
}

function splitVersion(v: string): [number, string, string] {
  const colon = v.indexOf(':');
  const epoch = colon >= 0 ? Number(v.slice(0, colon)) : 0;
  const rest = colon >= 0 ? v.slice(colon + 1) : v;
  const dash = rest.lastIndexOf('-');
  return dash >= 0 ? [epoch, rest.slice(0, dash), rest.slice(dash + 1)] : [epoch, rest, ''];
}

/** Compares two Debian versions as `dpkg --compare-versions` does: negative, zero or positive. */
export function compareDebVersions(a: string, b: string): number {
  const [ea, ua, ra] = splitVersion(a);
  const [eb, ub, rb] = splitVersion(b);
  if (ea !== eb) return ea - eb;
  return compareFragment(ua, ub) || compareFragment(ra, rb);
}

function versionSatisfies(version: string, op: VersionOp, want: string): boolean {
  const c = compareDebVersions(version, want);
  switch (op) {
    case '<<':
      return c < 0;
    case '<=':
      return c <= 0;
    case '=':
      return c === 0;
    case '>=':
      return c >= 0;
    case '>>':
      return c > 0;
  }
}

/** Does `pkg` satisfy `rel`, by its own name and version or by what it provides? */
function satisfies(pkg: DebPackage, rel: DebRelation): boolean {
  if (pkg.name === rel.name) {
    return rel.op === undefined || versionSatisfies(pkg.version, rel.op, rel.version!);
  }
  return pkg.provides.some(
    (p) =>
      p.name === rel.name &&
      (rel.op === undefined ||
        // An unversioned Provides never satisfies a versioned dependency.
        (p.op === '=' && versionSatisfies(p.version!, rel.op, rel.version!))),
  );
}

function formatRelation(rel: DebRelation): string {
  return rel.op === undefined ? rel.name : `${rel.name} (${rel.op} ${rel.version})`;
}

export interface ResolveDebClosureInput {
  /** Every package the archive offers (several versions of one name allowed). */
  available: DebPackage[];
  /** What the base image has installed (its dpkg status). */
  installed: DebPackage[];
  /** Names, or `name=version` pins. */
  wanted: string[];
}

/**
 * The packages to extract so that `wanted` and everything they depend on
 * (Pre-Depends and Depends; not Recommends) is present on top of the base.
 * A clause already met by the base or by a package chosen earlier adds
 * nothing; otherwise the first alternative the archive can satisfy is taken,
 * at its highest fitting version, a virtual name through the first of its
 * providers by name. A base package too old for a dependency is added again
 * at a newer version (the layer's copy overlays the base's). Conflicts and
 * Breaks are not checked: the layer is never configured by dpkg.
 *
 * @throws DsecError `invalid_argument` naming the package or relation that
 *   nothing satisfies.
 */
export function resolveDebClosure(input: ResolveDebClosureInput): DebClosure {
  const byName = new Map<string, DebPackage[]>();
  const providers = new Map<string, DebPackage[]>();
  for (const pkg of input.available) {
    const list = byName.get(pkg.name) ?? [];
    list.push(pkg);
    byName.set(pkg.name, list);
    for (const p of pkg.provides) {
      const plist = providers.get(p.name) ?? [];
      plist.push(pkg);
      providers.set(p.name, plist);
    }
  }
  // Highest version first; among equals the first index wins.
  for (const list of byName.values()) list.sort((a, b) => compareDebVersions(b.version, a.version));
  for (const list of providers.values())
    list.sort((a, b) => a.name.localeCompare(b.name) || compareDebVersions(b.version, a.version));

  const selected = new Map<string, DebPackage>();
  const fromBase = new Set<string>();
  const queue: DebPackage[] = [];

  const metBy = (rel: DebRelation): 'base' | 'selected' | undefined => {
    for (const pkg of selected.values()) if (satisfies(pkg, rel)) return 'selected';
    for (const pkg of input.installed) {
      if (satisfies(pkg, rel)) {
        fromBase.add(pkg.name);
        return 'base';
      }
    }
    return undefined;
  };
  const select = (pkg: DebPackage): void => {
    selected.set(pkg.name, pkg);
    queue.push(pkg);
  };
  const candidate = (rel: DebRelation): DebPackage | undefined => {
    const real = (byName.get(rel.name) ?? []).find((p) => satisfies(p, rel));
    if (real) return real;
    return (providers.get(rel.name) ?? []).find((p) => satisfies(p, rel));
  };

  for (const [i, spec] of input.wanted.entries()) {
    const eq = spec.indexOf('=');
    const rel: DebRelation =
      eq < 0 ? { name: spec } : { name: spec.slice(0, eq), op: '=', version: spec.slice(eq + 1) };
    if (metBy(rel) !== undefined) continue;
    const pkg = candidate(rel);
    if (!pkg) {
      throw new DsecError('invalid_argument', `no package ${formatRelation(rel)} in the archive`, {
        field: `packages.${i}`,
      });
    }
    // A pin on a name that another package merely provides is not a pin.
    if (rel.op === '=' && pkg.name !== rel.name) {
      throw new DsecError('invalid_argument', `${rel.name} is a virtual package; pin a real one`, {
        field: `packages.${i}`,
      });
    }
    if (!selected.has(pkg.name)) select(pkg);
  }

  for (let pkg = queue.shift(); pkg !== undefined; pkg = queue.shift()) {
    for (const clause of [...pkg.preDepends, ...pkg.depends]) {
      if (clause.some((rel) => metBy(rel) !== undefined)) continue;
      let chosen: DebPackage | undefined;
      for (const rel of clause) {
        chosen = candidate(rel);
        if (chosen) break;
      }
      if (!chosen) {
        throw new DsecError(
          'invalid_argument',
          `${pkg.name} ${pkg.version} depends on ${clause.map(formatRelation).join(' | ')}, which nothing in the archive or the base satisfies`,
          { field: 'packages' },
        );
      }
      select(chosen);
    }
  }

  const install = [...selected.values()].sort((a, b) => a.name.localeCompare(b.name));
  for (const p of install) fromBase.delete(p.name);
  return { install, fromBase: [...fromBase].sort() };
}
