import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { EdgeApi, EdgeStatus } from '@dsec/core';
import { Watcher } from './index.js';

function edge(edgeId: string, up: () => boolean): EdgeApi {
  const never = () => Promise.reject(new Error('not used'));
  const status = (): EdgeStatus => ({
    edgeId,
    url: `http://${edgeId}`,
    healthy: true,
    backends: ['container'],
    capacity: { memoryMb: 1024, cpuCores: 2, sandboxes: 10 },
    used: { memoryMb: 0, cpuCores: 0, sandboxes: 0 },
    sandboxesByProject: {},
    labels: {},
  });
  return {
    edgeId,
    status: () => (up() ? Promise.resolve(status()) : Promise.reject(new Error('refused'))),
    createSandbox: never,
    getSandbox: never,
    listSandboxes: never,
    stopSandbox: never,
    runCommand: never,
  };
}

test('an edge going down is logged as warn with the probe error, coming back as info, once each', async () => {
  let up = true;
  const lines: [string, Record<string, unknown>, string | undefined][] = [];
  const w = new Watcher({
    edges: new Map([['e1', edge('e1', () => up)]]),
    log: (msg, fields, level) => lines.push([msg, fields, level]),
  });
  await w.refresh(); // first sight, healthy: nothing to report
  assert.deepEqual(lines, []);
  up = false;
  await w.refresh();
  await w.refresh(); // still down: not logged again
  assert.deepEqual(lines, [['edge down', { edgeId: 'e1', err: 'refused' }, 'warn']]);
  up = true;
  await w.refresh();
  assert.deepEqual(lines[1], ['edge up', { edgeId: 'e1' }, 'info']);
  assert.equal(lines.length, 2);
});
