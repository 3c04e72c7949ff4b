// Child of pause.test.ts: opens the edge on argv[2] (cgroup parent argv[3]),
// prints `ready`, then pauses or resumes (argv[4]) every live sandbox at once
// and prints `done`; the parent kills it with SIGKILL somewhere in between (or after).
import { join } from 'node:path';
import { openContainerEdge } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';

const [dir, cgroupParent, action] = process.argv.slice(2) as [string, string, 'pause' | 'resume'];
const edge = await openContainerEdge({
  edgeId: 'node-1',
  stateDir: join(dir, 'edge'),
  store: new DirImageStore(join(dir, 'images')),
  cgroupParent,
  network: { mode: 'none' },
  pauseSwapChunkBytes: 512 * 2 ** 20,
  pauseSwapMaxBytes: 2 ** 30,
});
const ids = (await edge.listSandboxes({})).map((s) => s.id);
process.stdout.write('ready\n');
await Promise.all(
  ids.map((id) => (action === 'pause' ? edge.pauseSandbox(id) : edge.resumeSandbox(id))),
);
process.stdout.write('done\n');
// No close: the parent kills this process, and a close would switch swap off behind its back.
setInterval(() => undefined, 60_000);
