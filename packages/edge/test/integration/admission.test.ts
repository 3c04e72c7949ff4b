/**
 * Admission by real use (issue 9, docs/adr/0007-admission-by-real-use.md):
 * requested memory and CPU are ceilings, and the edge refuses by what the
 * node measures. A node with a low threshold on memory charged to its
 * sandboxes admits sandboxes far beyond it while they are idle, then refuses
 * with `capacity_exhausted` naming memory once the sandboxes fill memory, and
 * admits again once memory is freed. Concurrent creates never overshoot the
 * hard cap.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { isDsecError, randomId, type DsecError } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;
/** Each filled sandbox holds this much in its /dev/shm (64 MiB tmpfs): shmem, charged, not reclaimable. */
const FILL_MB = 60;

async function withEdge(
  admission: Parameters<typeof openContainerEdge>[0]['admission'],
  fn: (edge: Edge, stateDir: string) => Promise<void>,
): Promise<void> {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  const edge = await openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
    admission,
  });
  try {
    await fn(edge, dir);
  } finally {
    for (const sb of await edge.listSandboxes({}))
      await edge.stopSandbox(sb.id).catch(() => undefined);
    await edge.close();
    await cleanup();
  }
}

test(
  'filling memory inside sandboxes makes the edge refuse with capacity_exhausted naming memory',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    // Room for two full sandboxes and a half (160 MiB), though each *requests* 512 MiB:
    // requests are ceilings. Every create reads the node afresh (interval 0), so the
    // outcome does not depend on timing.
    await withEdge({ maxSandboxMemoryMb: 160, sampleIntervalMs: 0 }, async (edge, stateDir) => {
      const before = await hostResources(stateDir);
      const create = () =>
        edge.createSandbox({
          id: randomId('sb'),
          projectId: 'p',
          spec: spec({ memoryLimitMb: 512 }),
        });

      // Idle sandboxes are admitted well past 160 MiB of requests.
      const idle = [await create(), await create(), await create(), await create()];
      const status = await edge.status();
      assert.equal(status.used.memoryMb, 4 * 512, 'requests are counted…');
      assert.ok(
        (status.pressure?.sandboxMemoryMb ?? Infinity) < 4 * 8,
        `…but measured use is small: ${status.pressure?.sandboxMemoryMb} MiB`,
      );
      for (const sb of idle) await edge.stopSandbox(sb.id);

      const filled: string[] = [];
      let refusal: DsecError | undefined;
      for (let i = 0; i < 8 && !refusal; i++) {
        try {
          const sb = await create();
          const r = await edge.runCommand(sb.id, {
            shell: `head -c ${FILL_MB}m /dev/zero > /dev/shm/fill && echo ok`,
          });
          assert.equal(r.stdout, 'ok\n', r.stderr);
          filled.push(sb.id);
        } catch (err) {
          if (!isDsecError(err, 'capacity_exhausted')) throw err;
          refusal = err;
        }
      }
      assert.ok(refusal, 'the edge refused before 8 filled sandboxes');
      assert.equal(filled.length, 3, 'two full sandboxes fit under 160 MiB, the third passes it');
      assert.equal(refusal.details?.resource, 'memory');
      assert.equal(refusal.details?.measure, 'charged_mb');
      assert.equal(refusal.details?.limit, 160);
      assert.ok(Number(refusal.details?.current) > 3 * FILL_MB, String(refusal.details?.current));
      // The refused create left nothing behind, and placement sees the node as full.
      assert.equal((await edge.listSandboxes({})).length, 3);
      const full = await edge.status();
      assert.equal(full.pressure?.refusing?.resource, 'memory');
      assert.equal(full.capacity.sandboxes, full.used.sandboxes);

      // Freeing memory (here: stopping a filled sandbox) admits again.
      await edge.stopSandbox(filled.pop()!);
      await edge.stopSandbox(filled.pop()!);
      const again = await create();
      assert.equal(again.state, 'running');
      await edge.stopSandbox(again.id);
      for (const id of filled) await edge.stopSandbox(id);
      assert.deepEqual(await hostResources(stateDir), before);
    });
  },
);

test(
  'concurrent creates never pass the hard cap; each refusal names the cap',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    await withEdge({ maxSandboxes: 3 }, async (edge) => {
      const outcomes = await Promise.allSettled(
        Array.from({ length: 8 }, () =>
          edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() }),
        ),
      );
      const created = outcomes.filter((o) => o.status === 'fulfilled');
      assert.equal(created.length, 3);
      for (const o of outcomes) {
        if (o.status === 'fulfilled') continue;
        assert.ok(isDsecError(o.reason, 'capacity_exhausted'), String(o.reason));
        assert.deepEqual(
          {
            resource: o.reason.details?.resource,
            current: o.reason.details?.current,
            limit: o.reason.details?.limit,
          },
          { resource: 'sandboxes', current: 4, limit: 3 },
        );
      }
      assert.equal((await edge.status()).used.sandboxes, 3);
    });
  },
);
