import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readlink } from 'node:fs/promises';
import { setTimeout as sleep } from 'node:timers/promises';
import { DsecError, type NetworkTarget } from '@dsec/core';

/**
 * A network namespace for a build's `RUN` steps, wired and policed like a
 * sandbox's: buildah joins it (`--network ns:PATH`) and its resolver is
 * `nameserver`. `close` tears it down; it is idempotent.
 */
export interface BuildNetworkHandle {
  /** `/proc/PID/ns/net` of the namespace's holder process. */
  nsPath: string;
  /** The platform resolver's address for this namespace (`--dns`). */
  nameserver: string;
  close(): Promise<void>;
}

/** Opens a {@link BuildNetworkHandle} that lets `allow` (domains or CIDRs) out and nothing else. */
export interface BuildNetwork {
  open(options: {
    allow: NetworkTarget[];
    signal?: AbortSignal | undefined;
  }): Promise<BuildNetworkHandle>;
}

/**
 * The part of the edge's network manager (`NetworkManager` of `@dsec/edge`,
 * `LinuxNetwork`) a build uses; typed here so this package does not depend
 * on the edge.
 */
export interface EgressManager {
  setup(sb: EgressSandbox): Promise<{ resolvConf: string; gateway4: string } | undefined>;
  attach(sb: EgressSandbox, initPid: number): Promise<void>;
  teardown(sb: Pick<EgressSandbox, 'id' | 'slot'>): Promise<void>;
}

export interface EgressSandbox {
  id: string;
  slot: number;
  spec: { networkRules: Record<string, boolean>; networkAllow?: NetworkTarget[] | undefined };
}

/**
 * A {@link BuildNetwork} from the edge's egress machinery: each build is a
 * pseudo-sandbox `build-<random>` on a slot of its own (from `slots`, which
 * must not overlap the sandboxes' slots of the same manager), with the
 * sandbox's DNS-name allowlist, nftables elements and resolver; its network
 * namespace is held by an `unshare --net` process. Torn down (holder killed,
 * then the manager's `teardown`) by `close`, or when opening fails half way.
 */
export function egressBuildNetwork(
  manager: EgressManager,
  slots: { first: number; count: number },
): BuildNetwork {
  const taken = new Set<number>();
  return {
    async open({ allow }) {
      let slot = -1;
      for (let i = 0; i < slots.count; i++) {
        if (!taken.has(slots.first + i)) {
          slot = slots.first + i;
          break;
        }
      }
      if (slot < 0) {
        throw new DsecError(
          'capacity_exhausted',
          `all ${slots.count} build network slots are in use`,
        );
      }
      taken.add(slot);
      const sb: EgressSandbox = {
        id: `build-${randomBytes(8).toString('hex')}`,
        slot,
        spec: { networkRules: {}, networkAllow: allow },
      };
      let holder: ChildProcess | undefined;
      const close = async (): Promise<void> => {
        if (holder && holder.exitCode === null && holder.signalCode === null) {
          const gone = new Promise((r) => holder!.once('exit', r));
          holder.kill('SIGKILL');
          await gone;
        }
        holder = undefined;
        await manager.teardown(sb);
        taken.delete(slot);
      };
      try {
        const net = await manager.setup(sb);
        if (!net) {
          throw new DsecError(
            'unavailable',
            'this node has no sandbox networking (isolated mode) for build steps',
          );
        }
        // setpriv's parent-death signal: a build process killed outright (SIGKILL, OOM)
        // takes the holder with it, instead of leaving a namespace held forever.
        holder = spawn(
          'setpriv',
          ['--pdeathsig', 'KILL', '--', 'unshare', '--net', '--', 'sleep', '2147483647'],
          { stdio: 'ignore' },
        );
        const pid = holder.pid;
        if (pid === undefined)
          throw new DsecError('internal', 'cannot start the build network holder');
        const nsPath = `/proc/${pid}/ns/net`;
        // The holder is in its own namespace once its link differs from ours.
        const mine = await readlink('/proc/self/ns/net');
        for (let i = 0; ; i++) {
          const link = await readlink(nsPath).catch(() => mine);
          if (link !== mine) break;
          if (i > 200 || holder.exitCode !== null) {
            throw new DsecError('internal', 'the build network holder did not start');
          }
          await sleep(5);
        }
        await manager.attach(sb, pid);
        let closed: Promise<void> | undefined;
        return { nsPath, nameserver: net.gateway4, close: () => (closed ??= close()) };
      } catch (err) {
        await close().catch(() => undefined);
        throw err;
      }
    },
  };
}
