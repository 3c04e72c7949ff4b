import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DsecError, isDsecError, type LayerInfo } from '@dsec/core';
import type { InstallRequest } from '@dsec/images';
import type { DSecClient } from '@dsec/sdk';
import { clusterInstallRunner } from './install-runner.js';

/**
 * A cluster as the SDK sees it, reduced to what a builder uses: a create is
 * idempotent by `requestId` (a resend returns the sandbox the first made),
 * and `onCreate` decides what the caller hears back from the first create.
 */
function fakeCluster(onCreate: (n: number) => void): {
  client: DSecClient;
  live: () => string[];
} {
  const sandboxes = new Map<string, { id: string; stopped: boolean }>();
  let creates = 0;
  const handle = (sb: { id: string; stopped: boolean }): unknown => ({
    id: sb.id,
    runShell: () => Promise.resolve({ exitCode: 0, outcome: 'exited', stdout: '', stderr: '' }),
    snapshot: () => Promise.resolve({ layer: { name: 'snap', version: 'v1', digest: 'sha256:1' } }),
    stop: () => {
      sb.stopped = true;
      return Promise.resolve();
    },
  });
  const client = {
    runContainer: (spec: { requestId?: string }) => {
      const key = spec.requestId ?? `anonymous-${creates}`;
      let sb = sandboxes.get(key);
      if (sb === undefined) {
        // The cluster makes the sandbox whatever happens to the answer afterwards.
        sb = { id: `sb-${sandboxes.size}`, stopped: false };
        sandboxes.set(key, sb);
      }
      const n = creates++;
      return Promise.resolve().then(() => {
        onCreate(n);
        return handle(sb);
      });
    },
  } as unknown as DSecClient;
  return {
    client,
    live: () => [...sandboxes.values()].filter((s) => !s.stopped).map((s) => s.id),
  };
}

function request(signal?: AbortSignal): InstallRequest {
  return {
    recipe: 'tk',
    image: 'base:v1',
    toolkits: [],
    commands: ['true'],
    allowDomains: [],
    workdir: '/',
    env: {},
    timeoutMs: 60_000,
    snapshotName: 'tk-install-000000000000',
    scrub: [],
    signal,
  };
}

void test('a builder whose create is aborted or times out in flight is still stopped', async () => {
  // The answer to the create is lost (the caller aborted, the deadline passed) after the
  // cluster made the builder: without a stop it would hold its cores, memory and disk for
  // its whole TTL (up to 64 commands of an hour each).
  for (const code of ['aborted', 'deadline_exceeded'] as const) {
    const ac = new AbortController();
    const cluster = fakeCluster((n) => {
      if (n === 0) {
        ac.abort();
        throw new DsecError(code, 'the create did not answer');
      }
    });
    await assert.rejects(clusterInstallRunner(cluster.client)(request(ac.signal)), (e: unknown) =>
      isDsecError(e, code),
    );
    assert.deepEqual(cluster.live(), [], `${code}: the builder is left running`);
  }
});

void test('a builder is stopped after a good build and after a refused create', async () => {
  const ok = fakeCluster(() => undefined);
  const layer: LayerInfo = await clusterInstallRunner(ok.client)(request());
  assert.equal(layer.digest, 'sha256:1');
  assert.deepEqual(ok.live(), []);
  // A create the cluster refused made nothing: nothing is created to be stopped.
  let creates = 0;
  const refused = fakeCluster(() => {
    creates++;
    throw new DsecError('quota_exceeded', 'no room');
  });
  await assert.rejects(clusterInstallRunner(refused.client)(request()), (e: unknown) =>
    isDsecError(e, 'quota_exceeded'),
  );
  assert.equal(creates, 1);
});
