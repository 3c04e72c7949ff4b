// Opens an edge on argv[2] and creates sandboxes until killed (crash-recovery test helper).
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';
import { spec } from './fixture.js';

const dir = process.argv[2]!;
const edge = await openContainerEdge({
  edgeId: 'node-1',
  stateDir: join(dir, 'edge'),
  store: new DirImageStore(join(dir, 'images')),
  cgroupParent: process.argv[4],
});
process.stdout.write('open\n');
// Small sandboxes, so admission never refuses before the parent's kill; if it
// does, keep going: the point is to be killed in the middle of a create.
for (;;) {
  await edge
    .createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec({
        ttlSeconds: Number(process.argv[3] ?? 600),
        cpuCoresLimit: 0.05,
        memoryLimitMb: 32,
      }),
    })
    .catch(() => new Promise((r) => setTimeout(r, 20)));
}
