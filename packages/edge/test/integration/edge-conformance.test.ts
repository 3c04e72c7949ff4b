import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { edgeApiConformance } from '@dsec/core/testing';
import { openContainerEdge } from '@dsec/edge';
import { makeStateDir } from './fixture.js';

// The EdgeApi contract, io included, against the real container edge: a
// fresh state dir, image store and cgroup parent per case.
edgeApiConformance('Edge (container)', async () => {
  const state = await makeStateDir();
  const edge = await openContainerEdge({
    edgeId: 'node-conf',
    stateDir: join(state.dir, 'edge'),
    store: state.store,
    cgroupParent: state.cgroupParent,
    capacity: { sandboxes: 2 },
  });
  return {
    edge,
    capacitySandboxes: 2,
    mintId: () => randomId('sb'),
    image: 'busybox',
    cleanup: async () => {
      for (const s of await edge.listSandboxes({}))
        await edge.stopSandbox(s.id).catch(() => undefined);
      await edge.close();
      await state.cleanup();
    },
  };
});
