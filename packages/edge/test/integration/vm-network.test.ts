/**
 * A full VM's network (ADR 0016, docs/vm.md) against the tests' fake
 * internet (fake-internet.ts), as microvm-network.test.ts does for a
 * microVM: a tap under the same firewall elements and resolver as a
 * container's veth, a virtio-net NIC on q35's PCI bus, `eth0` configured by
 * the image's dsec-root service. Every packet goes to hosts this test
 * creates in a network namespace it creates (the edge's only uplink and
 * upstream resolver); the guard table drops anything else. One TCG boot of
 * a whole Debian (1–2 minutes): opt-in with DSEC_TEST_VM=all, and skipped
 * without root, nftables, QEMU or the VM image (/var/cache/dsec/vm or
 * DSEC_VM_IMAGE_DIR).
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readdir, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { randomId } from '@dsec/core';
import {
  DEFAULT_VM_IMAGE_DIR,
  findQemu,
  findVmImage,
  openContainerEdge,
  type Edge,
  type LinuxNetwork,
} from '@dsec/edge';
import { startFakeInternet, type FakeInternet } from './fake-internet.js';
import { makeStateDir, spec } from './fixture.js';

const imageDir = process.env.DSEC_VM_IMAGE_DIR || DEFAULT_VM_IMAGE_DIR;
const skip =
  process.env.DSEC_TEST_VM !== 'all'
    ? 'set DSEC_TEST_VM=all'
    : process.getuid?.() !== 0 || spawnSync('nft', ['list', 'tables']).status !== 0
      ? 'needs root and nftables'
      : !findQemu() || !findVmImage(imageDir)
        ? 'needs QEMU and the VM image'
        : false;

let state: Awaited<ReturnType<typeof makeStateDir>>;
let fake: FakeInternet;

before(async () => {
  if (skip) return;
  state = await makeStateDir();
  fake = await startFakeInternet();
});

after(async () => {
  if (skip) return;
  for (const e of await readdir('/proc')) {
    const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes('qemu-system') && cmd.includes(state.dir)) process.kill(Number(e), 'SIGKILL');
  }
  await fake?.close();
  await state?.cleanup();
});

function openEdge(): Promise<Edge> {
  return openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(state.dir, 'edge'),
    store: state.store,
    cgroupParent: state.cgroupParent,
    fncall: false,
    microvm: false,
    vm: { imageDir },
    network: {
      mode: 'isolated',
      upstream: [fake.dns],
      uplinks: [fake.uplink],
      publicRanges: fake.publicRanges,
    },
  });
}

test(
  'a VM reaches an allowed domain through the edge resolver, nothing else, and leaves nothing behind',
  { skip, timeout: 900_000 },
  async () => {
    const edge = await openEdge();
    const net = edge.options.network as LinuxNetwork;
    fake.guard({
      subnet4: `${net.subnet4.address}/${net.subnet4.prefix}`,
      subnet6: net.subnet6 && `${net.subnet6.address}/${net.subnet6.prefix}`,
    });
    const id = randomId('sb');
    const sh = async (line: string) =>
      (await edge.runCommand(id, { shell: `${line} 2>&1`, timeoutMs: 60_000 })).stdout;
    const get = (host: string, seconds = 10) =>
      sh(`printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w ${seconds} ${host} 80`);
    try {
      await fake.clear();
      await edge.createSandbox({
        id,
        projectId: 'p1',
        spec: spec({
          backend: 'vm',
          memoryLimitMb: 512,
          networkAllow: [{ domain: 'allowed.test' }],
        }),
      });
      const names = net.sandboxNetwork(id);
      assert.ok(names);
      const owner = Number(await readFile(`/sys/class/net/${names.veth}/owner`, 'utf8'));
      assert.ok(owner >= 100_000, `the tap belongs to the VM's own uid, not ${owner}`);
      assert.match(await sh('ls /sys/class/net'), /eth0/);
      assert.match(await sh('cat /etc/resolv.conf'), new RegExp(`nameserver ${names.host4}`));
      assert.match(
        await sh('nslookup allowed.test'),
        new RegExp(fake.allowedIp.replaceAll('.', '\\.')),
      );
      assert.match(await get('allowed.test'), /hello from/);
      assert.match(await sh('nslookup denied.test'), /NXDOMAIN|can't resolve/);
      assert.doesNotMatch(await get(fake.deniedIp, 5), /hello from/);
      assert.deepEqual(
        (await fake.log()).filter((e) => e.server === fake.deniedIp),
        [],
        'nothing reached the denied host',
      );
      await edge.stopSandbox(id);
      assert.equal(net.sandboxNetwork(id), undefined, 'the network went with the sandbox');
      assert.ok(
        !(await readdir('/sys/class/net')).includes(names.veth),
        'the tap went with the sandbox',
      );
    } finally {
      await edge.stopSandbox(id).catch(() => undefined);
      await edge.close();
    }
    assert.notEqual(
      spawnSync('nft', ['list', 'table', 'inet', net.table]).status,
      0,
      'table removed',
    );
  },
);
