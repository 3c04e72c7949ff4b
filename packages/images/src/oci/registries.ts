import { DsecError } from '@dsec/core';

/**
 * How this node reaches image registries, set once for registry imports,
 * Dockerfile builds and evaluations alike: from the config file's
 * `registries` section and the environment (docs/eval.md, docs/cluster.md).
 */
export interface RegistrySettings {
  /** `host[:port]` of registries reached over plain HTTP or with an unverified certificate (lower case). */
  insecure: string[];
  /**
   * A registry host → mirrors tried first, in order, before the registry
   * itself (`docker.io` → `["127.0.0.1:5000"]`). A mirror is `host[:port]`
   * or `host[:port]/namespace` (the image's path goes below it).
   */
  mirrors: Record<string, string[]>;
  /** A containers-auth.json file with credentials (default: `REGISTRY_AUTH_FILE`). */
  authFile?: string | undefined;
  /**
   * Registry hosts (`host[:port]`, lower case; `*` for any) a build sent to the
   * API may pull `FROM`, besides `docker.io` and the registries above (see
   * `buildPullHosts`). Absent: none besides those.
   */
  buildFrom?: string[] | undefined;
}

/** The config file's `registries` section, as far as it is given. */
export type RegistryConfig = Partial<RegistrySettings>;

/** Most entries one list may hold: a config is written by hand, and every entry costs each pull. */
export const MAX_REGISTRY_ENTRIES = 256;
/** Most mirrors one registry may have (each one a connection attempt per pull). */
export const MAX_MIRRORS_PER_REGISTRY = 16;

const MAX_HOST_CHARS = 261; // 253 for the name, `:` and 5 digits, plus brackets of an IPv6 literal
const MAX_MIRROR_PATH_CHARS = 255;
const LABEL = /^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$/;
const IPV6 = /^\[[0-9a-f:.]{2,45}\]$/;
const PATH_PART = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;

/**
 * The settings from the config file's section and the environment:
 * `DSEC_INSECURE_REGISTRIES` (comma-separated `host:port`) adds insecure
 * registries, `DSEC_REGISTRY_MIRRORS` (`host=mirror[|mirror…]`, comma-separated)
 * adds mirrors after the config file's, `REGISTRY_AUTH_FILE` is the auth file
 * unless the config names one. Hosts are compared in lower case. A malformed
 * entry, or more than `MAX_REGISTRY_ENTRIES` / `MAX_MIRRORS_PER_REGISTRY`,
 * is `invalid_argument` naming where it came from
 * (`registries.insecure`, `DSEC_REGISTRY_MIRRORS`, …).
 */
export function registrySettings(
  config: RegistryConfig | undefined,
  env: NodeJS.ProcessEnv = process.env,
): RegistrySettings {
  const insecure = new Set<string>();
  const addInsecure = (h: unknown, where: string) => {
    insecure.add(checkHost(h, where));
    if (insecure.size > MAX_REGISTRY_ENTRIES) tooMany(where, MAX_REGISTRY_ENTRIES);
  };
  if (config?.insecure !== undefined) {
    if (!Array.isArray(config.insecure)) notA('registries.insecure', 'a list of host[:port]');
    for (const h of config.insecure) addInsecure(h, 'registries.insecure');
  }
  for (const h of splitList(env.DSEC_INSECURE_REGISTRIES))
    addInsecure(h, 'DSEC_INSECURE_REGISTRIES');

  const mirrors: Record<string, string[]> = Object.create(null) as Record<string, string[]>;
  const addMirror = (host: unknown, mirror: unknown, where: string) => {
    const key = checkHost(host, where);
    if (!(key in mirrors) && Object.keys(mirrors).length >= MAX_REGISTRY_ENTRIES)
      tooMany(where, MAX_REGISTRY_ENTRIES);
    const list = (mirrors[key] ??= []);
    const m = checkMirror(mirror, where);
    if (m === key) {
      throw new DsecError('invalid_argument', `${where}: ${key} cannot be a mirror of itself`, {
        field: where,
      });
    }
    if (!list.includes(m)) list.push(m);
    if (list.length > MAX_MIRRORS_PER_REGISTRY) tooMany(where, MAX_MIRRORS_PER_REGISTRY, key);
  };
  if (config?.mirrors !== undefined) {
    const section = config.mirrors as unknown;
    if (typeof section !== 'object' || section === null || Array.isArray(section))
      notA('registries.mirrors', 'an object of host → [mirror, …]');
    for (const [host, list] of Object.entries(section as Record<string, unknown>)) {
      if (!Array.isArray(list)) notA(`registries.mirrors.${host}`, 'a list of mirrors');
      for (const m of list) addMirror(host, m, 'registries.mirrors');
    }
  }
  for (const entry of splitList(env.DSEC_REGISTRY_MIRRORS)) {
    const eq = entry.indexOf('=');
    if (eq <= 0) {
      throw new DsecError(
        'invalid_argument',
        `DSEC_REGISTRY_MIRRORS: ${JSON.stringify(entry.slice(0, 80))} is not host=mirror[|mirror…]`,
        { field: 'DSEC_REGISTRY_MIRRORS' },
      );
    }
    for (const m of entry.slice(eq + 1).split('|')) {
      addMirror(entry.slice(0, eq).trim(), m.trim(), 'DSEC_REGISTRY_MIRRORS');
    }
  }
  const buildFrom = new Set<string>();
  const addBuildFrom = (h: unknown, where: string) => {
    buildFrom.add(h === '*' ? '*' : checkHost(h, where));
    if (buildFrom.size > MAX_REGISTRY_ENTRIES) tooMany(where, MAX_REGISTRY_ENTRIES);
  };
  if (config?.buildFrom !== undefined) {
    if (!Array.isArray(config.buildFrom))
      notA('registries.buildFrom', 'a list of host[:port] (or "*")');
    for (const h of config.buildFrom) addBuildFrom(h, 'registries.buildFrom');
  }
  for (const h of splitList(env.DSEC_BUILD_REGISTRIES)) addBuildFrom(h, 'DSEC_BUILD_REGISTRIES');
  const authFile = config?.authFile ?? (env.REGISTRY_AUTH_FILE || undefined);
  if (authFile !== undefined && (typeof authFile !== 'string' || authFile === ''))
    notA('registries.authFile', 'a file path');
  return {
    insecure: [...insecure],
    mirrors: { ...mirrors },
    ...(authFile ? { authFile } : {}),
    ...(buildFrom.size > 0 ? { buildFrom: [...buildFrom] } : {}),
  };
}

/**
 * The registry hosts a build sent to the API may pull `FROM` (a tenant wrote
 * its Dockerfile, and the pull runs on the node, outside any sandbox's
 * network policy): `docker.io`, the insecure and mirrored registries, their
 * mirrors' hosts and `buildFrom`. Undefined (any host) when `buildFrom`
 * holds `*`.
 */
export function buildPullHosts(settings: RegistrySettings): string[] | undefined {
  if (settings.buildFrom?.includes('*')) return undefined;
  const hosts = new Set<string>(['docker.io', ...settings.insecure, ...(settings.buildFrom ?? [])]);
  for (const [registry, mirrors] of Object.entries(settings.mirrors)) {
    hosts.add(registry);
    for (const m of mirrors) hosts.add(m.split('/')[0]!);
  }
  return [...hosts];
}

/**
 * The registry host of an image reference as containers/image reads it: the
 * first path component when it holds a `.` or `:` or is `localhost`, else
 * `docker.io` (lower case; `index.docker.io` is `docker.io`).
 */
export function registryHostOf(ref: string): string {
  const slash = ref.indexOf('/');
  const first = slash < 0 ? '' : ref.slice(0, slash).toLowerCase();
  if (slash < 0 || !/[.:]|^localhost$/.test(first)) return 'docker.io';
  return first === 'index.docker.io' ? 'docker.io' : first;
}

/**
 * Whether `host` (`host[:port]` as in an image reference, or a mirror's
 * `host[:port]/namespace`) is one of the insecure registries.
 */
export function isInsecureRegistry(settings: RegistrySettings, host: string): boolean {
  const h = host.toLowerCase();
  const slash = h.indexOf('/');
  return settings.insecure.includes(slash < 0 ? h : h.slice(0, slash));
}

/**
 * The mirrors of `host` in the order they are tried, the registry itself
 * last: where a pull of an image of `host` may come from.
 */
export function pullSources(settings: RegistrySettings, host: string): string[] {
  const h = host.toLowerCase();
  return [...(settings.mirrors[h] ?? []), h];
}

/**
 * A containers-registries.conf (v2) for skopeo, buildah and podman holding
 * exactly these settings and no search registries (a short name never
 * reaches a registry nobody named). Handed to them through
 * `CONTAINERS_REGISTRIES_CONF`. A mirror is insecure when its host is
 * listed as insecure, independently of the registry it mirrors.
 */
export function registriesConf(settings: RegistrySettings): string {
  const lines = ['unqualified-search-registries = []', ''];
  const hosts = new Set([...settings.insecure, ...Object.keys(settings.mirrors)]);
  for (const host of hosts) {
    lines.push('[[registry]]', `location = ${toml(host)}`);
    if (settings.insecure.includes(host)) lines.push('insecure = true');
    for (const m of settings.mirrors[host] ?? []) {
      lines.push('[[registry.mirror]]', `location = ${toml(m)}`);
      if (isInsecureRegistry(settings, m)) lines.push('insecure = true');
    }
    lines.push('');
  }
  return lines.join('\n');
}

function splitList(text: string | undefined): string[] {
  if (text !== undefined && text.length > 64 * 1024) {
    throw new DsecError('invalid_argument', 'registry settings in the environment exceed 64 KiB', {
      field: 'env',
    });
  }
  return (text ?? '')
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s !== '');
}

/**
 * `host[:port]` in lower case: DNS labels (1–63 of a-z 0-9 -, no leading or
 * trailing hyphen), an IPv4 address or a bracketed IPv6 literal, an
 * optional port 1–65535. Checked label by label, never by one regular
 * expression over the whole (no backtracking over a caller's string).
 */
function checkHost(host: unknown, where: string): string {
  const fail = (): never => {
    throw new DsecError(
      'invalid_argument',
      `${where}: ${JSON.stringify(typeof host === 'string' ? host.slice(0, 80) : host)} is not host[:port]`,
      { field: where },
    );
  };
  if (typeof host !== 'string' || host === '' || host.length > MAX_HOST_CHARS) return fail();
  const h = host.toLowerCase();
  let name = h;
  let port: string | undefined;
  if (h.startsWith('[')) {
    const close = h.indexOf(']');
    if (close < 0) return fail();
    name = h.slice(0, close + 1);
    const rest = h.slice(close + 1);
    if (rest !== '') {
      if (!rest.startsWith(':')) return fail();
      port = rest.slice(1);
    }
    if (!IPV6.test(name)) return fail();
  } else {
    const colon = h.indexOf(':');
    if (colon >= 0) {
      name = h.slice(0, colon);
      port = h.slice(colon + 1);
    }
    const labels = name.split('.');
    if (name.length > 253 || labels.some((l) => !LABEL.test(l))) return fail();
  }
  if (port !== undefined) {
    const n = /^\d{1,5}$/.test(port) ? Number(port) : NaN;
    if (!(n >= 1 && n <= 65535)) return fail();
  }
  return h;
}

/** A mirror: `host[:port]` and an optional `/namespace` path (lower-case path components). */
function checkMirror(mirror: unknown, where: string): string {
  if (typeof mirror !== 'string') return checkHost(mirror, where);
  const slash = mirror.indexOf('/');
  if (slash < 0) return checkHost(mirror, where);
  const host = checkHost(mirror.slice(0, slash), where);
  const path = mirror.slice(slash + 1);
  if (
    path.length > MAX_MIRROR_PATH_CHARS ||
    path.split('/').some((p) => p.length > 128 || !PATH_PART.test(p))
  ) {
    throw new DsecError(
      'invalid_argument',
      `${where}: ${JSON.stringify(mirror.slice(0, 80))} is not host[:port][/namespace]`,
      { field: where },
    );
  }
  return `${host}/${path}`;
}

function tooMany(where: string, max: number, of?: string): never {
  throw new DsecError(
    'invalid_argument',
    `${where}: more than ${max} entries${of !== undefined ? ` for ${of}` : ''}`,
    { field: where },
  );
}

function notA(where: string, what: string): never {
  throw new DsecError('invalid_argument', `${where} must be ${what}`, { field: where });
}

// Hosts and paths are validated above (no quote, backslash or control
// character), so a JSON string is a TOML basic string.
function toml(s: string): string {
  return JSON.stringify(s);
}
