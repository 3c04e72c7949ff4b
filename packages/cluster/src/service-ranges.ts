import { isIP } from 'node:net';
import type { EdgeNetworkOptions } from '@dsec/edge';
import type { ClusterConfig, EdgeConfig } from './config.js';

/**
 * The cluster's own service addresses, protected from every sandbox (the
 * edge's `network.protectedRanges`, SECURITY.md L40): the database, the
 * image store's endpoint, the apiserver's and the edge's listeners, where
 * the configuration gives them as IP literals. Loopback and unspecified
 * addresses are left out (loopback is reserved anyway, and `0.0.0.0` names
 * no host); a service known only by its name is not resolved here (its
 * address may change, and an edge's start should not depend on DNS): such
 * services are protected when they sit on the node's own networks, or when
 * the operator lists their range in `network.protectedRanges`.
 *
 * `urls` are connection strings (`postgres://user@10.0.0.5:5432/db`,
 * `s3://bucket/prefix?endpoint=http://10.0.0.6:9000`, `https://[fd00::7]:7430`),
 * `hosts` bare hosts (a listener's `host`). Unparsable ones are skipped.
 */
export function serviceRanges(input: {
  urls?: (string | undefined)[];
  hosts?: (string | undefined)[];
}): string[] {
  const out = new Set<string>();
  const add = (host: string | undefined) => {
    if (!host) return;
    const h = host.startsWith('[') && host.endsWith(']') ? host.slice(1, -1) : host;
    const family = isIP(h);
    if (family === 0 || isLoopbackOrUnspecified(h, family)) return;
    out.add(`${h}/${family === 4 ? 32 : 128}`);
  };
  for (const url of input.urls ?? []) {
    if (!url) continue;
    let parsed: URL;
    try {
      parsed = new URL(url);
    } catch {
      continue;
    }
    add(parsed.hostname);
    // An S3 store's endpoint rides in its query (images/src/store/open.ts).
    const endpoint = parsed.searchParams.get('endpoint');
    if (endpoint) {
      try {
        add(new URL(endpoint).hostname);
      } catch {
        // not a URL: nothing to protect
      }
    }
  }
  for (const host of input.hosts ?? []) add(host);
  return [...out];
}

function isLoopbackOrUnspecified(address: string, family: number): boolean {
  if (family === 4) return address.startsWith('127.') || address === '0.0.0.0';
  // The URL parser writes an IPv6 address canonically (`0:0::1` → `[::1]`).
  const canonical = new URL(`http://[${address}]/`).hostname;
  return canonical === '[::]' || canonical === '[::1]';
}

/** An edge's network options with the cluster's service addresses added to its protected ranges. */
export function withServiceRanges(
  network: EdgeNetworkOptions | undefined,
  services: Parameters<typeof serviceRanges>[0],
): EdgeNetworkOptions {
  const extra = serviceRanges(services);
  return {
    ...network,
    protectedRanges: [...new Set([...(network?.protectedRanges ?? []), ...extra])],
  };
}

/**
 * The services of a cluster config an edge's sandboxes must not reach: the
 * control-plane database, the image store, the apiserver's listener and the
 * edge's own (`edgeUrl`, what apiservers dial, and its bind `host`).
 */
export function clusterServices(
  config: Pick<ClusterConfig, 'database' | 'imageStore' | 'apiserver'>,
  edge: Pick<EdgeConfig, 'host'>,
  edgeUrl: string,
): Parameters<typeof serviceRanges>[0] {
  return {
    urls: [config.database, config.imageStore, edgeUrl],
    hosts: [edge.host, config.apiserver?.host],
  };
}
