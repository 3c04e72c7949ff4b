import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { openContainerEdge } from '@dsec/edge';
import type { DirImageStore } from '@dsec/images';
import { hostResources, makeStateDir } from './fixture.js';

/** Whatever happened above, leave no sandbox of this state dir running. */
async function stopEverything(
  dir: string,
  store: DirImageStore,
  cgroupParent: string,
): Promise<void> {
  const edge = await openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
  });
  for (const sb of await edge.listSandboxes({}))
    await edge.stopSandbox(sb.id).catch(() => undefined);
  await edge.close();
}

/** Starts the child edge, lets it create sandboxes for `ms`, then kill -9s it mid-work. */
async function crashAfter(
  dir: string,
  cgroupParent: string,
  ms: number,
  ttlSeconds = 600,
): Promise<void> {
  const child = spawn(
    process.execPath,
    [
      '--conditions=dsec-source',
      '--import',
      'tsx',
      new URL('./crash-child.ts', import.meta.url).pathname,
      dir,
      String(ttlSeconds),
      cgroupParent,
    ],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  );
  await new Promise<void>((resolve, reject) => {
    child.stdout.once('data', () => resolve());
    child.once('exit', (code) => reject(new Error(`child exited early (${code})`)));
  });
  await new Promise((r) => setTimeout(r, ms));
  child.kill('SIGKILL');
  await new Promise((r) => child.once('exit', r));
}

test('an edge killed at any step of a create recovers: each sandbox is running or fully cleaned up', async () => {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  try {
    for (const ms of [10, 60, 150, 300, 500, 800]) await crashAfter(dir, cgroupParent, ms);
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      const live = await edge.listSandboxes({});
      // Both outcomes must have happened for the test to mean something.
      const all = await edge.listSandboxes({ includeEnded: true });
      assert.ok(live.length > 0, 'some creates finished before a kill');
      assert.ok(
        all.some((s) => s.state === 'failed' && s.reason === 'interrupted while creating'),
        'some creates were interrupted',
      );
      for (const sb of live) {
        assert.equal(sb.state, 'running');
        assert.equal((await edge.runCommand(sb.id, { argv: ['true'] })).exitCode, 0);
      }
      const res = await hostResources(dir);
      assert.equal(
        res.containers.length,
        live.length,
        'one container per running sandbox, none orphaned',
      );
      assert.equal(res.sandboxDirs.length, live.length, 'no half-created sandbox directories');
      assert.deepEqual(res.mounts, [], "rootfs mounts live in the runtimes' own namespaces");
      for (const sb of live) await edge.stopSandbox(sb.id);
      assert.deepEqual(await hostResources(dir), {
        mounts: [],
        cgroups: [],
        containers: [],
        processes: [],
        sandboxDirs: [],
      });
    } finally {
      await edge.close();
    }
  } finally {
    await stopEverything(dir, store, cgroupParent);
    await cleanup();
  }
});

test('a TTL that expired while the edge was down is enforced at startup', async () => {
  const { dir, store, cgroupParent, cleanup } = await makeStateDir();
  try {
    await crashAfter(dir, cgroupParent, 400, 1);
    await new Promise((r) => setTimeout(r, 1200));
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      assert.deepEqual(await edge.listSandboxes({}), []);
      assert.deepEqual(await hostResources(dir), {
        mounts: [],
        cgroups: [],
        containers: [],
        processes: [],
        sandboxDirs: [],
      });
    } finally {
      await edge.close();
    }
  } finally {
    await stopEverything(dir, store, cgroupParent);
    await cleanup();
  }
});
