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
function fakeCluster(
  onCreate: (n: number) => void,
  onSnapshot: () => void = () => undefined,
): {
  client: DSecClient;
  live: () => string[];
  images: Set<string>;
} {
  const sandboxes = new Map<string, { id: string; stopped: boolean }>();
  // The caller's project's images; a snapshot's name must be free there.
  const images = new Set<string>();
  let creates = 0;
  const handle = (sb: { id: string; stopped: boolean }): unknown => ({
    id: sb.id,
    runShell: () => Promise.resolve({ exitCode: 0, outcome: 'exited', stdout: '', stderr: '' }),
    snapshot: ({ name, timeoutMs }: { name: string; timeoutMs?: number }) =>
      Promise.resolve().then(() => {
        // The edge packs a writable layer for up to 10 minutes: a shorter client deadline
        // fails a large build that the edge would have finished.
        if ((timeoutMs ?? 120_000) < 600_000)
          throw new DsecError(
            'deadline_exceeded',
            `a snapshot deadline of ${timeoutMs ?? 'the default'}`,
          );
        if (images.has(name)) throw new DsecError('conflict', `image ${name} already exists`);
        images.add(name); // made by the edge, whatever happens to the answer
        onSnapshot();
        return { layer: { name, version: 'latest', digest: 'sha256:1' } };
      }),
    stop: () => {
      sb.stopped = true;
      return Promise.resolve();
    },
  });
  const client = {
    deleteImage: (ref: string) =>
      Promise.resolve().then(() => {
        if (!images.delete(ref)) throw new DsecError('image_not_found', `no image ${ref}`);
      }),
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
    images,
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

void test('a builder snapshot left by an interrupted build neither blocks the next nor stays', async () => {
  // The name is the recipe digest's (same on every run): a snapshot whose answer was lost, or
  // whose promotion never ran (the command killed), stayed in the project and made every later
  // build of the recipe fail with `conflict`, holding the project's image bytes meanwhile.
  const ac = new AbortController();
  const lost = fakeCluster(
    () => undefined,
    () => {
      ac.abort();
      throw new DsecError('aborted', 'the caller cancelled the operation');
    },
  );
  await assert.rejects(clusterInstallRunner(lost.client)(request(ac.signal)), (e: unknown) =>
    isDsecError(e, 'aborted'),
  );
  assert.deepEqual([...lost.images], [], 'the lost snapshot is left in the project');
  assert.deepEqual(lost.live(), []);
  // One left by a build killed before it could clean up: the next build still builds.
  const stale = fakeCluster(() => undefined);
  stale.images.add(request().snapshotName);
  const layer = await clusterInstallRunner(stale.client)(request());
  assert.equal(layer.name, request().snapshotName);
  assert.deepEqual(stale.live(), []);
});
