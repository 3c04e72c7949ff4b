import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdir, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { promisify } from 'node:util';
import { after, before, describe, test } from 'node:test';
import type { FnCallGpuRequest, FnCallRequest, FnCallResult } from '@dsec/core';
import { FNCALL_GPU_LABEL, openContainerEdge, type Edge, type GpuInventory } from '@dsec/edge';
import { fncallImages, removeStateDir } from './fncall-fixture.js';

const execFileAsync = promisify(execFile);

/**
 * No GPU here: GPU FnCall end to end through the edge (inventory file →
 * allocator → pool → container backend's OCI config → zygote env) with
 * stand-in device nodes. The nodes are made with mknod in a private
 * directory of the host's /dev, mode 0666 as the NVIDIA nodes are, with the
 * numbers of harmless devices none of the runtimes allows by default:
 * nvidiactl = fuse (10:229), nvidia-uvm = loop-control (10:237),
 * nvidia-uvm-tools = btrfs-control (10:234), GPU 0 = the first of autofs
 * (10:235), userfaultfd (10:257) and vga_arbiter (10:256) this kernel has
 * (a misc number the kernel lacks opens as ENODEV).
 * Opening one does nothing; opening it at all needs the device-cgroup rule
 * the GPU fragment adds. The call runs as the unprivileged call uid, as on a
 * GPU host.
 */
function harmlessMiscMinor(candidates: number[]): number {
  const present = new Set(
    (existsSync('/proc/misc') ? readFileSync('/proc/misc', 'utf8') : '')
      .split('\n')
      .map((line) => Number(line.trim().split(/\s+/)[0])),
  );
  return candidates.find((m) => present.has(m)) ?? candidates[0]!;
}

const DEV_DIR = `/dev/dsec-gpu-it-${process.pid}`;
const UUID = 'GPU-5a5a5a5a-0000-4000-8000-000000000001';
const NODES = {
  ctl: { path: `${DEV_DIR}/nvidiactl`, major: 10, minor: 229 },
  uvm: { path: `${DEV_DIR}/nvidia-uvm`, major: 10, minor: 237 },
  uvmTools: { path: `${DEV_DIR}/nvidia-uvm-tools`, major: 10, minor: 234 },
  gpu0: { path: `${DEV_DIR}/nvidia0`, major: 10, minor: harmlessMiscMinor([235, 257, 256]) },
};
const ALL_NODES = Object.values(NODES).map((n) => n.path);

// crun makes the nodes with mknod under its umask, runc binds the host's: both are run.
const runtimes = ['crun', 'runc'].filter((r) =>
  (process.env.PATH ?? '').split(':').some((d) => d && existsSync(join(d, r))),
);
const skip = process.getuid?.() !== 0 ? 'needs root' : undefined;

let inventoryFile = '';
let dir = '';

before(async () => {
  if (skip) return;
  dir = await mkdtemp(join(tmpdir(), 'dsec-fncall-gpu-it-'));
  await chmod(dir, 0o711);
  await mkdir(DEV_DIR, { mode: 0o755 });
  for (const n of Object.values(NODES)) {
    await execFileAsync('mknod', ['-m', '0666', n.path, 'c', String(n.major), String(n.minor)]);
  }
  // The "driver": a library with its soname link, and an nvidia-smi.
  const driver = join(dir, 'driver');
  await mkdir(driver, { mode: 0o755 });
  await writeFile(join(driver, 'libfake.so.1.2.3'), 'fake-driver\n', { mode: 0o644 });
  await writeFile(join(driver, 'nvidia-smi'), '#!/bin/sh\necho fake-smi\n', { mode: 0o755 });
  const inventory: GpuInventory = {
    driverVersion: '0.0.0-test',
    gpus: [
      {
        index: 0,
        uuid: UUID,
        name: 'NVIDIA Stand-In',
        memoryMib: 1024,
        pciBusId: '00000000:01:00.0',
        migEnabled: false,
        node: NODES.gpu0,
        migInstances: [],
      },
    ],
    control: { ctl: NODES.ctl, uvm: NODES.uvm, uvmTools: NODES.uvmTools },
    driverFiles: [
      {
        hostPath: join(driver, 'libfake.so.1.2.3'),
        kind: 'library',
        names: ['libfake.so.1.2.3', 'libfake.so.1'],
      },
      { hostPath: join(driver, 'nvidia-smi'), kind: 'binary', names: ['nvidia-smi'] },
    ],
  };
  inventoryFile = join(dir, 'gpus.json');
  await writeFile(inventoryFile, JSON.stringify(inventory));
});

after(async () => {
  await rm(DEV_DIR, { recursive: true, force: true });
  if (dir) await rm(dir, { recursive: true, force: true });
});

for (const runtime of runtimes) suite(runtime);

function suite(runtime: string): void {
  let edge: Edge;
  let close: () => Promise<void> = async () => undefined;

  const call = (
    gpu: FnCallGpuRequest | undefined,
    code: string,
    extra: Partial<FnCallRequest> = {},
  ): Promise<FnCallResult> =>
    edge.fncall(
      { language: 'python', code, timeoutMs: 30_000, ...(gpu ? { gpu } : {}), ...extra },
      { projectId: 'p1' },
    );

  const PROBE = `
import os, subprocess
for p in ${JSON.stringify(ALL_NODES)}:
    try:
        os.close(os.open(p, os.O_RDWR))
        print('open-ok', os.path.basename(p))
    except OSError as e:
        print('open-fail', os.path.basename(p), e.errno)
print('uid', os.getuid())
print('env', os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('NVIDIA_VISIBLE_DEVICES'), os.environ.get('LD_LIBRARY_PATH'))
print('lib', open('/usr/local/nvidia/lib64/libfake.so.1').read().strip())
print('smi', subprocess.run(['/usr/local/bin/nvidia-smi'], capture_output=True, text=True).stdout.strip())
`;

  async function gpuWorkers(includeEnded: boolean): Promise<string[]> {
    return (await edge.listSandboxes({ projectIds: ['_fncall'], includeEnded }))
      .filter((s) => s.spec.labels[FNCALL_GPU_LABEL] !== undefined)
      .map((s) => `${s.id}:${s.state}`);
  }

  async function unitState(): Promise<string> {
    const u = (await edge.status()).gpus?.[0];
    return `${u?.mode}:${u?.workers}`;
  }

  void describe(
    `fncall with GPUs under ${runtime} (stand-in devices, inventory file)`,
    { skip },
    () => {
      before(async () => {
        if (skip) return;
        const stateDir = await mkdtemp(join(tmpdir(), `dsec-fncall-gpu-${runtime}-`));
        await chmod(stateDir, 0o711);
        const cgroupParent = `dsec-test-${basename(stateDir)}`;
        close = async () => {
          await edge?.close();
          // runc leaves the sandboxes' (empty) cgroups of the hybrid v2 hierarchy behind.
          const unified = `/sys/fs/cgroup/unified/${cgroupParent}`;
          for (const child of await readdir(unified).catch(() => [] as string[]))
            if (child.startsWith('dsec-')) await rmdir(join(unified, child)).catch(() => undefined);
          await removeStateDir(stateDir, cgroupParent);
        };
        edge = await openContainerEdge({
          edgeId: 'gpu-edge',
          stateDir: join(stateDir, 'edge'),
          store: await fncallImages(),
          cgroupParent,
          runtimeBinary: runtime,
          // An idle GPU worker goes after 1 s (at the pools' next 5 s sweep): its unit comes back.
          fncall: {
            sizing: { min: 1, max: 2, spare: 0, idleRetireMs: 1000 },
            queueTimeoutMs: 60_000,
          },
          gpus: { inventoryFile },
        });
      });

      after(async () => {
        await close();
      });

      test('the edge reports its unit free before any call', async () => {
        const status = await edge.status();
        assert.deepEqual(status.gpus, [
          {
            kind: 'gpu',
            uuid: UUID,
            model: 'NVIDIA Stand-In',
            mode: 'free',
            workers: 0,
            maxSharedWorkers: 4,
          },
        ]);
      });

      test('a GPU call opens its devices, sees the UUID env, the driver files, as the call uid', async () => {
        const r = await call({ mode: 'exclusive' }, PROBE);
        assert.equal(r.outcome, 'ok', r.stderr);
        assert.deepEqual(r.stdout.trim().split('\n'), [
          'open-ok nvidiactl',
          'open-ok nvidia-uvm',
          'open-ok nvidia-uvm-tools',
          'open-ok nvidia0',
          'uid 60000',
          `env ${UUID} ${UUID} /usr/local/nvidia/lib64`,
          'lib fake-driver',
          'smi fake-smi',
        ]);
        // Its worker, idle now, still holds the unit.
        assert.equal(await unitState(), 'exclusive:1');
        const pool = (await edge.status()).fncall?.find((p) => p.gpu !== undefined);
        assert.deepEqual(pool?.gpu, { mode: 'exclusive', count: 1 });
      });

      test('a call without gpu has none of it', async () => {
        const r = await call(
          undefined,
          `import os\nprint([os.path.exists(p) for p in ${JSON.stringify(ALL_NODES)}], os.environ.get('CUDA_VISIBLE_DEVICES'), os.path.exists('/usr/local/nvidia'))`,
        );
        assert.equal(r.outcome, 'ok', r.stderr);
        assert.equal(r.stdout.trim(), '[False, False, False, False] None False');
      });

      test('with the unit taken: a second exclusive call waits for the worker; shared and 2-unit calls are refused', async () => {
        const sleepy = `import os, time\ntime.sleep(1.5)\nprint(os.environ['CUDA_VISIBLE_DEVICES'])`;
        const [a, b] = await Promise.all([
          call({ mode: 'exclusive' }, sleepy),
          call({ mode: 'exclusive' }, sleepy),
        ]);
        assert.equal(a.stdout.trim(), UUID);
        assert.equal(b.stdout.trim(), UUID);
        // One unit, so one GPU worker was ever made: the second call waited for it.
        assert.equal((await gpuWorkers(true)).length, 1);
        await assert.rejects(call({ mode: 'shared' }, 'print(1)'), {
          code: 'capacity_exhausted',
        });
        await assert.rejects(call({ mode: 'exclusive', count: 2 }, 'print(1)'), (e: Error) => {
          const d = (e as { details?: Record<string, unknown> }).details;
          return (e as { code?: string }).code === 'capacity_exhausted' && d?.['matching'] === 1;
        });
      });

      test('the idle worker retires and its unit is released; a shared call then gets it', async () => {
        for (let i = 0; i < 100 && (await unitState()) !== 'free:0'; i++)
          await new Promise((r) => setTimeout(r, 200));
        assert.equal(await unitState(), 'free:0');
        assert.deepEqual(
          (await gpuWorkers(true)).map((w) => w.split(':')[1]),
          ['stopped'],
        );
        const r = await call({ mode: 'shared' }, PROBE);
        assert.equal(r.outcome, 'ok', r.stderr);
        assert.match(r.stdout, new RegExp(`env ${UUID} ${UUID}`));
        assert.match(r.stdout, /open-ok nvidia0/);
        assert.equal(await unitState(), 'shared:1');
      });
    },
  );
}
