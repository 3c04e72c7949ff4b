import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { NetworkManager, NetworkSandbox, TapLink } from '../../network/network-manager.js';
import { hasNetworkLink } from '../../network/network-manager.js';

/** What of the edge's network manager a microVM uses. */
export type MicrovmNetwork = Pick<NetworkManager, 'setup' | 'teardown'> &
  Partial<Pick<NetworkManager, 'attachTap'>>;

/**
 * A microVM's network (ADR 0016): none unless its spec opens something (its
 * device is fixed at boot, see {@link hasNetworkLink}); else the edge's
 * firewall elements and resolver as for a container (`setup`), and a tap
 * owned by the hypervisor's uid in place of the veth's host end
 * (`attachTap`). Also none where the edge's manager has no taps (network
 * mode `none`: rules are accepted and open nothing, as for containers).
 * `teardown` (the backend's stop) removes both, also after a failure here.
 */
export async function connectMicrovm(
  network: MicrovmNetwork | undefined,
  sb: NetworkSandbox,
  options: { ownerUid: number; dir: string; restore: boolean },
): Promise<TapLink | undefined> {
  const saved = join(options.dir, 'net.json');
  // A restored machine (pause.ts) meets the tap it had: the manager kept it
  // (and its elements) while the VM was paused, across edge restarts too.
  if (options.restore) {
    const text = await readFile(saved, 'utf8').catch(() => undefined);
    return text === undefined ? undefined : (JSON.parse(text) as TapLink);
  }
  if (!network?.attachTap || !hasNetworkLink(sb.spec)) return undefined;
  await network.setup(sb);
  const link = await network.attachTap(sb, { ownerUid: options.ownerUid });
  await writeFile(saved, JSON.stringify(link), { mode: 0o600 });
  return link;
}

/**
 * QEMU's NIC: virtio-net on the microvm machine's virtio-mmio bus, backed
 * by the tap the edge made (`script=no`: QEMU configures nothing on the
 * host). No vhost: /dev/vhost-net is another host interface the jailed
 * process would need, and TCG gains nothing from it.
 */
export function tapArgs(link: TapLink): string[] {
  if (!/^[A-Za-z0-9_-]{1,15}$/.test(link.tap))
    throw new DsecError('internal', `bad tap name ${link.tap}`);
  return [
    '-netdev',
    `tap,id=net0,ifname=${link.tap},script=no,downscript=no,vhost=off`,
    '-device',
    'virtio-net-device,netdev=net0',
  ];
}

/**
 * Kernel command-line words the guest agent configures `eth0` from
 * (guest_agent.c setup_net): `dsec.net=eth0,ADDR/PLEN,GW[,ADDR6/PLEN,GW6]`,
 * `dsec.dns=RESOLVER`. Only addresses the edge derived: nothing the tenant wrote.
 */
export function netCmdline(link: TapLink): string[] {
  const fields = [link.guest.interface];
  for (const a of link.guest.addresses) fields.push(`${a.address}/${a.prefixLength}`, a.gateway);
  const words = [`dsec.net=${fields.join(',')}`, `dsec.dns=${link.nameserver}`];
  if (words.some((w) => !/^[\w.=,/:-]+$/.test(w)))
    throw new DsecError('internal', `bad guest network parameters ${words.join(' ')}`);
  return words;
}
