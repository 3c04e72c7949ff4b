import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { chmod, mkdir, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startSingleNode, type SingleNode, type SingleNodeOptions } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import type { LinuxNetwork } from '../../src/network/linux-network.js';
import { startFakeInternet, type FakeInternet } from './fake-internet.js';

/** A fresh 0711 work directory (sandboxes' mapped roots must traverse it). */
export async function workDir(prefix: string): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), prefix));
  await chmod(dir, 0o711);
  return dir;
}

export function hasGcc(): boolean {
  return spawnSync('gcc', ['--version']).status === 0;
}

/**
 * Builds the `busybox` base layer and the `probe` toolkit: a static C test
 * program (fixtures/probe.c) at /usr/local/bin/probe. The probe refuses to run
 * outside a user-namespaced sandbox; never run it on the host.
 */
export async function buildTestLayers(node: SingleNode, work: string): Promise<void> {
  const rootfs = join(work, 'busybox-rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  const toolkit = join(work, 'probe-toolkit');
  await mkdir(join(toolkit, 'usr/local/bin'), { recursive: true });
  const src = fileURLToPath(new URL('./fixtures/probe.c', import.meta.url));
  execFileSync('gcc', ['-static', '-O1', '-w', '-o', join(toolkit, 'usr/local/bin/probe'), src]);
  await node.buildLayer({ name: 'probe', kind: 'toolkit', from: { dir: toolkit } });
}

/** A single node behind the fake internet, with the test layers built: the egress tests' fixture. */
export interface EgressNode {
  work: string;
  fake: FakeInternet;
  node: SingleNode;
  net: LinuxNetwork;
  client: DSecClient;
  /** A sandbox from `busybox` with the `probe` toolkit, stopped by `close`. */
  create(opts?: Parameters<DSecClient['runContainer']>[0]): Promise<Sandbox>;
  /** A shell line's stdout and stderr together. */
  sh(sb: Sandbox, line: string, timeoutMs?: number): Promise<string>;
  /** Stops everything, then checks the edge's nftables table is gone. */
  close(): Promise<void>;
}

type NetworkExtras = Omit<
  NonNullable<SingleNodeOptions['network']>,
  'mode' | 'upstream' | 'uplinks'
>;

export async function startEgressNode(
  prefix: string,
  network: (fake: FakeInternet) => NetworkExtras = () => ({}),
): Promise<EgressNode> {
  const work = await workDir(prefix);
  const sandboxes: Sandbox[] = [];
  let fake: FakeInternet | undefined;
  let node: SingleNode | undefined;
  let net: LinuxNetwork | undefined;
  let client: DSecClient | undefined;
  const close = async (): Promise<void> => {
    try {
      for (const sb of sandboxes) await sb.stop().catch(() => undefined);
      client?.close();
      await node?.close({ stopSandboxes: true });
    } finally {
      await fake?.close();
      await rm(work, { recursive: true, force: true });
    }
    if (net) assert.notEqual(spawnSync('nft', ['list', 'table', 'inet', net.table]).status, 0);
  };
  try {
    fake = await startFakeInternet();
    node = await startSingleNode({
      stateDir: join(work, 'state'),
      port: 0,
      network: {
        mode: 'isolated',
        upstream: [fake.dns],
        uplinks: [fake.uplink],
        publicRanges: fake.publicRanges,
        ...network(fake),
      },
    });
    net = node.edge.options.network as LinuxNetwork;
    fake.guard({
      subnet4: `${net.subnet4.address}/${net.subnet4.prefix}`,
      subnet6: net.subnet6 && `${net.subnet6.address}/${net.subnet6.prefix}`,
    });
    await buildTestLayers(node, work);
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
  } catch (err) {
    await close().catch(() => undefined);
    throw err;
  }
  const c = client;
  return {
    work,
    fake,
    node,
    net,
    client: c,
    async create(opts = { image: 'busybox' }) {
      const sb = await c.runContainer({ toolkits: ['probe'], ...opts, image: 'busybox' });
      sandboxes.push(sb);
      return sb;
    },
    async sh(sb, line, timeoutMs = 120_000) {
      return (await sb.runShell(`${line} 2>&1`, { timeoutMs })).stdout;
    },
    close,
  };
}
