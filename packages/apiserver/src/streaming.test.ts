import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { AddressInfo } from 'node:net';
import type { CommandResult, CommandSpec, RunCommandOptions } from '@dsec/core';
import { createTestApi, FakeEdge } from './testing/index.js';

/** Emits one chunk, then waits for the test to open the gate before finishing. */
class GatedEdge extends FakeEdge {
  open!: () => void;
  readonly gate = new Promise<void>((resolve) => {
    this.open = resolve;
  });

  override async runCommand(
    id: string,
    command: CommandSpec,
    options: RunCommandOptions = {},
  ): Promise<CommandResult> {
    await this.getSandbox(id);
    options.onStdout?.(Buffer.from('first\n'));
    await this.gate;
    options.onStdout?.(Buffer.from('second\n'));
    return super.runCommand(id, command, {});
  }
}

test(
  'NDJSON chunks reach a real HTTP client before the command ends',
  { timeout: 20_000 },
  async (t) => {
    const edge = new GatedEdge({ edgeId: 'edge-a' });
    const a = await createTestApi({ edges: [edge] });
    t.after(() => a.close());
    await a.app.listen({ host: '127.0.0.1', port: 0 });
    const base = `http://127.0.0.1:${(a.app.server.address() as AddressInfo).port}`;
    const auth = { authorization: `Bearer ${a.rootKey}`, 'content-type': 'application/json' };
    const created = await fetch(`${base}/v1/sandboxes`, {
      method: 'POST',
      headers: auth,
      body: '{"image":"base"}',
    });
    const { id } = (await created.json()) as { id: string };

    const res = await fetch(`${base}/v1/sandboxes/${id}/commands`, {
      method: 'POST',
      headers: { ...auth, accept: 'application/x-ndjson' },
      body: JSON.stringify({ argv: ['x'] }),
    });
    assert.equal(res.status, 200);
    const reader = res.body!.getReader();
    const decoder = new TextDecoder();
    let text = '';
    // The command is blocked on the gate, so this read can only finish if the first chunk was flushed.
    while (!text.includes('\n'))
      text += decoder.decode((await reader.read()).value, { stream: true });
    const first = JSON.parse(text.split('\n')[0]!) as { type: string; data: string };
    assert.equal(first.type, 'stdout');
    assert.equal(Buffer.from(first.data, 'base64').toString(), 'first\n');
    edge.open();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += decoder.decode(value, { stream: true });
    }
    const events = text
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as { type: string });
    assert.deepEqual(
      events.map((e) => e.type),
      ['stdout', 'stdout', 'result'],
    );
  },
);
