import type { SandboxEventKind, SandboxSpec } from '@dsec/core';
import { compilePolicy, DEFAULT_NETWORK_CATALOGUE } from './policy.js';

/** The part of a sandbox record the network layer needs. */
export interface NetworkSandbox {
  id: string;
  /** The sandbox's slot on this edge (unique among live sandboxes); addresses derive from it. */
  slot: number;
  spec: Pick<SandboxSpec, 'networkRules' | 'networkAllow' | 'networkDeny'> &
    Partial<Pick<SandboxSpec, 'backend'>>;
}

/**
 * Whether the sandbox has a link at all. A container always has its veth (a
 * policy update may open it later); a VM's network device is fixed when it
 * boots, so a microVM gets a tap only when its spec opens something, and
 * none at all otherwise (ADR 0016).
 */
export function hasNetworkLink(spec: NetworkSandbox['spec']): boolean {
  if (spec.backend === undefined || spec.backend === 'container') return true;
  return Boolean(spec.networkAllow?.length) || Object.values(spec.networkRules).some(Boolean);
}

/**
 * A microVM's link: a tap device on the host, configured as a container's
 * veth host end, and what the guest configures on its `eth0`.
 */
export interface TapLink {
  /** The tap's name on the host (QEMU's `-netdev tap,ifname=`). */
  tap: string;
  /** The guest's side, in `FarEndConfig` terms. */
  guest: FarEndConfig;
  /** The edge's resolver for this sandbox (the guest's resolv.conf). */
  nameserver: string;
}

/** What the OCI config needs to put a sandbox on its network. */
export interface SandboxNetwork {
  /** Host file bind-mounted read-only over the sandbox's `/etc/resolv.conf`. */
  resolvConf: string;
  /** The sandbox's own addresses, for logs and tests. */
  addresses: string[];
  gateway4: string;
}

/**
 * The sandbox's side of its link, as a process already in the sandbox's
 * namespaces configures it (the sandbox's chronus daemon, before it drops
 * its capabilities: `PendingChronus.configureNetwork`).
 */
export interface FarEndConfig {
  interface: string;
  addresses: { address: string; prefixLength: number; gateway: string }[];
}

/** Configures the sandbox's end of its link from inside its namespaces (see {@link FarEndConfig}). */
export type FarEndConfigurator = (config: FarEndConfig) => Promise<void>;

export type NetworkEventSink = (
  sandboxId: string,
  kind: SandboxEventKind,
  message: string,
  details: Record<string, unknown>,
  dedupeKey?: string,
) => void;

/**
 * How sandboxes get (or do not get) a network. Lifecycle per sandbox:
 * `setup` before the runtime starts (firewall chain and sets, resolver,
 * resolv.conf; idempotent: it resets leftovers of an earlier try), `attach`
 * once the runtime has made the sandbox's (empty) network namespace and its
 * init runs, `update` while it runs, `teardown` after its processes are gone
 * (idempotent, also on a half-set-up sandbox). After an edge restart
 * `reconcile` gets the live sandboxes: it adopts theirs and removes every
 * interface and firewall entry of sandboxes that are gone.
 *
 * A returned `teardown` has removed the sandbox's firewall state and resolver;
 * the kernel may still be removing its interface (the sandbox's network
 * namespace is released, and the host end of its veth goes with it a few
 * tens of milliseconds later): `attach` of a sandbox on the same slot waits
 * for that, `drained` waits for all of them, and `close` calls `drained`.
 */
export interface NetworkManager {
  readonly mode: 'isolated' | 'none';
  /** Undefined: the runtime makes a fresh, empty network namespace (loopback only). */
  setup(sb: NetworkSandbox): Promise<SandboxNetwork | undefined>;
  /**
   * Wires the network namespace of `initPid` (the sandbox's PID 1 on the host)
   * to the node. `farEnd`: configures the sandbox's end from inside (else the
   * network layer runs a process in the sandbox's namespace for it).
   */
  attach(sb: NetworkSandbox, initPid: number, farEnd?: FarEndConfigurator): Promise<void>;
  /**
   * A microVM's `attach` (after `setup`): a tap owned by `ownerUid` (the
   * hypervisor's uid) in place of the veth's host end, under the same
   * firewall elements and resolver. `teardown` deletes it. Absent: the
   * manager gives VMs no network.
   */
  attachTap?(sb: NetworkSandbox, options: { ownerUid: number }): Promise<TapLink>;
  /** Applies a changed policy to new connections; other sandboxes are untouched. */
  update(sb: NetworkSandbox): Promise<void>;
  teardown(sb: Pick<NetworkSandbox, 'id' | 'slot'>): Promise<void>;
  /** Resolves once no interface of a torn-down sandbox is left on the host. */
  drained(): Promise<void>;
  reconcile(live: NetworkSandbox[]): Promise<void>;
  /** Checks a policy before a create is admitted; throws `invalid_argument` (unknown rule, bad CIDR…). */
  validate(spec: NetworkSandbox['spec']): void;
  /** Turns what the firewall recorded since the last look into audit events. */
  collectEvents(): Promise<void>;
  /**
   * Waits for `drained`, stops background work; with no live sandboxes left,
   * removes the edge's table too.
   */
  close(): Promise<void>;
}

/**
 * No network: each sandbox gets a fresh network namespace from the runtime
 * with only loopback in it. Nothing to set up, nothing to leak. Rules are
 * accepted but have nothing to open.
 */
export class NoNetwork implements NetworkManager {
  readonly mode = 'none' as const;
  constructor(
    readonly catalogue: Readonly<Record<string, readonly string[]>> = DEFAULT_NETWORK_CATALOGUE,
  ) {}
  async setup(): Promise<undefined> {
    return undefined;
  }
  async attach(): Promise<void> {}
  async update(): Promise<void> {}
  async teardown(): Promise<void> {}
  async drained(): Promise<void> {}
  async reconcile(): Promise<void> {}
  /** Rules are still checked, so a spec is valid or not whatever the edge's mode. */
  validate(spec: NetworkSandbox['spec']): void {
    compilePolicy(spec, this.catalogue);
  }
  async collectEvents(): Promise<void> {}
  async close(): Promise<void> {}
}
