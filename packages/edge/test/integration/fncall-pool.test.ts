import assert from 'node:assert/strict';
import { test } from 'node:test';
import { FNCALL_NETWORK_LABEL, FNCALL_RUNTIME_LABEL } from '@dsec/edge';
import { hostResources } from './fixture.js';
import { openFnCallEdge, removeStateDir } from './fncall-fixture.js';

void test('pools: concurrent calls, hidden workers, network pools apart, nothing left after close', async () => {
  const f = await openFnCallEdge({ sizing: { min: 1, max: 6 }, warm: { python: 2 } });
  try {
    const { edge } = f;
    // 20 calls at once, each with its own input: all succeed, each gets its own answer.
    const results = await Promise.all(
      Array.from({ length: 20 }, (_, i) =>
        edge.fncall(
          {
            language: 'python',
            code: 'import time\nn = int(input())\ntime.sleep(0.2)\nprint(n * n)',
            stdin: `${i}\n`,
          },
          { projectId: 'p1' },
        ),
      ),
    );
    assert.deepEqual(
      results.map((r) => [r.outcome, r.stdout]),
      Array.from({ length: 20 }, (_, i) => ['ok', `${i * i}\n`]),
    );
    const status = (await edge.status()).fncall ?? [];
    const python = status.find((p) => p.language === 'python' && !p.network);
    assert.ok(python && python.idle + python.busy + python.starting <= 6, JSON.stringify(status));
    assert.ok(python.idle >= 2, 'the pool grew past its warm size under load');

    // Workers are the edge's own: not in users' lists, labelled, without egress.
    assert.deepEqual(await edge.listSandboxes({}), []);
    const workers = await edge.listSandboxes({ projectIds: ['_fncall'] });
    assert.ok(workers.length >= 2);
    for (const w of workers) {
      assert.equal(w.spec.labels[FNCALL_RUNTIME_LABEL], 'python');
      assert.equal(w.spec.labels[FNCALL_NETWORK_LABEL], 'false');
      assert.deepEqual(w.spec.networkRules, {});
    }

    // A call with network runs in a pool of its own.
    const net = await edge.fncall(
      { language: 'python', code: 'print("net")', network: true },
      { projectId: 'p1' },
    );
    assert.equal(net.stdout, 'net\n');
    const netWorkers = (await edge.listSandboxes({ projectIds: ['_fncall'] })).filter(
      (w) => w.spec.labels[FNCALL_NETWORK_LABEL] === 'true',
    );
    assert.ok(netWorkers.length >= 1);
    assert.ok(Object.values(netWorkers[0]!.spec.networkRules).some(Boolean));
    assert.ok((await edge.status()).fncall?.some((p) => p.language === 'python' && p.network));
  } finally {
    await f.close();
    // Everything of the pools is gone: sandboxes, mounts, cgroups, runtime state, processes.
    const left = await hostResources(f.stateDir);
    await removeStateDir(f.stateDir, f.cgroupParent);
    assert.deepEqual(left, {
      mounts: [],
      cgroups: [],
      containers: [],
      processes: [],
      sandboxDirs: [],
    });
  }
});
