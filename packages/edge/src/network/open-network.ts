import type { EventLog } from '../events/event-log.js';
import { LinuxNetwork, probeLinuxNetwork, type NetworkOptions } from './linux-network.js';
import { NoNetwork, type NetworkManager } from './network-manager.js';

/** How an edge networks its sandboxes (`ContainerEdgeOptions.network`). */
export type EdgeNetworkOptions = Omit<NetworkOptions, 'stateDir' | 'onEvent' | 'log'> & {
  /**
   * `isolated`: a network namespace per sandbox behind a veth, egress by policy.
   * `none`: loopback only. `auto` (default): `isolated` where nftables and
   * network namespaces work (root, tools installed), else `none`.
   */
  mode?: 'auto' | 'isolated' | 'none';
};

export async function openNetwork(
  stateDir: string,
  options: EdgeNetworkOptions = {},
  events: EventLog | undefined,
  log?: (msg: string, fields?: Record<string, unknown>) => void,
): Promise<NetworkManager> {
  const { mode = 'auto', ...rest } = options;
  if (mode === 'none') return new NoNetwork(rest.catalogue);
  if (mode === 'auto' && !(await probeLinuxNetwork())) {
    log?.('sandbox networks disabled: nftables or network namespaces unavailable');
    return new NoNetwork(rest.catalogue);
  }
  return LinuxNetwork.open({
    ...rest,
    stateDir,
    log,
    onEvent:
      events &&
      ((id, kind, message, details, key) => events.record(id, kind, message, details, key)),
  });
}
