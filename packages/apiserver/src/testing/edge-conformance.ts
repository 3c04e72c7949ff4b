import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import type { EdgeApi, SandboxSpec } from '@dsec/core';

export interface EdgeUnderTest {
  /** An edge with room for exactly `capacitySandboxes` default sandboxes. */
  edge: EdgeApi;
  capacitySandboxes: number;
  /** Mints a valid sandbox ID for this edge. */
  mintId: () => string;
  /** A base image the edge can start. */
  image: string;
  cleanup?: () => Promise<void>;
}

export const conformanceSpec = (image: string): SandboxSpec => ({
  backend: 'container',
  image,
  toolkits: [],
  memoryLimitMb: 64,
  cpuCoresLimit: 0.1,
  pidsLimit: 64,
  ttlSeconds: 600,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
});

/**
 * The `EdgeApi` contract as tests; every implementation (real edge client
 * or fake) runs it: `edgeApiConformance('FakeEdge', async () => ({ ... }))`.
 */
export function edgeApiConformance(name: string, make: () => Promise<EdgeUnderTest>): void {
  const withEdge = (title: string, fn: (u: EdgeUnderTest) => Promise<void>): void =>
    void test(`${name}: ${title}`, async () => {
      const u = await make();
      try {
        await fn(u);
      } finally {
        await u.cleanup?.();
      }
    });

  withEdge('status names the edge', async ({ edge }) => {
    const s = await edge.status();
    assert.equal(s.edgeId, edge.edgeId);
    assert.ok(s.capacity.sandboxes >= 1);
  });

  withEdge('create, get, list, run, stop (twice)', async ({ edge, mintId, image }) => {
    const id = mintId();
    const info = await edge.createSandbox({ id, projectId: 'prj-t', spec: conformanceSpec(image) });
    assert.equal(info.id, id);
    assert.equal(info.edgeId, edge.edgeId);
    assert.equal(Date.parse(info.expiresAt) - Date.parse(info.createdAt), 600_000);
    assert.equal((await edge.getSandbox(id)).state, 'running');
    assert.deepEqual(
      (await edge.listSandboxes({ projectIds: ['prj-t'] })).map((s) => s.id),
      [id],
    );
    assert.deepEqual(await edge.listSandboxes({ projectIds: ['prj-other'] }), []);
    const chunks: Buffer[] = [];
    const r = await edge.runCommand(
      id,
      { argv: ['echo', 'hi'] },
      { onStdout: (c) => chunks.push(c) },
    );
    assert.equal(r.exitCode, 0);
    assert.match(r.stdout, /hi\n$/);
    assert.equal(Buffer.concat(chunks).toString(), r.stdout);
    await edge.stopSandbox(id);
    await edge.stopSandbox(id);
    assert.equal((await edge.getSandbox(id)).state, 'stopped');
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }), (e) =>
      isDsecError(e, 'sandbox_not_running'),
    );
  });

  withEdge('unknown IDs are sandbox_not_found', async ({ edge, mintId }) => {
    const id = mintId();
    const nf = (e: unknown) => isDsecError(e, 'sandbox_not_found');
    await assert.rejects(edge.getSandbox(id), nf);
    await assert.rejects(edge.stopSandbox(id), nf);
    await assert.rejects(edge.runCommand(id, { argv: ['true'] }), nf);
  });

  withEdge(
    'admission refuses past capacity; stopping frees room',
    async ({ edge, mintId, image, capacitySandboxes }) => {
      const ids: string[] = [];
      for (let i = 0; i < capacitySandboxes; i++) {
        ids.push(
          (
            await edge.createSandbox({
              id: mintId(),
              projectId: 'prj-t',
              spec: conformanceSpec(image),
            })
          ).id,
        );
      }
      await assert.rejects(
        edge.createSandbox({ id: mintId(), projectId: 'prj-t', spec: conformanceSpec(image) }),
        (e) => isDsecError(e, 'capacity_exhausted'),
      );
      await edge.stopSandbox(ids[0]!);
      await edge.createSandbox({ id: mintId(), projectId: 'prj-t', spec: conformanceSpec(image) });
    },
  );

  withEdge('a requestId makes create idempotent', async ({ edge, mintId, image }) => {
    const a = await edge.createSandbox({
      id: mintId(),
      projectId: 'prj-t',
      spec: conformanceSpec(image),
      requestId: 'r1',
    });
    const b = await edge.createSandbox({
      id: mintId(),
      projectId: 'prj-t',
      spec: conformanceSpec(image),
      requestId: 'r1',
    });
    assert.equal(b.id, a.id);
    assert.equal((await edge.listSandboxes({ projectIds: ['prj-t'] })).length, 1);
  });
}
