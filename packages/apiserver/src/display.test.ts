import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { DisplayInput } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';

/** A fake edge with a screen: answers a fixed PNG and records the input it was sent. */
class DisplayEdge extends FakeEdge {
  readonly inputs: [string, DisplayInput][] = [];
  async screenshot(id: string): Promise<Buffer> {
    await this.getSandbox(id);
    return Buffer.from('\x89PNG fake', 'latin1');
  }
  async sendInput(id: string, input: DisplayInput): Promise<void> {
    await this.getSandbox(id);
    this.inputs.push([id, input]);
  }
}

async function setup(t: { after: (fn: () => Promise<void>) => void }, edge: FakeEdge) {
  const a = await createTestApi({ edges: [edge] });
  t.after(() => a.close());
  const inject = (method: 'GET' | 'POST', url: string, body?: unknown, key = a.rootKey) =>
    a.app.inject({
      method,
      url,
      headers: { authorization: `Bearer ${key}` },
      ...(body === undefined ? {} : { payload: body as object }),
    });
  const created = await inject('POST', '/v1/sandboxes', { image: 'base' });
  assert.equal(created.statusCode, 201, created.body);
  return { a, inject, id: created.json<{ id: string }>().id };
}

test('screenshot and input reach the edge of a sandbox with a display', async (t) => {
  const edge = new DisplayEdge({ edgeId: 'edge-a' });
  const { inject, id } = await setup(t, edge);
  const shot = await inject('GET', `/v1/sandboxes/${id}/screenshot`);
  assert.equal(shot.statusCode, 200);
  assert.equal(shot.headers['content-type'], 'image/png');
  assert.equal(shot.rawPayload.toString('latin1'), '\x89PNG fake');

  const events = [
    { type: 'move', x: 10, y: 20 },
    { type: 'button', button: 'left' },
    { type: 'key', key: 'ctrl', down: true },
    { type: 'moveBy', dx: -3, dy: 4 },
  ];
  assert.equal((await inject('POST', `/v1/sandboxes/${id}/input`, { events })).statusCode, 204);
  assert.equal(
    (await inject('POST', `/v1/sandboxes/${id}/input`, { text: 'ls\n' })).statusCode,
    204,
  );
  assert.deepEqual(edge.inputs, [
    [id, { events }],
    [id, { text: 'ls\n' }],
  ]);
});

test('bad input is refused before the edge; no display is unavailable; others see a 404', async (t) => {
  const edge = new DisplayEdge({ edgeId: 'edge-a' });
  const { a, inject, id } = await setup(t, edge);
  for (const body of [
    { events: [{ type: 'key', key: 'Return; rm -rf' }] },
    { events: [{ type: 'button', button: 'fourth' }] },
    { events: [{ type: 'move', x: -1, y: 0 }] },
    { text: 'a', events: [] },
    {},
  ]) {
    const r = await inject('POST', `/v1/sandboxes/${id}/input`, body);
    assert.equal(r.statusCode, 400, JSON.stringify(body));
    assert.equal(r.json<{ error: { code: string } }>().error.code, 'invalid_argument');
  }
  assert.deepEqual(edge.inputs, []);

  const p = await inject('POST', '/v1/projects', { name: 'other' });
  const k = await inject('POST', '/v1/keys', { projectId: p.json().id, role: 'admin' });
  const other = k.json().key as string;
  assert.equal(
    (await inject('GET', `/v1/sandboxes/${id}/screenshot`, undefined, other)).statusCode,
    404,
  );
  void a;

  const plain = await setup(t, new FakeEdge({ edgeId: 'edge-b' }));
  const r = await plain.inject('GET', `/v1/sandboxes/${plain.id}/screenshot`);
  assert.equal(r.statusCode, 503);
  assert.equal(r.json<{ error: { code: string } }>().error.code, 'unavailable');
  const i = await plain.inject('POST', `/v1/sandboxes/${plain.id}/input`, { text: 'x' });
  assert.equal(i.statusCode, 503);
});
