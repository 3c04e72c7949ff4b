import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isDsecError, type BackendKind, type SandboxSpec } from '@dsec/core';
import type { Backend, BackendSandbox } from './backend.js';
import { BackendSet } from './backend-set.js';

/** A backend that records which sandbox IDs each call got. */
function fake(kind: BackendKind, calls: string[], withPause: boolean): Backend {
  const note = (op: string) => async (rec: BackendSandbox) => {
    calls.push(`${kind}.${op}:${rec.id}`);
    return undefined as never;
  };
  return {
    kind,
    start: async (rec) => (calls.push(`${kind}.start:${rec.id}`), { initPid: 1, chronusPid: 1 }),
    stop: note('stop'),
    isRunning: async () => true,
    ensureChronus: note('ensure'),
    channel: note('channel'),
    ...(withPause ? { pause: note('pause'), isFrozen: async () => true } : {}),
  };
}

const sandbox = (id: string, backend: BackendKind): BackendSandbox => ({
  id,
  slot: 0,
  layers: [],
  spec: { backend } as SandboxSpec,
});

test('each call goes to the backend of the sandbox, and the first is the default', async () => {
  const calls: string[] = [];
  const set = new BackendSet([fake('container', calls, true), fake('microvm', calls, false)]);
  assert.equal(set.kind, 'container');
  assert.deepEqual(set.kinds, ['container', 'microvm']);
  await set.start(sandbox('a', 'microvm'));
  await set.start(sandbox('b', 'container'));
  await set.stop(sandbox('a', 'microvm'));
  await set.channel(sandbox('b', 'container'));
  assert.deepEqual(calls, [
    'microvm.start:a',
    'container.start:b',
    'microvm.stop:a',
    'container.channel:b',
  ]);
});

test('abilities a backend lacks: pause is unavailable, resume and isFrozen are no-ops', async () => {
  const set = new BackendSet([fake('container', [], true), fake('microvm', [], false)]);
  const vm = sandbox('a', 'microvm');
  assert.throws(
    () => set.pause(vm),
    (e) => isDsecError(e, 'unavailable'),
  );
  assert.deepEqual(await set.resume(vm), {});
  assert.equal(await set.isFrozen(vm), false);
  assert.equal(await set.isFrozen(sandbox('b', 'container')), true);
  assert.equal(await set.oomKilled(vm), false);
});

test('a sandbox of a kind the set does not run is refused', async () => {
  const set = new BackendSet([fake('container', [], true)]);
  assert.throws(
    () => set.for(sandbox('a', 'vm')),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});
