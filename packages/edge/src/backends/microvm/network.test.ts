import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import type { NetworkSandbox, TapLink } from '../../network/network-manager.js';
import { hasNetworkLink } from '../../network/network-manager.js';
import { connectMicrovm, netCmdline, tapArgs, type MicrovmNetwork } from './network.js';

const link: TapLink = {
  tap: 'dsv0123456789ab',
  guest: {
    interface: 'eth0',
    addresses: [
      { address: '10.213.0.6', prefixLength: 30, gateway: '10.213.0.5' },
      { address: 'fd5e:c0de:d5:1::2', prefixLength: 64, gateway: 'fd5e:c0de:d5:1::1' },
    ],
  },
  nameserver: '10.213.0.5',
};

function sandbox(spec: Partial<NetworkSandbox['spec']> = {}): NetworkSandbox {
  return { id: 'sb-1', slot: 0, spec: { backend: 'microvm', networkRules: {}, ...spec } };
}

test('a microVM has a link only when its spec opens something; a container always', () => {
  assert.equal(hasNetworkLink(sandbox().spec), false);
  assert.equal(hasNetworkLink(sandbox({ networkRules: { pypi: false } }).spec), false);
  assert.equal(hasNetworkLink(sandbox({ networkRules: { pypi: true } }).spec), true);
  assert.equal(hasNetworkLink(sandbox({ networkAllow: [{ domain: 'a.test' }] }).spec), true);
  assert.equal(hasNetworkLink({ backend: 'container', networkRules: {} }), true);
  assert.equal(hasNetworkLink({ networkRules: {} }), true);
});

test('the guest gets its addresses and resolver as kernel command-line words the agent parses', () => {
  assert.deepEqual(netCmdline(link), [
    'dsec.net=eth0,10.213.0.6/30,10.213.0.5,fd5e:c0de:d5:1::2/64,fd5e:c0de:d5:1::1',
    'dsec.dns=10.213.0.5',
  ]);
  // Nothing that could split into another kernel parameter.
  assert.throws(() => netCmdline({ ...link, nameserver: '10.0.0.1 init=/bin/sh' }), /bad guest/);
  assert.deepEqual(tapArgs(link), [
    '-netdev',
    'tap,id=net0,ifname=dsv0123456789ab,script=no,downscript=no,vhost=off',
    '-device',
    'virtio-net-device,netdev=net0',
  ]);
  assert.throws(() => tapArgs({ ...link, tap: 'x,script=/bin/sh' }), /bad tap/);
});

test('connectMicrovm sets up then makes the tap, keeps the link for a restore, and skips VMs without rules', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-mvnet-'));
  try {
    const calls: string[] = [];
    const network: MicrovmNetwork = {
      setup: async () => {
        calls.push('setup');
        return undefined;
      },
      attachTap: async (_sb, { ownerUid }) => {
        calls.push(`tap ${ownerUid}`);
        return link;
      },
      teardown: async () => undefined,
    };
    const none = await connectMicrovm(network, sandbox(), { ownerUid: 7, dir, restore: false });
    assert.equal(none, undefined);
    assert.deepEqual(calls, []);

    const rules = sandbox({ networkAllow: [{ domain: 'a.test' }] });
    assert.deepEqual(
      await connectMicrovm(network, rules, { ownerUid: 100_000, dir, restore: false }),
      link,
    );
    assert.deepEqual(calls, ['setup', 'tap 100000']);
    assert.deepEqual(JSON.parse(await readFile(join(dir, 'net.json'), 'utf8')), link);

    // A restore reuses the tap the VM had: nothing is made again.
    assert.deepEqual(
      await connectMicrovm(network, rules, { ownerUid: 100_000, dir, restore: true }),
      link,
    );
    assert.deepEqual(calls, ['setup', 'tap 100000']);

    // A manager without taps (network mode `none`): rules open nothing.
    const { attachTap: _, ...noTaps } = network;
    assert.equal(
      await connectMicrovm(noTaps, rules, { ownerUid: 1, dir: join(dir, 'x'), restore: false }),
      undefined,
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
