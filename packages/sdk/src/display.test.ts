// screenshot() and input() against the real apiserver (over a FakeEdge with a screen), through HTTP.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { DsecError, isDsecError } from '@dsec/core';
import type { DisplayInput, SandboxSpec } from '@dsec/core';
import { createTestApi, FakeEdge } from '@dsec/apiserver/testing';
import type { TestApi } from '@dsec/apiserver/testing';
import { DSecClient } from './index.js';

/** Only `vm` sandboxes have a screen, as on a real edge. */
class DisplayEdge extends FakeEdge {
  readonly inputs: DisplayInput[] = [];
  readonly specs = new Map<string, SandboxSpec>();
  override async createSandbox(...args: Parameters<FakeEdge['createSandbox']>) {
    this.specs.set(args[0].id, args[0].spec);
    return super.createSandbox(...args);
  }
  #display(id: string): void {
    if (this.specs.get(id)?.backend !== 'vm') throw new DsecError('unavailable', 'no display');
  }
  async screenshot(id: string): Promise<Buffer> {
    this.#display(id);
    return Buffer.from([0x89, 0x50, 0x4e, 0x47, 1, 2, 3]);
  }
  async sendInput(id: string, input: DisplayInput): Promise<void> {
    this.#display(id);
    this.inputs.push(input);
  }
}

let api: TestApi;
let client: DSecClient;
const edge = new DisplayEdge({ edgeId: 'edge-a', backends: ['container', 'vm'] });

before(async () => {
  api = await createTestApi({ edges: [edge] });
  const url = await api.app.listen({ port: 0, host: '127.0.0.1' });
  client = new DSecClient({ url, apiKey: api.rootKey });
});
after(async () => {
  client.close();
  await api.close();
});

test('runVM makes a vm sandbox whose screen the handle reads and drives', async () => {
  const sb = await client.runVM({ image: 'base', memoryLimitMb: 512 });
  assert.equal(edge.specs.get(sb.id)?.backend, 'vm');
  assert.deepEqual([...(await sb.screenshot())], [0x89, 0x50, 0x4e, 0x47, 1, 2, 3]);
  await sb.input({ text: 'ls\n' });
  await sb.input({
    events: [
      { type: 'move', x: 5, y: 6 },
      { type: 'button', button: 'left' },
    ],
  });
  assert.deepEqual(edge.inputs, [
    { text: 'ls\n' },
    {
      events: [
        { type: 'move', x: 5, y: 6 },
        { type: 'button', button: 'left' },
      ],
    },
  ]);
  await assert.rejects(
    sb.input({ events: [{ type: 'key', key: 'Bad Key' }] }),
    (err) => isDsecError(err) && err.code === 'invalid_argument',
  );
});

test('a container has no display: unavailable', async () => {
  const sb = await client.runContainer({ image: 'base' });
  await assert.rejects(sb.screenshot(), (err) => isDsecError(err) && err.code === 'unavailable');
});
