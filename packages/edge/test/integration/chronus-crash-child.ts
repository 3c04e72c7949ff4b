// Opens an edge on argv[2], creates one sandbox, prints its ID, then waits to be
// killed (chronus supervisor adoption test helper).
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
  cgroupParent: process.argv[3],
  network: { mode: 'none' },
});
const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
process.stdout.write(`${sb.id}\n`);
setInterval(() => undefined, 60_000);
