import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import type { GpuHostProbe } from './discover.js';
import { EdgeGpus, readGpuInventoryFile } from './edge-gpus.js';
import type { GpuInventory } from './inventory.js';

const INVENTORY: GpuInventory = {
  driverVersion: '550.90.07',
  gpus: [
    {
      index: 0,
      uuid: 'GPU-00000000-0000-0000-0000-000000000000',
      name: 'NVIDIA A100-SXM4-80GB',
      memoryMib: 81_920,
      pciBusId: '00000000:18:00.0',
      migEnabled: true,
      node: { path: '/dev/nvidia0', major: 195, minor: 0 },
      migInstances: [
        {
          uuid: 'MIG-11111111-1111-1111-1111-111111111111',
          profile: '1g.10gb',
          parentIndex: 0,
          deviceIndex: 0,
          gpuInstanceId: 7,
          computeInstanceId: 0,
          capNodes: [
            { path: '/dev/nvidia-caps/nvidia-cap66', major: 508, minor: 66 },
            { path: '/dev/nvidia-caps/nvidia-cap67', major: 508, minor: 67 },
          ],
        },
      ],
    },
    {
      index: 1,
      uuid: 'GPU-22222222-2222-2222-2222-222222222222',
      name: 'NVIDIA A100-SXM4-80GB',
      memoryMib: 81_920,
      pciBusId: '00000000:2a:00.0',
      migEnabled: false,
      node: { path: '/dev/nvidia1', major: 195, minor: 1 },
      migInstances: [],
    },
  ],
  control: {
    ctl: { path: '/dev/nvidiactl', major: 195, minor: 255 },
    uvm: { path: '/dev/nvidia-uvm', major: 510, minor: 0 },
    uvmTools: { path: '/dev/nvidia-uvm-tools', major: 510, minor: 1 },
  },
  driverFiles: [
    {
      hostPath: '/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07',
      kind: 'library',
      names: ['libcuda.so.550.90.07', 'libcuda.so.1'],
    },
  ],
};

/** A host whose /dev has exactly the inventory's nodes (minus `missing`), and no NVIDIA tools. */
function probe(options: { missing?: string; driver?: boolean } = {}): GpuHostProbe {
  const nodes = new Map<string, { major: number; minor: number }>();
  const c = INVENTORY.control;
  for (const n of [
    c.ctl,
    c.uvm,
    c.uvmTools,
    ...INVENTORY.gpus.flatMap((g) => [g.node, ...g.migInstances.flatMap((m) => m.capNodes)]),
  ])
    if (n.path !== options.missing) nodes.set(n.path, { major: n.major, minor: n.minor });
  return {
    run: () => Promise.reject(new Error('no nvidia-smi here')),
    readFile: (path) =>
      options.driver && path === '/proc/driver/nvidia/version'
        ? Promise.resolve('NVRM version: 550.90.07\n')
        : Promise.reject(new Error(`ENOENT ${path}`)),
    charDevice: (path) => Promise.resolve(nodes.get(path)),
    symlinksIn: () => Promise.resolve([]),
  };
}

let dir: string;
before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-edge-gpus-'));
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
});

async function file(name: string, content: unknown): Promise<string> {
  const path = join(dir, name);
  await writeFile(path, typeof content === 'string' ? content : JSON.stringify(content));
  return path;
}

void describe('EdgeGpus', () => {
  test('off (and absent) means no GPUs; auto without a driver too', async () => {
    assert.equal(await EdgeGpus.open(undefined, { probe: probe() }), undefined);
    assert.equal(await EdgeGpus.open('off', { probe: probe() }), undefined);
    const logged: string[] = [];
    assert.equal(
      await EdgeGpus.open('auto', { probe: probe(), log: (m) => logged.push(m) }),
      undefined,
    );
    assert.deepEqual(logged, ['no NVIDIA driver: GPUs off']);
  });

  test('auto with a driver whose discovery fails refuses (the edge does not start)', async () => {
    await assert.rejects(EdgeGpus.open('auto', { probe: probe({ driver: true }) }), {
      code: 'unavailable',
      message: /nvidia-smi/,
    });
  });

  test('an inventory file: units, assignment with its fragment, release', async () => {
    const path = await file('ok.json', INVENTORY);
    const gpus = await EdgeGpus.open(
      { inventoryFile: path, maxSharedWorkersPerUnit: 2 },
      { probe: probe() },
    );
    assert.ok(gpus);
    assert.deepEqual(
      gpus.status().map((u) => [u.kind, u.model, u.mode, u.maxSharedWorkers]),
      [
        ['mig', '1g.10gb', 'free', 2],
        ['gpu', 'NVIDIA A100-SXM4-80GB', 'free', 2],
      ],
    );
    const mig = gpus.assign('w1', { mode: 'exclusive', model: '1g.10gb' });
    assert.equal(mig.env['CUDA_VISIBLE_DEVICES'], 'MIG-11111111-1111-1111-1111-111111111111');
    assert.ok(mig.devices.some((d) => d.path === '/dev/nvidia-caps/nvidia-cap66'));
    const whole = gpus.assign('w2', { mode: 'shared', model: 'A100-80GB' });
    assert.equal(whole.env['CUDA_VISIBLE_DEVICES'], INVENTORY.gpus[1]!.uuid);
    assert.deepEqual(gpus.heldBy('w2'), [INVENTORY.gpus[1]!.uuid]);
    assert.deepEqual(
      gpus.status().map((u) => `${u.mode}:${u.workers}`),
      ['exclusive:1', 'shared:1'],
    );
    assert.throws(() => gpus.assign('w3', { mode: 'exclusive' }), {
      code: 'capacity_exhausted',
    });
    assert.equal(gpus.release('w1'), true);
    assert.equal(gpus.release('w1'), false);
    assert.equal(gpus.release('w2'), true);
    assert.deepEqual(
      gpus.status().map((u) => u.mode),
      ['free', 'free'],
    );
  });

  test('a malformed or inconsistent inventory file is refused with what is wrong', async () => {
    const cases: [unknown, RegExp][] = [
      ['{not json', /cannot read it as JSON/],
      [{ ...INVENTORY, driverVersion: 1 }, /driverVersion/],
      [{ ...INVENTORY, gpus: {} }, /gpus must be an array/],
      [
        { ...INVENTORY, control: { ...INVENTORY.control, uvm: { path: 'dev/x', major: 1 } } },
        /control\.uvm/,
      ],
      [
        { ...INVENTORY, gpus: [INVENTORY.gpus[1], { ...INVENTORY.gpus[1], index: 2 }] },
        /gpus\.1\.uuid must be a unique/,
      ],
      [
        {
          ...INVENTORY,
          gpus: [
            {
              ...INVENTORY.gpus[0],
              migInstances: [{ ...INVENTORY.gpus[0]!.migInstances[0], capNodes: [] }],
            },
          ],
        },
        /capNodes must be its GI and CI nodes/,
      ],
      [
        {
          ...INVENTORY,
          driverFiles: [{ hostPath: '/lib/x.so', kind: 'library', names: ['../x.so'] }],
        },
        /driverFiles\.0/,
      ],
    ];
    for (const [i, [content, message]] of cases.entries()) {
      await assert.rejects(readGpuInventoryFile(await file(`bad${i}.json`, content), probe()), {
        code: 'unavailable',
        message,
      });
    }
  });

  test('an inventory naming a node the host lacks (or with other numbers) is refused', async () => {
    const path = await file('nodes.json', INVENTORY);
    await assert.rejects(readGpuInventoryFile(path, probe({ missing: '/dev/nvidia1' })), {
      code: 'unavailable',
      message: /\/dev\/nvidia1 does not exist/,
    });
    const renumbered = await file('renumbered.json', {
      ...INVENTORY,
      control: { ...INVENTORY.control, ctl: { path: '/dev/nvidiactl', major: 195, minor: 254 } },
    });
    await assert.rejects(readGpuInventoryFile(renumbered, probe()), {
      code: 'unavailable',
      message: /nvidiactl is 195:255, expected 195:254/,
    });
    await assert.rejects(
      EdgeGpus.open({ inventoryFile: join(dir, 'absent.json') }, { probe: probe() }),
      { code: 'unavailable' },
    );
  });
});
