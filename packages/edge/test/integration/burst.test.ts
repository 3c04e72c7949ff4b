/**
 * Bursts (issue 9, item 3): many concurrent creates with the default network
 * policy against a node that cannot take them all, and creates that fail
 * after everything was made. Every create is accounted for (a sandbox, or a
 * clean `capacity_exhausted`), and once all are removed nothing is left on
 * the host: no veth, nftables element, directory, mount, cgroup or process.
 * No packet leaves the host: the edge has no uplink and its resolver's
 * upstream is a closed local port.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readdir, rm, rmdir } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { DsecError, isDsecError } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { DSecClient, type Sandbox } from '@dsec/sdk';
import type { LinuxNetwork } from '../../src/network/linux-network.js';
import type { NetworkManager } from '../../src/network/network-manager.js';
import { hostResources } from './fixture.js';
import { workDir } from './network-helpers.js';

const root = process.getuid?.() === 0;
const nftOk = spawnSync('nft', ['list', 'tables']).status === 0;
const skip = !root || !nftOk ? 'needs root and nftables' : false;

/** More creates than the node takes, all at once. */
const REQUESTS = 160;
const CAP = 48;

describe('bursts of creates', { skip, timeout: 300_000 }, () => {
  let work = '';
  let node: SingleNode;
  let client: DSecClient;
  let net: LinuxNetwork;
  /** Every sandbox ID the node was asked to make, for the veth count. */
  const ids = new Set<string>();

  before(async () => {
    work = await workDir('dsec-burst-it-');
    node = await startNode();
    net = node.edge.options.network as LinuxNetwork;
    const rootfs = join(work, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfs);
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
    client = new DSecClient({ url: node.url, apiKey: node.adminKey, maxSockets: REQUESTS });
    await client.open();
  });

  after(async () => {
    try {
      client?.close();
      await node?.close({ stopSandboxes: true });
    } finally {
      if (work) await rm(work, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/dsec-test-${basename(work)}`).catch(() => undefined);
    }
  });

  function startNode(): Promise<SingleNode> {
    return startSingleNode({
      stateDir: work,
      port: 0,
      // hostResources() finds this node's cgroups under this parent.
      cgroupParent: `dsec-test-${basename(work)}`,
      capacity: { sandboxes: CAP },
      // Placement sees freed room soon after a burst's sandboxes are removed.
      watcherIntervalMs: 100,
      network: { mode: 'isolated', upstream: ['127.0.0.1:9'], uplinks: [] },
    });
  }

  /**
   * What the node's sandboxes left on the host (empty lists and zeros when
   * clean), once the kernel has removed the veths of stopped ones.
   */
  async function leftovers() {
    await net.drained();
    return {
      ...(await hostResources(work)),
      veths: [...ids].map((id) => net.names({ id, slot: 0 }).veth).filter(linkExists),
      nftElements: nftElements(net.table),
      resolvConfs: await readdir(join(work, 'edge', 'network', 'resolv')),
    };
  }
  const clean = {
    mounts: [],
    cgroups: [],
    containers: [],
    processes: [],
    sandboxDirs: [],
    veths: [],
    nftElements: 0,
    resolvConfs: [],
  };

  it('accounts for every create of a burst beyond capacity, and removing them leaves nothing', async () => {
    const outcomes = await Promise.allSettled(
      Array.from({ length: REQUESTS }, () =>
        client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25, memoryLimitMb: 128 }),
      ),
    );
    const made: Sandbox[] = [];
    const refused: string[] = [];
    for (const o of outcomes) {
      if (o.status === 'fulfilled') made.push(o.value);
      else if (isDsecError(o.reason, 'capacity_exhausted')) refused.push(o.reason.message);
      else assert.fail(`a create failed with ${String(o.reason)}, not capacity_exhausted`);
    }
    for (const sb of made) ids.add(sb.id);
    assert.ok(made.length > 0, 'no create succeeded');
    assert.ok(made.length <= CAP, `${made.length} sandboxes on a node capped at ${CAP}`);
    assert.equal(made.length + refused.length, REQUESTS);

    // Each made sandbox is running and wired: its veth and firewall elements exist.
    const listed = await client.listSandboxes();
    assert.deepEqual(new Set(listed.map((s) => s.id)), new Set(made.map((s) => s.id)));
    for (const sb of made) assert.ok(linkExists(net.names({ id: sb.id, slot: 0 }).veth), sb.id);
    assert.ok(nftElements(net.table) >= 2 * made.length);
    const r = await made[0]!.exec(['true']);
    assert.equal(r.exitCode, 0);

    await Promise.all(made.map((sb) => sb.stop()));
    assert.deepEqual(await leftovers(), clean);
  });

  it('a create that fails after its sandbox was fully started leaves nothing', async () => {
    // The last step of a create, wiring the network, fails after doing its work:
    // the sandbox's runtime, daemon, mounts, cgroups, veth and firewall elements all exist.
    await withFailing(net, 'attach', async () => {
      const err = await placed(() =>
        client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25, memoryLimitMb: 128 }),
      ).then(
        () => undefined,
        (e: unknown) => e,
      );
      assert.ok(isDsecError(err, 'internal'), String(err));
    });
    for (const sb of await node.edge.listSandboxes({ includeEnded: true })) ids.add(sb.id);
    assert.deepEqual(await leftovers(), clean);
  });

  it('a create that fails while the runtime starts leaves nothing', async () => {
    // Network setup fails (after writing its resolv.conf) while the layers,
    // cgroups and command daemon are being prepared in parallel.
    await withFailing(net, 'setup', async () => {
      const outcomes = await Promise.allSettled(
        Array.from({ length: 8 }, () =>
          placed(() =>
            client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25, memoryLimitMb: 128 }),
          ),
        ),
      );
      for (const o of outcomes) {
        assert.equal(o.status, 'rejected');
        assert.ok(isDsecError(o.reason, 'internal'), String(o.reason));
      }
    });
    for (const sb of await node.edge.listSandboxes({ includeEnded: true })) ids.add(sb.id);
    assert.deepEqual(await leftovers(), clean);
    // The node is still whole: a create works and is removed cleanly.
    const sb = await placed(() => client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25 }));
    ids.add(sb.id);
    assert.equal((await sb.exec(['true'])).exitCode, 0);
    await sb.stop();
    assert.deepEqual(await leftovers(), clean);
  });

  it('after a node restart, adopted sandboxes keep their rules and leave nothing when removed; a leftover veth drains before its slot is reused', async () => {
    const plain = await placed(() =>
      client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25 }),
    );
    const ruled = await placed(() =>
      client.runContainer({
        image: 'busybox',
        cpuCoresLimit: 0.25,
        networkAllow: [{ cidr: '198.18.0.0/16', ports: [80] }],
      }),
    );
    for (const sb of [plain, ruled]) ids.add(sb.id);
    const before = nftElements(net.table);
    // The slot the next create will get (the lowest one no live sandbox holds).
    const taken = new Set([plain, ruled].map((sb) => net.sandboxNetwork(sb.id)?.sandbox4));
    let freeSlot = 0;
    while (taken.has(net.names({ id: 'x', slot: freeSlot }).sandbox4)) freeSlot++;
    const freeNames = net.names({ id: 'x', slot: freeSlot });
    client.close();
    await node.close();

    // While the node is down, a sandbox that died left its elements and CIDR chain.
    const T = `inet ${net.table}`;
    const stale = 'dsvdeadbeef0000';
    // And an edge that crashed while a stopped sandbox's veth drained left that
    // veth (here one whose namespace never goes, so the next edge must delete it).
    const leftover = 'dsvdeadbeef0001';
    ip('link', 'add', leftover, 'type', 'veth', 'peer', 'name', 'dsxdeadbeef0001');
    ip('addr', 'add', `${freeNames.host4}/30`, 'dev', leftover);
    ip('link', 'set', leftover, 'up');
    nftScript(
      [
        `add chain ${T} pol_00000000deadbeef`,
        `add element ${T} ifaces { "${stale}" }`,
        `add element ${T} src4 { "${stale}" . ${net.subnet4.address.replace(/\.0$/, '.250')} }`,
        `add element ${T} cidr_policy { "${stale}" : jump pol_00000000deadbeef }`,
      ].join('\n'),
    );

    node = await startNode();
    net = node.edge.options.network as LinuxNetwork;
    client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    // The survivors' elements are there, the dead one's are gone with its chain.
    assert.equal(nftElements(net.table), before);
    assert.doesNotMatch(listTable(net.table), /deadbeef/);
    try {
      // The leftover's slot goes to the next create, whose veth waits for it.
      const next = await placed(() =>
        client.runContainer({ image: 'busybox', cpuCoresLimit: 0.25 }),
      );
      ids.add(next.id);
      assert.equal(net.sandboxNetwork(next.id)?.sandbox4, freeNames.sandbox4);
      assert.equal(linkExists(leftover), false);
      assert.equal((await next.exec(['true'])).exitCode, 0);
      await next.stop();
    } finally {
      spawnSync('ip', ['link', 'del', leftover]);
    }
    for (const sb of [plain, ruled]) {
      const again = client.sandbox(sb.id);
      assert.equal((await again.exec(['true'])).exitCode, 0);
      await again.stop();
    }
    assert.deepEqual(await leftovers(), clean);
    assert.doesNotMatch(listTable(net.table), /pol_/);
  });
});

/**
 * Runs a create, again while placement still refuses it: the apiserver's
 * view of the node's room lags its removals by a watcher round.
 */
async function placed<T>(create: () => Promise<T>): Promise<T> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await create();
    } catch (err) {
      if (!isDsecError(err, 'capacity_exhausted') || attempt >= 50) throw err;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
}

/** Makes `method` of the network manager do its work and then throw, for the duration of `f`. */
async function withFailing(
  net: NetworkManager,
  method: 'setup' | 'attach',
  f: () => Promise<void>,
): Promise<void> {
  const original = net[method].bind(net) as (...args: unknown[]) => Promise<unknown>;
  const target = net as unknown as Record<string, unknown>;
  target[method] = async (...args: unknown[]) => {
    await original(...args);
    throw new DsecError('internal', `injected failure after ${method}`);
  };
  try {
    await f();
  } finally {
    delete target[method];
  }
}

function ip(...args: string[]): void {
  const r = spawnSync('ip', args, { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
}

function nftScript(script: string): void {
  const r = spawnSync('nft', ['-f', '-'], { input: script + '\n', encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
}

function listTable(table: string): string {
  return spawnSync('nft', ['list', 'table', 'inet', table], { encoding: 'utf8' }).stdout;
}

function linkExists(name: string): boolean {
  return existsSync(`/sys/class/net/${name}`);
}

/**
 * Elements in every set and map of the edge's table that sandboxes fill (0 when the table is
 * gone); the protected ranges are the node's own, filled at start.
 */
function nftElements(table: string): number {
  const r = spawnSync('nft', ['-j', 'list', 'table', 'inet', table], { encoding: 'utf8' });
  if (r.status !== 0) return 0;
  const parsed = JSON.parse(r.stdout) as {
    nftables: { set?: { name: string; elem?: unknown[] }; map?: { elem?: unknown[] } }[];
  };
  return parsed.nftables.reduce(
    (n, o) =>
      o.set?.name.startsWith('protected') ? n : n + (o.set?.elem ?? o.map?.elem ?? []).length,
    0,
  );
}
