import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import type { EdgeApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';

// Volumes over the edge protocol (docs/edge-protocol.md, docs/volumes.md): what a cluster's
// apiserver reaches through RemoteEdge.volumes.
const EDGE = 'edge-v';
const ids = new SandboxIdCodec('edge-http-volumes-secret');

async function withServed(edge: EdgeApi, fn: (remote: RemoteEdge) => Promise<void>): Promise<void> {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret });
  const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
  try {
    await fn(remote);
  } finally {
    remote.close();
    await server.close();
  }
}

test('volumes cross the wire: create, get, list, delete, and the edge’s errors exactly', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  await withServed(fake, async (remote) => {
    const made = await remote.volumes.create({ projectId: 'prj-a', name: 'data', sizeMb: 64 });
    assert.deepEqual(
      {
        name: made.name,
        projectId: made.projectId,
        sizeMb: made.sizeMb,
        mountedBy: made.mountedBy,
      },
      { name: 'data', projectId: 'prj-a', sizeMb: 64, mountedBy: [] },
    );
    await assert.rejects(
      remote.volumes.create({ projectId: 'prj-a', name: 'data', sizeMb: 64 }),
      (e) => isDsecError(e, 'conflict'),
    );
    assert.equal((await remote.volumes.get('prj-a', 'data')).sizeMb, 64);
    await assert.rejects(remote.volumes.get('prj-b', 'data'), (e) =>
      isDsecError(e, 'volume_not_found'),
    );
    assert.deepEqual(
      (await remote.volumes.list('prj-a')).map((v) => v.name),
      ['data'],
    );
    assert.deepEqual(await remote.volumes.list('prj-b'), []);
    assert.equal((await remote.volumes.list(undefined)).length, 1);

    const sb = await remote.createSandbox({
      id: ids.mint(EDGE),
      projectId: 'prj-a',
      spec: {
        backend: 'container',
        image: 'base',
        toolkits: [],
        memoryLimitMb: 64,
        cpuCoresLimit: 1,
        pidsLimit: 64,
        ttlSeconds: 60,
        networkRules: {},
        initUser: 'root',
        env: {},
        labels: {},
        volumes: [{ name: 'data', path: '/data' }],
      },
    });
    await assert.rejects(remote.volumes.delete('prj-a', 'data'), (e) => {
      assert.ok(isDsecError(e, 'volume_in_use'), String(e));
      assert.deepEqual(e.details?.['sandboxes'], [sb.id]);
      return true;
    });
    await remote.stopSandbox(sb.id);
    await remote.volumes.delete('prj-a', 'data');
    await assert.rejects(remote.volumes.delete('prj-a', 'data'), (e) =>
      isDsecError(e, 'volume_not_found'),
    );
    // A malformed body is refused on the edge with the field named.
    await assert.rejects(
      remote.volumes.get(42 as unknown as string, 'data'),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'projectId',
    );
  });
});

test('an edge without volumes answers unavailable through the client', async () => {
  const fake = new FakeEdge({ edgeId: EDGE });
  const bare: EdgeApi = {
    edgeId: EDGE,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: (id, c, o) => fake.runCommand(id, c, o),
  };
  await withServed(bare, async (remote) => {
    const un = (e: unknown) => isDsecError(e, 'unavailable') && e.message.includes(EDGE);
    await assert.rejects(remote.volumes.create({ projectId: 'p', name: 'x', sizeMb: 16 }), un);
    await assert.rejects(remote.volumes.list('p'), un);
    await assert.rejects(remote.volumes.get('p', 'x'), un);
    await assert.rejects(remote.volumes.delete('p', 'x'), un);
  });
});
