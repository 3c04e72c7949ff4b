import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { A100_MIG_NODE, A100_MIG_UUIDS, fixtureProbe, H200_NODE } from './gpu-fixtures.js';
import { gpuHostCheck } from './host-check.js';

test('host-check inventory and assign, against the fixtures', async () => {
  const inv = JSON.parse(await gpuHostCheck(['inventory'], { probe: fixtureProbe(H200_NODE) })) as {
    gpus: unknown[];
  };
  assert.equal(inv.gpus.length, 8);
  const out = JSON.parse(
    await gpuHostCheck(
      ['assign', '--mode', 'shared', '--model', '1g.10gb', '--workers', '3', '--max-shared', '2'],
      { probe: fixtureProbe(A100_MIG_NODE) },
    ),
  ) as { fragment: { env: Record<string, string> } }[];
  assert.deepEqual(
    out.map((o) => o.fragment.env['CUDA_VISIBLE_DEVICES']),
    [A100_MIG_UUIDS.g1a, A100_MIG_UUIDS.g1b, A100_MIG_UUIDS.g1a],
  );
  await assert.rejects(
    gpuHostCheck(['assign', '--workers', '9'], { probe: fixtureProbe(H200_NODE) }),
    (e) => isDsecError(e, 'capacity_exhausted'),
  );
  await assert.rejects(gpuHostCheck(['frobnicate'], { probe: fixtureProbe(H200_NODE) }), /usage/);
});

test('host-check bundle writes a config that runs the command with the assignment', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-gpu-check-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const said = await gpuHostCheck(
    [
      'bundle',
      '--count',
      '2',
      '--rootfs',
      join(dir, 'rootfs'),
      '--out',
      dir,
      '--',
      'nvidia-smi',
      '-L',
    ],
    { probe: fixtureProbe(H200_NODE) },
  );
  assert.match(said, /runc run --bundle/);
  const config = JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')) as {
    process: { args: string[]; env: string[] };
    mounts: { destination: string }[];
    linux: { devices: { path: string }[]; uidMappings: { hostID: number }[] };
  };
  assert.deepEqual(config.process.args, ['nvidia-smi', '-L']);
  assert.deepEqual(
    config.linux.devices.map((d) => d.path),
    ['/dev/nvidiactl', '/dev/nvidia-uvm', '/dev/nvidia-uvm-tools', '/dev/nvidia0', '/dev/nvidia1'],
  );
  assert.equal(config.linux.uidMappings[0]?.hostID, 0);
  assert.ok(!config.mounts.some((m) => m.destination === '/dev/.dsec-init'));
  assert.ok(config.process.env.some((e) => e.startsWith('CUDA_VISIBLE_DEVICES=GPU-')));
});
