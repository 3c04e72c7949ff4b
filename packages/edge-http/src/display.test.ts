import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError, SandboxIdCodec } from '@dsec/core';
import type { DisplayInput } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, RemoteEdge, serveEdge } from './index.js';

/** A fake edge with a screen: a PNG of 300 KiB (more than one chunk) and the input it got. */
class DisplayEdge extends FakeEdge {
  readonly png = Buffer.concat([Buffer.from('\x89PNG', 'latin1'), Buffer.alloc(300 * 1024, 7)]);
  readonly inputs: [string, DisplayInput][] = [];
  async screenshot(id: string): Promise<Buffer> {
    await this.getSandbox(id);
    return this.png;
  }
  async sendInput(id: string, input: DisplayInput): Promise<void> {
    await this.getSandbox(id);
    this.inputs.push([id, input]);
  }
}

async function served(edge: FakeEdge, fn: (remote: RemoteEdge, id: string) => Promise<void>) {
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret });
  const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
  try {
    const id = new SandboxIdCodec('display-test-secret-0123456789').mint(edge.edgeId);
    await edge.createSandbox({
      id,
      projectId: 'p',
      spec: {
        backend: 'container',
        image: 'base',
        toolkits: [],
        memoryLimitMb: 256,
        cpuCoresLimit: 1,
        pidsLimit: 64,
        ttlSeconds: 600,
        networkRules: {},
        initUser: 'root',
      } as never,
    });
    await fn(remote, id);
  } finally {
    remote.close();
    await server.close();
  }
}

test('screenshots and input cross the edge protocol', async () => {
  const edge = new DisplayEdge({ edgeId: 'edge-d' });
  await served(edge, async (remote, id) => {
    assert.ok((await remote.screenshot(id)).equals(edge.png));
    await remote.sendInput(id, { text: 'echo hi\n' });
    await remote.sendInput(id, { events: [{ type: 'key', key: 'ret' }] });
    assert.deepEqual(edge.inputs, [
      [id, { text: 'echo hi\n' }],
      [id, { events: [{ type: 'key', key: 'ret' }] }],
    ]);
    await assert.rejects(remote.screenshot('sb-missing'), (err) => isDsecError(err));
  });
});

test('an edge without a display answers unavailable over the protocol', async () => {
  await served(new FakeEdge({ edgeId: 'edge-n' }), async (remote, id) => {
    await assert.rejects(
      remote.screenshot(id),
      (err) => isDsecError(err) && err.code === 'unavailable',
    );
    await assert.rejects(
      remote.sendInput(id, { text: 'x' }),
      (err) => isDsecError(err) && err.code === 'unavailable',
    );
  });
});
