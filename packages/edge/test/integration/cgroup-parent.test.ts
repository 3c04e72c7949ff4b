/**
 * The node's cgroup parent is the edge's: closing an edge with no sandboxes
 * left removes it from every controller, and closing one whose sandboxes keep
 * running (to be adopted by the next edge) leaves it with them.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readdirSync } from 'node:fs';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;

/** The controllers' directories that hold the parent now. */
function parentDirs(cgroupParent: string): string[] {
  return readdirSync('/sys/fs/cgroup')
    .map((ctrl) => `/sys/fs/cgroup/${ctrl}/${cgroupParent}`)
    .filter((dir) => existsSync(dir));
}

test(
  'closing an edge removes its emptied cgroup parent and keeps one that running sandboxes hold',
  { skip: root ? false : 'needs root', timeout: 120_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const open = () =>
      openContainerEdge({ edgeId: 'node-1', stateDir: `${dir}/edge`, store, cgroupParent });
    try {
      let edge = await open();
      const a = await edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() });
      assert.notDeepEqual(parentDirs(cgroupParent), []);
      await edge.close();
      // Still running: the parent stays, with the sandbox in it.
      assert.notDeepEqual(parentDirs(cgroupParent), []);

      edge = await open();
      assert.equal((await edge.runCommand(a.id, { shell: 'echo adopted' })).stdout, 'adopted\n');
      await edge.stopSandbox(a.id);
      await edge.close();
      assert.deepEqual(parentDirs(cgroupParent), []);
    } finally {
      await cleanup();
    }
  },
);
