// Child of snapshot.test.ts: opens an edge on argv[2], makes a sandbox with a
// large writable layer, then snapshots it; the parent kills it with SIGKILL
// while the sandbox is frozen.
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
});
const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec() });
// Many files: the capture takes long enough for the parent to see the freeze.
const r = await edge.runCommand(sb.id, {
  shell:
    'mkdir /big && i=0; while [ $i -lt 160 ]; do dd if=/dev/zero of=/big/f$i bs=1M count=1 2>/dev/null; i=$((i+1)); done',
});
if (r.exitCode !== 0) throw new Error(r.stderr);
process.stdout.write(`snapshotting ${sb.id}\n`);
await edge.snapshotSandbox(sb.id, { name: 'crashed' });
process.stdout.write('snapshotted\n');
