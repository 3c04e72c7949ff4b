import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import { buildContainerConfig } from '../backends/container/spec.js';
import { GpuAllocator } from './allocator.js';
import { discoverGpuInventory } from './discover.js';
import {
  A100_MIG_NODE,
  A100_MIG_UUIDS,
  fixtureCapMinor,
  fixtureProbe,
  H200_NODE,
} from './gpu-fixtures.js';
import { GPU_LIBRARY_DIR, gpuSpecFragment, withGpu } from './oci-fragment.js';
import type { OciDeviceRule, OciLinuxDevice, OciMount } from './oci-fragment.js';

const h200 = await discoverGpuInventory({ probe: fixtureProbe(H200_NODE) });
const a100 = await discoverGpuInventory({ probe: fixtureProbe(A100_MIG_NODE) });

const CONTROL = ['/dev/nvidiactl', '/dev/nvidia-uvm', '/dev/nvidia-uvm-tools'];

test('exclusive whole GPUs: control nodes plus exactly the assigned device nodes, UUIDs in env', () => {
  const alloc = new GpuAllocator(h200);
  alloc.assign('other', { mode: 'exclusive', count: 2 }); // GPUs 0 and 1
  const a = alloc.assign('w', { mode: 'exclusive', count: 2 }); // GPUs 2 and 3
  const f = gpuSpecFragment(a, h200);
  assert.deepEqual(
    f.devices.map((d) => d.path),
    [...CONTROL, '/dev/nvidia2', '/dev/nvidia3'],
  );
  assert.deepEqual(f.devices[3], {
    path: '/dev/nvidia2',
    type: 'c',
    major: 195,
    minor: 2,
    fileMode: 0o666,
    uid: 0,
    gid: 0,
  });
  assert.deepEqual(
    f.deviceRules.map((r) => [r.allow, r.type, r.major, r.minor, r.access]),
    [
      [true, 'c', 195, 255, 'rw'],
      [true, 'c', 237, 0, 'rw'],
      [true, 'c', 237, 1, 'rw'],
      [true, 'c', 195, 2, 'rw'],
      [true, 'c', 195, 3, 'rw'],
    ],
  );
  const uuids = `${h200.gpus[2]!.uuid},${h200.gpus[3]!.uuid}`;
  assert.deepEqual(f.env, {
    CUDA_VISIBLE_DEVICES: uuids,
    NVIDIA_VISIBLE_DEVICES: uuids,
    LD_LIBRARY_PATH: GPU_LIBRARY_DIR,
  });
  // The other six GPUs are hidden from /proc/driver/nvidia/gpus.
  assert.equal(f.maskedPaths.length, 6);
  assert.ok(f.maskedPaths.includes('/proc/driver/nvidia/gpus/0000:18:00.0'));
  assert.ok(!f.maskedPaths.includes('/proc/driver/nvidia/gpus/0000:3a:00.0'));
  // modeset only when asked for.
  assert.ok(!f.devices.some((d) => d.path === '/dev/nvidia-modeset'));
  assert.ok(
    gpuSpecFragment(a, h200, { modeset: true }).devices.some(
      (d) => d.path === '/dev/nvidia-modeset',
    ),
  );
});

test('driver files: read-only binds of every library name and of nvidia-smi', () => {
  const a = new GpuAllocator(h200).assign('w', { mode: 'shared' });
  const f = gpuSpecFragment(a, h200);
  const byDest = new Map(f.mounts.map((m) => [m.destination, m]));
  const lib = '/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07';
  for (const name of ['libcuda.so.550.90.07', 'libcuda.so.1', 'libcuda.so']) {
    assert.deepEqual(byDest.get(`${GPU_LIBRARY_DIR}/${name}`), {
      destination: `${GPU_LIBRARY_DIR}/${name}`,
      type: 'bind',
      source: lib,
      options: ['bind', 'ro', 'nosuid', 'nodev'],
    });
  }
  assert.equal(byDest.get('/usr/local/bin/nvidia-smi')?.source, '/usr/bin/nvidia-smi');
  assert.ok(f.mounts.every((m) => m.options.includes('ro') && !m.options.includes('noexec')));
  assert.ok(!f.mounts.some((m) => m.source.includes('persistenced') || m.source.includes('mps')));
});

test('a MIG instance: its parent node, its two capability nodes (read-only), its MIG UUID', () => {
  const a = new GpuAllocator(a100).assign('w', { mode: 'exclusive', model: '1g.10gb' });
  const f = gpuSpecFragment(a, a100);
  const giCap = fixtureCapMinor(1, 9);
  const ciCap = fixtureCapMinor(1, 9, 0);
  assert.deepEqual(
    f.devices.map((d) => [d.path, d.major, d.minor, d.fileMode]),
    [
      ['/dev/nvidiactl', 195, 255, 0o666],
      ['/dev/nvidia-uvm', 239, 0, 0o666],
      ['/dev/nvidia-uvm-tools', 239, 1, 0o666],
      // GPU index 0 is minor 1 on this node.
      ['/dev/nvidia1', 195, 1, 0o666],
      [`/dev/nvidia-caps/nvidia-cap${giCap}`, 236, giCap, 0o444],
      [`/dev/nvidia-caps/nvidia-cap${ciCap}`, 236, ciCap, 0o444],
    ],
  );
  assert.equal(f.deviceRules.length, 6);
  assert.equal(f.env['CUDA_VISIBLE_DEVICES'], A100_MIG_UUIDS.g1a);
  assert.equal(f.env['NVIDIA_VISIBLE_DEVICES'], A100_MIG_UUIDS.g1a);
  // The MIG config and monitor capabilities (minors 1 and 2) are never given.
  assert.ok(!f.devices.some((d) => d.major === 236 && d.minor <= 2));
  // The other (whole) GPU is masked; the parent is not.
  assert.deepEqual(f.maskedPaths, ['/proc/driver/nvidia/gpus/0000:0f:00.0']);
});

test('an assignment from another inventory is refused', () => {
  const a = new GpuAllocator(h200).assign('w', { mode: 'exclusive' });
  assert.throws(
    () => gpuSpecFragment(a, a100),
    (e) => isDsecError(e, 'internal'),
  );
  const forged = { ...a, units: [{ ...a.units[0]!, uuid: 'GPU-00000000' }] };
  assert.throws(
    () => gpuSpecFragment(forged, h200),
    (e) => isDsecError(e, 'internal'),
  );
});

test('withGpu merges into a real container config: allows after the deny-all, env replaced, input untouched', () => {
  const spec = {
    image: 'python',
    memoryLimitMb: 512,
    cpuCoresLimit: 1,
    pidsLimit: 256,
  } as unknown as SandboxSpec;
  const base = buildContainerConfig({
    spec,
    hostname: 'w',
    rootfs: '/tmp/rootfs',
    initBinary: '/usr/lib/dsec/dsec-init',
    cgroupsPath: '/dsec/w',
    hostIdBase: 100_000,
    idCount: 65_536,
  });
  const before = JSON.stringify(base);
  const a = new GpuAllocator(h200).assign('w', { mode: 'exclusive' });
  const f = gpuSpecFragment(a, h200);
  const merged = withGpu(base, { ...f, env: { ...f.env, PATH: '/opt/bin' } }) as {
    process: { env: string[] };
    mounts: OciMount[];
    linux: {
      devices: OciLinuxDevice[];
      resources: { devices: (OciDeviceRule | { allow: false; access: string })[] };
      maskedPaths: string[];
    };
  };
  assert.equal(JSON.stringify(base), before);
  assert.deepEqual(merged.linux.resources.devices[0], { allow: false, access: 'rwm' });
  assert.deepEqual(merged.linux.resources.devices.slice(1), f.deviceRules);
  assert.deepEqual(merged.linux.devices, f.devices);
  assert.deepEqual(merged.mounts.slice(-f.mounts.length), f.mounts);
  assert.ok(merged.mounts.some((m) => m.destination === '/proc'));
  assert.ok(merged.process.env.includes(`CUDA_VISIBLE_DEVICES=${a.units[0]!.uuid}`));
  assert.deepEqual(
    merged.process.env.filter((e) => e.startsWith('PATH=')),
    ['PATH=/opt/bin'],
  );
  assert.ok(merged.linux.maskedPaths.includes('/proc/kcore'));
  assert.ok(merged.linux.maskedPaths.includes('/proc/driver/nvidia/gpus/0000:2a:00.0'));
  assert.throws(
    () => withGpu({}, f),
    (e) => isDsecError(e, 'internal'),
  );
});
