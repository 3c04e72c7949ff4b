import { DsecError } from '@dsec/core';

/**
 * How this node reaches image registries, set once for registry imports,
 * Dockerfile builds and evaluations alike: from the config file's
 * `registries` section and the environment (docs/eval.md).
 */
export interface RegistrySettings {
  /** `host[:port]` of registries reached over plain HTTP or with an unverified certificate. */
  insecure: string[];
  /** A registry host → mirrors tried first, in order (`docker.io` → `["127.0.0.1:5000"]`). */
  mirrors: Record<string, string[]>;
  /** A containers-auth.json file with credentials (default: `REGISTRY_AUTH_FILE`). */
  authFile?: string | undefined;
}

/** The config file's `registries` section, as far as it is given. */
export type RegistryConfig = Partial<RegistrySettings>;

const HOST_PORT = /^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}\.?)*|\[[0-9a-fA-F:]+\])(?::\d{1,5})?$/;

/**
 * The settings from the config file's section and the environment:
 * `DSEC_INSECURE_REGISTRIES` (comma-separated `host:port`) adds insecure
 * registries, `DSEC_REGISTRY_MIRRORS` (`host=mirror[|mirror…]`, comma-separated)
 * adds mirrors after the config file's, `REGISTRY_AUTH_FILE` is the auth file
 * unless the config names one. A malformed entry is `invalid_argument`
 * naming where it came from.
 */
export function registrySettings(
  config: RegistryConfig | undefined,
  env: NodeJS.ProcessEnv = process.env,
): RegistrySettings {
  const insecure = new Set<string>();
  for (const h of config?.insecure ?? []) insecure.add(checkHost(h, 'registries.insecure'));
  for (const h of splitList(env.DSEC_INSECURE_REGISTRIES)) {
    insecure.add(checkHost(h, 'DSEC_INSECURE_REGISTRIES'));
  }
  const mirrors: Record<string, string[]> = {};
  const addMirror = (host: string, mirror: string, where: string) => {
    const key = checkHost(host, where);
    const list = (mirrors[key] ??= []);
    const m = checkHost(mirror, where);
    if (!list.includes(m)) list.push(m);
  };
  for (const [host, list] of Object.entries(config?.mirrors ?? {})) {
    for (const m of list) addMirror(host, m, 'registries.mirrors');
  }
  for (const entry of splitList(env.DSEC_REGISTRY_MIRRORS)) {
    const eq = entry.indexOf('=');
    if (eq <= 0) {
      throw new DsecError(
        'invalid_argument',
        `DSEC_REGISTRY_MIRRORS: ${JSON.stringify(entry)} is not host=mirror[|mirror…]`,
        { field: 'DSEC_REGISTRY_MIRRORS' },
      );
    }
    for (const m of entry.slice(eq + 1).split('|')) {
      addMirror(entry.slice(0, eq), m.trim(), 'DSEC_REGISTRY_MIRRORS');
    }
  }
  const authFile = config?.authFile ?? (env.REGISTRY_AUTH_FILE || undefined);
  return { insecure: [...insecure], mirrors, ...(authFile ? { authFile } : {}) };
}

/** Whether `host` (`host[:port]`, as in an image reference) is one of the insecure registries. */
export function isInsecureRegistry(settings: RegistrySettings, host: string): boolean {
  return settings.insecure.includes(host.toLowerCase());
}

/**
 * A containers-registries.conf (v2) for skopeo, buildah and podman holding
 * exactly these settings and no search registries (a short name never
 * reaches a registry nobody named). Handed to them through
 * `CONTAINERS_REGISTRIES_CONF`.
 */
export function registriesConf(settings: RegistrySettings): string {
  const lines = ['unqualified-search-registries = []', ''];
  const hosts = new Set([...settings.insecure, ...Object.keys(settings.mirrors)]);
  for (const host of hosts) {
    lines.push('[[registry]]', `location = ${toml(host)}`);
    if (settings.insecure.includes(host)) lines.push('insecure = true');
    for (const m of settings.mirrors[host] ?? []) {
      lines.push('[[registry.mirror]]', `location = ${toml(m)}`);
      if (settings.insecure.includes(m)) lines.push('insecure = true');
    }
    lines.push('');
  }
  return lines.join('\n');
}

function splitList(text: string | undefined): string[] {
  return (text ?? '')
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s !== '');
}

function checkHost(host: string, where: string): string {
  if (typeof host !== 'string' || host.length > 261 || !HOST_PORT.test(host)) {
    throw new DsecError(
      'invalid_argument',
      `${where}: ${JSON.stringify(host)} is not host[:port]`,
      {
        field: where,
      },
    );
  }
  return host.toLowerCase();
}

function toml(s: string): string {
  return JSON.stringify(s);
}
