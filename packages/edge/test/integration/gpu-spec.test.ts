import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { promisify } from 'node:util';
import type { SandboxSpec } from '@dsec/core';
import { makeBusyboxRootfs } from '@dsec/images';
import { buildContainerConfig, GpuAllocator, gpuSpecFragment, withGpu } from '@dsec/edge';
import type { GpuInventory } from '@dsec/edge';

const execFileAsync = promisify(execFile);

/**
 * No GPU here: this runs the GPU spec fragment for real under each OCI
 * runtime installed, with harmless host character devices standing in for
 * the NVIDIA nodes (/dev/fuse as nvidiactl, /dev/loop-control as uvm,
 * /dev/btrfs-control as uvm-tools, /dev/autofs as GPU 0, /dev/kmsg as GPU
 * 1; opening any of them does nothing, and none is among the devices the
 * runtimes allow by default, as /dev/net/tun is). It proves what a GPU host
 * could not tell apart from a spec mistake: the runtime accepts the
 * fragment inside a user namespace, the worker sees exactly its nodes and
 * can open them, the driver files are read-only under their sonames, the
 * environment names the assigned device, and a node it was not given is
 * refused by the device cgroup even when it is mounted in.
 */
const STAND_INS: GpuInventory = {
  driverVersion: '0.0.0-test',
  gpus: [
    {
      index: 0,
      uuid: 'GPU-00000000-0000-0000-0000-000000000000',
      name: 'NVIDIA Stand-In',
      memoryMib: 1024,
      pciBusId: '00000000:01:00.0',
      migEnabled: false,
      node: { path: '/dev/autofs', major: 10, minor: 235 },
      migInstances: [],
    },
    {
      index: 1,
      uuid: 'GPU-11111111-1111-1111-1111-111111111111',
      name: 'NVIDIA Stand-In',
      memoryMib: 1024,
      pciBusId: '00000000:02:00.0',
      migEnabled: false,
      node: { path: '/dev/kmsg', major: 1, minor: 11 },
      migInstances: [],
    },
  ],
  control: {
    ctl: { path: '/dev/fuse', major: 10, minor: 229 },
    uvm: { path: '/dev/loop-control', major: 10, minor: 237 },
    uvmTools: { path: '/dev/btrfs-control', major: 10, minor: 234 },
  },
  driverFiles: [],
};

const runtimes = ['runc', 'crun'].filter((r) =>
  (process.env.PATH ?? '').split(':').some((d) => d && existsSync(join(d, r))),
);
const nodesPresent = [
  ...STAND_INS.gpus.map((g) => g.node.path),
  STAND_INS.control.ctl.path,
  STAND_INS.control.uvm.path,
  STAND_INS.control.uvmTools.path,
].every((p) => existsSync(p));

const CHECK = `
for d in /dev/fuse /dev/loop-control /dev/btrfs-control /dev/autofs; do
  if (exec 3<>$d) 2>/dev/null; then echo "open-ok $d"; else echo "open-fail $d"; fi
done
[ -e /dev/kmsg ] && echo "present /dev/kmsg" || echo "absent /dev/kmsg"
if (exec 3</mnt/kmsg) 2>/dev/null; then echo "open-ok /mnt/kmsg"; else echo "open-fail /mnt/kmsg"; fi
echo "lib $(cat /usr/local/nvidia/lib64/libfake.so.1)"
echo "lib-real $(cat /usr/local/nvidia/lib64/libfake.so.1.2.3)"
if (echo x > /usr/local/nvidia/lib64/libfake.so.1) 2>/dev/null; then echo lib-writable; else echo lib-readonly; fi
echo "smi $(/usr/local/bin/nvidia-smi)"
echo "env $CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES $LD_LIBRARY_PATH"
`;

for (const runtime of runtimes) {
  test(
    `GPU spec fragment under ${runtime}: assigned nodes only, read-only driver files, UUID env`,
    {
      skip: process.getuid?.() !== 0 || !nodesPresent ? 'needs root and the stand-in nodes' : false,
    },
    async (t) => {
      const dir = await mkdtemp(join(tmpdir(), 'dsec-gpu-it-'));
      const stateRoot = join(dir, 'runtime-state');
      const id = `dsec-gpu-${basename(dir).slice(-8).toLowerCase()}`;
      const cgroup = `dsec-gpu-test-${basename(dir).slice(-8).toLowerCase()}`;
      t.after(async () => {
        await execFileAsync(runtime, ['--root', stateRoot, 'delete', '-f', id]).catch(
          () => undefined,
        );
        for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [] as string[])) {
          await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroup}`).catch(() => undefined);
        }
        await rm(dir, { recursive: true, force: true });
      });
      await chmod(dir, 0o711);
      const rootfs = join(dir, 'rootfs');
      await makeBusyboxRootfs(rootfs);
      // The "driver": a library with a soname link, and an nvidia-smi.
      const driverDir = join(dir, 'driver');
      await mkdir(driverDir);
      await writeFile(join(driverDir, 'libfake.so.1.2.3'), 'fake-driver\n');
      await writeFile(join(driverDir, 'nvidia-smi'), '#!/bin/sh\necho fake-smi\n', { mode: 0o755 });
      const inventory: GpuInventory = {
        ...STAND_INS,
        driverFiles: [
          {
            hostPath: join(driverDir, 'libfake.so.1.2.3'),
            kind: 'library',
            names: ['libfake.so.1.2.3', 'libfake.so.1'],
          },
          { hostPath: join(driverDir, 'nvidia-smi'), kind: 'binary', names: ['nvidia-smi'] },
        ],
      };
      const assignment = new GpuAllocator(inventory).assign('w', { mode: 'exclusive' });
      assert.equal(assignment.units[0]?.uuid, STAND_INS.gpus[0]!.uuid);
      const base = buildContainerConfig({
        spec: {
          memoryLimitMb: 256,
          cpuCoresLimit: 1,
          pidsLimit: 64,
          env: {},
        } as unknown as SandboxSpec,
        hostname: 'gpu',
        rootfs,
        initBinary: '/bin/true',
        cgroupsPath: `/${cgroup}`,
        hostIdBase: 0,
        idCount: 65_536,
      });
      const config = withGpu(base, gpuSpecFragment(assignment, inventory)) as {
        process: { args: string[] };
        mounts: { destination: string; type: string; source: string; options: string[] }[];
      };
      config.process.args = ['/bin/sh', '-c', CHECK];
      config.mounts = config.mounts.filter((m) => m.destination !== '/dev/.dsec-init');
      // GPU 1's node, mounted in without being assigned: only the device cgroup stands in the way.
      config.mounts.push({
        destination: '/mnt/kmsg',
        type: 'bind',
        source: '/dev/kmsg',
        options: ['bind', 'ro', 'nosuid'],
      });
      const bundle = join(dir, 'bundle');
      await mkdir(bundle);
      await writeFile(join(bundle, 'config.json'), JSON.stringify(config));
      // crun refuses a hybrid cgroup layout: as the edge does (oci-runtime.ts), run it in a
      // private mount namespace where the v2 hierarchy is hidden under an empty tmpfs.
      const hybrid = runtime === 'crun' && existsSync('/sys/fs/cgroup/unified');
      const argv = [runtime, '--root', stateRoot, 'run', '--bundle', bundle, id];
      const [file, ...args] = hybrid
        ? [
            'unshare',
            '-m',
            '--propagation',
            'private',
            '--',
            'sh',
            '-c',
            'mount -t tmpfs tmpfs /sys/fs/cgroup/unified && exec "$@"',
            'sh',
            ...argv,
          ]
        : argv;
      const { stdout } = await execFileAsync(file!, args, { timeout: 60_000 });
      const lines = stdout.trim().split('\n');
      assert.deepEqual(lines, [
        'open-ok /dev/fuse',
        'open-ok /dev/loop-control',
        'open-ok /dev/btrfs-control',
        'open-ok /dev/autofs',
        'absent /dev/kmsg',
        'open-fail /mnt/kmsg',
        'lib fake-driver',
        'lib-real fake-driver',
        'lib-readonly',
        'smi fake-smi',
        `env ${STAND_INS.gpus[0]!.uuid} ${STAND_INS.gpus[0]!.uuid} /usr/local/nvidia/lib64`,
      ]);
    },
  );
}
