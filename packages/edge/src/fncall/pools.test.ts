import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { DsecError } from '@dsec/core';
import type { CommandExit, SandboxChannel, SandboxCommand } from '../backends/channel.js';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FnCallPools, inotifyBudget, ranOutOfMemory } from './pools.js';
import type { FnCallHost } from './worker.js';

/** How a fake worker answers a call line: as a zygote would, or by dying. */
type Behaviour = (call: { id: number; stdin: string }, z: FakeZygote) => void;

const answer: Behaviour = (call, z) => {
  z.emit({ t: 'started', id: call.id });
  z.emit({
    t: 'done',
    id: call.id,
    exitCode: 0,
    signal: null,
    outcome: 'ok',
    stdout: call.stdin,
    stderr: '',
    stdoutBytes: call.stdin.length,
    stderrBytes: 0,
    truncated: false,
    durationMs: 1,
    leftover: 0,
    retire: false,
  });
};

/** A zygote's side of the channel, without a sandbox. */
class FakeZygote implements SandboxCommand {
  readonly started = Promise.resolve({ pid: 7, reclaimedProcesses: 0, reclaimedGroups: 0 });
  readonly exited: Promise<CommandExit>;
  #exit!: (e: CommandExit) => void;
  #out: ((chunk: Buffer) => void)[] = [];

  constructor(readonly behaviour: Behaviour) {
    this.exited = new Promise((resolve) => (this.#exit = resolve));
    setImmediate(() => this.emit({ t: 'ready', pid: 7 }));
  }
  onStdout(cb: (chunk: Buffer) => void): this {
    this.#out.push(cb);
    return this;
  }
  onStderr(): this {
    return this;
  }
  emit(obj: object): void {
    // Split in two chunks: lines must be reassembled.
    const buf = Buffer.from(`${JSON.stringify(obj)}\n`);
    for (const cb of this.#out) {
      cb(buf.subarray(0, 5));
      cb(buf.subarray(5));
    }
  }
  write(data: Buffer | string): boolean {
    const call = JSON.parse(String(data)) as { id: number; stdin: string };
    setImmediate(() => this.behaviour(call, this));
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

/** A host whose n-th worker behaves as `behaviours[n]` (the last one for the rest). */
function fakeHost(behaviours: Behaviour[], options: { failCreate?: Error; oom?: boolean } = {}) {
  const created: string[] = [];
  const stopped: string[] = [];
  const zygotes = new Map<string, FakeZygote>();
  /** Each worker's zygote configuration (the last argument of its command). */
  const configs = new Map<string, { watchScratch: boolean }>();
  const host: FnCallHost = {
    create: async (id) => {
      if (options.failCreate) throw options.failCreate;
      created.push(id);
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
          configs.set(id, JSON.parse(spec.argv.at(-1)!) as { watchScratch: boolean });
          const z = new FakeZygote(
            behaviours[Math.min(created.indexOf(id), behaviours.length - 1)]!,
          );
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
    oomKilled: async () => options.oom === true,
  };
  return { host, created, stopped, configs };
}

function pools(host: FnCallHost, max = 2) {
  return new FnCallPools(
    { edgeId: 'e1', backendKind: 'container', host },
    { sizing: { min: 0, max, spare: 0, maxStarting: max } },
  );
}

const req = (stdin: string) => ({ language: 'python', code: 'x', stdin });

void describe('fncall pools (fake workers)', () => {
  test('a worker dead before the call started: the call runs once more, on another worker', async () => {
    const die: Behaviour = (_call, z) => z.die();
    const h = fakeHost([die, answer]);
    const p = pools(h.host);
    const r = await p.call(req('hi'), { projectId: 'p' });
    assert.equal(r.outcome, 'ok');
    assert.equal(r.stdout, 'hi');
    assert.equal(h.created.length, 2);
    assert.ok(h.stopped.includes(h.created[0]!), 'the dead worker was retired');
    await p.close();
  });

  test('a worker that dies after the call started is not retried; the call says why', async () => {
    const startThenDie: Behaviour = (call, z) => {
      z.emit({ t: 'started', id: call.id });
      z.die();
    };
    const h = fakeHost([startThenDie, answer]);
    const p = pools(h.host);
    const r = await p.call(req('hi'), { projectId: 'p' });
    assert.equal(r.outcome, 'runtime_error');
    assert.equal(r.exitCode, -1);
    assert.match(r.reason ?? '', /zygote exited.*replaced/);
    assert.equal((await p.call(req('next'), { projectId: 'p' })).stdout, 'next');
    await p.close();
  });

  test('a worker killed by the OOM killer reports oom', async () => {
    const startThenDie: Behaviour = (call, z) => {
      z.emit({ t: 'started', id: call.id });
      z.die();
    };
    const h = fakeHost([startThenDie], { oom: true });
    const p = pools(h.host);
    assert.equal((await p.call(req('x'), { projectId: 'p' })).outcome, 'oom');
    await p.close();
  });

  test('calls past the pool size wait for a worker and all run', async () => {
    const h = fakeHost([answer]);
    const p = pools(h.host, 1);
    const out = await Promise.all(
      ['a', 'b', 'c', 'd'].map((s) => p.call(req(s), { projectId: 'p' })),
    );
    assert.deepEqual(
      out.map((r) => r.stdout),
      ['a', 'b', 'c', 'd'],
    );
    assert.equal(h.created.length, 1);
    assert.deepEqual(
      p.status().find((s) => s.language === 'python'),
      { language: 'python', network: false, idle: 1, busy: 0, starting: 0, max: 1 },
    );
    await p.close();
    assert.deepEqual(h.stopped, h.created);
  });

  test('when no worker can start, waiting calls fail with the edge’s refusal', async () => {
    const h = fakeHost([answer], {
      failCreate: new DsecError('capacity_exhausted', 'edge full'),
    });
    const p = pools(h.host);
    await assert.rejects(p.call(req('x'), { projectId: 'p' }), { code: 'capacity_exhausted' });
    await p.close();
  });

  test('close fails waiting calls and stops every worker', async () => {
    let startedCall!: () => void;
    const callStarted = new Promise<void>((resolve) => (startedCall = resolve));
    const never: Behaviour = (call, z) => {
      z.emit({ t: 'started', id: call.id });
      startedCall();
    };
    const h = fakeHost([never]);
    const p = pools(h.host, 1);
    const running = p.call(req('a'), { projectId: 'p' });
    const waiting = p.call(req('b'), { projectId: 'p' });
    // Close only once the first call runs on the worker (a fixed sleep raced a loaded machine).
    await callStarted;
    await new Promise((r) => setImmediate(r));
    await p.close();
    await assert.rejects(waiting, { code: 'unavailable' });
    assert.equal((await running).outcome, 'runtime_error');
    assert.deepEqual(h.stopped, h.created);
  });

  test('gpu requests and unknown runtimes are refused before any worker starts', async () => {
    const h = fakeHost([answer]);
    const p = pools(h.host);
    await assert.rejects(p.call({ ...req('x'), gpu: { mode: 'shared' } }, { projectId: 'p' }), {
      code: 'unavailable',
    });
    await assert.rejects(p.call({ ...req('x'), language: 'cobol' }, { projectId: 'p' }), {
      code: 'invalid_argument',
    });
    await assert.rejects(p.call({ ...req('x'), memoryMb: 1 << 20 }, { projectId: 'p' }), {
      code: 'invalid_argument',
      field: 'memoryMb',
    });
    assert.equal(h.created.length, 0);
    await p.close();
  });

  test('at most inotifyWorkers workers watch their scratch places; a retired one frees its place', async () => {
    const h = fakeHost([answer]);
    const p = new FnCallPools(
      { edgeId: 'e1', backendKind: 'container', host: h.host },
      {
        sizing: { min: 0, max: 2, spare: 0, maxStarting: 2 },
        inotifyWorkers: 1,
        maxCallsPerWorker: 1,
      },
    );
    await Promise.all([p.call(req('a'), { projectId: 'p' }), p.call(req('b'), { projectId: 'p' })]);
    assert.deepEqual(
      h.created.map((id) => h.configs.get(id)?.watchScratch),
      [true, false],
    );
    // Each worker retires after its one call; the next worker may watch again.
    while (h.stopped.length < 2) await new Promise((r) => setImmediate(r));
    await p.call(req('c'), { projectId: 'p' });
    assert.equal(h.configs.get(h.created[2]!)?.watchScratch, true);
    await p.close();
  });

  test('the inotify budget is a quarter of the host limit, none when it cannot be read', () => {
    const dir = mkdtempSync(join(tmpdir(), 'dsec-inotify-'));
    try {
      writeFileSync(join(dir, 'max'), '128\n');
      assert.equal(inotifyBudget(join(dir, 'max')), 32);
      assert.equal(inotifyBudget(join(dir, 'missing')), 0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('a failed call whose stderr says its runtime ran out of memory is oom; nothing else is', () => {
    const node = { oomMessages: ['JavaScript heap out of memory'] };
    const said =
      'FATAL ERROR: Reached heap limit Allocation failed - JavaScript heap out of memory';
    assert.equal(ranOutOfMemory(node, 'signaled', 134, said), true);
    assert.equal(ranOutOfMemory(node, 'ok', 1, said), true);
    assert.equal(ranOutOfMemory(node, 'ok', 0, said), false, 'a program that exits 0 ran fine');
    assert.equal(ranOutOfMemory(node, 'timeout', 137, said), false);
    assert.equal(ranOutOfMemory(node, 'ok', 1, 'Error: no'), false);
    assert.equal(ranOutOfMemory({}, 'signaled', 134, said), false);
  });
});
