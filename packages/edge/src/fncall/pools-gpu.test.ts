import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { DsecError } from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';
import type { CommandExit, SandboxChannel, SandboxCommand } from '../backends/channel.js';
import type { EdgeStartOptions } from '../edge.js';
import { EdgeGpus } from '../gpu/edge-gpus.js';
import type { GpuInventory } from '../gpu/inventory.js';
import { FnCallPools, poolKey, type FnCallPoolsHost } from './pools.js';

/** Two whole GPUs (device numbers never opened here: no sandbox runs). */
const INVENTORY: GpuInventory = {
  driverVersion: '550.90.07',
  gpus: [0, 1].map((index) => ({
    index,
    uuid: `GPU-${index}0000000-0000-0000-0000-000000000000`,
    name: 'NVIDIA H200',
    memoryMib: 143_771,
    pciBusId: `00000000:1${index}:00.0`,
    migEnabled: false,
    node: { path: `/dev/nvidia${index}`, major: 195, minor: index },
    migInstances: [],
  })),
  control: {
    ctl: { path: '/dev/nvidiactl', major: 195, minor: 255 },
    uvm: { path: '/dev/nvidia-uvm', major: 510, minor: 0 },
    uvmTools: { path: '/dev/nvidia-uvm-tools', major: 510, minor: 1 },
  },
  driverFiles: [],
};
const UUID0 = INVENTORY.gpus[0]!.uuid;
const UUID1 = INVENTORY.gpus[1]!.uuid;

/**
 * A zygote that answers each call after `holdMs` with the CUDA env it was
 * configured with (so a test sees what every call's environment starts from).
 */
class FakeZygote implements SandboxCommand {
  readonly started = Promise.resolve({ pid: 7, reclaimedProcesses: 0, reclaimedGroups: 0 });
  readonly exited: Promise<CommandExit>;
  #exit!: (e: CommandExit) => void;
  #out: ((chunk: Buffer) => void)[] = [];

  constructor(
    readonly env: Record<string, string>,
    readonly holdMs: () => number,
  ) {
    this.exited = new Promise((resolve) => (this.#exit = resolve));
    setImmediate(() => this.#emit({ t: 'ready', pid: 7 }));
  }
  onStdout(cb: (chunk: Buffer) => void): this {
    this.#out.push(cb);
    return this;
  }
  onStderr(): this {
    return this;
  }
  #emit(obj: object): void {
    for (const cb of this.#out) cb(Buffer.from(`${JSON.stringify(obj)}\n`));
  }
  write(data: Buffer | string): boolean {
    const call = JSON.parse(String(data)) as { id: number };
    this.#emit({ t: 'started', id: call.id });
    setTimeout(
      () =>
        this.#emit({
          t: 'done',
          id: call.id,
          exitCode: 0,
          signal: null,
          outcome: 'ok',
          stdout: this.env['CUDA_VISIBLE_DEVICES'] ?? '',
          stderr: '',
          stdoutBytes: 0,
          stderrBytes: 0,
          truncated: false,
          durationMs: 1,
          leftover: 0,
          retire: false,
        }),
      this.holdMs(),
    );
    return true;
  }
  die(): void {
    this.#exit({
      waitStatus: 9,
      exitCode: null,
      signal: 'SIGKILL',
      userUsec: 0,
      sysUsec: 0,
      maxRssKib: 0,
    });
  }
  endStdin(): void {}
  signal(): void {}
  killTree(): void {}
  resize(): void {}
}

function fakeHost(options: { holdMs?: number; failCreate?: Error } = {}) {
  const creates: { id: string; spec: SandboxSpec; start: EdgeStartOptions | undefined }[] = [];
  const stopped: string[] = [];
  const zygotes = new Map<string, FakeZygote>();
  const host: FnCallPoolsHost = {
    create: async (id, spec, _signal, start) => {
      if (options.failCreate) throw options.failCreate;
      creates.push({ id, spec, start });
    },
    stop: async (id) => {
      stopped.push(id);
      zygotes.get(id)?.die();
    },
    channel: async (id) => {
      const channel: SandboxChannel = {
        onPidsLimit: undefined,
        closed: false,
        spawn: (spec) => {
          // argv: python3 -c ZYGOTE_BOOT ZYGOTE_PY CONFIG
          const config = JSON.parse(spec.argv.at(-1)!) as { env: Record<string, string> };
          const z = new FakeZygote(config.env, () => options.holdMs ?? 0);
          zygotes.set(id, z);
          return z;
        },
        close: () => undefined,
        pause: () => undefined,
        resume: () => undefined,
        drained: async () => undefined,
      };
      return channel;
    },
    oomKilled: async () => false,
  };
  return { host, creates, stopped, zygotes };
}

function gpuPools(host: FnCallPoolsHost, gpus: EdgeGpus | undefined, max = 4) {
  return new FnCallPools(
    { edgeId: 'e1', backendKind: 'container', host, gpus },
    { sizing: { min: 0, max, spare: 0, maxStarting: max }, queueTimeoutMs: 5_000 },
  );
}

const call = (gpu: { mode: 'shared' | 'exclusive'; count?: number; model?: string }) => ({
  language: 'python',
  code: 'x',
  gpu,
});
const held = (g: EdgeGpus) => g.status().map((u) => `${u.mode}:${u.workers}`);

void describe('fncall GPU pools (fake workers, fixture inventory)', () => {
  test('pools are keyed by runtime, network and the GPU request with its defaults', () => {
    assert.equal(poolKey('python', false), 'python/nonet');
    assert.equal(
      poolKey('python', false, { mode: 'exclusive', count: 1 }),
      'python/nonet/gpu:exclusivex1',
    );
    const keys = new Set([
      poolKey('python', false),
      poolKey('python', true),
      poolKey('python', false, { mode: 'exclusive', count: 1 }),
      poolKey('python', false, { mode: 'shared', count: 1 }),
      poolKey('python', false, { mode: 'exclusive', count: 2 }),
      poolKey('python', false, { mode: 'exclusive', count: 1, model: 'H200' }),
      poolKey('python', true, { mode: 'exclusive', count: 1 }),
      poolKey('node', false, { mode: 'exclusive', count: 1 }),
    ]);
    assert.equal(keys.size, 8);
  });

  test('a GPU call gets a worker holding its unit, the fragment at create and the UUIDs in every call env', async () => {
    const h = fakeHost();
    const gpus = new EdgeGpus(INVENTORY);
    const p = gpuPools(h.host, gpus);
    const r = await p.call(call({ mode: 'exclusive' }), { projectId: 'p' });
    assert.equal(r.outcome, 'ok');
    assert.equal(r.stdout, UUID0, 'the call env names the assigned GPU');
    assert.equal(h.creates.length, 1);
    const { id, spec, start } = h.creates[0]!;
    assert.equal(start?.gpu?.env['CUDA_VISIBLE_DEVICES'], UUID0);
    assert.deepEqual(
      start?.gpu?.devices.map((d) => d.path),
      ['/dev/nvidiactl', '/dev/nvidia-uvm', '/dev/nvidia-uvm-tools', '/dev/nvidia0'],
    );
    assert.equal(spec.labels?.['dsec.fncall/gpu'], 'exclusivex1');
    assert.deepEqual(gpus.heldBy(id), [UUID0]);
    assert.deepEqual(held(gpus), ['exclusive:1', 'free:0']);
    // The same request (count defaulted) reuses the pool and its idle worker.
    const again = await p.call(call({ mode: 'exclusive', count: 1 }), { projectId: 'p' });
    assert.equal(again.stdout, UUID0);
    assert.equal(h.creates.length, 1);
    const pool = p.status().find((s) => s.gpu !== undefined);
    assert.deepEqual(pool, {
      language: 'python',
      network: false,
      idle: 1,
      busy: 0,
      starting: 0,
      max: 4,
      gpu: { mode: 'exclusive', count: 1 },
    });
    // A CPU call never lands on the GPU worker.
    await p.call({ language: 'python', code: 'x' }, { projectId: 'p' });
    assert.equal(h.creates.length, 2);
    assert.equal(h.creates[1]!.start, undefined);
    await p.close();
    assert.deepEqual(held(gpus), ['free:0', 'free:0'], 'close released every unit');
  });

  test('exclusive calls past the units wait for a worker holding one; shared and oversized ones are refused', async () => {
    const h = fakeHost({ holdMs: 50 });
    const gpus = new EdgeGpus(INVENTORY);
    const p = gpuPools(h.host, gpus);
    const out = await Promise.all(
      [1, 2, 3, 4].map(() => p.call(call({ mode: 'exclusive' }), { projectId: 'p' })),
    );
    assert.ok(out.every((r) => r.outcome === 'ok'));
    // Two units, two workers: the other two calls waited for them.
    assert.equal(h.creates.length, 2);
    assert.deepEqual(out.map((r) => r.stdout).sort(), [UUID0, UUID0, UUID1, UUID1].sort());
    assert.deepEqual(held(gpus), ['exclusive:1', 'exclusive:1']);
    // Shared: both units are held exclusively by idle workers; its pool has none to wait for.
    await assert.rejects(p.call(call({ mode: 'shared' }), { projectId: 'p' }), {
      code: 'capacity_exhausted',
    });
    // More units than the node has.
    await assert.rejects(p.call(call({ mode: 'exclusive', count: 3 }), { projectId: 'p' }), {
      code: 'capacity_exhausted',
    });
    await assert.rejects(
      p.call(call({ mode: 'exclusive', model: 'A100' }), { projectId: 'p' }),
      (e: DsecError) => e.code === 'capacity_exhausted' && e.details?.['matching'] === 0,
    );
    assert.equal(h.creates.length, 2, 'refused requests started no worker');
    await p.close();
    assert.deepEqual(held(gpus), ['free:0', 'free:0']);
    assert.deepEqual(h.stopped.sort(), h.creates.map((c) => c.id).sort());
  });

  test('idle GPU workers retire (min 0) and their units go back; then a shared call gets them', async () => {
    const h = fakeHost();
    const gpus = new EdgeGpus(INVENTORY);
    const p = new FnCallPools(
      { edgeId: 'e1', backendKind: 'container', host: h.host, gpus },
      { sizing: { min: 1, max: 4, spare: 1, maxStarting: 4, idleRetireMs: 0 } },
    );
    await p.call(call({ mode: 'exclusive', count: 2 }), { projectId: 'p' });
    assert.equal(h.creates.length, 1, 'no spare GPU worker is started');
    assert.deepEqual(held(gpus), ['exclusive:1', 'exclusive:1']);
    assert.deepEqual(h.creates[0]!.start?.gpu?.env['CUDA_VISIBLE_DEVICES'], `${UUID0},${UUID1}`);
    // The pools' sweeper (every 5 s) retires it: idle past idleRetireMs, above min 0.
    for (let i = 0; i < 60 && held(gpus)[0] !== 'free:0'; i++)
      await new Promise((r) => setTimeout(r, 200));
    assert.deepEqual(held(gpus), ['free:0', 'free:0']);
    const r = await p.call(call({ mode: 'shared' }), { projectId: 'p' });
    assert.equal(r.stdout, UUID0);
    assert.deepEqual(held(gpus), ['shared:1', 'free:0']);
    await p.close();
  });

  test('a worker that fails to start holds nothing; an edge without GPUs answers unavailable', async () => {
    const gpus = new EdgeGpus(INVENTORY);
    const failing = fakeHost({ failCreate: new DsecError('capacity_exhausted', 'edge full') });
    const p = gpuPools(failing.host, gpus);
    await assert.rejects(p.call(call({ mode: 'exclusive' }), { projectId: 'p' }), {
      code: 'capacity_exhausted',
    });
    assert.deepEqual(held(gpus), ['free:0', 'free:0']);
    await p.close();
    const none = gpuPools(fakeHost().host, undefined);
    await assert.rejects(none.call(call({ mode: 'exclusive' }), { projectId: 'p' }), {
      code: 'unavailable',
      field: 'gpu',
    });
    await assert.rejects(none.call(call({ mode: 'exclusive', count: 0 }), { projectId: 'p' }), {
      code: 'unavailable',
    });
    await none.close();
    const bad = gpuPools(fakeHost().host, gpus);
    await assert.rejects(bad.call(call({ mode: 'exclusive', count: 0 }), { projectId: 'p' }), {
      code: 'invalid_argument',
      field: 'gpu.count',
    });
    await bad.close();
  });
});
