/**
 * A microVM's network (ADR 0016) against the tests' fake internet
 * (fake-internet.ts): a tap under the same firewall elements and resolver
 * as a container's veth. Every packet goes to hosts this test creates in a
 * network namespace it creates; that namespace is the edge's only uplink and
 * upstream resolver, and the guard table drops anything else a sandbox
 * sends. Two TCG boots in all. Skipped where QEMU, the built kernel, root or
 * nftables are absent.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { randomId } from '@dsec/core';
import {
  DEFAULT_MICROVM_ASSETS_DIR,
  ensureMicrovmAssets,
  findMicrovmAssets,
  findQemu,
  openContainerEdge,
  type Edge,
  type LinuxNetwork,
} from '@dsec/edge';
import { startFakeInternet, type FakeInternet } from './fake-internet.js';
import { makeStateDir, spec } from './fixture.js';

const skip =
  process.getuid?.() !== 0 || spawnSync('nft', ['list', 'tables']).status !== 0
    ? 'needs root and nftables'
    : !findQemu() || !findMicrovmAssets(DEFAULT_MICROVM_ASSETS_DIR)
      ? 'needs QEMU and the microVM kernel (dsec setup)'
      : false;

let state: Awaited<ReturnType<typeof makeStateDir>>;
let fake: FakeInternet;

before(async () => {
  if (skip) return;
  // The initramfs must carry this tree's agent and modules (a no-op when it does).
  await ensureMicrovmAssets();
  state = await makeStateDir();
  fake = await startFakeInternet();
});

after(async () => {
  if (skip) return;
  // Whatever failed, no QEMU of this test outlives it.
  for (const e of await readdir('/proc')) {
    const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
    if (cmd.includes('qemu-system') && cmd.includes(state.dir)) process.kill(Number(e), 'SIGKILL');
  }
  await fake?.close();
  await state?.cleanup();
});

function openEdge(microvm?: { bootTimeoutMs: number }): Promise<Edge> {
  return openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(state.dir, 'edge'),
    store: state.store,
    cgroupParent: state.cgroupParent,
    fncall: false,
    network: {
      mode: 'isolated',
      upstream: [fake.dns],
      uplinks: [fake.uplink],
      publicRanges: fake.publicRanges,
    },
    ...(microvm ? { microvm } : {}),
  });
}

test(
  'a microVM reaches an allowed domain through the edge resolver, nothing else, and leaves nothing behind',
  { skip, timeout: 240_000 },
  async () => {
    let edge = await openEdge();
    const net = edge.options.network as LinuxNetwork;
    fake.guard({
      subnet4: `${net.subnet4.address}/${net.subnet4.prefix}`,
      subnet6: net.subnet6 && `${net.subnet6.address}/${net.subnet6.prefix}`,
    });
    const table = net.table;
    const withNet = randomId('sb');
    const without = randomId('sb');
    const sh = async (id: string, line: string) =>
      (await edge.runCommand(id, { shell: `${line} 2>&1`, timeoutMs: 30_000 })).stdout;
    // busybox's nc (its static wget crashes in this guest's image).
    const get = (id: string, host: string, seconds = 10) =>
      sh(id, `printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w ${seconds} ${host} 80`);
    try {
      await fake.clear();
      await Promise.all([
        edge.createSandbox({
          id: withNet,
          projectId: 'p1',
          spec: spec({
            backend: 'microvm',
            memoryLimitMb: 200,
            networkAllow: [{ domain: 'allowed.test' }],
          }),
        }),
        edge.createSandbox({
          id: without,
          projectId: 'p1',
          spec: spec({ backend: 'microvm', memoryLimitMb: 200 }),
        }),
      ]);

      // No rules: no network device at all, and no tap on the host.
      assert.deepEqual((await sh(without, 'ls /sys/class/net')).trim().split('\n'), ['lo']);
      const taps = (await readdir('/sys/class/net')).filter((n) => n.startsWith('dsv'));
      const vmTaps = taps.filter((n) => existsSync(`/sys/class/net/${n}/tun_flags`));
      assert.equal(vmTaps.length, 1, `one tap on the host: ${vmTaps.join(' ')}`);
      const tap = vmTaps[0]!;
      const owner = Number(await readFile(`/sys/class/net/${tap}/owner`, 'utf8'));
      assert.ok(owner >= 100_000, `the tap belongs to the VM's own uid, not ${owner}`);

      // Allowed by domain: the guest resolves through the edge and connects.
      assert.match(await sh(withNet, 'ls /sys/class/net'), /eth0/);
      const names = net.sandboxNetwork(withNet);
      assert.ok(names);
      const gateway = names.host4;
      assert.equal(names.veth, tap, "the tap has the name a container's veth would have");
      assert.match(await sh(withNet, 'cat /etc/resolv.conf'), new RegExp(`nameserver ${gateway}`));
      assert.match(
        await sh(withNet, 'nslookup allowed.test'),
        new RegExp(fake.allowedIp.replaceAll('.', '\\.')),
      );
      assert.match(await get(withNet, 'allowed.test', 10), /hello from/);
      // Over IPv6 too (the tap's /64), when the edge has a v6 range.
      if (net.subnet6) assert.match(await get(withNet, `${fake.allowedIp6}`, 10), /hello from/);

      // Denied: the name does not resolve, its address fails at once, nothing arrives.
      assert.match(await sh(withNet, 'nslookup denied.test'), /NXDOMAIN|can't resolve/);
      assert.doesNotMatch(await get(withNet, `${fake.deniedIp}`, 5), /hello from/);
      assert.deepEqual(
        (await fake.log()).filter((e) => e.server === fake.deniedIp),
        [],
        'nothing reached the denied host',
      );
      // Both show as the sandbox's audit events, as a container's do.
      const events = await edge.listEvents(withNet);
      assert.ok(
        events.some((e) => e.kind === 'dns_blocked' && e.details.name === 'denied.test'),
        JSON.stringify(events),
      );
      assert.ok(
        events.some((e) => e.kind === 'network_denied' && e.details.destination === fake.deniedIp),
        JSON.stringify(events),
      );
      // The resolver file is the edge's, read-only (the guest's root could unmount it: the
      // firewall, not the file, keeps DNS on the edge's resolver).
      assert.match(
        await sh(withNet, 'echo nameserver 127.0.0.1 > /etc/resolv.conf; echo rc=$?'),
        /^rc=1$/m,
      );

      // A live policy change opens the other host, as for a container.
      await edge.updateNetwork(withNet, {
        allow: [{ domain: 'allowed.test' }, { domain: 'denied.test' }],
      });
      assert.match(await get(withNet, 'denied.test', 10), /hello from/);
      // The VM without a device: rules cannot give it one.
      await assert.rejects(
        edge.updateNetwork(without, { allow: [{ domain: 'allowed.test' }] }),
        (err: { code?: string }) => err.code === 'invalid_argument',
      );

      // An edge restart adopts the VM's network: the resolver answers again.
      await edge.close();
      edge = await openEdge();
      assert.match(await get(withNet, 'allowed.test', 10), /hello from/);
      const net2 = edge.options.network as LinuxNetwork;
      assert.equal(
        net2.sandboxNetwork(without),
        undefined,
        'the VM without a device is not networked',
      );

      await edge.stopSandbox(withNet);
      await edge.stopSandbox(without);
      // Nothing of either is left: no tap, no firewall element.
      assert.equal(existsSync(`/sys/class/net/${tap}`), false, 'the tap is gone after stop');
      const ruleset = spawnSync('nft', ['list', 'table', 'inet', table], {
        encoding: 'utf8',
      }).stdout;
      assert.doesNotMatch(ruleset, new RegExp(tap));
      assert.doesNotMatch(ruleset, new RegExp(`${names.sandbox4.replaceAll('.', '\\.')}\\b`));
    } finally {
      await edge.stopSandbox(withNet).catch(() => undefined);
      await edge.stopSandbox(without).catch(() => undefined);
      await edge.close();
    }
    assert.notEqual(spawnSync('nft', ['list', 'table', 'inet', table]).status, 0, 'table removed');
  },
);

test(
  'a networked microVM that fails to boot is rolled back with its tap and elements',
  { skip, timeout: 120_000 },
  async () => {
    // The boot deadline passes at once: QEMU starts on the tap, the create fails, the edge rolls back.
    const edge = await openEdge({ bootTimeoutMs: 1 });
    const net = edge.options.network as LinuxNetwork;
    const id = randomId('sb');
    try {
      await assert.rejects(
        edge.createSandbox({
          id,
          projectId: 'p1',
          spec: spec({
            backend: 'microvm',
            memoryLimitMb: 200,
            networkAllow: [{ domain: 'allowed.test' }],
          }),
        }),
        (err: { code?: string }) => err.code === 'deadline_exceeded',
      );
      const taps = Array.from({ length: 4 }, (_, slot) => net.names({ id, slot }));
      for (const t of taps)
        assert.equal(existsSync(`/sys/class/net/${t.veth}`), false, `${t.veth} is gone`);
      const ruleset = spawnSync('nft', ['list', 'table', 'inet', net.table], {
        encoding: 'utf8',
      }).stdout;
      assert.doesNotMatch(ruleset, /dsv[0-9a-f]{12}/, 'no interface element is left');
      assert.equal(net.sandboxNetwork(id), undefined);
    } finally {
      await edge.stopSandbox(id).catch(() => undefined);
      await edge.close();
    }
  },
);
