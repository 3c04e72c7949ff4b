import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import fc from 'fast-check';
import { isDsecError } from '@dsec/core';
import { discoverGpuInventory, nodeGpuHostProbe } from './discover.js';
import {
  A100_MIG_NODE,
  A100_MIG_UUIDS,
  fixtureCapMinor,
  fixtureProbe,
  H200_NODE,
  type GpuHostFixture,
} from './gpu-fixtures.js';
import {
  legacyMigIds,
  parseContainerCliList,
  parseGpuInformation,
  parseGpuList,
  parseGpuQuery,
  parseMigDeviceTable,
  parseMigMinors,
  parseProcDevices,
  procGpuDir,
} from './inventory.js';

const QUERY = Object.keys(H200_NODE.commands).find((c) => c.includes('--query-gpu'))!;

const unavailable = (pattern: RegExp) => (e: unknown) =>
  isDsecError(e, 'unavailable') && pattern.test(e.message);

/** A fixture with some parts replaced. */
function variant(base: GpuHostFixture, change: (f: GpuHostFixture) => void): GpuHostFixture {
  const f = structuredClone(base);
  change(f);
  return f;
}

test('parseGpuQuery reads nounits and unit forms, MIG modes, and refuses what it cannot read', () => {
  const rows =
    parseGpuQuery(`0, GPU-aa-bb, NVIDIA H200, 143771 MiB, 00000000:18:00.0, 550.90.07, Disabled
1, GPU-cc-dd, NVIDIA A100-SXM4-80GB, 81920, 00000000:0F:00.0, 535.183.01, Enabled
2, GPU-ee-ff, Tesla T4, 15360, 00000000:AF:00.0, 535.183.01, [N/A]
`);
  assert.deepEqual(
    rows.map((r) => [r.index, r.name, r.memoryMib, r.migEnabled]),
    [
      [0, 'NVIDIA H200', 143771, false],
      [1, 'NVIDIA A100-SXM4-80GB', 81920, true],
      [2, 'Tesla T4', 15360, false],
    ],
  );
  // A field list that does not match ours (an older query), and an error text nvidia-smi prints.
  assert.throws(() => parseGpuQuery('0, GPU-aa-bb, NVIDIA H200, 143771'), unavailable(/line 1/));
  assert.throws(
    () =>
      parseGpuQuery(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
      ),
    unavailable(/cannot read line 1/),
  );
});

test('parseGpuList reads GPUs and their MIG instances, in both UUID forms', () => {
  const list = parseGpuList(A100_MIG_NODE.commands['nvidia-smi -L']!);
  assert.deepEqual(
    list.map((g) => [g.index, g.name, g.mig.map((m) => [m.profile, m.deviceIndex, m.uuid])]),
    [
      [
        0,
        'NVIDIA A100-SXM4-80GB',
        [
          ['3g.40gb', 0, A100_MIG_UUIDS.g3],
          ['1g.10gb', 1, A100_MIG_UUIDS.g1a],
          ['1g.10gb', 2, A100_MIG_UUIDS.g1b],
        ],
      ],
      [1, 'NVIDIA A100-SXM4-80GB', []],
    ],
  );
  // R450's form carries GI and CI in the UUID itself.
  const old = parseGpuList(`GPU 0: A100-SXM4-40GB (UUID: GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2)
  MIG 1g.5gb Device 0: (UUID: MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/7/0)
`);
  assert.equal(old[0]?.mig[0]?.uuid, 'MIG-GPU-e91edf3b-b297-37c1-a2a7-7601c3238fa2/7/0');
  assert.deepEqual(legacyMigIds(old[0].mig[0].uuid), { gi: 7, ci: 0 });
  assert.equal(legacyMigIds(A100_MIG_UUIDS.g3), undefined);
  assert.throws(() => parseGpuList('  MIG 1g.5gb Device 0: (UUID: MIG-x)'), unavailable(/-L/));
});

test('parseMigDeviceTable reads only the MIG devices table', () => {
  assert.deepEqual(parseMigDeviceTable(A100_MIG_NODE.commands['nvidia-smi']!), [
    { gpu: 0, gi: 2, ci: 0, migDevice: 0, memoryMib: 40192 },
    { gpu: 0, gi: 9, ci: 0, migDevice: 1, memoryMib: 9728 },
    { gpu: 0, gi: 10, ci: 0, migDevice: 2, memoryMib: 9728 },
  ]);
});

test('parseProcDevices keeps character devices only; procGpuDir maps the bus id', () => {
  const majors = parseProcDevices(`Character devices:
195 nvidia-frontend
237 nvidia-uvm

Block devices:
  8 nvidia-uvm
`);
  assert.equal(majors.get('nvidia-uvm'), 237);
  assert.equal(majors.get('nvidia-frontend'), 195);
  assert.equal(procGpuDir('00000000:AB:00.0'), '/proc/driver/nvidia/gpus/0000:ab:00.0');
  assert.equal(procGpuDir('0001:1B:00.0'), '/proc/driver/nvidia/gpus/0001:1b:00.0');
  assert.throws(
    () => procGpuDir('18:00.0'),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('discovery on the 8 × H200 node: eight whole GPUs, control nodes, driver files with sonames', async () => {
  const probe = fixtureProbe(H200_NODE);
  const inv = await discoverGpuInventory({ probe });
  assert.equal(inv.driverVersion, '550.90.07');
  assert.equal(inv.gpus.length, 8);
  assert.deepEqual(
    inv.gpus.map((g) => [g.index, g.node.path, g.node.major, g.node.minor, g.migEnabled]),
    Array.from({ length: 8 }, (_, i) => [i, `/dev/nvidia${i}`, 195, i, false]),
  );
  assert.equal(inv.gpus[3]?.pciBusId, '00000000:5D:00.0');
  assert.equal(inv.gpus[3]?.memoryMib, 143771);
  assert.deepEqual(inv.control, {
    ctl: { path: '/dev/nvidiactl', major: 195, minor: 255 },
    uvm: { path: '/dev/nvidia-uvm', major: 237, minor: 0 },
    uvmTools: { path: '/dev/nvidia-uvm-tools', major: 237, minor: 1 },
    modeset: { path: '/dev/nvidia-modeset', major: 195, minor: 254 },
  });
  const cuda = inv.driverFiles.find((f) => f.hostPath.endsWith('libcuda.so.550.90.07'));
  assert.deepEqual(cuda?.names, ['libcuda.so.550.90.07', 'libcuda.so', 'libcuda.so.1']);
  const nvvm = inv.driverFiles.find((f) => f.hostPath.includes('libnvidia-nvvm'));
  assert.deepEqual(nvvm?.names, ['libnvidia-nvvm.so.550.90.07', 'libnvidia-nvvm.so.4']);
  assert.ok(!inv.driverFiles.some((f) => f.names.includes('libc.so.6')));
  // Only nvidia-smi of the driver's programs: no persistenced, no MPS control.
  assert.deepEqual(
    inv.driverFiles.filter((f) => f.kind === 'binary').map((f) => f.hostPath),
    ['/usr/bin/nvidia-smi'],
  );
  // No MIG: neither the plain nvidia-smi table nor mig-minors is read.
  assert.ok(!probe.ran.includes('nvidia-smi'));
});

test('discovery on the A100 MIG node: instances with GI/CI, capability nodes under the right minor', async () => {
  const inv = await discoverGpuInventory({ probe: fixtureProbe(A100_MIG_NODE) });
  const [g0, g1] = inv.gpus;
  // The driver numbered them against PCI order: index 0 is /dev/nvidia1.
  assert.equal(g0?.node.path, '/dev/nvidia1');
  assert.equal(g1?.node.path, '/dev/nvidia0');
  assert.equal(g0?.migEnabled, true);
  assert.equal(g1?.migEnabled, false);
  assert.equal(inv.control.modeset, undefined);
  assert.equal(inv.control.uvm.major, 239);
  assert.deepEqual(
    g0?.migInstances.map((m) => [m.profile, m.gpuInstanceId, m.computeInstanceId, m.memoryMib]),
    [
      ['3g.40gb', 2, 0, 40192],
      ['1g.10gb', 9, 0, 9728],
      ['1g.10gb', 10, 0, 9728],
    ],
  );
  const small = g0?.migInstances[1];
  assert.equal(small?.uuid, A100_MIG_UUIDS.g1a);
  assert.deepEqual(small?.capNodes, [
    {
      path: `/dev/nvidia-caps/nvidia-cap${fixtureCapMinor(1, 9)}`,
      major: 236,
      minor: fixtureCapMinor(1, 9),
    },
    {
      path: `/dev/nvidia-caps/nvidia-cap${fixtureCapMinor(1, 9, 0)}`,
      major: 236,
      minor: fixtureCapMinor(1, 9, 0),
    },
  ]);
});

test('discovery refuses to guess: missing minors, nodes, modules, tables and tools fail with the reason', async () => {
  const cases: [string, GpuHostFixture, RegExp][] = [
    [
      'no procfs information for a GPU',
      variant(H200_NODE, (f) => {
        delete f.files['/proc/driver/nvidia/gpus/0000:2a:00.0/information'];
      }),
      /cannot read \/proc\/driver\/nvidia\/gpus\/0000:2a:00.0\/information/,
    ],
    [
      'uvm not loaded',
      variant(H200_NODE, (f) => {
        f.files['/proc/devices'] = f.files['/proc/devices']!.replace('237 nvidia-uvm\n', '');
      }),
      /no nvidia-uvm/,
    ],
    [
      'a device node not created',
      variant(H200_NODE, (f) => {
        delete f.devices['/dev/nvidia-uvm-tools'];
      }),
      /\/dev\/nvidia-uvm-tools does not exist/,
    ],
    [
      'a GPU node not created',
      variant(H200_NODE, (f) => {
        delete f.devices['/dev/nvidia7'];
      }),
      /\/dev\/nvidia7 does not exist/,
    ],
    [
      'a device node with other numbers',
      variant(H200_NODE, (f) => {
        f.devices['/dev/nvidia5'] = [195, 6];
      }),
      /\/dev\/nvidia5 is 195:6, expected 195:5/,
    ],
    [
      '-L and --query-gpu disagree (a GPU fell off the bus between them)',
      variant(H200_NODE, (f) => {
        f.commands['nvidia-smi -L'] = f.commands['nvidia-smi -L']!.split('\n')
          .slice(0, 7)
          .join('\n');
      }),
      /not listed by nvidia-smi -L/,
    ],
    [
      'a MIG device missing from the table',
      variant(A100_MIG_NODE, (f) => {
        f.commands['nvidia-smi'] = f.commands['nvidia-smi']!.replace(
          /\|\s+0\s+10\s+0\s+2\s+\|.*\n/,
          '',
        );
      }),
      /MIG device 2 of GPU 0 is missing/,
    ],
    [
      'no driver',
      variant(H200_NODE, (f) => {
        delete f.commands[QUERY];
      }),
      /nvidia-smi --query-gpu=.* failed/,
    ],
    [
      'no container CLI',
      variant(H200_NODE, (f) => {
        delete f.commands['nvidia-container-cli list --libraries'];
      }),
      /nvidia-container-cli list --libraries failed/,
    ],
  ];
  for (const [what, fixture, pattern] of cases) {
    await assert.rejects(
      discoverGpuInventory({ probe: fixtureProbe(fixture) }),
      unavailable(pattern),
      what,
    );
  }
});

test('a modeset module without its node is left out, not an error', async () => {
  const f = variant(H200_NODE, (x) => {
    delete x.devices['/dev/nvidia-modeset'];
  });
  const inv = await discoverGpuInventory({ probe: fixtureProbe(f) });
  assert.equal(inv.control.modeset, undefined);
  assert.equal(inv.gpus.length, 8);
});

test('discovery with a configured driver list and no container CLI', async () => {
  const probe = fixtureProbe(H200_NODE);
  const inv = await discoverGpuInventory({
    probe,
    containerCli: false,
    driverLibraries: ['/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07'],
    binaries: ['/opt/nvidia/bin/nvidia-smi'],
  });
  assert.deepEqual(
    inv.driverFiles.map((f) => [f.kind, f.hostPath]),
    [
      ['library', '/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07'],
      ['binary', '/opt/nvidia/bin/nvidia-smi'],
    ],
  );
  assert.ok(!probe.ran.some((c) => c.startsWith('nvidia-container-cli')));
  await assert.rejects(
    discoverGpuInventory({ probe: fixtureProbe(H200_NODE), containerCli: false }),
    unavailable(/give driverLibraries/),
  );
});

test('the real host probe: runs programs, reads device numbers and symlinks', async (t) => {
  const probe = nodeGpuHostProbe();
  assert.equal(await probe.run('echo', ['a', 'b'], { timeoutMs: 10_000 }), 'a b\n');
  await assert.rejects(probe.run('false', [], { timeoutMs: 10_000 }));
  assert.deepEqual(await probe.charDevice('/dev/null'), { major: 1, minor: 3 });
  assert.equal(await probe.charDevice('/etc/hostname'), undefined);
  assert.equal(await probe.charDevice('/dev/nonexistent-dsec'), undefined);
  const dir = mkdtempSync(join(tmpdir(), 'dsec-gpu-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  writeFileSync(join(dir, 'libx.so.1.2.3'), '');
  symlinkSync('libx.so.1.2.3', join(dir, 'libx.so.1'));
  symlinkSync('libx.so.1', join(dir, 'libx.so'));
  symlinkSync('missing', join(dir, 'dangling'));
  const links = await probe.symlinksIn(dir);
  assert.deepEqual(links.map((l) => [l.name, l.resolved]).sort(), [
    ['libx.so', join(dir, 'libx.so.1.2.3')],
    ['libx.so.1', join(dir, 'libx.so.1.2.3')],
  ]);
});

test('property: the parsers answer any text with a result or `unavailable`, never another error', () => {
  // Text built from the pieces real output is made of, so the fuzzer reaches deep into each format.
  const piece = fc.constantFrom(
    '0',
    '1',
    '195',
    ', ',
    ' ',
    '\n',
    '|',
    'GPU ',
    'GPU-aa-bb',
    'MIG ',
    'MIG-cc-dd',
    '1g.10gb',
    ' Device  0: (UUID: ',
    ')',
    'NVIDIA H200',
    '143771',
    ' MiB',
    '00000000:18:00.0',
    'Enabled',
    'Character devices:',
    'Block devices:',
    'nvidia-uvm',
    'MIG devices:',
    'Processes:',
    '13MiB / 40192MiB',
    'Device Minor: ',
  );
  const text = fc.oneof(
    fc.string({ maxLength: 300 }),
    fc.array(piece, { maxLength: 60 }).map((a) => a.join('')),
  );
  const parsers: ((t: string) => unknown)[] = [
    parseGpuQuery,
    parseGpuList,
    parseMigDeviceTable,
    parseProcDevices,
    parseGpuInformation,
    parseMigMinors,
    parseContainerCliList,
  ];
  fc.assert(
    fc.property(text, (t) => {
      for (const parse of parsers) {
        try {
          parse(t);
        } catch (e) {
          assert.ok(isDsecError(e, 'unavailable'), String(e));
        }
      }
    }),
    { numRuns: 2000 },
  );
});
